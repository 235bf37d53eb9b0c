"""Decodes NVLink5 Xids 144-150 (IntrInfo and error status) with NVIDIA's decode table."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache
from importlib import resources

_BUCKET_RANK = {"IGNORE": 0, "XID_154_EVAL": 1, "RESET_GPU": 2}
_SUBCODE = "Subcode V1(<R575)/V2(>=R575) V1(<R575): IntrInfo[9:5] V2(>=R575):IntrInfo[6:0]"
_V1 = '(V1(<R575)) IntrInfo decode for Data Center Recovery Action IntrInfo (binary; "-" user decode)'
_V2 = '(V2(>=R575)) IntrInfo decode for Data Center Recovery Action IntrInfo (binary; "-" user decode)'
_SEVERITY = "Severity (for items with '*' please see Customer User Guide tab)"


@dataclass(frozen=True, slots=True)
class DecodeRow:
    xid: int
    subcode: str
    patterns: tuple[str, str]
    statuses: tuple[int, ...]
    bucket: str
    severity: str

    def matches(self, intr_info: int, error_status: int) -> bool:
        if not any(_pattern_matches(p, intr_info) for p in self.patterns if p):
            return False
        if not self.statuses:
            return True
        return any(error_status == s or (s and s & (s - 1) == 0 and error_status & s) for s in self.statuses)


@dataclass(frozen=True, slots=True)
class Decoded:
    """The bucket NVIDIA's table gives; `ambiguous` when matching rows disagree (the worst one is kept)."""

    bucket: str
    subcode: str
    severity: str
    ambiguous: bool


def _pattern_matches(pattern: str, value: int) -> bool:
    width = len(pattern)
    for position, char in enumerate(pattern):
        if char in "01" and ((value >> (width - 1 - position)) & 1) != int(char):
            return False
    return True


def _statuses(text: str) -> tuple[int, ...]:
    return tuple(int(part, 16) for part in text.split("/") if part.strip())


@cache
def decode_table() -> tuple[DecodeRow, ...]:
    text = (resources.files("agent") / "data" / "xid_144_150_decode.csv").read_text(encoding="utf-8")
    return tuple(
        DecodeRow(int(row["Xid"]), row[_SUBCODE], (row[_V1], row[_V2]), _statuses(row["Error Status (hex)"]),
                  row["Resolution Bucket (Data Center Recovery Action)"], row[_SEVERITY])
        for row in csv.DictReader(text.splitlines())
    )


def decode(xid: int, intr_info: int, error_status: int) -> Decoded | None:
    """The resolution bucket for one Xid 144-150 line, or None when no row of the table matches."""
    rows = [r for r in decode_table() if r.xid == xid and r.matches(intr_info, error_status)]
    if not rows:
        return None
    worst = max(rows, key=lambda r: _BUCKET_RANK.get(r.bucket, 0))
    return Decoded(worst.bucket, worst.subcode, worst.severity, len({r.bucket for r in rows}) > 1)

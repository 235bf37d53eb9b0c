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
_V1_ACTION2 = "(V1(<R575)) Decode for action 2"
_V2_ACTION2 = "(V2(>=R575)) Decode for action 2"
_SEVERITY = "Severity (for items with '*' please see Customer User Guide tab)"


@dataclass(frozen=True, slots=True)
class DecodeRow:
    xid: int
    subcode: str
    patterns: tuple[str, str]
    statuses: tuple[int, ...]
    bucket: str
    severity: str
    action2_patterns: tuple[str, str] = ("", "")
    action2: str = ""

    def bucket_for(self, intr_info: int, error_status: int) -> str | None:
        """This row's bucket for the line: the first action's, or the second action's where the table gives
        one and the IntrInfo matches its decode; None when the row does not describe the line."""
        if not self._status_matches(error_status):
            return None
        if any(_pattern_matches(p, intr_info) for p in self.patterns if p):
            return self.bucket
        if self.action2 and any(_pattern_matches(p, intr_info) for p in self.action2_patterns if p):
            return self.action2
        return None

    def _status_matches(self, error_status: int) -> bool:
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
                  row["Resolution Bucket (Data Center Recovery Action)"], row[_SEVERITY],
                  (row[_V1_ACTION2], row[_V2_ACTION2]), row["Action 2"].strip())
        for row in csv.DictReader(text.splitlines())
    )


def decode(xid: int, intr_info: int, error_status: int) -> Decoded | None:
    """The resolution bucket for one Xid 144-150 line, or None when no row of the table matches."""
    found = [(bucket, row) for row in decode_table() if row.xid == xid
             and (bucket := row.bucket_for(intr_info, error_status)) is not None]
    if not found:
        return None
    bucket, worst = max(found, key=lambda pair: _BUCKET_RANK.get(pair[0], 0))
    return Decoded(bucket, worst.subcode, worst.severity, len({b for b, _ in found}) > 1)

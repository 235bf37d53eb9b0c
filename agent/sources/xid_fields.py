"""Structured fields of Xid lines, read from the driver's end: SM location, cause, NVLink registers, recovery action."""

from __future__ import annotations

import re
from typing import Any

from agent.sources.nvlink5 import decode

_CAUSED_BY = re.compile(r"(?:caused by|due to)\s+(?:an?\s+)?(?:previous\s+)?Xid\s*(\d{1,6})(?!\d)", re.IGNORECASE)
_ACTION_VALUE = r"(0x[0-9a-fA-F]{1,8}|\d{1,6})(?![0-9a-fA-Fx])"
_RECOVERY = re.compile(r"recovery action changed from\s+" + _ACTION_VALUE + r"(?:\s*\(([^()]{0,64})\))?\s+to\s+"
                       + _ACTION_VALUE + r"(?:\s*\(([^()]{0,64})\))?\s*\.?\s*$", re.IGNORECASE)
# Registers close the line: "... Link 12 (0x4 0x2 0x0 ...)" (NVLink5) or "... on link 14(0x0, 0x0, ...)" (Xid 74).
# NVLink5 prints "Link -1" for an error of the whole unit rather than of one link (GB200).
_LINK_TAIL = re.compile(r"\blink\s+(?P<link>-?\d{1,4})\s*\(\s*(?P<regs>[^()]{0,400})\)\s*\.?\s*$", re.IGNORECASE)
_NVLINK5_HEAD = re.compile(r"(?<![A-Za-z0-9_])(?P<sub>[A-Za-z][A-Za-z0-9_]{0,39})\s+"
                           r"(?P<fatal>Fatal|Nonfatal|Non-fatal)\b", re.IGNORECASE)
#: The last SM location in a text, "(GPC 4, TPC 1, SM 0)": the greedy lead moves the match to the driver's end of
#: the line, past any location a process name may spell.
_LAST_SM = re.compile(r"(?s:.*)\(\s*GPC\s+(?P<gpc>\d{1,4}),\s*TPC\s+(?P<tpc>\d{1,4})(?:,\s*SM\s+(?P<sm>\d{1,4}))?\s*\)",
                      re.IGNORECASE)
_HEX = re.compile(r"0x[0-9a-fA-F]{1,16}(?![0-9a-fA-F])")
_TAIL_WINDOW = 512


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    found = None
    for found in pattern.finditer(text):  # noqa: B007 - the last match is the driver's, not the process name's
        pass
    return found


#: The Xids whose lines carry structured fields that xid_extras reads.
STRUCTURED_CODES = frozenset({13, 45, 74, 154, *range(144, 151)})


def xid_extras(code: int, text: str) -> dict[str, Any]:
    """The structured fields of an Xid line of STRUCTURED_CODES, read from the driver's end of the line."""
    extras: dict[str, Any] = {}
    tail = text[-_TAIL_WINDOW:]
    if code == 13:  # the commonest by far: an application's fault
        location = _LAST_SM.match(tail)
        if location:
            gpc, tpc, sm = location.group("gpc", "tpc", "sm")
            extras["gpc"], extras["tpc"] = int(gpc), int(tpc)
            extras["sm_location"] = f"GPC {int(gpc)}, TPC {int(tpc)}"
            if sm is not None:
                extras["sm"] = int(sm)
    elif code == 45:
        caused = _last(_CAUSED_BY, tail)
        if caused:
            extras["caused_by"] = int(caused.group(1))
    elif code == 154:
        recovery = _RECOVERY.search(tail)
        if recovery:
            extras["recovery_action_from"] = _action_value(recovery.group(1))
            extras["recovery_action"] = _action_value(recovery.group(3))
            if recovery.group(4):
                extras["recovery_action_name"] = recovery.group(4)
    elif 144 <= code <= 150:
        extras.update(_nvlink5_extras(code, tail))
    elif code == 74:
        regs = _LINK_TAIL.search(tail)
        if regs:
            extras["link"] = int(regs.group("link"))
            values = _HEX.findall(regs.group("regs"))
            for n, value in enumerate(values):
                extras[f"reg{n}"] = value.lower()
            if len(values) >= 5:
                extras["nvlink_error_class"] = nvlink_error_class([int(v, 16) for v in values])
    return extras


def _action_value(text: str) -> int:
    """A recovery action as printed: `0x2` is hexadecimal; `2` or `02` is the same value written plainly."""
    return int(text, 16) if text.lower().startswith("0x") else int(text, 10)


# NVIDIA's WORKFLOW_NVLINK_ERR (Xid 74): which bits of the first, third, fourth and fifth registers mean what.
_R1_IGNORABLE = frozenset({0, 23, 30})
_R1_SYMPATHETIC = frozenset({1, 20})
_R1_ECC_PARITY = frozenset({4, 5})
_R3_ECC_PARITY = frozenset({0, 1, 2, 6})
_R4_SYMPATHETIC = frozenset({16, 17})
#: "Generally sympathetic or secondary errors, though a reset of the fabric is required."
_R4_FABRIC_RESET = 18
_R5_ECC_PARITY = frozenset({18, 19, 21, 22, 24, 25, 27, 28})
_R5_THRESHOLD_ONLY = frozenset({20, 23, 26, 29})


def _bits(value: int) -> set[int]:
    return {bit for bit in range(32) if value >> bit & 1}


def nvlink_error_class(registers: list[int]) -> str:
    """The class of an Xid 74's registers by NVIDIA's workflow, the most serious bit deciding:
    INVESTIGATE (a bit of a possible link or mechanical issue, or one the workflow does not list),
    FABRIC_RESET (fourth register bit 18: a reset of the fabric is required),
    ECC_PARITY (ECC/parity bits only: "if seen more than 2 times on the same link, report a bug"),
    SYMPATHETIC (only secondary bits: the other Xid or SXid decides), else IGNORE (only bits NVIDIA says can be
    ignored, or ECC thresholds exceeded without an uncorrectable error)."""
    r1, r3, r4, r5 = _bits(registers[0]), _bits(registers[2]), _bits(registers[3]), _bits(registers[4])
    ecc = r1 & _R1_ECC_PARITY | r3 & _R3_ECC_PARITY | r5 & _R5_ECC_PARITY
    other = ((r1 - _R1_IGNORABLE - _R1_SYMPATHETIC - _R1_ECC_PARITY) | (r3 - _R3_ECC_PARITY)
             | (r4 - _R4_SYMPATHETIC - {_R4_FABRIC_RESET}) | (r5 - _R5_THRESHOLD_ONLY - _R5_ECC_PARITY))
    if other:
        return "INVESTIGATE"
    if _R4_FABRIC_RESET in r4:
        return "FABRIC_RESET"
    if ecc:
        return "ECC_PARITY"
    if r1 & _R1_SYMPATHETIC or r4:
        return "SYMPATHETIC"
    return "IGNORE"


def _nvlink5_extras(code: int, text: str) -> dict[str, Any]:
    tail = _LINK_TAIL.search(text)
    if not tail:
        return {}
    head = _last(_NVLINK5_HEAD, text[max(0, tail.start() - 200):tail.start()])
    if not head:
        return {}
    registers = _HEX.findall(tail.group("regs"))
    extras: dict[str, Any] = {
        "subcomponent": head.group("sub"),
        "fatal": head.group("fatal").lower() == "fatal",
        "link": int(tail.group("link")),
    }
    if extras["link"] < 0:
        extras["link_scope"] = "unit"  # the whole NVLink unit; the decode table resolves it like any link's
    if len(registers) >= 2:
        intr_info, error_status = int(registers[0], 16), int(registers[1], 16)
        extras.update(intr_info=registers[0].lower(), error_status=registers[1].lower())
        decoded = decode(code, intr_info, error_status)
        if decoded is not None:
            extras.update(decoded_action=decoded.bucket, decoded_subcode=decoded.subcode,
                          decoded_severity=decoded.severity, decode_ambiguous=decoded.ambiguous)
    return extras

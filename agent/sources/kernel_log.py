"""Parses NVIDIA kernel-log records (Xid, NVSwitch SXid, GPU loss, GPU banners) in every common form.

Pure: lines in, records out. A line counts only when, after a known log prefix (raw /dev/kmsg,
`<N>`, syslog, ISO time, dmesg, dmesg -T, dmesg --decode, `kernel:`), its body is a driver record;
text that merely mentions an Xid (a device-plugin log line) is not one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from agent.sources.nvlink5 import decode

_PCI = r"[0-9a-fA-F]{1,8}:[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}(?:\.[0-7])?"

_KMSG = re.compile(r"(\d+),(\d+),(\d+),[^;]*;")
_PRIORITY = re.compile(r"<(\d{1,3})>")
_HOST = r"(?:(?!NVRM:|kernel(?:\[\d+\])?:|\[|nvidia-nvswitch)[^\s:\[]+\s+)?"
_SYSLOG = re.compile(r"[^\W\d_]{3,9}\.?\s+\d{1,2}\s+\d{1,2}:\d{2}:\d{2}\s+" + _HOST)
_ISO = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?\s+" + _HOST)
_DMESG = re.compile(r"\[\s*\d+\.\d+\]\s*")
_DMESG_T = re.compile(r"\[[A-Z][a-z]{2} [A-Z][a-z]{2} +\d{1,2} \d{2}:\d{2}:\d{2} \d{4}\]\s*")
_DECODE = re.compile(r"(?:kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7])\s*:"
                     r"\s*(?:emerg|alert|crit|err|warn|notice|info|debug)\s*:\s*")
_IDENT = re.compile(r"kernel(?:\[\d+\])?:\s*")
_PREFIXES = (_PRIORITY, _SYSLOG, _ISO, _DMESG_T, _DMESG, _DECODE, _IDENT)

_XID = re.compile(
    r"NVRM:\s*Xid\s*\(\s*(?:PCI:)?(?P<pci>" + _PCI + r")\s*\)\s*:\s*(?P<code>\d+)\s*(?:,\s*)?(?P<rest>.*)", re.DOTALL
)
_PID = re.compile(r"pid\s*=\s*(?P<pid>'?<unknown>'?|\d+)\s*(?:,\s*|$)")
_NAME = re.compile(r"name\s*=\s*")
_SXID = re.compile(r"(?P<switch>nvidia-nvswitch\d+):\s*SXid\s*\(\s*(?:PCI:)?(?P<pci>" + _PCI + r")\s*\)\s*:\s*"
                   r"(?P<code>\d+)\s*,\s*(?P<rest>.*)", re.DOTALL)
_SXID_SEVERITY = re.compile(r"(?P<severity>Fatal|Non-fatal|Nonfatal)\s*,\s*(?P<message>.*)", re.DOTALL | re.IGNORECASE)
_LINK = re.compile(r"\bLink\s+(\d+)", re.IGNORECASE)
_BANNER = re.compile(r"NVRM:\s*GPU at (?:PCI:)?(?P<pci>" + _PCI + r")\s*:\s*(?P<uuid>GPU-[0-9a-fA-F-]{8,})\s*$")
_LOST = re.compile(r"NVRM:\s*GPU(?: at)?\s+(?:PCI:)?(?P<pci>" + _PCI + r")\s*:\s*GPU has fallen off the bus",
                   re.IGNORECASE)
_LOST_START = re.compile(r"NVRM:\s*The NVIDIA GPU\s+(?:PCI:)?(?P<pci>" + _PCI + r")\s*$")
_LOST_END = re.compile(r"NVRM:.*fallen off the bus", re.IGNORECASE)
_CAUSED_BY = re.compile(r"(?:caused by|due to)\s+(?:an?\s+)?(?:previous\s+)?Xid\s*(\d+)", re.IGNORECASE)
_RECOVERY = re.compile(r"recovery action changed from\s+(0x[0-9a-fA-F]+|\d+)(?:\s*\(([^)]*)\))?\s+to\s+"
                       r"(0x[0-9a-fA-F]+|\d+)(?:\s*\(([^)]*)\))?", re.IGNORECASE)
_NVLINK5 = re.compile(r"(?P<sub>[A-Za-z0-9_]+)\s+(?P<fatal>Fatal|Nonfatal|Non-fatal)\b(?P<mid>.*?)\bLink\s+"
                      r"(?P<link>\d+)\s*\(\s*(?P<regs>[^)]*)\)", re.IGNORECASE)
_XID74 = re.compile(r"link\s+(?P<link>\d+)\s*\((?P<regs>[^)]*)\)", re.IGNORECASE)
_HEX = re.compile(r"0x[0-9a-fA-F]+")

KERNEL_FACILITY = 0


@dataclass(frozen=True, slots=True)
class Prefix:
    """What the log prefix said: the raw-kmsg sequence, time and facility, or a `<N>` priority."""

    seq: int | None = None
    timestamp_us: int | None = None
    facility: int | None = None
    level: int | None = None


@dataclass(slots=True)
class KernelRecord:
    """One recognised record. `pci` is the bus id as printed (lower-case, without `PCI:`)."""

    kind: str
    line: int
    code: int | None = None
    pci: str = ""
    pid: int | None = None
    process: str | None = None
    message: str = ""
    extras: dict[str, Any] = field(default_factory=dict)
    prefix: Prefix = field(default_factory=Prefix)

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {"line": self.line, "kind": self.kind, "code": self.code, "pci": self.pci,
                                    "pid": self.pid, "process": self.process, "message": self.message}
        for key, value in self.extras.items():
            document.setdefault(key, value)
        if self.prefix.seq is not None:
            document.setdefault("seq", self.prefix.seq)
        return document


def strip_prefix(line: str) -> tuple[str, Prefix]:
    """The record body and what the prefix told, whichever of the common log forms the line is in."""
    text = line.rstrip("\r\n")
    prefix = Prefix()
    match = _KMSG.match(text)
    if match:
        value = int(match.group(1))
        prefix = Prefix(int(match.group(2)), int(match.group(3)), value >> 3, value & 7)
        text = text[match.end():]
        if text.startswith(("NVRM", "nvidia-nvswitch")):
            return text.strip(), prefix
    for _ in range(6):
        for pattern in _PREFIXES:
            match = pattern.match(text)
            if match:
                if pattern is _PRIORITY and prefix.level is None:
                    value = int(match.group(1))
                    prefix = Prefix(level=value & 7, facility=(value >> 3) or None)
                text = text[match.end():]
                break
        else:
            break
    return text.strip(), prefix


class KernelLogParser:
    """Turns lines into records, keeping the little state multi-line reports need and the PCI -> UUID map."""

    def __init__(self) -> None:
        self.pci_to_uuid: dict[str, str] = {}
        self._lost_pci: str | None = None
        self._lost_lines = 0
        self._last_sxid: KernelRecord | None = None

    def feed(self, line: str, line_no: int = 0) -> KernelRecord | None:
        """The record this line completes, if any. Never raises on any input."""
        if "NVRM" not in line and "SXid" not in line:
            return None
        body, prefix = strip_prefix(line)
        if body.startswith("NVRM"):
            return self._nvrm(body, prefix, line_no)
        if body.startswith("nvidia-nvswitch"):
            return self._sxid(body, prefix, line_no)
        return None

    def _nvrm(self, body: str, prefix: Prefix, line_no: int) -> KernelRecord | None:
        match = _XID.match(body)
        if match:
            self._lost_pci = None
            return _xid_record(match, prefix, line_no)
        match = _BANNER.match(body)
        if match:
            self.pci_to_uuid[match.group("pci").lower()] = match.group("uuid")
            return KernelRecord("gpu_uuid", line_no, pci=match.group("pci").lower(), message=body,
                                extras={"uuid": match.group("uuid")}, prefix=prefix)
        match = _LOST.match(body)
        if match:
            return KernelRecord("gpu_lost", line_no, pci=match.group("pci").lower(), message=body, prefix=prefix)
        match = _LOST_START.match(body)
        if match:
            self._lost_pci, self._lost_lines = match.group("pci").lower(), 0
            return None
        if self._lost_pci is not None:
            self._lost_lines += 1
            if _LOST_END.match(body):
                pci, self._lost_pci = self._lost_pci, None
                return KernelRecord("gpu_lost", line_no, pci=pci, message=body, prefix=prefix,
                                    extras={"multi_line": True})
            if self._lost_lines >= 3:
                self._lost_pci = None
        return None

    def _sxid(self, body: str, prefix: Prefix, line_no: int) -> KernelRecord | None:
        match = _SXID.match(body)
        if not match:
            return None
        code, pci, rest = int(match.group("code")), match.group("pci").lower(), match.group("rest").strip()
        extras: dict[str, Any] = {"switch": match.group("switch")}
        first = _SXID_SEVERITY.match(rest)
        if first:
            severity = "fatal" if first.group("severity").lower() == "fatal" else "non-fatal"
            message = first.group("message").strip()
            link = _LINK.search(message)
            extras.update(severity=severity, link=int(link.group(1)) if link else None, continuation=False)
            record = KernelRecord("sxid", line_no, code, pci, message=message, extras=extras, prefix=prefix)
            self._last_sxid = record
            return record
        last = self._last_sxid
        same_report = last is not None and last.code == code and last.pci == pci
        extras.update(severity=last.extras.get("severity") if same_report and last else None,
                      link=last.extras.get("link") if same_report and last else None, continuation=True)
        return KernelRecord("sxid", line_no, code, pci, message=rest, extras=extras, prefix=prefix)


def _xid_record(match: re.Match[str], prefix: Prefix, line_no: int) -> KernelRecord:
    code = int(match.group("code"))
    rest = match.group("rest")
    pid: int | None = None
    process: str | None = None
    pid_match = _PID.match(rest)
    if pid_match:
        raw = pid_match.group("pid")
        pid = int(raw) if raw.isdigit() else None
        rest = rest[pid_match.end():]
        name_match = _NAME.match(rest)
        if name_match:
            rest = rest[name_match.end():]
            cut = rest.find(", ")
            name, rest = (rest, "") if cut < 0 else (rest[:cut], rest[cut + 2:])
            process = None if name.strip("'") in {"<unknown>", ""} else name
    message = rest.strip()
    return KernelRecord("xid", line_no, code, match.group("pci").lower(), pid, process, message,
                        _xid_extras(code, message), prefix)


def _xid_extras(code: int, message: str) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    if code == 45:
        caused = _CAUSED_BY.search(message)
        if caused:
            extras["caused_by"] = int(caused.group(1))
    elif code == 154:
        recovery = _RECOVERY.search(message)
        if recovery:
            extras["recovery_action_from"] = int(recovery.group(1), 0)
            extras["recovery_action"] = int(recovery.group(3), 0)
            if recovery.group(4):
                extras["recovery_action_name"] = recovery.group(4)
    elif 144 <= code <= 150:
        extras.update(_nvlink5_extras(code, message))
    elif code == 74:
        regs = _XID74.search(message)
        if regs:
            extras["link"] = int(regs.group("link"))
            values = _HEX.findall(regs.group("regs"))
            for n, value in enumerate(values):
                extras[f"reg{n}"] = value.lower()
            if len(values) >= 5:
                extras["nvlink_error_class"] = nvlink_error_class([int(v, 16) for v in values])
    return extras


# NVIDIA's WORKFLOW_NVLINK_ERR (Xid 74): which bits of the first, third, fourth and fifth registers mean what.
_R1_IGNORABLE = frozenset({0, 23, 30})
_R1_SYMPATHETIC = frozenset({1, 20})
_R4_SYMPATHETIC = frozenset({16, 17, 18})
_R5_THRESHOLD_ONLY = frozenset({20, 23, 26, 29})


def _bits(value: int) -> set[int]:
    return {bit for bit in range(32) if value >> bit & 1}


def nvlink_error_class(registers: list[int]) -> str:
    """IGNORE (only bits NVIDIA says can be ignored, or ECC thresholds without an uncorrectable error),
    SYMPATHETIC (only secondary bits: the other Xid or SXid decides), else INVESTIGATE."""
    r1, r3, r4, r5 = _bits(registers[0]), _bits(registers[2]), _bits(registers[3]), _bits(registers[4])
    serious = (r1 - _R1_IGNORABLE - _R1_SYMPATHETIC) | r3 | (r4 - _R4_SYMPATHETIC) | (r5 - _R5_THRESHOLD_ONLY)
    if serious:
        return "INVESTIGATE"
    if r1 & _R1_SYMPATHETIC or r4:
        return "SYMPATHETIC"
    return "IGNORE"


def _nvlink5_extras(code: int, message: str) -> dict[str, Any]:
    match = _NVLINK5.search(message)
    if not match:
        return {}
    registers = _HEX.findall(match.group("regs"))
    extras: dict[str, Any] = {
        "subcomponent": match.group("sub"),
        "fatal": match.group("fatal").lower() == "fatal",
        "link": int(match.group("link")),
    }
    if len(registers) >= 2:
        intr_info, error_status = int(registers[0], 16), int(registers[1], 16)
        extras.update(intr_info=registers[0].lower(), error_status=registers[1].lower())
        decoded = decode(code, intr_info, error_status)
        if decoded is not None:
            extras.update(decoded_action=decoded.bucket, decoded_subcode=decoded.subcode,
                          decoded_severity=decoded.severity, decode_ambiguous=decoded.ambiguous)
    return extras

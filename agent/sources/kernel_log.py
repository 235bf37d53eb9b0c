"""Parses NVIDIA kernel-log records (Xid, NVSwitch SXid, GPU loss, GPU banners) in every common form.

Pure: lines in, records out. A line counts only when, after a known log prefix (raw /dev/kmsg,
`<N>`, syslog, ISO time, dmesg, dmesg -T, dmesg --decode, `kernel:`, journalctl's short-precise,
short-monotonic, short-full and json outputs), its body is a driver record; text that merely mentions
an Xid (a device-plugin log line) is not one. Every number is bounded in length and every pattern is
linear in the line: no line can raise or stall the parser. Structured fields (registers, recovery
action, SM location) are read from the driver's end of the line, never through the process name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from agent.sources.xid_fields import STRUCTURED_CODES, xid_extras

_PCI = r"[0-9a-fA-F]{1,8}:[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}(?:\.[0-7])?"
#: A kernel record is at most 1-2 KB (printk's limit): a longer message is kept only this far.
MAX_MESSAGE = 2048

_KMSG = re.compile(r"(\d{1,3}),(\d{1,20}),(\d{1,20}),[^;]{0,16};")
_PRIORITY = re.compile(r"<(\d{1,3})>")
_HOST = r"(?:(?!NVRM:|kernel(?:\[\d{1,10}\])?:|\[|nvidia-nvswitch)[^\s:\[]{1,255}\s+)?"
_SYSLOG = re.compile(r"[^\W\d_]{3,9}\.?\s{1,8}\d{1,2}\s{1,8}\d{1,2}:\d{2}:\d{2}(?:\.\d{1,9})?\s+" + _HOST)
_ISO = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d{1,9})?(?:Z|[+-]\d{2}:?\d{2})?\s+" + _HOST)
# journalctl -o short-full: "Mon 2026-11-30 23:33:39 UTC host kernel: ..."
_FULL = re.compile(r"[A-Z][a-z]{2}\s+\d{4}-\d{2}-\d{2}\s+\d{2}:\d{2}:\d{2}(?:\.\d{1,9})?\s+[A-Za-z0-9+\-_/]{1,32}\s+"
                   + _HOST)
_DMESG = re.compile(r"\[\s{0,20}\d{1,12}\.\d{1,9}\]\s*")
# journalctl -o short-monotonic: "[ 1234.567890] host kernel: ..." (the host is dropped only before "kernel:")
_HOST_KERNEL = re.compile(r"[^\s:\[]{1,255}\s+(?=kernel(?:\[\d{1,10}\])?:)")
_DMESG_T = re.compile(r"\[[A-Z][a-z]{2} [A-Z][a-z]{2} +\d{1,2} \d{2}:\d{2}:\d{2} \d{4}\]\s*")
# NVIDIA's documentation elides the prefix as "[...]" or "[…]".
_ELIDED = re.compile(r"\[(?:\.\.\.|\u2026)\]\s*")
_DECODE = re.compile(r"(?:kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7])\s*:"
                     r"\s*(?:emerg|alert|crit|err|warn|notice|info|debug)\s*:\s*")
_IDENT = re.compile(r"kernel(?:\[\d{1,10}\])?:\s*")
_PREFIXES = (_PRIORITY, _SYSLOG, _FULL, _ISO, _DMESG_T, _DMESG, _ELIDED, _DECODE, _HOST_KERNEL, _IDENT)
#: The form rsyslog writes a kernel record in ("Dec  7 08:10:00 host kernel: [ 1234.567890] NVRM: ..."), as
#: one pattern: what the general loop would strip from it, pattern by pattern, in one match.
_SYSLOG_KERNEL = re.compile(_SYSLOG.pattern + _IDENT.pattern + r"(?:" + _DMESG.pattern + r")?")
_DRIVER_BODIES = ("NVRM", "nvidia-nvswitch")

# The address may carry the MIG instance ("PCI:0000:3b:00 GPU-I:05 GPU-CI:02"), or be redacted or mangled:
# it is captured loosely and read strictly, so a bad address still gives an Xid (on an unknown GPU).
_XID = re.compile(r"NVRM:\s*Xid\s*\(\s*(?P<addr>[^()]{0,96}?)\s*\)\s*:\s*(?P<code>\d{1,6})(?!\d)\s*(?:,\s*)?"
                  r"(?P<rest>.*)", re.DOTALL)
_ADDRESS = re.compile(r"(?:PCI:)?\s*(?P<pci>" + _PCI + r")(?:\s+GPU-I:\s*(?P<gi>\d{1,4}))?"
                      r"(?:\s+GPU-CI:\s*(?P<ci>\d{1,4}))?", re.IGNORECASE)
_PID = re.compile(r"pid\s*=\s*(?P<pid>'?<unknown>'?|\d{1,10})(?!\d)\s*(?:,\s*|$)")
_NAME = re.compile(r"name\s*=\s*")
_SXID = re.compile(r"(?P<switch>nvidia-nvswitch\d{1,4}):\s*SXid\s*\(\s*(?:PCI:)?(?P<pci>" + _PCI + r")\s*\)\s*:\s*"
                   r"(?P<code>\d{1,6})(?!\d)\s*,\s*(?P<rest>.*)", re.DOTALL)
_SXID_SEVERITY = re.compile(r"(?P<severity>Fatal|Non-fatal|Nonfatal)\s*,\s*(?P<message>.*)", re.DOTALL | re.IGNORECASE)
_LINK = re.compile(r"\bLink\s+(\d{1,4})(?!\d)", re.IGNORECASE)
_BANNER = re.compile(r"NVRM:\s*GPU at (?:PCI:)?(?P<pci>" + _PCI + r")\s*:\s*(?P<uuid>GPU-[0-9a-fA-F-]{8,64})\s*$")
# "NVRM: GPU at PCI:0000:3b:00: GPU has fallen off the bus." or the kernel's "NVRM: GPU at 0000:01:00.0 has fallen
# off the bus."
_LOST = re.compile(r"NVRM:\s*GPU(?: at)?\s+(?:PCI:)?(?P<pci>" + _PCI + r")\s*(?::\s*GPU)?\s+has fallen off the bus",
                   re.IGNORECASE)
_LOST_START = re.compile(r"NVRM:\s*The NVIDIA GPU\s+(?:PCI:)?(?P<pci>" + _PCI + r")\s*$")
_LOST_END = re.compile(r"NVRM:.{0,200}fallen off the bus", re.IGNORECASE | re.DOTALL)

KERNEL_FACILITY = 0
USER_FACILITY = 1


class Prefix(NamedTuple):
    """What the log prefix said: the raw-kmsg sequence, time and facility, or a `<N>` priority (a named
    tuple: one is built per driver line, and a tuple costs a fifth of a frozen dataclass)."""

    seq: int | None = None
    timestamp_us: int | None = None
    facility: int | None = None
    level: int | None = None


_NO_PREFIX = Prefix()


@dataclass(slots=True, init=False)
class KernelRecord:
    """One recognised record. `pci` is the bus id as printed (lower-case, without `PCI:`).

    Its __init__ is written out rather than generated: mypyc compiles a written one, while the dataclass's
    generated one stays interpreted, and one record is built per driver line of a storm."""

    kind: str
    line: int
    code: int | None
    pci: str
    pid: int | None
    process: str | None
    message: str
    extras: dict[str, Any]
    prefix: Prefix

    def __init__(self, kind: str, line: int, code: int | None = None, pci: str = "", pid: int | None = None,
                 process: str | None = None, message: str = "", extras: dict[str, Any] | None = None,
                 prefix: Prefix = _NO_PREFIX) -> None:
        self.kind = kind
        self.line = line
        self.code = code
        self.pci = pci
        self.pid = pid
        self.process = process
        self.message = message
        self.extras = {} if extras is None else extras
        self.prefix = prefix

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
        if text.startswith(_DRIVER_BODIES):
            return text.strip(), prefix
    else:
        match = _SYSLOG_KERNEL.match(text)
        if match and text.startswith(_DRIVER_BODIES, match.end()):
            return text[match.end():].strip(), prefix
    return strip_prefixes_one_by_one(text, prefix)


def strip_prefixes_one_by_one(text: str, prefix: Prefix) -> tuple[str, Prefix]:
    """The record body left once every known prefix form has been stripped, one at a time, from the front of
    `text`, and `prefix` with the priority one told (strip_prefix's general case)."""
    for _ in range(8):
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


def journal_entry(line: str) -> tuple[str, Prefix] | None:
    """The message and origin of one `journalctl -o json` entry, or None when the line is not one.

    A record the kernel wrote (`_TRANSPORT=kernel`) gets the kernel facility; anything else is user space,
    so the forged-record filter sees it for what it is.
    """
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(entry, dict):
        return None
    message = entry.get("MESSAGE")
    if isinstance(message, list):  # journald writes non-UTF-8 messages as a byte array
        try:
            message = bytes(b for b in message if isinstance(b, int) and 0 <= b < 256).decode("utf-8", "replace")
        except (TypeError, ValueError):
            return None
    if not isinstance(message, str):
        return None
    kernel = entry.get("_TRANSPORT") == "kernel"
    facility = KERNEL_FACILITY if kernel else _int_or(entry.get("SYSLOG_FACILITY"), USER_FACILITY)
    level = _int_or(entry.get("PRIORITY"), None)
    monotonic = _int_or(entry.get("_SOURCE_MONOTONIC_TIMESTAMP"), None)
    seq = _int_or(entry.get("__SEQNUM"), None)
    return message, Prefix(seq=seq, timestamp_us=monotonic, facility=facility, level=level)


def _int_or(value: object, fallback: int | None) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit() and len(value) <= 20:
        return int(value)
    return fallback


class KernelLogParser:
    """Turns lines into records, keeping the little state multi-line reports need and the PCI -> UUID map.

    `skipped` counts the lines that named a driver record but could not be read; they are dropped.
    """

    def __init__(self) -> None:
        self.pci_to_uuid: dict[str, str] = {}
        self.skipped = 0
        self._lost_pci: str | None = None
        self._lost_lines = 0
        self._last_sxid: KernelRecord | None = None

    def feed(self, line: str, line_no: int = 0) -> KernelRecord | None:
        """The record this line completes, if any. Never raises on any input: an unreadable line is skipped."""
        try:
            return self._feed(line, line_no)
        except Exception:  # noqa: BLE001 - one line must never stop the source; it is counted instead
            self.skipped += 1
            return None

    def _feed(self, line: str, line_no: int) -> KernelRecord | None:
        fast = KMSG_XID.match(line)
        if fast:
            return self.kmsg_xid(fast, line, line_no)
        if line[:1] == "{" or (line[:1].isspace() and line.lstrip().startswith("{")):
            entry = journal_entry(line)
            if entry is None:
                return None
            message, json_prefix = entry
            if "NVRM" not in message and "SXid" not in message:
                return None
            body, prefix = strip_prefix(message)
            prefix = json_prefix
        else:
            if "NVRM" not in line and "SXid" not in line:
                return None
            body, prefix = strip_prefix(line)
        if body.startswith("NVRM"):
            return self._nvrm(body, prefix, line_no)
        if body.startswith("nvidia-nvswitch"):
            return self._sxid(body, prefix, line_no)
        return None

    def kmsg_xid(self, match: re.Match[str], line: str, line_no: int) -> KernelRecord:
        """The record of a line KMSG_XID matched: the driver's own Xid form in raw /dev/kmsg (a storm's lines)."""
        self._lost_pci = None
        return _kmsg_xid_record(match, line, line_no)

    def _nvrm(self, body: str, prefix: Prefix, line_no: int) -> KernelRecord | None:
        match = _XID.match(body)
        if match:
            self._lost_pci = None
            return _xid_record(match, prefix, line_no)
        if _XID_START.match(body):
            self.skipped += 1  # an Xid whose code cannot be read (missing, or an absurdly long number)
            return None
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


_XID_START = re.compile(r"NVRM:\s*Xid\b")


def _xid_record(match: re.Match[str], prefix: Prefix, line_no: int) -> KernelRecord:
    code = int(match.group("code"))
    whole = rest = match.group("rest")
    pid: int | None = None
    process: str | None = None
    pid_match = _PID.match(rest)
    if pid_match:
        raw = pid_match.group("pid")
        pid = int(raw) if raw.isdigit() else None
        rest = rest[pid_match.end():]
        name_match = _NAME.match(rest)
        if name_match:
            process, rest = _process_name(rest[name_match.end():])
    extras = _address_extras(match.group("addr"))
    pci = str(extras.pop("pci", ""))
    return _finished(code, whole, pci, pid, process, rest, extras, prefix, line_no)


# The driver's own form of an Xid record read from /dev/kmsg, in one pattern (the storm's fast path): what it
# matches is read exactly as strip_prefix + _XID + _PID + _NAME read it; anything else takes that longer way.
# Its priority is one digit 0-7: the kernel's facility (0), so a line it matches cannot come from user space.
KMSG_XID = re.compile(r"(?P<pri>[0-7]),(?P<seq>\d{1,20}),(?P<ts>\d{1,20}),[^;]{0,16};NVRM: Xid \(PCI:(?P<pci>"
                       + _PCI + r")\): (?P<code>\d{1,6}), (?P<whole>pid=(?P<pid>\d{1,10}), name=\s*)")


def _kmsg_xid_record(match: re.Match[str], line: str, line_no: int) -> KernelRecord:
    priority, seq, timestamp, pci, code, _whole, pid = match.groups()
    value, number = int(priority), int(code)
    prefix = _new_prefix(Prefix, (int(seq), int(timestamp), value >> 3, value & 7))
    process, rest = _process_name(line[match.end():].strip())
    whole = line[match.start("whole"):] if number in STRUCTURED_CODES else ""
    return _finished(number, whole, pci.lower(), int(pid), process, rest, {}, prefix, line_no)


#: Builds a Prefix from a tuple of its four fields without the named tuple's Python-level __new__.
_new_prefix = tuple.__new__


def _process_name(rest: str) -> tuple[str | None, str]:
    """The process name that opens `rest` (up to ", "), and what follows it."""
    cut = rest.find(", ")
    name, rest = (rest, "") if cut < 0 else (rest[:cut], rest[cut + 2:])
    return (None if name.strip("'") in {"<unknown>", ""} else name), rest


def _finished(code: int, whole: str, pci: str, pid: int | None, process: str | None, rest: str,
              extras: dict[str, Any], prefix: Prefix, line_no: int) -> KernelRecord:
    # Structured fields are read from the driver's end of the whole line: a process name cannot move them.
    if code in STRUCTURED_CODES:
        extras.update(xid_extras(code, whole.rstrip()))
    return KernelRecord("xid", line_no, code, pci, pid, process, rest.strip()[:MAX_MESSAGE], extras, prefix)


def _address_extras(address: str) -> dict[str, Any]:
    """The PCI bus id and MIG instance of an Xid's address; a redacted or mangled one leaves the GPU unknown."""
    match = _ADDRESS.fullmatch(address.strip())
    if match is None:
        return {"address_unreadable": True, "address": address.strip()[:64]}
    extras: dict[str, Any] = {"pci": match.group("pci").lower()}
    if match.group("gi") is not None:
        extras["gpu_instance"] = int(match.group("gi"))
    if match.group("ci") is not None:
        extras["compute_instance"] = int(match.group("ci"))
    return extras



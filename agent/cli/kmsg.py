"""`kmsg parse`: NVIDIA records in a kernel log or the kernel's ring buffer."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import click

from agent.cli.common import fail, reporting_bad_input
from agent.sources.kernel_log import KernelLogParser, KernelRecord
from agent.sources.kmsg_records import RecordReader


@click.group()
def kmsg() -> None:
    """Work with kernel logs."""


@kmsg.command(name="parse")
@click.argument("path", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per recognised Xid or SXid line.")
@click.option("--all", "all_kinds", is_flag=True, help="Also GPU-loss and GPU banner records.")
@reporting_bad_input
def kmsg_parse(path: str, as_json: bool, all_kinds: bool) -> None:
    """Parse a kernel log (dmesg, syslog, journalctl or raw /dev/kmsg records) for NVIDIA records.

    On /dev/kmsg it reads the records now in the kernel's ring buffer and stops (`run` follows it).
    A summary (lines read, records found, Xid lines not recognised) goes to stderr.
    """
    tally = ParseTally()
    parser = KernelLogParser()
    with contextlib.ExitStack() as files:
        if path != "-" and Path(path).exists() and stat.S_ISCHR(Path(path).stat().st_mode):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                lines: Iterable[str] = list(RecordReader(fd, tally.lost).available())
            finally:
                os.close(fd)
            tally.device = True
        else:
            try:
                handle = sys.stdin.buffer if path == "-" else files.enter_context(open(path, "rb"))
            except OSError as exc:
                fail([f"{path}: cannot read: {exc.strerror}"])
            if looks_binary(handle.peek(8192)[:8192] if hasattr(handle, "peek") else b""):
                fail([f"{path}: binary data, not a kernel log (give a text log: dmesg, syslog, journalctl)"])
            lines = (raw.decode("utf-8", errors="replace") for raw in handle)
        records = [r for r in tally.count(parser, lines) if r is not None]
    shown = [r for r in records if all_kinds or r.kind in {"xid", "sxid"}]
    if as_json:
        for record in shown:
            click.echo(json.dumps(record.to_json(), default=str))
    else:
        click.echo(f"{'line':>6}  {'kind':8} {'code':>6}  {'pci':14} {'pid':>8}  {'process':16} message")
        for r in shown:
            click.echo(f"{r.line:>6}  {r.kind:8} {r.code if r.code is not None else '-':>6}  {r.pci:14} "
                       f"{r.pid if r.pid is not None else '-':>8}  {(r.process or '-')[:16]:16} {r.message}")
    click.echo(tally.summary(path, records=len(records), shown=len(shown)), err=True)


def looks_binary(head: bytes) -> bool:
    """NUL bytes, or mostly bytes that are not UTF-8 text: not a log."""
    if b"\0" in head:
        return True
    text = head.decode("utf-8", errors="replace")
    return bool(head) and text.count("\ufffd") > len(text) // 10


@dataclasses.dataclass(slots=True)
class ParseTally:
    """What `kmsg parse` read: lines, Xid-looking lines the parser did not recognise, records lost (EPIPE)."""

    lines: int = 0
    unrecognised: int = 0
    records_lost: int = 0
    device: bool = False

    def lost(self) -> None:
        self.records_lost += 1

    def count(self, parser: KernelLogParser, lines: Iterable[str]) -> Iterator[KernelRecord | None]:
        for number, line in enumerate(lines, 1):
            self.lines = number
            record = parser.feed(line, number)
            if record is None and ("Xid" in line and ("NVRM" in line or "SXid" in line)):
                self.unrecognised += 1
            yield record

    def summary(self, path: str, *, records: int, shown: int) -> str:
        what = f"{self.lines} record(s) in the kernel ring buffer" if self.device else f"{self.lines} line(s)"
        extra = f", {self.records_lost} overwritten before they were read" if self.records_lost else ""
        hidden = f" ({records - shown} more with --all)" if records > shown else ""
        follow = "; stopped at the end of the buffer (not following)" if self.device else ""
        return (f"{path}: read {what}{extra}: {shown} NVIDIA record(s) shown{hidden}, "
                f"{self.unrecognised} Xid line(s) not recognised{follow}")

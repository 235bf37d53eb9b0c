#!/usr/bin/env python3
"""Feeds mutated kernel-log records to the parser and prints how many raised (the target is none).

Usage: scripts/fuzz_kernel_log.py [LINES] [SEED]   (default 1,000,000 lines, seed 12)
Seeds are the fixture logs plus every form the parser reads; each line gets 1-6 random edits (insert,
delete, replace, duplicate a span, swap in a token the parser looks for, lengthen a number to 5,000 digits).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from agent.sources.kernel_log import KernelLogParser

ROOT = Path(__file__).resolve().parent.parent
EXTRA_SEEDS = [
    "NVRM: Xid (PCI:0000:48:00): 154, GPU recovery action changed from 0x0 (None) to 02 (Node Reboot Required)",
    "NVRM: Xid (PCI:0000:3b:00 GPU-I:05 GPU-CI:02): 31, pid=4242, name=python, Ch 00000008, MMU Fault",
    "Nov 30 23:33:39.123456 node kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off",
    "Mon 2026-11-30 23:33:39 UTC node kernel: NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, DBE",
    '{"_TRANSPORT":"kernel","PRIORITY":"4","MESSAGE":"NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, b"}',
    "[…] NVRM: Xid (0000:03:00): 14, Channel 00000001",
    "NVRM: Xid (PCI:0000:3b:00): 13, pid=5, name=py, Graphics SM Warp Exception on (GPC 4, TPC 1, SM 0): Out Of Range",
    "NVRM: Xid (PCI:0000:3b:00): 74, pid=99, name=a, link 0 (0xff, NVLink: fatal error detected on link 14(0x0, 0x0, "
    "0x10000, 0x0, 0x0, 0x0, 0x0)",
]
TOKENS = ["NVRM: ", "Xid ", "(PCI:", "0000:3b:00", "): ", ", ", "pid=", "name=", "<unknown>", "Link 3 (", "0x1 ",
          ")", "(", "GPU-I:05 ", "{", "\"MESSAGE\":", "Fatal ", "caused by previous Xid ", "to 02 (", "\u2026", "\x00",
          "\udcff", "[", "]", "kernel: ", "SXid ", "nvidia-nvswitch0: ", "GPC 1, TPC 2", "9" * 5000]


def seeds() -> list[str]:
    lines = list(EXTRA_SEEDS)
    for path in sorted((ROOT / "tests" / "fixtures" / "kmsg").glob("*.log")):
        lines.extend(line for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return lines


def mutate(line: str, rng: random.Random) -> str:
    for _ in range(rng.randint(1, 6)):
        at = rng.randint(0, len(line))
        kind = rng.randrange(6)
        if kind == 0:
            line = line[:at] + rng.choice(TOKENS) + line[at:]
        elif kind == 1:
            line = line[:at] + line[at + rng.randint(1, 12):]
        elif kind == 2:
            line = line[:at] + chr(rng.randrange(1, 0x2FF)) + line[at + 1:]
        elif kind == 3:
            span = line[at:at + rng.randint(1, 40)]
            line = line[:at] + span * rng.randint(2, 50) + line[at:]
        elif kind == 4:
            line = line[:at] + str(rng.randrange(10 ** rng.randint(1, 30))) + line[at:]
        else:
            line = line[:at] + rng.choice(TOKENS) + line[at + rng.randint(0, 8):]
    return line


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 12)  # noqa: S311 - reproducible, not secret
    corpus = seeds()
    parser = KernelLogParser()
    raised = records = 0
    slowest = 0.0
    started = time.perf_counter()
    for n in range(total):
        line = mutate(rng.choice(corpus), rng)
        before = time.perf_counter()
        try:
            record = parser._feed(line, n)  # the unguarded parse: the catch-all in feed() must never be needed
        except Exception as exc:  # noqa: BLE001 - counted and shown: the figure this script exists for
            raised += 1
            if raised <= 5:
                print(f"raised {type(exc).__name__}: {exc} on {line[:200]!r}")
            record = None
        slowest = max(slowest, time.perf_counter() - before)
        records += record is not None
    elapsed = time.perf_counter() - started
    print(f"lines: {total:,}  records: {records:,}  skipped: {parser.skipped:,}  raised: {raised:,}  "
          f"slowest line: {slowest * 1000:.2f} ms  rate: {total / elapsed:,.0f} lines/s")
    sys.exit(1 if raised else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Prints the throughput of the kernel-log path (parser + storm dedup + engine) on one core, for the input
shapes of issue 14: a storm of distinct Xid lines, a storm of repeating lines, a 1 M-line log with 1 % NVRM
lines, and the distinct storm again with the Xid rules duplicated x8 (the engine must not care).

Targets: distinct-line storm >= 100,000 lines/s; x8 rules within 10 % of x1.
Usage: python scripts/bench_engine.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass

import msgspec

from agent.engine import EngineState, RuleSet, builtin_rules_dir, evaluate, load_rules
from agent.hot_path import describe
from agent.model import Signal
from agent.sources.kmsg import KernelLogProcessor

OTHER = [
    "6,{seq},{ts},-;usb 1-1: new high-speed USB device number {n} using xhci_hcd",
    "6,{seq},{ts},-;IPv6: ADDRCONF(NETDEV_CHANGE): cali{n:x}: link becomes ready",
    "4,{seq},{ts},-;cgroup: fork rejected by pids controller in /kubepods.slice/pod{n}",
    "6,{seq},{ts},-;EXT4-fs (nvme0n1p{n}): mounted filesystem with ordered data mode. Quota mode: none.",
]
XIDS = [
    "4,{seq},{ts},-;NVRM: Xid (PCI:0000:{bus}:00): 31, pid={n}, name=pt_main_thread, Ch 00000008, intr 10000000. "
    "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f12_{n:08x}. Fault is of type FAULT_PDE",
    "4,{seq},{ts},-;NVRM: Xid (PCI:0000:{bus}:00): 13, pid={n}, name=python3, Graphics SM Warp Exception "
    "on (GPC {g}, TPC 1, SM 0): Out Of Range Address",
    "4,{seq},{ts},-;NVRM: Xid (PCI:0000:{bus}:00): 43, pid={n}, name=python3, Ch 0000{g:04x}",
]
BUSES = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]


def kernel_log(count: int, nvrm_share: float, *, pids: int = 1_000_000, seed: int = 7) -> list[str]:
    """A kernel log: `nvrm_share` of its lines are Xids (from `pids` processes) on eight GPUs."""
    rng = random.Random(seed)  # noqa: S311 - benchmark data, not security
    out = []
    for seq in range(count):
        pool = XIDS if rng.random() < nvrm_share else OTHER
        out.append(rng.choice(pool).format(seq=seq, ts=seq * 10, n=rng.randrange(pids), g=rng.randrange(8),
                                           bus=rng.choice(BUSES)))
    return out


def repeating_storm(count: int) -> list[str]:
    """The same 29 distinct Xid lines over and over (the field's 800,000-line storm)."""
    distinct = kernel_log(29, 1.0, pids=4, seed=11)
    return [distinct[n % len(distinct)].replace(",0,-;", f",{n},-;", 1) for n in range(count)]


def multiplied(rules: RuleSet, factor: int, *, new_codes: bool = False) -> RuleSet:
    """The rule set with every Xid rule copied `factor - 1` more times under new ids: copies that match the
    same codes (every observation then matches `factor` times the rules), or, with `new_codes`, a catalog
    `factor` times larger (the copies take codes 1000, 2000, ... above the originals)."""
    extra = [msgspec.structs.replace(rule, id=f"{rule.id}-copy{n}", code=_shifted(rule.code, n * 1000))
             if new_codes else msgspec.structs.replace(rule, id=f"{rule.id}-copy{n}")
             for n in range(1, factor) for rule in rules.for_signal(Signal.XID)]
    return RuleSet(rules=(*rules.rules, *extra))


def _shifted(code: int | list[int] | None, by: int) -> int | list[int] | None:
    if code is None:
        return None
    return code + by if isinstance(code, int) else [c + by for c in code]


@dataclass(frozen=True, slots=True)
class Figure:
    lines: int
    seconds: float
    cpu_seconds: float
    observations: int

    @property
    def lines_per_second(self) -> float:
        """Per core: lines over the CPU time they took (the machine may be shared)."""
        return self.lines / max(self.cpu_seconds, 1e-9)

    @property
    def cpu_us_per_line(self) -> float:
        return self.cpu_seconds / self.lines * 1e6


def run_path(sample: list[str], rules: RuleSet | None, *, repeat: int = 3) -> Figure:
    """Best of `repeat` runs of every line through the processor and (when given rules) the engine."""
    best: Figure | None = None
    for _ in range(repeat):
        processor = KernelLogProcessor(dedup_seconds=1.0)
        state = EngineState()
        observations = 0
        start_cpu, start = time.process_time(), time.perf_counter()
        for n, line in enumerate(sample):
            now = 1_000.0 + n * 1e-5  # 100,000 lines per simulated second
            for observation in processor.handle(line, now, n):
                observations += 1
                if rules is not None:
                    evaluate(observation, state, now, rules=rules)
        figure = Figure(len(sample), time.perf_counter() - start, time.process_time() - start_cpu, observations)
        if best is None or figure.cpu_seconds < best.cpu_seconds:
            best = figure
    if best is None:
        raise ValueError("repeat must be at least 1")
    return best


def show(name: str, figure: Figure) -> None:
    print(f"{name:46} {figure.lines:>9,} lines {figure.lines_per_second:>11,.0f} lines/s "
          f"{figure.cpu_us_per_line:>7.2f} us CPU/line  ({figure.observations:,} observations)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the lines")
    args = parser.parse_args()
    scale = 10 if args.quick else 1
    rules = load_rules(builtin_rules_dir())
    distinct = kernel_log(200_000 // scale, 1.0)
    print(f"python {sys.version.split()[0]} ({os.path.realpath(sys.executable)}), {len(rules.rules)} rules "
          f"({len(rules.for_signal(Signal.XID))} Xid), {describe()}")
    show("distinct-line Xid storm, parser only", run_path(distinct, None))
    x1 = run_path(distinct, rules)
    show("distinct-line Xid storm, parser + engine", x1)
    show("repeating Xid storm, parser + engine", run_path(repeating_storm(200_000 // scale), rules))
    show("1 M-line log, 1 % NVRM, parser + engine", run_path(kernel_log(1_000_000 // scale, 0.01), rules, repeat=1))
    for new_codes, label in ((True, "x8 catalog (copies on new codes)"), (False, "x8 copies on the same codes")):
        x8 = run_path(distinct, multiplied(rules, 8, new_codes=new_codes))
        show(f"distinct storm, {label}", x8)
        ratio = x1.cpu_us_per_line / x8.cpu_us_per_line
        print(f"{'  throughput x8 / x1 (CPU time)':46} {ratio:>9.3f}  (target >= 0.90)")


if __name__ == "__main__":
    main()

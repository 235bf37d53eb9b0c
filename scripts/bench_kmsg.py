#!/usr/bin/env python3
"""Prints the kernel-log source's throughput (lines/s on one core) for a mixed log and an Xid storm,
and, as root, the latency from a record written to /dev/kmsg to its observation.

Targets (issue 4): >= 500,000 lines/s with 1 % NVRM lines; >= 100,000 lines/s for an all-Xid storm.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

from agent.drill import mark_test_record
from agent.sources.kmsg import KernelLogProcessor, KmsgSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import kernel_log


def lines(count: int, nvrm_share: float, *, pids: int = 100_000, seed: int = 7) -> list[str]:
    """A kernel log: `nvrm_share` of its lines are Xids from `pids` different processes."""
    return kernel_log(count, nvrm_share, pids=pids, seed=seed)


def throughput(name: str, sample: list[str], repeat: int = 3) -> None:
    best = 0.0
    emitted = 0
    for _ in range(repeat):
        processor = KernelLogProcessor(dedup_seconds=1.0)
        start_cpu = time.process_time()
        start = time.perf_counter()
        emitted = 0
        for n, line in enumerate(sample):
            emitted += len(processor.handle(line, start + n * 1e-6, n))
        emitted += len(processor.flush(0.0, force=True))
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - start_cpu
        best = max(best, len(sample) / max(elapsed, cpu, 1e-9))
    print(f"{name:38} {len(sample):>9,} lines  {best:>12,.0f} lines/s  ({emitted:,} observations emitted)")


def latency(samples: int = 50) -> None:
    if os.geteuid() != 0 or not os.access("/dev/kmsg", os.W_OK):
        print("kmsg write -> observation latency      skipped (needs root and a writable /dev/kmsg)")
        return
    seen: dict[str, float] = {}
    done = threading.Event()

    def emit(observation: object) -> None:
        message = str(getattr(observation, "attrs", {}).get("message", ""))
        if message.startswith("bench "):
            seen[message] = time.perf_counter()

    source = KmsgSource(path=Path("/dev/kmsg"), admit_user_records=True, wake_seconds=0.05, dedup_seconds=0.0)
    thread = threading.Thread(target=source.run, args=(emit, done), daemon=True)
    thread.start()
    source.ready.wait(5)
    time.sleep(0.5)
    delays = []
    with open("/dev/kmsg", "w") as kmsg:
        for n in range(samples):
            message = mark_test_record(f"bench {uuid.uuid4().hex} {n}")  # nobody reading dmesg takes it for a fault
            sent = time.perf_counter()
            kmsg.write(f"<4>NVRM: Xid (PCI:0000:ee:00): 31, pid=1, name=bench, {message}\n")
            kmsg.flush()
            deadline = sent + 2
            while message not in seen and time.perf_counter() < deadline:
                time.sleep(0.0002)
            if message in seen:
                delays.append(seen[message] - sent)
    done.set()
    thread.join(5)
    if delays:
        delays.sort()
        p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
        print(f"kmsg write -> observation latency      p50 {statistics.median(delays) * 1e3:.2f} ms, "
              f"p99 {p99 * 1e3:.2f} ms over {len(delays)} records")


def main() -> None:
    throughput("mixed kernel log, 1 % NVRM lines", lines(500_000, 0.01))
    throughput("all-Xid storm, 4 processes", lines(200_000, 1.0, pids=4))
    throughput("all-Xid storm, every line distinct", lines(200_000, 1.0))
    latency()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this benchmark process     {rss:.1f} MiB")


if __name__ == "__main__":
    main()

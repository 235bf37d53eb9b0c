#!/usr/bin/env python3
"""Prints the kernel-log source's throughput (lines/s on one core) for a mixed log and an Xid storm,
and, as root, the latency from a record written to /dev/kmsg to its observation.

Targets (issue 4): >= 500,000 lines/s with 1 % NVRM lines; >= 100,000 lines/s for an all-Xid storm.
"""

from __future__ import annotations

import os
import random
import resource
import statistics
import threading
import time
import uuid
from pathlib import Path

from agent.sources.kmsg import KernelLogProcessor, KmsgSource

OTHER = [
    "6,{seq},{ts},-;usb 1-1: new high-speed USB device number {n} using xhci_hcd",
    "6,{seq},{ts},-;IPv6: ADDRCONF(NETDEV_CHANGE): cali{n:x}: link becomes ready",
    "4,{seq},{ts},-;cgroup: fork rejected by pids controller in /kubepods.slice/pod{n}",
    "6,{seq},{ts},-;EXT4-fs (nvme0n1p{n}): mounted filesystem with ordered data mode. Quota mode: none.",
]
XIDS = [
    "4,{seq},{ts},-;NVRM: Xid (PCI:0000:3b:00): 31, pid={n}, name=pt_main_thread, Ch 00000008, intr 10000000. "
    "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f12_34560000. Fault is of type FAULT_PDE",
    "4,{seq},{ts},-;NVRM: Xid (PCI:0000:5d:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception "
    "on (GPC {g}, TPC 1, SM 0): Out Of Range Address",
]


def lines(count: int, nvrm_share: float, *, pids: int = 100_000, seed: int = 7) -> list[str]:
    """A kernel log: `nvrm_share` of its lines are Xids from `pids` different processes."""
    rng = random.Random(seed)  # noqa: S311 - benchmark data, not security
    out = []
    for seq in range(count):
        pool = XIDS if rng.random() < nvrm_share else OTHER
        out.append(rng.choice(pool).format(seq=seq, ts=seq * 10, n=rng.randrange(pids), g=rng.randrange(8)))
    return out


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
            message = f"bench {uuid.uuid4().hex} {n}"
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

#!/usr/bin/env python3
"""Prints what the agent's classification step costs per kernel-log record in a storm, the durable record
included: a storm of distinct raw /dev/kmsg Xid lines through the kernel-log processor and Pipeline.handle
(local mode, journal on disk, metrics, eight GPUs), ticking once a simulated second as the daemon's loop does.

Every raw kmsg record carries its sequence number, which the pipeline acknowledges in the journal before the
next is handled: with the record when the record changed, else the cursor alone; the figures show which.
Usage: python scripts/bench_pipeline.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent.engine import builtin_rules_dir, load_rules
from agent.hot_path import describe
from agent.journal import Journal
from agent.logs import configure_logging
from agent.metrics import Metrics
from agent.model import GpuRef, NodeInventory, Observation, Signal, frozen_attrs
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy
from agent.sources.kmsg import KernelLogProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import BUSES, kernel_log

#: The node's eight GPUs, as NVML names them, at the PCI addresses the storm's lines print.
INVENTORY = NodeInventory(name="benchnode", gpus=tuple(
    GpuRef(index=n, uuid=f"GPU-{n:08d}-0000-0000-0000-000000000000", pci_bus_id=f"00000000:{bus}:00.0", model="H100")
    for n, bus in enumerate(BUSES)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the lines")
    args = parser.parse_args()
    configure_logging("error", "json")  # verdicts are logged at warning: thousands in a storm
    lines = kernel_log(20_000 if args.quick else 200_000, 1.0)
    with tempfile.TemporaryDirectory() as work:
        journal = Journal(Path(work) / "journal.db")
        writes = {"record": 0, "cursor": 0}
        save_record, set_cursors = journal.save_record, journal.set_cursors

        def record_written(*args: object, **kwargs: object) -> None:
            writes["record"] += 1
            save_record(*args, **kwargs)  # type: ignore[arg-type]

        def cursor_written(cursors: Mapping[str, str]) -> None:
            writes["cursor"] += 1
            set_cursors(cursors)

        journal.save_record = record_written  # type: ignore[method-assign]
        journal.set_cursors = cursor_written  # type: ignore[method-assign]
        pipeline = Pipeline(rules=load_rules(builtin_rules_dir()), inventory=INVENTORY, policy=GuardPolicy(),
                            journal=journal, metrics=Metrics(CollectorRegistry()), inline=False,
                            clock=lambda: 1_000.0)
        pipeline.handle(Observation(Signal.BOOT, 0, 999.0, "kmsg", attrs=frozen_attrs({"boot_id": "bench"})))
        processor = KernelLogProcessor(dedup_seconds=1.0)
        observations, next_tick = 0, 1_001.0
        start_cpu, start = time.process_time(), time.perf_counter()
        for n, line in enumerate(lines):
            now = 1_000.0 + n * 1e-4  # 10,000 lines per simulated second, the storm of issue 14
            for observation in processor.handle(line, now, n):
                observations += 1
                pipeline.handle(observation, now)
            if now >= next_tick:
                pipeline.tick(now)
                next_tick += 1.0
        cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start
        journal.close()
    print(f"python {sys.version.split()[0]}, {describe()}, {len(lines):,} distinct raw kmsg Xid lines, "
          f"{observations:,} observations")
    print(f"kernel-log processor + Pipeline.handle (journal)  {cpu / len(lines) * 1e6:8.1f} us CPU/line "
          f"{len(lines) / max(cpu, 1e-9):>10,.0f} lines/s  ({wall:.1f} s wall)")
    print(f"journal writes: the whole record {writes['record']:,}, a cursor alone {writes['cursor']:,} "
          f"({(writes['record'] + writes['cursor']) / len(lines):.4f} per line)")


if __name__ == "__main__":
    main()

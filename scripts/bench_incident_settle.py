#!/usr/bin/env python3
"""Prints what sets remediation.incident_settle_seconds: how long an incident's NVML event can take to reach the
agent after the driver raised it, while the NVML source polls every GPU, beside the driver's own spread.

One incident reaches the agent by two paths: its Xid lines through the kernel log (read as they are printed,
bench_latency.py: p99 <= 50 ms to the taint) and its DBE through NVML's event wait, which shares the NVML session
with the poll: an event raised during a poll of every GPU waits for that poll to end. This script runs the real
NVML source on the fake library (8 GPUs), polling back to back (the worst phase: a poll always under way), and
injects a DBE event at random moments: it prints the poll's duration and the event's delay (injection to
emit), p50 / p99 / max. The fake answers a call in microseconds and looks for events every 20 ms; a real
driver answers in about a millisecond per call (some 40 calls per GPU), so on a node the poll, and so the
delay, is larger: docs/remediation.md turns both into the window. Needs tests/fakenvml/build.sh.
Usage: scripts/bench_incident_settle.py [EVENTS]
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAKE = REPO / "tests" / "fakenvml" / "build" / "libnvidia-ml.so.1"
sys.path.insert(0, str(REPO))

from agent.model import Observation, Signal  # noqa: E402
from agent.sources.nvml import NvmlSource, load_pynvml  # noqa: E402
from tests.conftest import eight_gpus  # noqa: E402


def _write(path: Path, state: dict[str, object]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(state))
    os.replace(temporary, path)


def _figures(name: str, values_ms: list[float]) -> str:
    ordered = sorted(values_ms)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"{name}: p50 {statistics.median(ordered):.1f} ms, p99 {p99:.1f} ms, max {ordered[-1]:.1f} ms"


def main(events: int) -> int:
    if not FAKE.exists():
        print(f"{FAKE} is missing: run tests/fakenvml/build.sh", file=sys.stderr)
        return 2
    ctypes.CDLL(str(FAKE), mode=os.RTLD_NOW | ctypes.RTLD_GLOBAL)
    state = Path(tempfile.mkdtemp()) / "nvml-state.json"
    os.environ["FAKE_NVML_STATE"] = str(state)
    base = eight_gpus()
    _write(state, base)
    source = NvmlSource(load_pynvml(), poll_seconds=0.0, event_wait_ms=500)
    seen: dict[int, float] = {}
    arrived = threading.Condition()

    def emit(observation: Observation) -> None:
        if observation.signal is Signal.ECC_DBE and observation.source == "nvml-event":
            with arrived:
                seen[len(seen)] = time.monotonic()
                arrived.notify_all()

    polls: list[float] = []
    stop = threading.Event()
    timed_poll = source.poll

    def poll() -> list[Observation]:
        started = time.monotonic()
        try:
            return timed_poll()
        finally:
            polls.append((time.monotonic() - started) * 1000)

    source.poll = poll  # type: ignore[method-assign]
    runner = threading.Thread(target=source.run, args=(emit, stop), daemon=True)
    runner.start()
    source.ready.wait(10)
    delays: list[float] = []
    rng = random.Random(41)  # noqa: S311 - a benchmark's phases, not a secret
    for n in range(events):
        time.sleep(rng.uniform(0.005, 0.05))
        injected = time.monotonic()
        _write(state, {**base, "events": [{"id": n + 1, "gpu": n % 8, "type": 2, "data": 0}]})
        with arrived:
            arrived.wait_for(lambda n=n: n in seen, timeout=5)
        if n in seen:
            delays.append((seen[n] - injected) * 1000)
    stop.set()
    runner.join(timeout=5)
    print(_figures("poll of 8 GPUs", polls))
    print(_figures("NVML event, injection to emit, polls back to back", delays))
    print(f"events delivered: {len(delays)} of {events}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))

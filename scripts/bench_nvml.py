#!/usr/bin/env python3
"""Prints the agent's cost with 8 fake GPUs at the default poll interval (CPU share of one core, RSS),
and the time from an NVML event injected into the fake library to its verdict.

Targets (issue 5): the whole agent process <= 0.5 % of one core and <= 64 MiB RSS.
Needs tests/fakenvml/build/libnvidia-ml.so.1 (tests/fakenvml/build.sh).
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAKE_DIR = REPO / "tests" / "fakenvml" / "build"
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from agent.engine import builtin_rules_dir, load_rules  # noqa: E402
from agent.logs import configure_logging  # noqa: E402
from agent.model import NodeInventory, Signal  # noqa: E402
from agent.pipeline import Pipeline  # noqa: E402
from agent.remediation import GuardPolicy, Mode  # noqa: E402
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster, populate  # noqa: E402
from agent.sources.nvml import NvmlSource, load_pynvml  # noqa: E402
from tests.conftest import eight_gpus  # noqa: E402


def _proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def process_cost(state: Path, seconds: float, kubeconfig: Path | None = None) -> None:
    env = dict(os.environ, LD_LIBRARY_PATH=str(FAKE_DIR), FAKE_NVML_STATE=str(state),
               GPU_HEALTH_SOURCES__KMSG__ENABLED="off", GPU_HEALTH_JOURNAL_PATH=str(state.parent / "j.db"),
               GPU_HEALTH_HTTP__HOST="127.0.0.1", GPU_HEALTH_LOG__LEVEL="warning", NODE_NAME="bench",
               KUBECONFIG=str(kubeconfig or state.parent / "no-kubeconfig"))
    agent = subprocess.Popen([sys.executable, "-m", "agent", "run", "--port", "0"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        time.sleep(5)  # start-up (imports, discovery) is not the steady state
        cpu0, t0 = _proc_cpu_seconds(agent.pid), time.monotonic()
        time.sleep(seconds)
        cpu1, t1 = _proc_cpu_seconds(agent.pid), time.monotonic()
        share = (cpu1 - cpu0) / (t1 - t0) * 100
        polls = (t1 - t0) / 10.0
        mode = "cluster mode (fake API server)" if kubeconfig else "local mode"
        print(f"agent process, {mode}, 8 GPUs, 10 s poll: {share:.3f} % of one core over {t1 - t0:.0f} s "
              f"({(cpu1 - cpu0) / polls * 1000:.1f} ms CPU per poll cycle), RSS {_rss_mib(agent.pid):.1f} MiB")
    finally:
        agent.terminate()
        agent.wait(15)


def event_latency(state: Path, samples: int) -> None:
    configure_logging("error")
    ctypes.CDLL(str(FAKE_DIR / "libnvidia-ml.so.1"), mode=os.RTLD_NOW | ctypes.RTLD_GLOBAL)
    os.environ["FAKE_NVML_STATE"] = str(state)
    pipeline = Pipeline(rules=load_rules(builtin_rules_dir()), inventory=NodeInventory("bench"),
                        policy=GuardPolicy(mode=Mode.OBSERVE))
    verdict_at: dict[int, float] = {}

    def emit(observation: object) -> None:
        outcome = pipeline.handle(observation)  # type: ignore[arg-type]
        if getattr(observation, "signal", None) is Signal.XID and outcome.verdicts:
            verdict_at[int(getattr(observation, "attrs", {}).get("event_type", 0)) and len(verdict_at)] = \
                time.perf_counter()

    source = NvmlSource(load_pynvml(), poll_seconds=3600, event_wait_ms=100)
    stop = threading.Event()
    thread = threading.Thread(target=source.run, args=(emit, stop), daemon=True)
    thread.start()
    source.ready.wait(10)
    data = eight_gpus()
    delays = []
    for n in range(samples):
        data["events"] = [{"id": n + 1, "gpu": n % 8, "type": 8, "data": 79}]
        before = len(verdict_at)
        sent = time.perf_counter()
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, state)
        deadline = sent + 5
        while len(verdict_at) == before and time.perf_counter() < deadline:
            time.sleep(0.0005)
        if len(verdict_at) > before:
            delays.append(max(verdict_at.values()) - sent)
        # clear the fault so the next Xid 79 on this GPU raises a verdict again
        pipeline.engine.rules.clear()
        pipeline.active.clear()
    stop.set()
    thread.join(5)
    delays.sort()
    print(f"NVML Xid event -> verdict: p50 {statistics.median(delays) * 1e3:.1f} ms, "
          f"p99 {delays[min(len(delays) - 1, int(len(delays) * 0.99))] * 1e3:.1f} ms over {len(delays)} events "
          "(includes the fake library polling its state file every 20 ms for events)")


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    with tempfile.TemporaryDirectory() as folder:
        state = Path(folder) / "state.json"
        state.write_text(json.dumps(eight_gpus()))
        process_cost(state, seconds)
        cluster = FakeCluster()
        populate(cluster, NodeInventory("bench", (), ()))
        server = FakeApiServer(cluster).start()
        kubeconfig = Path(folder) / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(server.kubeconfig()))
        try:
            process_cost(state, seconds, kubeconfig)
        finally:
            server.stop()
        event_latency(state, 50)


if __name__ == "__main__":
    main()

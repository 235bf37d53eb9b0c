#!/usr/bin/env python3
"""Prints what per-GPU isolation costs against the fake API server: the time from a GPU fault to its
isolation being visible through the API (DeviceTaintRule with `isolation: device`, node taint with `node`;
p50, p99 over TRIALS faults, each on a fresh node), and the API requests of one reconciliation pass on a
healthy node with each setting (device isolation lists the node's ResourceSlices and the agent's rules).
Figures only, no target: the machine is shared and noisy.
Usage: scripts/bench_dra.py [TRIALS]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.cluster_side import build_cluster_side  # noqa: E402
from agent.config import load_config  # noqa: E402
from agent.engine import builtin_rules_dir, load_rules  # noqa: E402
from agent.k8s.client import client_for  # noqa: E402
from agent.logs import configure_logging  # noqa: E402
from agent.model import GpuRef, NodeInventory, Observation, PodRef, Signal  # noqa: E402
from agent.pipeline import Pipeline  # noqa: E402
from agent.remediation import GuardPolicy, Mode  # noqa: E402
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster, populate  # noqa: E402

NODE = "bench-node"
RULES = load_rules(builtin_rules_dir())
GPUS = tuple(GpuRef(i, f"GPU-bench-{i:04d}", f"0000:{0x18 + i:02x}:00.0") for i in range(8))
INVENTORY = NodeInventory(NODE, GPUS, tuple(PodRef("ml", f"trainer-{g.index}", f"uid-{g.index}", (g.uuid,))
                                            for g in GPUS))


def agent(isolation: str, journal_dir: str) -> tuple[FakeCluster, FakeApiServer, Pipeline]:
    cluster = FakeCluster()
    populate(cluster, INVENTORY, dra=True)
    server = FakeApiServer(cluster).start()
    config = load_config(None, env={"NODE_NAME": NODE, "GPU_HEALTH_REMEDIATION__ISOLATION": isolation,
                                    "GPU_HEALTH_JOURNAL_PATH": f"{journal_dir}/journal.db"})
    side = build_cluster_side(client_for(server.url), config, on_stuck=lambda pod: None)
    pipeline = Pipeline(rules=RULES, inventory=NodeInventory(NODE, GPUS), policy=GuardPolicy(mode=Mode.QUARANTINE),
                        actuator=side.actuator, gate=side.gate, own_pod=side.own_pod, pods=side.pods.pods)
    pipeline.start()
    return cluster, server, pipeline


def isolated(cluster: FakeCluster, isolation: str) -> bool:
    if isolation == "device":
        return bool(cluster.device_taint_rules())
    return any(t.get("key") == "gpu-health-agent.io/unhealthy" for t in cluster.node(NODE)["spec"].get("taints", []))


def time_to_isolation(isolation: str, trials: int) -> list[float]:
    times = []
    with tempfile.TemporaryDirectory() as journal_dir:
        for trial in range(trials):
            cluster, server, pipeline = agent(isolation, journal_dir)
            try:
                gpu = GPUS[trial % len(GPUS)]
                started = time.perf_counter()
                pipeline.handle(Observation(Signal.XID, 48, time.time(), "kmsg", gpu), time.time())
                if not isolated(cluster, isolation):
                    raise SystemExit(f"{isolation}: the fault did not isolate anything")
                times.append(time.perf_counter() - started)
            finally:
                server.stop()
    return times


def requests_per_healthy_pass(isolation: str) -> int:
    with tempfile.TemporaryDirectory() as journal_dir:
        cluster, server, pipeline = agent(isolation, journal_dir)
        try:
            before = cluster.faults.requests
            pipeline.reconcile()
            return cluster.faults.requests - before
        finally:
            server.stop()


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    configure_logging("error", "console")
    for isolation in ("node", "device"):
        times = sorted(time_to_isolation(isolation, trials))
        p50, p99 = statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))]
        print(f"isolation {isolation:6}: fault -> isolation visible through the API: p50 {p50 * 1000:.1f} ms, "
              f"p99 {p99 * 1000:.1f} ms ({trials} faults); requests per healthy reconciliation pass: "
              f"{requests_per_healthy_pass(isolation)}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Prints the time from a fault's appearance in the kernel log to the agent's taint being visible through
the API (p50, p99 over >= 200 faults), and the API requests a healthy node makes per hour.

The whole agent runs in this process: the kmsg source tails a pipe standing in for /dev/kmsg, NVML is the
fake library (8 GPUs), and the Kubernetes actuators talk over HTTP to the fake API server, or with `--real`
over HTTPS to the real control plane of tests/realcluster (kube-apiserver 1.37.2, etcd, kwok; built by
scripts/build-controlplane), with the agent's own ServiceAccount token under the shipped RBAC and policy.
"Visible" is when a watch on the node delivers it tainted (the real server), as a scheduler would see it.
Targets: p99 <= 50 ms; 0 writes per healthy node per hour.
Usage: scripts/bench_latency.py [--real] [FAULTS] [HEALTHY_SECONDS]
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prometheus_client import CollectorRegistry  # noqa: E402

from agent.config import load_config  # noqa: E402
from agent.daemon import Daemon  # noqa: E402
from agent.engine import builtin_rules_dir, load_rules  # noqa: E402
from agent.k8s.client import client_for  # noqa: E402
from agent.k8s.cluster import build_cluster_side  # noqa: E402
from agent.logs import configure_logging  # noqa: E402
from agent.model import NodeInventory, Observation, PodRef, Signal  # noqa: E402
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster, populate  # noqa: E402
from tests.conftest import eight_gpus  # noqa: E402

NODE = "bench-node"


class FakeBackend:
    """The fake API server in this process: the node as the agent's writes leave it, its request log."""

    name = "fake API server"

    def __init__(self, inventory: NodeInventory) -> None:
        self.cluster = FakeCluster()
        populate(self.cluster, inventory)
        self.server = FakeApiServer(self.cluster).start()
        self.agent_client = client_for(self.server.url)

    def node(self) -> dict[str, Any]:
        return self.cluster.node(NODE)

    def wait_tainted(self, wanted: bool, started: float, timeout: float) -> float | None:
        """Seconds from `started` until the node's taint is as wanted (read in this process's memory)."""
        while bool(self.node()["spec"].get("taints")) is not wanted:
            if time.perf_counter() - started > timeout:
                return None
            time.sleep(0.0005)
        return time.perf_counter() - started

    def counts(self) -> tuple[int, int]:
        return self.cluster.faults.requests, self.cluster.faults.writes

    def calls_since(self, start: int) -> list[str]:
        return [f"{method} {path}" for method, path, _ in self.cluster.log[start:]]

    def mark(self) -> int:
        return len(self.cluster.log)

    def stop(self) -> None:
        self.server.stop()


class RealBackend:
    """The real control plane, started in a temporary directory; the agent uses its own token."""

    name = "real kube-apiserver 1.37.2"

    def __init__(self, inventory: NodeInventory, folder: Path) -> None:
        from tests.realcluster.backend import RealCluster, RealServer  # noqa: PLC0415 - only with --real
        from tests.realcluster.controlplane import ControlPlane  # noqa: PLC0415
        self.plane = ControlPlane(folder / "controlplane").start()
        self.plane.apply_shipped_manifests()
        self.cluster = RealCluster(self.plane)
        self.cluster.populate(inventory)
        self.agent_client = RealServer(self.plane).agent_client(NODE)
        # A watch on the node, as a scheduler or controller sees the taint arrive: polling the server every
        # half millisecond would itself take a core of this 2-core machine from the agent and the server.
        self.changed = threading.Condition()
        self.tainted = bool(self.node()["spec"].get("taints"))
        self.changed_at = 0.0
        self.stopped = False
        threading.Thread(target=self._watch, daemon=True).start()

    def node(self) -> dict[str, Any]:
        return self.cluster.node(NODE)

    def _watch(self) -> None:
        while not self.stopped:
            try:
                self._follow()
            except Exception:  # noqa: BLE001 - the server went away (the benchmark ends) or cut the watch
                time.sleep(0.1)

    def _follow(self) -> None:
        response = self.plane.core.list_node(field_selector=f"metadata.name={NODE}", watch=True,
                                             timeout_seconds=300, _preload_content=False)
        buffer = b""
        for chunk in response.stream(4096, decode_content=True):
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                event = json.loads(line)
                tainted = bool(event.get("object", {}).get("spec", {}).get("taints"))
                with self.changed:
                    if tainted is not self.tainted:
                        self.tainted, self.changed_at = tainted, time.perf_counter()
                        self.changed.notify_all()

    def wait_tainted(self, wanted: bool, started: float, timeout: float) -> float | None:
        """Seconds from `started` until the watch delivered the node with its taint as wanted."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.tainted is wanted, timeout=timeout):
                return None
            return self.changed_at - started

    def counts(self) -> tuple[int, int]:
        return len(self.cluster.log), self.cluster.faults.writes

    def calls_since(self, start: int) -> list[str]:
        return [f"{verb} {path}" for verb, path, _ in self.cluster.log[start:]]

    def mark(self) -> int:
        return len(self.cluster.log)

    def stop(self) -> None:
        self.stopped = True
        self.plane.stop()


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--real"]
    real = "--real" in sys.argv[1:]
    faults = int(args[0]) if args else 200
    healthy_seconds = float(args[1]) if len(args) > 1 else 60.0
    configure_logging("error")
    folder = Path(tempfile.mkdtemp())
    state = folder / "nvml.json"
    state.write_text(json.dumps(eight_gpus()))
    os.environ["FAKE_NVML_STATE"] = str(state)
    ctypes.CDLL(str(REPO / "tests/fakenvml/build/libnvidia-ml.so.1"), mode=os.RTLD_NOW | ctypes.RTLD_GLOBAL)
    kmsg = folder / "kmsg"
    os.mkfifo(kmsg)
    writer = os.open(kmsg, os.O_RDWR | os.O_NONBLOCK)

    gpus = [g for g in eight_gpus()["gpus"]]  # type: ignore[union-attr]
    pods = tuple(PodRef("ml", f"trainer-{i}", f"u{i}", (str(g["uuid"]),)) for i, g in enumerate(gpus))
    inventory = NodeInventory(NODE, (), pods)
    backend = RealBackend(inventory, folder) if real else FakeBackend(inventory)
    env = {"NODE_NAME": NODE, "GPU_HEALTH_JOURNAL_PATH": str(folder / "j.db"), "GPU_HEALTH_MODE": "quarantine",
           "GPU_HEALTH_SOURCES__KMSG__PATH": str(kmsg), "GPU_HEALTH_SOURCES__KMSG__ADMIT_USER_RECORDS": "true",
           "GPU_HEALTH_SOURCES__DCGM__ENABLED": "off", "GPU_HEALTH_TICK_SECONDS": "0.2"}
    config = load_config(None, env=env)
    side = build_cluster_side(backend.agent_client, config, on_stuck=lambda pod: None)
    daemon = Daemon(config, rules=load_rules(builtin_rules_dir()), registry=CollectorRegistry(), cluster=side)
    stop = threading.Event()
    thread = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    thread.start()
    time.sleep(2.0)

    delays = []
    for n in range(faults):
        gpu = gpus[n % 8]
        bus = str(gpu["pci"]).split(":", 1)[1][:5].lower()
        started = time.perf_counter()
        os.write(writer, f"4,{n + 1},{n},-;NVRM: Xid (PCI:0000:{bus}): 79, pid=1, name=x, fault {n}\n".encode())
        delay = backend.wait_tainted(True, started, 5.0)
        if delay is not None and delay >= 0:  # a negative one: the last release had not shown yet
            delays.append(delay)
        daemon.emit(Observation(Signal.OPERATOR_RELEASE, 1, time.time(), "bench"))
        backend.wait_tainted(False, time.perf_counter(), 5.0)
    delays.sort()
    p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
    print(f"{backend.name}: kernel-log fault -> taint visible through the API: p50 {statistics.median(delays) * 1e3:.1f} ms, "
          f"p99 {p99 * 1e3:.1f} ms, max {delays[-1] * 1e3:.1f} ms over {len(delays)} of {faults} faults")

    time.sleep(5.0)  # let the last recovery finish (untaint, conditions, state annotation, budget slot)
    log_start = backend.mark()
    requests0, writes0 = backend.counts()
    time.sleep(healthy_seconds)
    per_hour = 3600 / healthy_seconds
    requests1, writes1 = backend.counts()
    print(f"healthy node: {(requests1 - requests0) * per_hour:.0f} API requests per hour, "
          f"{(writes1 - writes0) * per_hour:.0f} writes per hour "
          f"(measured over {healthy_seconds:.0f} s; reads are the node sync every "
          f"{config.remediation.node_sync_seconds:g} s)")
    calls: dict[str, int] = {}
    for call in backend.calls_since(log_start):
        calls[call] = calls.get(call, 0) + 1
    for call, count in sorted(calls.items()):
        print(f"  {count:4d} x {call}")
    stop.set()
    thread.join(10)
    backend.stop()


if __name__ == "__main__":
    main()

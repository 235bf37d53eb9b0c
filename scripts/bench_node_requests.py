#!/usr/bin/env python3
"""Prints the API requests one healthy node's agent makes per hour, with the watch of its Node and without it
(`remediation.node_watch_seconds: 0`, a GET every pass, as before issue 24).

The whole agent (the daemon, as `gpu-health-agent run` builds it: isolation auto, the fleet view and the
brake on) runs in this process on a healthy node, against the fake API server, or with `--real` the real
control plane of tests/realcluster (kube-apiserver, etcd, kwok; its audit log of the agent's own
ServiceAccount). Passes come every `--sync` seconds (default 1, to see many in a short run); each is scaled
to the shipped 30 s. The watch is re-opened by the server after node_watch_seconds plus up to as many again
(mean 1.5 x 1800 s), which no short run sees: that rate is added from the setting, and the watch opens the
run itself saw (the first, at start) are left out. No assertion: figures only.
Usage: scripts/bench_node_requests.py [--real] [--seconds S] [--sync S] [--baseline]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections import Counter
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prometheus_client import CollectorRegistry  # noqa: E402

from agent.cluster_side import build_cluster_side  # noqa: E402
from agent.config import load_config  # noqa: E402
from agent.daemon import Daemon  # noqa: E402
from agent.engine import builtin_rules_dir, load_rules  # noqa: E402
from agent.fleetapi.claims_watch import REOPEN_FACTOR  # noqa: E402
from agent.k8s.client import client_for  # noqa: E402
from agent.logs import configure_logging  # noqa: E402
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster, populate  # noqa: E402
from tests.k8s_helpers import gpu_node  # noqa: E402

NODE = "bench-node"
SHIPPED_SYNC_SECONDS = 30.0


class Idle:
    """A source that sees nothing: the node stays healthy."""

    name = "idle"

    def run(self, emit: object, stop: threading.Event) -> None:
        stop.wait()


class Fake:
    name = "fake API server"

    def __init__(self) -> None:
        self.cluster = FakeCluster()
        populate(self.cluster, gpu_node(NODE), dra=True)  # 8 GPUs published in ResourceSlices
        self.server = FakeApiServer(self.cluster).start()

    def client(self) -> object:
        return client_for(self.server.url)

    def calls(self) -> list[str]:
        return [f"{'WATCH' if method == 'WATCH' else method} {path}" for method, path, _ in self.cluster.log]

    def stop(self) -> None:
        self.server.stop()


class Real:
    name = "real kube-apiserver"

    def __init__(self, folder: Path) -> None:
        from tests.realcluster.controlplane import ControlPlane  # noqa: PLC0415 - only with --real
        from tests.realcluster.test_dra import publish_gpus  # noqa: PLC0415
        self.plane = ControlPlane(folder / "controlplane").start()
        self.plane.apply_shipped_manifests()
        self.plane.apply_dra_manifests()
        self.plane.add_gpu_node(NODE)
        publish_gpus(self.plane, NODE)  # 8 GPUs published in ResourceSlices
        self.plane.agent_pod(NODE)

    def client(self) -> object:
        from tests.realcluster.backend import RealServer  # noqa: PLC0415
        return RealServer(self.plane).agent_client(NODE)

    def calls(self) -> list[str]:
        from tests.realcluster.controlplane import audit_requests  # noqa: PLC0415
        return [f"{'WATCH' if e['verb'] == 'watch' else e['verb'].upper()} {e['requestURI'].split('?', 1)[0]}"
                for e in audit_requests(self.plane.audit_log)]

    def stop(self) -> None:
        self.plane.stop()


def measure(backend: Fake | Real, folder: Path, *, watch_seconds: float | None, sync: float,
            seconds: float) -> None:
    """One run; `watch_seconds` None: a checkout without the setting (`--baseline`)."""
    env = {"NODE_NAME": NODE, "GPU_HEALTH_JOURNAL_PATH": str(folder / f"j-{watch_seconds}.db"),
           "GPU_HEALTH_MODE": "remediate", "GPU_HEALTH_REMEDIATION__NODE_SYNC_SECONDS": str(sync),
           "GPU_HEALTH_TICK_SECONDS": "0.2"}
    if watch_seconds is not None:
        env["GPU_HEALTH_REMEDIATION__NODE_WATCH_SECONDS"] = str(watch_seconds)
    config = load_config(None, env=env)
    daemon = Daemon(config, rules=load_rules(builtin_rules_dir()), sources=[Idle()], registry=CollectorRegistry(),
                    cluster_of=partial(build_cluster_side, backend.client(), config, on_stuck=lambda pod: None))
    stop = threading.Event()
    thread = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    thread.start()
    time.sleep(max(3.0, 3 * sync))  # start: the record, the slot given back, the DRA view once, the watch opened
    reconciler = daemon.pipeline.reconciler
    mark, passes = len(backend.calls()), reconciler._passes  # a private count: a benchmark reads it
    time.sleep(seconds)
    calls, passes = backend.calls()[mark:], reconciler._passes - passes
    stop.set()
    thread.join(15)
    per_pass = [c for c in calls if not c.startswith("WATCH")]
    # Each watch the agent holds is re-opened at its rate: its Node's, and with the brake on its claims'
    # (asked to end REOPEN_FACTOR times later).
    claims = daemon.cluster is not None and daemon.cluster.claims_watch is not None
    watches = 1 + claims
    reopen = 3600 / (1.5 * watch_seconds) * (1 + claims / REOPEN_FACTOR) if watch_seconds else 0.0
    hourly = len(per_pass) / max(passes, 1) * (3600 / SHIPPED_SYNC_SECONDS) + reopen
    label = f"{watches} watches (the Node's re-opened every {watch_seconds:g}-{2 * watch_seconds:g} s)" \
        if watch_seconds \
        else "no watch (node_watch_seconds: 0, a GET every pass)" if watch_seconds is not None \
        else f"checkout {REPO} as it is"
    watch_seconds = watch_seconds or 0.0
    print(f"{backend.name}, {label}: {hourly:.1f} requests per healthy node per hour "
          f"({len(per_pass)} requests in {passes} passes, scaled to one pass every {SHIPPED_SYNC_SECONDS:g} s; "
          f"+{reopen:.2f}/h watch re-opens); at 10,000 nodes {hourly * 10000 / 3600:.1f} requests/s")
    for call, count in sorted(Counter(per_pass).items()):
        print(f"  {count:4d} x {call}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="the real control plane of tests/realcluster")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long each run is measured")
    parser.add_argument("--sync", type=float, default=1.0, help="node_sync_seconds in the run")
    parser.add_argument("--baseline", action="store_true",
                        help="one run without node_watch_seconds (a copy of this script in an older checkout)")
    args = parser.parse_args()
    configure_logging("error")
    folder = Path(tempfile.mkdtemp())
    backend: Fake | Real = Real(folder) if args.real else Fake()
    try:
        for watch_seconds in (None,) if args.baseline else (0.0, 1800.0):
            measure(backend, folder, watch_seconds=watch_seconds, sync=args.sync, seconds=args.seconds)
    finally:
        backend.stop()


if __name__ == "__main__":
    main()

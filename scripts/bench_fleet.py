#!/usr/bin/env python3
"""Prints what the fleet controller costs at fleet scale, against the fake API server in this process:
the metadata-only list of N annotated Nodes, a correlation pass (correlate + next_holds + the holds write)
with F of them faulty, one summary change's way to its pass, and the controller's RSS after the list.

Usage: scripts/bench_fleet.py [NODES ...]   (default: 1000 5000; F = 10 % of the nodes, one job's)
Figures go to stdout; nothing is asserted (docs/testing.md: no timed assertions in tests).
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.fleet import CorrelationPolicy, FaultSummary, NodeSummary
from agent.fleet.published import SUMMARY_ANNOTATION
from agent.fleetctl.controller import FleetController
from agent.fleetctl.settings import FleetSettings
from agent.k8s.client import client_for
from agent.k8s.events import EventRecorder
from agent.k8s.raw import RawApi
from agent.k8s.watch import ListWatch, WatchOptions
from agent.model import Action, FaultClass, Severity
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster


def summary(i: int, faulty: bool) -> str:
    job = "ml/Job/train" if faulty else f"team-{i % 50}/Job/run-{i}"
    faults = (FaultSummary("xid-13", FaultClass.APPLICATION, Severity.FATAL, Action.QUARANTINE, owners=(job,)),) \
        if faulty else ()
    return NodeSummary(node=f"gpu-{i}", gpu_model="NVIDIA H100 80GB HBM3",
                       driver_version="570.86.15" if i % 2 else "575.51.03", fabric_domain=f"fabric-{i // 18}",
                       boot_id=f"boot-{i}", uptime_seconds=86400.0, workloads=(job,), faults=faults).to_json()


def run(nodes: int) -> None:
    faulty = max(3, nodes // 10)
    cluster = FakeCluster()
    for i in range(nodes):
        cluster.add("nodes", {"metadata": {"name": f"gpu-{i}", "labels": {
            "topology.kubernetes.io/zone": f"zone-{i % 3}", "topology.kubernetes.io/rack": f"rack-{i // 18}",
            "nvidia.com/gpu.present": "true"}, "annotations": {SUMMARY_ANNOTATION: summary(i, i < faulty)}},
            "status": {"capacity": {"nvidia.com/gpu": "8"}}})
    server = FakeApiServer(cluster).start()
    try:
        raw = RawApi(client_for(server.url))
        controller = FleetController(raw, FleetSettings(policy=CorrelationPolicy()), identity="bench",
                                     events=EventRecorder(raw, instance="bench", fold_seconds=0.0))
        lw = ListWatch(client_for(server.url, timeouts=None), "/api/v1/nodes", WatchOptions(metadata_only=True))
        began = time.perf_counter()
        items, _ = lw.list_all()
        listed = time.perf_counter() - began
        began = time.perf_counter()
        controller.on_sync(items)
        viewed = time.perf_counter() - began
        began = time.perf_counter()
        fresh = controller.reconcile()
        first = time.perf_counter() - began
        began = time.perf_counter()
        controller.reconcile()
        again = time.perf_counter() - began
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{nodes:>6} nodes ({faulty} faulty): metadata-only list {listed * 1000:7.0f} ms, view "
              f"{viewed * 1000:6.0f} ms, first pass {first * 1000:6.0f} ms ({len(fresh)} correlation(s), "
              f"{len(controller.holds)} hold(s) on {sum(len(h.nodes) for h in controller.holds)} nodes), "
              f"next pass {again * 1000:6.0f} ms, peak RSS {rss:5.0f} MiB (this process, fake server included)")
    finally:
        server.stop()


if __name__ == "__main__":
    for count in [int(a) for a in sys.argv[1:]] or [1000, 5000]:
        run(count)

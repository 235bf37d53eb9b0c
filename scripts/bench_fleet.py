#!/usr/bin/env python3
"""Prints what the fleet controller costs at fleet scale, against the fake API server in this process:
the metadata-only list of N annotated Nodes, a correlation pass (correlate + next_holds + the holds write)
with F of them faulty, one summary change's way to its pass, and the controller's RSS after the list.

Usage: scripts/bench_fleet.py [NODES ...] [job|jobs|fabric ...]   (default: 1000 5000, job; see SCENARIOS)
Figures go to stdout; nothing is asserted (docs/testing.md: no timed assertions in tests).
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.fleet import CorrelationPolicy, FaultSummary, NodeSummary
from agent.fleet.published import HOLDS_CONFIGMAP, SUMMARY_ANNOTATION
from agent.fleetctl.controller import FleetController
from agent.fleetctl.settings import FleetSettings
from agent.k8s.client import client_for
from agent.k8s.events import EventRecorder
from agent.k8s.raw import RawApi
from agent.k8s.watch import ListWatch, WatchOptions
from agent.model import Action, FaultClass, Severity
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster

#: The node's name: cloud-length (EKS's), as the holds object's size depends on it.
NAME = "ip-10-{}-{}-{}.us-west-2.compute.internal"
#: What goes wrong, by scenario: `job` one job's Xid 13 on 10 % of the nodes; `jobs` 400 jobs of 25 nodes each
#: failing at once; `fabric` a three-rule NVLink event on every node of every fabric domain (issue 38's worst
#: case for the holds object's size).
SCENARIOS = ("job", "jobs", "fabric")


def name(i: int) -> str:
    return NAME.format(i // 65536, (i // 256) % 256, i % 256)


def summary(i: int, nodes: int, scenario: str) -> tuple[str, bool]:
    """Node i's summary JSON in `scenario`, and whether it is faulty."""
    faults: tuple[FaultSummary, ...] = ()
    job = f"team-{i % 50}/Job/run-{i}"
    if scenario == "job" and i < max(3, nodes // 10):
        job = "ml/Job/train"
        faults = (FaultSummary("xid-13", FaultClass.APPLICATION, Severity.FATAL, Action.QUARANTINE, owners=(job,)),)
    elif scenario == "jobs" and i < 400 * 25:
        job = f"ml/PyTorchJob/train-{i // 25:03}"
        faults = (FaultSummary("xid-13", FaultClass.APPLICATION, Severity.FATAL, Action.QUARANTINE, owners=(job,)),)
    elif scenario == "fabric":
        faults = tuple(FaultSummary(rule, FaultClass.INTERCONNECT, Severity.FATAL, Action.RESET_GPU, owners=(job,))
                       for rule in ("fabric-degraded-bandwidth", "fabric-route-unhealthy", "fabric-not-registered"))
    return NodeSummary(node=name(i), gpu_model="NVIDIA H100 80GB HBM3",
                       driver_version="570.86.15" if i % 2 else "575.51.03",
                       fabric_domain=f"{i // 18:032x}.0", boot_id=f"boot-{i}", uptime_seconds=86400.0,
                       workloads=(job,), faults=faults).to_json(), bool(faults)


def run(nodes: int, scenario: str) -> None:
    cluster = FakeCluster()
    faulty = 0
    for i in range(nodes):
        text, bad = summary(i, nodes, scenario)
        faulty += bad
        cluster.add("nodes", {"metadata": {"name": name(i), "labels": {
            "topology.kubernetes.io/zone": f"zone-{i % 3}", "topology.kubernetes.io/rack": f"rack-{i // 18}",
            "nvidia.com/gpu.present": "true"}, "annotations": {SUMMARY_ANNOTATION: text}},
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
        data = raw.get(f"/api/v1/namespaces/{controller.settings.namespace}/configmaps/{HOLDS_CONFIGMAP}")["data"]
        size = sum(len(k) + len(v.encode()) for k, v in data.items())
        print(f"{nodes:>6} nodes, {scenario:<6} ({faulty} faulty): metadata-only list {listed * 1000:7.0f} ms, view "
              f"{viewed * 1000:6.0f} ms, first pass {first * 1000:6.0f} ms ({len(fresh)} correlation(s), "
              f"{len(controller.holds)} hold(s) on {len({n for h in controller.holds for n in h.nodes})} nodes), "
              f"next pass {again * 1000:6.0f} ms, holds object {size / 1024:6.1f} KiB, peak RSS {rss:5.0f} MiB "
              "(this process, fake server included)")
    finally:
        server.stop()


if __name__ == "__main__":
    chosen = [a for a in sys.argv[1:] if a in SCENARIOS] or ["job"]
    for count in [int(a) for a in sys.argv[1:] if a.isdigit()] or [1000, 5000]:
        for scenario in chosen:
            run(count, scenario)

"""daemonset/rbac.yaml derived from use: what the agent's token did in a whole remediation, per the audit log."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agent.cluster_side import request_release
from agent.fleet import BrakePolicy
from agent.model import Observation, Signal
from tests.k8s_helpers import TAINT, gpu_node, make_agent
from tests.realcluster.backend import RealCluster, RealServer
from tests.realcluster.controlplane import REPO, ControlPlane, audit_events, wait_until

RBAC = REPO / "daemonset" / "rbac.yaml"
Permission = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)
#: A watch still open when the log is read shows only its ResponseStarted event.
ANSWERED = ("ResponseStarted", "ResponseComplete")


pytestmark = pytest.mark.usefixtures("no_retry_sleep")


def granted(path: Path = RBAC) -> set[Permission]:
    """Every (group, resource, verb) the shipped ClusterRole and Role grant."""
    grants = set()
    for document in yaml.safe_load_all(path.read_text()):
        if document and document["kind"] in {"ClusterRole", "Role"}:
            for rule in document["rules"]:
                grants |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return grants


def used(events: list[dict]) -> set[Permission]:
    permissions = set()
    for event in events:
        ref = event.get("objectRef") or {}
        resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        permissions.add((ref.get("apiGroup", ""), resource, event["verb"]))
    return permissions


def remediate_once(plane: ControlPlane) -> None:
    """Fault -> condition, taint, eviction, events, budget slot (taken, renewed, given back); an operator's
    release; recovery -> clear; the agent restarted."""
    cluster, server = RealCluster(plane), RealServer(plane)
    name = plane.unique("rbac")
    inventory = gpu_node(name)
    # Reads its node as after a restart, then through its watch; reads the fleet's holds and counts the
    # quarantined for the brake.
    agent = make_agent(cluster, server, inventory, restore=True, fleet=True, brake=BrakePolicy(), node_watch=True)
    wait_until(lambda: agent.side.writer.seen.current() is not None, "the node watch to list and open")
    agent.side.pods.pods()
    agent.pipeline.handle(Observation(Signal.TEMPERATURE, 95, 1.0, "nvml", inventory.gpus[2],
                                      {"shutdown_c": 92, "slowdown_c": 90}), 1.0)
    for _ in range(2):  # the second is folded into the first Event's series
        agent.actuator.events.record(regarding={"kind": "Node", "apiVersion": "v1", "name": name},
                                     reason="GpuWarning", action="Record", note="same")
    agent.pipeline.handle(Observation(Signal.ROW_REMAP_FAILURE, 1, 2.0, "nvml", inventory.gpus[5]), 2.0)
    agent.pipeline.reconcile(650.0)  # still disrupted 10 minutes on: the budget slot is renewed
    request_release(server.operator_client(), name, inventory.gpus[5].uuid)
    agent.pipeline.reconcile(651.0)
    agent.pipeline.handle(Observation(Signal.TEMPERATURE, 70, 652.0, "nvml", inventory.gpus[2],
                                      {"shutdown_c": 92, "slowdown_c": 90}), 652.0)
    assert agent.pipeline.tick(1400.0).verdicts
    assert TAINT not in {t["key"] for t in cluster.node(name)["spec"].get("taints") or []}
    agent.close()
    # Restarted: its first pass looks for a budget slot an earlier process may have left (a GET by name).
    again = make_agent(cluster, server, inventory, restore=True, fleet=True, brake=BrakePolicy(),
                       populate_node=False)
    again.pipeline.reconcile(1500.0)
    again.close()
    server.stop()


def test_the_agent_uses_exactly_what_rbac_grants(control_plane):
    """Nothing used that is not granted (no 403 on the way), and nothing granted that a remediation does
    not use: rbac.yaml is the agent's footprint, read off the API server's audit log."""
    start = len(audit_events(control_plane.audit_log, stages=ANSWERED))
    remediate_once(control_plane)
    events = audit_events(control_plane.audit_log, stages=ANSWERED)[start:]
    denied = [(e["verb"], e["requestURI"]) for e in events if e["responseStatus"]["code"] == 403]
    assert denied == []
    assert used(events) - granted() == set(), "used but not granted"
    assert granted() - used(events) == set(), "granted but never used: remove it from rbac.yaml"

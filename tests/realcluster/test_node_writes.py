"""The Node writes of one pass, counted in the real API server's audit log: a pass's Node changes go in one
write, two where it changes both the taint (spec) and a condition (status), which no one request can do."""

from __future__ import annotations

from typing import Any

import pytest

from agent.k8s.raw import RawApi
from agent.model import StepKind, StepResult
from tests.k8s_helpers import TAINT, Agent, gpu_node, make_agent
from tests.realcluster.backend import RealCluster, RealServer
from tests.realcluster.controlplane import ControlPlane, audit_requests

pytestmark = pytest.mark.usefixtures("no_retry_sleep")

#: Xid 54: quarantine (the taint and GpuFatalFault, nobody evicted). Xid 79: reboot the node (evict, request).
QUARANTINE_XID, REBOOT_XID = 54, 79


@pytest.fixture
def real(control_plane: ControlPlane):
    server = RealServer(control_plane)
    yield RealCluster(control_plane), server
    server.stop()


def node_writes(plane: ControlPlane, node: str) -> list[tuple[str, str]]:
    """(verb, subresource) of every write the agent made to its Node, in order."""
    return [(e["verb"], e["objectRef"].get("subresource", "")) for e in audit_requests(plane.audit_log)
            if e["verb"] in {"create", "update", "patch", "delete"} and e["objectRef"].get("resource") == "nodes"
            and e["objectRef"].get("name") == node]


def results(outcome: Any) -> dict[tuple[StepKind, str], StepResult]:
    return {(a.step.kind, a.step.target): a.result for a in outcome.actions}


def one_pass(plane: ControlPlane, agent: Agent, *, gpu: int, xid: int,
             at: float = 1.0) -> tuple[dict[tuple[StepKind, str], StepResult], list[tuple[str, str]]]:
    """The step results of the pass an Xid starts, and the Node writes it made."""
    node = agent.inventory.name
    before = len(node_writes(plane, node))
    outcome = agent.fault(gpu, xid=xid, at=at)
    return results(outcome), node_writes(plane, node)[before:]


def shown(node: dict[str, Any]) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """The Node's labels, annotations and conditions (type: status)."""
    meta = node["metadata"]
    return (meta.get("labels") or {}, meta.get("annotations") or {},
            {c["type"]: c["status"] for c in node["status"]["conditions"]})


def test_a_node_status_patch_changes_metadata_and_conditions_but_never_the_spec(control_plane, real):
    """What the one write stands on: the Node status subresource takes labels, annotations and conditions,
    and drops a taint (the fake API server answers the same: test_fake_apiserver_realism)."""
    control_plane.add_gpu_node("nw0", 1)
    patch = {"metadata": {"labels": {"gpu-health-agent.io/disruption": "active"},
                          "annotations": {"gpu-health-agent.io/reboot-requested": "now"}},
             "spec": {"taints": [{"key": TAINT, "effect": "NoSchedule"}]},
             "status": {"conditions": [{"type": "GpuFatalFault", "status": "True", "reason": "R", "message": "m"}]}}
    _, server = real
    node = RawApi(server.agent_client("nw0")).strategic_patch("/api/v1/nodes/nw0/status", patch)
    assert node["metadata"]["labels"]["gpu-health-agent.io/disruption"] == "active"
    assert node["metadata"]["annotations"]["gpu-health-agent.io/reboot-requested"] == "now"
    assert "GpuFatalFault" in {c["type"] for c in node["status"]["conditions"]}
    assert not node["spec"].get("taints")


def test_a_quarantine_writes_the_node_twice_the_taint_and_then_its_status(control_plane, real):
    """Xid 54: the taint to the Node, then GpuDegraded, AcceleratedHardwareReady and the mirrored record in
    one status patch."""
    cluster, server = real
    taken, writes = one_pass(control_plane, make_agent(cluster, server, gpu_node("nw1")), gpu=2, xid=QUARANTINE_XID)
    assert taken[(StepKind.TAINT, "nw1")] is StepResult.APPLIED
    assert writes == [("patch", ""), ("patch", "status")]
    node = cluster.node("nw1")
    _, annotations, conditions = shown(node)
    assert TAINT in {t["key"] for t in node["spec"]["taints"]}
    assert conditions["GpuDegraded"] == "True" and "gpu-health-agent.io/state" in annotations


def test_a_disrupting_pass_on_a_quarantined_node_writes_the_node_once(control_plane, real):
    """Xid 79 on a node Xid 54 quarantined: the eviction and the reboot request's pass makes one Node write
    (GpuFatalFault, GpuRebootRequired, the reboot annotation, the disruption label and the mirror)."""
    cluster, server = real
    agent = make_agent(cluster, server, gpu_node("nw2"))
    agent.fault(2, xid=QUARANTINE_XID)
    taken, writes = one_pass(control_plane, agent, gpu=3, xid=REBOOT_XID, at=2.0)
    assert taken[(StepKind.REBOOT_REQUEST, "nw2")] is StepResult.APPLIED
    assert taken[(StepKind.EVICT, "ml/nw2-trainer-3")] is StepResult.APPLIED
    assert writes == [("patch", "status")]
    labels, annotations, conditions = shown(cluster.node("nw2"))
    assert labels["gpu-health-agent.io/disruption"] == "active" and conditions["GpuRebootRequired"] == "True"
    assert "gpu-health-agent.io/reboot-requested" in annotations


def test_a_disrupting_pass_that_also_taints_writes_the_node_twice(control_plane, real):
    """Xid 79 on a healthy node: the taint first (before the eviction), then everything else in one status
    patch."""
    cluster, server = real
    taken, writes = one_pass(control_plane, make_agent(cluster, server, gpu_node("nw3")), gpu=3, xid=REBOOT_XID)
    assert taken[(StepKind.EVICT, "ml/nw3-trainer-3")] is StepResult.APPLIED
    assert writes == [("patch", ""), ("patch", "status")]

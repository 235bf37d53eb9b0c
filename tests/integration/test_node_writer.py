"""The node writer's fault path: one PATCH from the Node as last observed, a fresh read only on conflict or to
confirm that nothing is to be done, on the fake API server and on the real kube-apiserver."""

from __future__ import annotations

from typing import Any

from agent.k8s.node import NodeWriter
from agent.k8s.raw import RawApi
from agent.simulation.fake_apiserver.resources import RESOURCES
from tests.k8s_helpers import TAINT, agent_client, gpu_node, make_agent, populate_any

NODES = next(r for r in RESOURCES if r.plural == "nodes")


def writer_on(fake: Any, name: str) -> NodeWriter:
    cluster, server = fake
    populate_any(cluster, gpu_node(name, 1))
    return NodeWriter(RawApi(agent_client(server, name)), name, taint_key=TAINT)


def requests_since(cluster: Any, start: int) -> list[str]:
    """The agent's requests as 'GET' / 'PATCH' (the fake's log, or the real server's audit log)."""
    return [str(method).upper() for method, _, _ in cluster.log[start:]]


def operator_sets_taints(cluster: Any, name: str, taints: list[dict[str, str]]) -> None:
    node = cluster.node(name)
    node["spec"]["taints"] = taints
    cluster.replace(NODES, "", name, node)


def requests_of(fake: Any, name: str, writes: Any) -> list[str]:
    """The requests `writes(writer)` makes on a Node the writer has just read."""
    cluster, _ = fake
    writer = writer_on(fake, name)
    writer.read()
    start = len(cluster.log)
    writes(writer)
    return requests_since(cluster, start)


def test_a_fault_taints_a_node_already_read_with_one_patch_and_no_get(fake):
    """After the pass's read, the taint is one PATCH: the writer does not GET the Node again first."""
    assert requests_of(fake, "nw-one-patch", lambda writer: writer.set_taint(True)) == ["PATCH"]
    assert [t["key"] for t in fake[0].node("nw-one-patch")["spec"]["taints"]] == [TAINT]


def test_a_taint_added_by_someone_after_the_read_is_kept_when_the_agent_taints(fake):
    """The stale observation is refused (409), read again, and the agent's taint joins the operator's."""
    cluster, _ = fake
    writer = writer_on(fake, "nw-stale")
    writer.read()
    operator_sets_taints(cluster, "nw-stale", [{"key": "someone/else", "effect": "NoSchedule"}])
    assert writer.set_taint(True)
    assert [t["key"] for t in cluster.node("nw-stale")["spec"]["taints"]] == ["someone/else", TAINT]


def test_a_taint_removed_by_someone_after_the_read_is_put_back(fake):
    """The observation says the taint is there; a fresh read says it is not, so the agent writes it again."""
    cluster, _ = fake
    writer = writer_on(fake, "nw-removed")
    assert writer.set_taint(True)
    operator_sets_taints(cluster, "nw-removed", [])
    assert writer.set_taint(True)
    assert [t["key"] for t in cluster.node("nw-removed")["spec"]["taints"]] == [TAINT]


def test_conditions_and_annotations_after_a_taint_need_no_read(fake):
    """Each write's answer is the next write's observation: taint, condition and record are three PATCHes."""
    def writes(writer: NodeWriter) -> None:
        assert writer.set_taint(True)
        assert writer.set_condition("GpuFatalFault", status=True, reason="Xid79", message="fell off the bus")
        assert writer.save_record({"generation": 1})

    assert requests_of(fake, "nw-chain", writes) == ["PATCH", "PATCH", "PATCH"]


def test_a_fatal_fault_taints_before_the_pod_list_and_the_events_are_read_or_sent(fake):
    """The pass's first write is the taint: the pod list and the fault's Events come after it."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("nw-order"))
    start = len(cluster.log)
    agent.fault(3)
    calls = [(str(method).upper(), path) for method, path, _ in cluster.log[start:]]
    taint = calls.index(("PATCH", "/api/v1/nodes/nw-order"))
    later = [i for i, (method, path) in enumerate(calls) if path.endswith("/pods") or "/events" in path]
    assert later and taint < min(later)


def test_removing_labels_and_annotations_the_node_does_not_have_writes_nothing(fake):
    """None for a label or annotation that is absent is no change: a fresh read confirms it, and no PATCH."""
    requests = requests_of(fake, "nw-remove-absent", lambda writer: writer.set_metadata(
        labels={"gpu-health-agent.io/absent": None}, annotations={"gpu-health-agent.io/absent": None}))
    assert requests == ["GET"]

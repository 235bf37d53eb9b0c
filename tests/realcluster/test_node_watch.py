"""What an agent costs the real API server (its ServiceAccount's requests, from the audit log): a healthy node
reads its Node through a watch and asks nothing per pass; a blocked node stays within 10 requests a minute."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from agent.cluster_side import ClusterSide, build_cluster_side, request_release
from agent.config import load_config
from agent.fleetapi.budget import LeaseBudget
from agent.fleetapi.budget_slots import slot_name
from agent.model import Observation, Signal, StepResult
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy, Mode
from tests.k8s_helpers import RULES, TAINT, gpu_node, make_agent
from tests.realcluster.backend import RealCluster, RealServer
from tests.realcluster.budget_tokens import agent_raw
from tests.realcluster.controlplane import ControlPlane, audit_requests, wait_until
from tests.realcluster.test_dra import dra_node, gpu_inventory  # noqa: F401 - dra_node is a fixture

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
PASS_SECONDS = 30.0  # remediation.node_sync_seconds


@dataclass
class Running:
    """An agent as the daemon assembles it (build_cluster_side), its Node watch on its own thread."""

    pipeline: Pipeline
    side: ClusterSide
    stop: threading.Event
    now: float = 1000.0

    def passes(self, count: int) -> None:
        for _ in range(count):
            self.now += PASS_SECONDS
            self.pipeline.reconcile(self.now)

    def watching(self) -> bool:
        return self.side.writer.seen.current() is not None


@pytest.fixture
def running(control_plane: ControlPlane, dra_node: str, tmp_path: Path) -> Iterator[Running]:  # noqa: F811
    """The agent of a DRA node (isolation auto, the fleet view and the brake on: the defaults), started."""
    server = RealServer(control_plane)
    config = load_config(None, env={"NODE_NAME": dra_node, "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db"),
                                    "GPU_HEALTH_MODE": "remediate"})
    side = build_cluster_side(server.agent_client(dra_node), config, on_stuck=lambda pod: None)
    pipeline = Pipeline(rules=RULES, inventory=gpu_inventory(dra_node), policy=GuardPolicy(mode=Mode.REMEDIATE),
                        actuator=side.actuator, gate=side.gate, own_pod=side.own_pod, pods=side.pods.pods,
                        fleet=side.fleet)
    stop = threading.Event()
    assert side.node_watch is not None
    thread = threading.Thread(target=side.node_watch.run, args=(stop, pipeline.wake.set), daemon=True)
    thread.start()
    agent = Running(pipeline, side, stop)
    pipeline.start()
    agent.passes(2)  # the first passes give back a slot nobody holds, read the DRA view once
    yield agent
    stop.set()
    side.node_watch.close()
    thread.join(10)
    server.stop()


def requests(plane: ControlPlane) -> list[tuple[str, str]]:
    """(verb, path) of every request the agents' identity made so far."""
    return [(e["verb"], e["requestURI"].split("?", 1)[0]) for e in audit_requests(plane.audit_log)]


def test_a_healthy_agent_makes_no_request_in_its_passes_once_its_watch_is_open(control_plane, running):
    """Ten passes (five minutes of node syncs) after the watch is in: not one request, no GET of the Node."""
    wait_until(running.watching, "the node watch to list and open")
    before = len(requests(control_plane))
    running.passes(10)
    assert requests(control_plane)[before:] == []


def test_a_healthy_agents_only_requests_are_its_watch_re_opened_at_most_twice_an_hour(control_plane, running):
    """The watch asks the server for >= 1800 s (timeoutSeconds): at most 3600 / 1800 = 2 requests an hour."""
    wait_until(running.watching, "the node watch to list and open")
    watches = [e for e in audit_requests(control_plane.audit_log)
               if e["verb"] == "watch" and e["objectRef"].get("resource") == "nodes"
               and f"metadata.name={running.side.writer.name}" in parse_qs(urlsplit(e["requestURI"]).query)
               .get("fieldSelector", [""])]
    assert len(watches) == 1
    seconds = int(parse_qs(urlsplit(watches[0]["requestURI"]).query)["timeoutSeconds"][0])
    assert 3600 / seconds <= 2


def test_without_a_live_watch_each_pass_reads_the_node_with_one_get(control_plane, running):
    """The watch stopped: the cache vouches for nothing after its bound, and every pass GETs the Node."""
    running.stop.set()
    assert running.side.node_watch is not None
    running.side.node_watch.close()
    wait_until(lambda: not running.watching(), "the node watch to stop")
    before = len(requests(control_plane))
    running.passes(3)
    assert requests(control_plane)[before:] == [("get", f"/api/v1/nodes/{running.side.writer.name}")] * 3


def test_an_operators_release_reaches_the_agent_through_the_watch_and_wakes_a_pass(control_plane, running):
    """Fault -> taint; the operator's release annotation arrives by the watch, which wakes the reconciler; the
    pass that follows untaints with no GET of the Node."""
    node = running.side.writer.name
    gpu = running.pipeline.inventory.gpus[2]
    running.pipeline.handle(Observation(Signal.XID, 79, running.now, "kmsg", gpu), running.now)
    running.passes(1)
    assert TAINT in {t["key"] for t in RealCluster(control_plane).node(node)["spec"].get("taints") or []}
    wait_until(running.watching, "the node watch to be live")
    running.pipeline.wake.clear()
    request_release(RealServer(control_plane).operator_client(), node)
    wait_until(running.pipeline.wake.is_set, "the watch to deliver the release and wake the reconciler")
    before = len(requests(control_plane))
    running.passes(1)
    assert ("get", f"/api/v1/nodes/{node}") not in requests(control_plane)[before:]
    assert TAINT not in {t["key"] for t in RealCluster(control_plane).node(node)["spec"].get("taints") or []}


def test_a_broken_watch_falls_back_to_a_get_and_resumes(control_plane, running):
    """The watch's connection cut: the next pass GETs the Node; the watch comes back on its own (resumed, no
    list) and the passes after it ask nothing again."""
    node = running.side.writer.name
    assert running.side.node_watch is not None
    wait_until(running.watching, "the node watch to be live")
    lists = running.side.node_watch.lister.lists
    running.side.node_watch.close()  # not stopped: as when the connection breaks
    wait_until(lambda: not running.watching(), "the agent to see its watch broken")
    before = len(requests(control_plane))
    running.passes(1)
    assert requests(control_plane)[before:] == [("get", f"/api/v1/nodes/{node}")]
    control_plane.core.patch_node(node, {"metadata": {"labels": {"gpu-health-test/touched": "yes"}}})
    wait_until(running.watching, "the watch to resume and deliver the change")
    assert running.side.node_watch.lister.lists == lists
    before = len(requests(control_plane))
    running.passes(3)
    assert requests(control_plane)[before:] == []


def test_a_node_the_budget_blocks_stays_within_10_requests_a_minute(control_plane):
    """Another node holds the budget's one slot; this node's fault waits on it, a pass asking again at the
    reconciler's own schedule: over ten minutes of passes, at most 10 requests a minute (no cache in the
    fleet view: the worst case)."""
    cluster, server = RealCluster(control_plane), RealServer(control_plane)
    holder = control_plane.unique("holder")
    control_plane.add_gpu_node(holder)
    control_plane.forget("coordination.k8s.io", "leases", "gpu-health", slot_name(holder))
    assert LeaseBudget(agent_raw(control_plane, holder), node_name=holder, namespace="gpu-health",
                       max_nodes=1, max_percent=0).acquire().held
    clock = [1000.0]
    agent = make_agent(cluster, server, gpu_node(control_plane.unique("blocked")), max_nodes=1, max_percent=0,
                       restore=True, fleet=True, budget_clock=lambda: clock[0], node_watch=True)
    try:
        wait_until(lambda: agent.side.writer.seen.current() is not None, "the node watch to list and open")
        agent.fault(3, xid=79, at=clock[0])
        start, before, blocked = clock[0], len(requests(control_plane)), 0
        while clock[0] < start + 600:
            clock[0] = max(clock[0] + 1.0, agent.pipeline.due_at)
            actions = agent.pipeline.reconcile(clock[0]).actions
            blocked += sum(a.result is StepResult.BLOCKED for a in actions)
        made = len(requests(control_plane)) - before
        assert blocked >= 10  # it kept asking the budget, and was refused
        assert made / ((clock[0] - start) / 60) <= 10, made
    finally:
        agent.close()

"""Issue 24, the node side: several agents and the fleet controller on the fake API server. A fleet-wide cause
is held (0 tainted) with the controller, bounded by the quarantine brake without it, and a node's own
hardware evidence is acted on whatever the hold says."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from agent.cluster_side import request_release
from agent.fleet import BrakePolicy, CorrelationPolicy, NodeSummary
from agent.fleet.published import CENSUS_KEY, HOLDS_CONFIGMAP, QUARANTINE_LABEL, SUMMARY_ANNOTATION
from agent.fleetapi.fleet_gate import FleetGate
from agent.fleetctl.controller import FleetController
from agent.fleetctl.settings import FleetSettings
from agent.k8s.events import EventRecorder
from agent.k8s.node import DISRUPTION_LABEL
from agent.k8s.raw import RawApi
from agent.k8s.watch import ListWatch, WatchOptions
from agent.logs import capture_logs
from agent.model import Observation, Signal
from agent.remediation import Mode
from tests.k8s_helpers import Agent, gpu_node, make_agent, operator_client

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
NS = "gpu-health"
SETTINGS = FleetSettings(namespace=NS, policy=CorrelationPolicy(min_nodes=3), hold_seconds=600.0,
                         max_hold_seconds=3600.0, tick_seconds=600.0, settle_seconds=0.0)
BRAKE = BrakePolicy(max_share=0.15, min_nodes=2, max_nodes=200, window_seconds=600.0)
FLEET = 6


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def agents(fake: Any, count: int = FLEET, **options: Any) -> list[Agent]:
    cluster, server = fake
    return [make_agent(cluster, server, gpu_node(f"n{i}", gpus=2), mode=Mode.QUARANTINE, **options)
            for i in range(count)]


def fleet_controller(fake: Any, settings: FleetSettings = SETTINGS, wall: float = 1.7e9) -> FleetController:
    _, server = fake
    raw = RawApi(operator_client(server))
    return FleetController(raw, settings, identity="fleet-a", clock=Clock(), wall=Clock(wall),
                           events=EventRecorder(raw, instance="fleet-a", namespace=NS))


def correlate(fake: Any, controller: FleetController | None) -> None:
    """What the controller's watch and pass do after a summary changed (none: no controller runs)."""
    if controller is not None:
        nodes = ListWatch(controller.raw.api_client, "/api/v1/nodes", WatchOptions(metadata_only=True))
        controller.on_sync(nodes.list_all()[0])
        controller.reconcile()


def storm(fake: Any, fleet: list[Agent], controller: FleetController | None, fault: Any) -> None:
    """The same fault on every node, one after the other, the controller passing after each; then a pass on
    every node (each reads the holds)."""
    for agent in fleet:
        fault(agent)
        correlate(fake, controller)
    for agent in fleet:
        agent.settle(200.0)


def tainted(fake: Any, fleet: list[Agent]) -> list[str]:
    return [a.inventory.name for a in fleet if fake[0].node(a.inventory.name)["spec"].get("taints")]


def gsp_timeouts(agent: Agent) -> None:
    agent.fault(0, xid=119, at=1.0)
    agent.fault(1, xid=120, at=1.5)


def links_down(agent: Agent) -> None:
    for at in (1.0, 70.0):
        for gpu in agent.inventory.gpus:
            agent.pipeline.handle(Observation(Signal.NVLINK_DOWN, 18, at, "nvml", gpu), at)


@pytest.mark.parametrize("fault", [gsp_timeouts, links_down], ids=["xid-119-120-one-driver", "all-nvlinks-down"])
def test_a_fleet_wide_cause_taints_no_node_while_the_fleet_controller_runs(fake, fault):
    """The controller correlates the cause at the third node; every node honours the hold and stays untainted."""
    fleet = agents(fake, fleet=True)
    storm(fake, fleet, fleet_controller(fake), fault)
    assert tainted(fake, fleet) == []


@pytest.mark.parametrize("fault", [gsp_timeouts, links_down], ids=["xid-119-120-one-driver", "all-nvlinks-down"])
def test_a_cause_that_reaches_every_node_at_once_is_held_before_any_node_acts(fake, fault):
    """Every node sees the fault and passes before the controller has seen any summary: the settle keeps each
    node's taint waiting until the controller's hold is there, so no node is tainted even for a moment."""
    clock = Clock()
    fleet = agents(fake, fleet=True, fleet_clock=clock, settle_seconds=10.0)
    controller = fleet_controller(fake)
    correlate(fake, controller)  # the leader's first pass: the holds object tells the agents it publishes
    for agent in fleet:  # the fault on every node first, each node's pass at once (a summary, no taint)
        fault(agent)
        agent.settle(200.0)
    assert tainted(fake, fleet) == []
    correlate(fake, controller)  # the controller's pass on the summaries
    clock.now += 10.0  # the settle ends
    for agent in fleet:
        agent.settle(400.0)
    assert tainted(fake, fleet) == []


@pytest.mark.fake_only  # on the shared real control plane, earlier tests' GSP timeouts are a cause with it
def test_after_the_settle_a_fault_no_cause_explains_is_acted_on(fake):
    """One node alone: the controller finds no cause, and the pass due when the settle ends quarantines it."""
    clock = Clock()
    fleet = agents(fake, fleet=True, fleet_clock=clock, settle_seconds=10.0)
    controller = fleet_controller(fake)
    correlate(fake, controller)
    gsp_timeouts(fleet[0])
    fleet[0].settle(200.0)
    correlate(fake, controller)
    assert tainted(fake, fleet) == []
    clock.now += 10.0
    fleet[0].settle(211.0)  # a pass is due when the settle ends, not only at the next node sync
    assert tainted(fake, fleet) == ["n0"]


#: A controller that promises its next write within 15 s (3 ticks of 5 s), on the agents' wall clock.
QUICK = FleetSettings(namespace=NS, policy=CorrelationPolicy(min_nodes=3), hold_seconds=600.0,
                      max_hold_seconds=3600.0, tick_seconds=5.0, settle_seconds=0.0)


@pytest.mark.parametrize("fault", [gsp_timeouts, links_down], ids=["xid-119-120-one-driver", "all-nvlinks-down"])
def test_past_the_settle_a_node_the_controller_has_not_heard_of_waits_for_its_word(fake, fault):
    """The controller is slow to see the summaries (a loaded API server): past the 10-s settle each node keeps
    waiting while the controller has not heard of its fault, and the hold that comes then covers it."""
    clock = Clock(1.7e9)
    fleet = agents(fake, fleet=True, fleet_clock=clock, settle_seconds=10.0, settle_max_seconds=60.0)
    controller = fleet_controller(fake, QUICK, wall=1.7e9)
    correlate(fake, controller)  # the first pass: the object exists, nothing heard
    for agent in fleet:
        fault(agent)
        agent.settle(200.0)
    clock.now += 12.0  # the settle is over, the controller's promise (15 s) stands, it has heard of no node
    for agent in fleet:
        agent.settle(400.0)
    assert tainted(fake, fleet) == []
    controller.clock.now += 12.0  # type: ignore[attr-defined]
    correlate(fake, controller)  # it hears of every node at once and holds the cause
    clock.now += 6.0
    for agent in fleet:
        agent.settle(600.0)
    assert tainted(fake, fleet) == []


def lone_fault(fake: Any, clock: Clock) -> tuple[list[Agent], FleetController]:
    """Agents that wait up to 60 s for the word, a QUICK controller's first pass (its wall clock at 1.7e9),
    then GSP timeouts on n0 and its pass."""
    fleet = agents(fake, fleet=True, fleet_clock=clock, settle_seconds=10.0, settle_max_seconds=60.0)
    controller = fleet_controller(fake, QUICK, wall=1.7e9)
    correlate(fake, controller)
    gsp_timeouts(fleet[0])
    fleet[0].settle(200.0)
    return fleet, controller


@pytest.mark.fake_only  # on the shared real control plane, earlier tests' GSP timeouts are a cause with it
def test_a_node_the_controller_heard_of_acts_when_no_cause_explains_its_fault(fake):
    """One node alone, heard of by the controller in a pass that found no cause: it acts when its settle
    ends, without waiting out the longer bound."""
    clock = Clock(1.7e9)
    fleet, controller = lone_fault(fake, clock)
    correlate(fake, controller)
    clock.now += 10.0
    fleet[0].settle(211.0)
    assert tainted(fake, fleet) == ["n0"]


@pytest.mark.fake_only  # on the shared real control plane, earlier tests' GSP timeouts are a cause with it
def test_a_node_waits_for_no_word_from_a_controller_that_stopped_writing(fake):
    """The controller's promise to write again lapsed (it is gone): past the settle the node acts on its own
    evidence instead of waiting out the longer bound."""
    clock = Clock(1.7e9)
    fleet, _ = lone_fault(fake, clock)
    clock.now += 16.0  # past the settle and the controller's 15-s promise, well within 60 s
    fleet[0].settle(217.0)
    assert tainted(fake, fleet) == ["n0"]


@pytest.mark.fake_only  # on the shared real control plane, earlier tests' GSP timeouts are a cause with it
def test_a_holds_object_a_gone_controller_left_behind_delays_a_node_one_promise_at_most(fake):
    """The controller was uninstalled (the object stays): an agent that first reads it waits at most the
    promise the object makes (15 s, from its own first read: no wall clock of two machines compared), then
    acts on its own evidence at once, not after the 60-s bound. A wall clock 20 s ahead changes nothing."""
    clock = Clock(1.7e9 + 20.0)
    fleet, _ = lone_fault(fake, clock)
    assert tainted(fake, fleet) == []  # the settle, then waiting for a word while the promise stands
    clock.now += 16.0  # the promise, counted from this agent's first read, has lapsed
    fleet[0].settle(217.0)
    assert tainted(fake, fleet) == ["n0"]


#: The brake counts every GPU node of the cluster: the real control plane is shared by the session's tests
#: (their nodes and quarantines), so its bound is checked on the fake alone.
BRAKE_ON_THE_FAKE = pytest.mark.fake_only


@BRAKE_ON_THE_FAKE
@pytest.mark.parametrize("fault", [gsp_timeouts, links_down], ids=["xid-119-120-one-driver", "all-nvlinks-down"])
def test_without_the_fleet_controller_the_brake_bounds_a_fleet_wide_cause(fake, fault):
    """No controller, no holds: the brake lets max(2, 15 % of 6) nodes be newly quarantined, the rest wait."""
    fleet = agents(fake, fleet=True, brake=BRAKE)
    storm(fake, fleet, None, fault)
    assert len(tainted(fake, fleet)) == 2


def test_a_held_node_still_quarantines_a_double_bit_ecc_of_its_own(fake):
    """Inside a driver-version hold, one node's GPU reports a DBE (Xid 48, hardware): that node is tainted."""
    fleet = agents(fake, fleet=True)
    storm(fake, fleet, fleet_controller(fake), gsp_timeouts)
    fleet[4].fault(1, xid=48, at=300.0)
    assert tainted(fake, fleet) == ["n4"]


def test_a_held_node_keeps_its_condition(fake):
    """The hold takes the taint away, never the condition: it says the fault and that a fleet hold holds it."""
    fleet = agents(fake, fleet=True)
    storm(fake, fleet, fleet_controller(fake), gsp_timeouts)
    conditions = {c["type"]: c for c in fake[0].node("n5")["status"]["conditions"]}
    assert conditions["GpuFatalFault"]["status"] == "True"
    assert "held by fleet hold xid-119/driver-version/570.86.15" in conditions["GpuFatalFault"]["message"]


@pytest.mark.fake_only  # on the real control plane node n0 carries the session's earlier tests' record
def test_each_agent_publishes_its_summary_with_the_mirrored_record(fake):
    """One fault: the Node carries the summary (rule, class, driver, quarantined since) beside the state."""
    fleet = agents(fake, count=1, fleet=True)
    fleet[0].fault(0, xid=119, at=1.0)
    annotations = fake[0].node("n0")["metadata"]["annotations"]
    summary = NodeSummary.from_json(annotations[SUMMARY_ANNOTATION])
    assert [(f.rule_id, str(f.fault_class)) for f in summary.faults] == [("xid-119", "driver")]
    assert summary.driver_version == "570.86.15" and summary.quarantined_since > 0


@pytest.mark.fake_only  # on the real control plane node n0 carries the session's earlier tests' record
def test_a_healthy_node_publishes_its_summary_once_then_writes_nothing(fake):
    """With the fleet view on, a healthy node writes its record and summary at its first pass (so it counts
    in its groups before it faults: a hold covers it too), and nothing more while it stays healthy."""
    cluster, _ = fake
    [agent] = agents(fake, count=1, fleet=True)
    agent.settle(1.0)
    summary = NodeSummary.from_json(cluster.node("n0")["metadata"]["annotations"][SUMMARY_ANNOTATION])
    assert summary.faults == () and summary.driver_version == "570.86.15"
    writes = cluster.faults.writes
    for second in range(2, 300, 7):
        agent.settle(float(second))
    assert cluster.faults.writes == writes


def test_a_dry_run_publishes_no_summary(fake):
    """The summary goes with the mirror: a dry run writes neither to the Node."""
    fleet = agents(fake, count=1, fleet=True, dry_run=True)
    fleet[0].fault(0, xid=119, at=1.0)
    assert SUMMARY_ANNOTATION not in (fake[0].node("n0")["metadata"].get("annotations") or {})


@BRAKE_ON_THE_FAKE
def test_the_brake_closes_by_itself_when_the_window_has_passed(fake):
    """A node the brake kept waiting is tainted once the window moved past the others' quarantines."""
    clock = Clock()
    fleet = agents(fake, fleet=True, brake=BRAKE, fleet_clock=clock)
    storm(fake, fleet, None, gsp_timeouts)
    clock.now += BRAKE.window_seconds + 2.0
    fake[0].clock = lambda: time.time() + BRAKE.window_seconds + 2.0  # the API server's time passes too
    fleet[5].settle(400.0)
    assert "n5" in tainted(fake, fleet)


def falls_off_the_bus(agent: Agent) -> None:
    agent.fault(0, xid=79, at=1.0)


@BRAKE_ON_THE_FAKE
def test_with_a_live_controller_the_brake_counts_the_labelled_nodes_and_lists_no_summaries(fake):
    """A hardware storm (never held) while the controller runs: the brake still lets 2 of 6 through, counted
    from the quarantine labels and the controller's census, and no agent lists every GPU node's summary."""
    fleet = agents(fake, fleet=True, brake=BRAKE)
    controller = fleet_controller(fake)
    correlate(fake, controller)  # it runs before the storm: its census is there for the first node
    storm(fake, fleet, controller, falls_off_the_bus)
    assert len(tainted(fake, fleet)) == 2
    assert [a.side.fleet.lists for a in fleet] == [0] * FLEET
    assert all(a.side.fleet.label_lists for a in fleet)


def test_a_quarantined_node_carries_the_quarantine_label_with_its_summary(fake):
    """The label says the second (the node's wall clock) the summary says it was first quarantined."""
    [agent] = agents(fake, count=1, fleet=True, fleet_clock=Clock(1.7e9 + 5.0))
    agent.fault(0, xid=79, at=1.0)
    metadata = fake[0].node("n0")["metadata"]
    summary = NodeSummary.from_json(metadata["annotations"][SUMMARY_ANNOTATION])
    assert metadata["labels"][QUARANTINE_LABEL] == str(int(summary.quarantined_since)) == str(int(1.7e9 + 5.0))


@BRAKE_ON_THE_FAKE
def test_the_census_counts_the_gpu_nodes_and_an_older_agents_unlabelled_quarantine(fake):
    """An older agent's node publishes its quarantine in its summary alone, and a CPU node is no GPU node: the
    controller's census counts 3 GPU nodes and names the older node's quarantine, which the brake counts once
    its own summary says so (one list of the GPU nodes, only while the census names such a node)."""
    _, server = fake
    fleet = agents(fake, count=2, fleet=True, brake=BRAKE, fleet_clock=Clock(1.7e9))
    operator = RawApi(operator_client(server))
    older = NodeSummary(node="old", driver_version="570.86.15", quarantined_since=1.7e9 - 60.0)
    operator.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": "old", "labels": {"nvidia.com/gpu.present": "true"},
        "annotations": {SUMMARY_ANNOTATION: older.to_json()}}})
    operator.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu"}})
    correlate(fake, fleet_controller(fake))
    reading = fleet[0].side.fleet.read(count=True)
    assert reading.gpu_nodes == 3
    assert set(reading.quarantined_at) == {"old"}
    assert fleet[0].side.fleet.lists == 1


@BRAKE_ON_THE_FAKE
def test_a_census_naming_nodes_that_are_not_there_blocks_no_quarantine(fake):
    """The census names ten quarantined nodes that do not exist (forged, or stale): the brake counts none of
    them, and Xid 79 on two of six nodes is tainted (its bound)."""
    _, server = fake
    fleet = agents(fake, fleet=True, brake=BRAKE, fleet_clock=Clock(1.7e9))
    correlate(fake, fleet_controller(fake))
    path = f"/api/v1/namespaces/{NS}/configmaps/{HOLDS_CONFIGMAP}"
    raw = RawApi(operator_client(server))
    census = json.loads(raw.get(path)["data"][CENSUS_KEY])
    census["unlabelled"] = {f"ghost-{i}": 1.7e9 - 10.0 for i in range(10)}
    raw.merge_patch(path, {"data": {CENSUS_KEY: json.dumps(census)}})
    for agent in fleet[:2]:
        agent.fault(0, xid=79, at=1.0)
    assert len(tainted(fake, fleet)) == 2


@BRAKE_ON_THE_FAKE
def test_a_census_someone_broke_is_one_line_and_the_brake_counts_for_itself(fake):
    """The census is unreadable: one warning naming the object, and the brake lists the GPU nodes as it does
    without a controller (the holds beside it still stand)."""
    _, server = fake
    fleet = agents(fake, count=1, fleet=True, brake=BRAKE, fleet_clock=Clock(1.7e9))
    correlate(fake, fleet_controller(fake))
    RawApi(operator_client(server)).merge_patch(f"/api/v1/namespaces/{NS}/configmaps/{HOLDS_CONFIGMAP}",
                                                {"data": {CENSUS_KEY: "{"}})
    with capture_logs() as captured:
        reading = fleet[0].side.fleet.read(count=True)
    [warning] = [e for e in captured if e["event"] == "fleet_census_unreadable"]
    assert f"configmap {NS}/{HOLDS_CONFIGMAP}" in str(warning["error"])
    assert reading.gpu_nodes == 1 and fleet[0].side.fleet.lists == 1


@pytest.mark.fake_only  # on the real control plane node n0 carries the session's earlier tests' record
def test_a_released_node_takes_its_quarantine_label_off(fake):
    """The operator releases the quarantine: the untainted node no longer counts as quarantined for the brake."""
    _, server = fake
    [agent] = agents(fake, count=1, fleet=True, fleet_clock=Clock(1.7e9))
    agent.fault(0, xid=79, at=1.0)
    assert QUARANTINE_LABEL in fake[0].node("n0")["metadata"]["labels"]
    request_release(operator_client(server), "n0", "all")
    agent.settle(100.0)
    assert tainted(fake, [agent]) == []
    assert QUARANTINE_LABEL not in fake[0].node("n0")["metadata"]["labels"]


def test_a_verdict_recorded_while_the_fleet_view_is_read_takes_no_step_before_its_own_read(fake):
    """Every GPU's links drop at once: GPU 1's verdict lands while the pass for GPU 0's reads the holds. Its
    fault was not in that read, so the pass takes no step for it (no taint added and lifted again); the pass
    its verdict wakes reads the view for it, and the settle holds both."""
    clock = Clock(1.7e9)
    [agent] = agents(fake, count=1, fleet=True, fleet_clock=clock, settle_seconds=10.0, settle_max_seconds=60.0)
    correlate(fake, fleet_controller(fake, QUICK, wall=1.7e9))
    gate, read = agent.side.fleet, agent.side.fleet.read
    arrived: list[object] = []

    def read_while_a_verdict_lands(**kwargs: Any) -> Any:
        if not arrived:  # the source thread records GPU 1's fault meanwhile (no pass of its own yet)
            arrived.append(agent.pipeline.classifier.handle(
                Observation(Signal.XID, 119, 1.0, "kmsg", agent.inventory.gpus[1]), 1.0))
        return read(**kwargs)

    gate.read = read_while_a_verdict_lands  # type: ignore[method-assign]
    first = agent.fault(0, xid=119, at=1.0)
    second = agent.settle(2.0)
    taken = [str(a.step.kind) for a in [*first.actions, *second.actions]]
    assert arrived and "taint" not in taken and "untaint" not in taken
    assert tainted(fake, [agent]) == []


def test_a_hardware_verdict_recorded_while_the_fleet_view_is_read_is_tainted_before_the_pods_are_listed(fake):
    """Xid 79 on GPU 1 lands while the pass for GPU 0's GSP timeout reads the holds: the pass reads the view
    again at once, so the taint goes first, not behind the pass's pod list (the 1 s quarantine target)."""
    clock = Clock(1.7e9)
    [agent] = agents(fake, count=1, fleet=True, fleet_clock=clock, settle_seconds=10.0, settle_max_seconds=60.0)
    correlate(fake, fleet_controller(fake, QUICK, wall=1.7e9))
    gate, read = agent.side.fleet, agent.side.fleet.read
    reconciler, refresh = agent.pipeline.reconciler, agent.pipeline.reconciler.refresh_pods
    order: list[str] = []

    def read_while_a_verdict_lands(**kwargs: Any) -> Any:
        if not order:
            agent.pipeline.classifier.handle(Observation(Signal.XID, 79, 1.0, "kmsg", agent.inventory.gpus[1]), 1.0)
        order.append("read")
        return read(**kwargs)

    def listing() -> None:
        order.append("pods")
        refresh()

    gate.read = read_while_a_verdict_lands  # type: ignore[method-assign]
    reconciler.refresh_pods = listing  # type: ignore[method-assign]
    first = agent.fault(0, xid=119, at=1.0)
    kinds = [str(a.step.kind) for a in first.actions]
    assert kinds[:1] == ["taint"] and tainted(fake, [agent]) == ["n0"]
    assert order[:2] == ["read", "read"] and "pods" not in order[:2]


def test_the_brakes_count_says_when_it_is_cached_and_is_listed_afresh_when_asked(fake):
    """A count listed within count_seconds comes from the cache and says so; fresh_count lists it anew (what a
    quarantine the cached count allows asks for before it is taken)."""
    agents(fake, count=2, brake=BRAKE)
    clock = Clock(100.0)
    gate = FleetGate(RawApi(operator_client(fake[1])), namespace="gpu-health",
                     gpu_node_selector="nvidia.com/gpu.present=true", brake=BRAKE, holds=False, count_seconds=60.0,
                     clock=clock, wall=lambda: 1.0)
    first = gate.read(count=True)
    clock.now += 5.0
    second, third = gate.read(count=True), gate.read(count=True, fresh_count=True)
    assert [r.count_cached for r in (first, second, third)] == [False, True, False]
    assert gate.lists == 2 and third.gpu_nodes == first.gpu_nodes >= 2


@pytest.mark.fake_only  # counts every FleetCorrelation Event of the cluster
def test_every_nvlink_down_on_several_fabric_domains_heard_node_by_node_is_one_verdict_and_taints_no_node(fake):
    """Issue 24 (b): every NVLink drops on 12 nodes of three fabric domains, the controller hearing of them node
    by node (a pass after each): one hold naming the fabric across the domains, one Event, no unit of the
    first domain, and no node tainted."""
    cluster, server = fake
    clock = Clock()
    fleet = [make_agent(cluster, server, gpu_node(f"n{i}", gpus=2), mode=Mode.QUARANTINE, fleet=True,
                        fleet_clock=clock, settle_seconds=10.0, settle_max_seconds=60.0,
                        fabric_domain=f"fabric-{i // 4}") for i in range(12)]
    controller = fleet_controller(fake)
    for agent in fleet:  # each publishes its summary (its fabric domain) at its first pass
        agent.poll(0, 0.2)
        agent.settle(0.5)
    correlate(fake, controller)
    for agent in fleet:
        links_down(agent)
        agent.settle(200.0)
        correlate(fake, controller)
    clock.now += 10.0  # the settle ends
    for agent in fleet:
        agent.settle(400.0)
    assert tainted(fake, fleet) == []
    holds = controller.store.read()[0]
    assert [(h.id, h.unit) for h in holds] == [("nvlink-link-down/fabric-domain/several-domains", False)]
    assert len([e for e in cluster.events() if e.get("reason") == "FleetCorrelation"]) == 1


def disrupting_fault(fake: Any, *, controller: bool) -> tuple[Agent, list[tuple[str, str, int]]]:
    """One remediating agent with the fleet view on and the brake off (with the controller's census, or none):
    its Xid 79 takes a budget slot to evict and to ask for a reboot, and nothing but the budget would list
    Nodes. The agent, and the requests in the fake's log while it handled the fault."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n0", gpus=2), mode=Mode.REMEDIATE, fleet=True,
                       fleet_clock=Clock(1.7e9))
    if controller:
        correlate(fake, fleet_controller(fake))
    before = len(cluster.log)
    falls_off_the_bus(agent)
    return agent, cluster.log[before:]


def node_lists(log: list[tuple[str, str, int]]) -> int:
    return sum(1 for method, path, _ in log if (method, path) == ("GET", "/api/v1/nodes"))


@pytest.mark.fake_only  # counts the requests in the fake's log
def test_with_a_live_controller_the_budget_counts_the_gpu_nodes_by_its_census(fake):
    """A node that disrupts while the controller runs lists no Nodes: its budget's limit comes from the census
    (at 1,000 nodes, listing every GPU node's metadata was most of a disrupting agent's work)."""
    agent, log = disrupting_fault(fake, controller=True)
    assert "n0" in agent.side.gate.holders()
    assert node_lists(log) == 0


@pytest.mark.fake_only  # counts the requests in the fake's log
def test_without_a_live_controller_the_budget_lists_the_gpu_nodes_itself(fake):
    """No controller, so no census: the budget counts the GPU nodes with its own list."""
    agent, log = disrupting_fault(fake, controller=False)
    assert "n0" in agent.side.gate.holders()
    assert node_lists(log) == 1


@pytest.mark.fake_only  # counts the requests in the fake's log
def test_a_disrupting_fault_writes_its_node_without_a_conflict(fake):
    """The budget's disruption label goes through the agent's Node writer, whose view of the Node stays current:
    no Node write of the fault's pass is answered 409 and read again (its one GET is the pass's read)."""
    _, log = disrupting_fault(fake, controller=True)
    assert DISRUPTION_LABEL in fake[0].node("n0")["metadata"]["labels"]
    node_requests = [(method, code) for method, path, code in log if path == "/api/v1/nodes/n0"]
    assert ("PATCH", 409) not in node_requests and node_requests.count(("GET", 200)) == 1

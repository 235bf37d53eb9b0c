"""Issue 38: the fleet tier fails safe. What several agents share (the holds object, its units, the brake's
count) is read entry by entry, checked against what the reader knows itself, and a read that fails leaves
the last holds standing and the brake at its floor: no unknown entry, API fault or forged unit puts a broken
node back in service or takes more nodes out than the brake's bound."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.fleet import BrakePolicy, Dimension, Hold
from agent.fleet.published import HOLDS_CONFIGMAP, QUARANTINE_LABEL, SEEN_KEY, encode
from agent.fleetapi.fleet_gate import FleetGate
from agent.k8s.raw import RawApi
from agent.logs import capture_logs
from agent.model import FaultClass
from agent.remediation import Mode
from tests.integration.test_fleet_agents import (
    NS,
    Clock,
    agents,
    correlate,
    fleet_controller,
    gsp_timeouts,
    storm,
    tainted,
)
from tests.k8s_helpers import gpu_node, make_agent, operator_client, restart

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
BRAKE = BrakePolicy(max_share=0.15, min_nodes=2, max_nodes=200, window_seconds=600.0)
HOLDS_PATH = f"/api/v1/namespaces/{NS}/configmaps/{HOLDS_CONFIGMAP}"
#: The brake's bound counts every GPU node of the cluster: on the real control plane, shared by the
#: session's tests, it is checked on the fake alone.
BRAKE_ON_THE_FAKE = pytest.mark.fake_only


def operator(fake: Any) -> RawApi:
    return RawApi(operator_client(fake[1]))


def add_entries(fake: Any, *entries: dict[str, object]) -> None:
    """An operator's (or a newer controller's) entries appended to the published holds."""
    raw = operator(fake)
    data = raw.get(HOLDS_PATH)["data"]
    raw.merge_patch(HOLDS_PATH, {"data": {"holds.json": json.dumps([*json.loads(data["holds.json"]), *entries])}})


def newer_entries() -> list[dict[str, object]]:
    """Entries a newer controller might write: a dimension, a kind and a class this version does not know."""
    base = {"rule": "xid-79", "class": "hardware", "dimension": "fabric-domain", "key": "k", "cause": "c",
            "nodes": ["n0"], "started": 1.7e9, "expires": 1.7e9 + 900.0}
    return [dict(base, id="a", dimension="pcie-switch"), dict(base, id="b", kind="quarantine"),
            dict(base, id="c", **{"class": "thermal"})]


def braked(fault_row: Any, case: str, fake: Any, fleet: list[Any], bound: int = 2) -> None:
    """The row of a case where every node's fault is its own and the brake takes out exactly its bound."""
    out = len(tainted(fake, fleet))
    fault_row(case, over_brake_bound=max(0, out - bound), wrongly_untainted=max(0, bound - out))


def falls_off_the_bus(fleet: list[Any], at: float = 300.0) -> None:
    for agent in fleet:
        agent.fault(0, xid=79, at=at)


def test_restarted_agents_still_honour_a_hold_beside_an_entry_of_a_newer_format(fake, fault_row):
    """A newer controller's entries beside a hold: agents that read the object afresh (restarted) set them
    aside, one line each, and the hold still keeps its rule's taint off every node it names."""
    fleet = agents(fake, fleet=True)
    storm(fake, fleet, fleet_controller(fake), gsp_timeouts)
    add_entries(fake, *newer_entries())
    with capture_logs() as captured:
        fleet = [restart(agent) for agent in fleet]
        for agent in fleet:
            agent.settle(400.0)
    fault_row("a holds entry of a newer format, agents restarted", held_tainted=len(tainted(fake, fleet)))
    set_aside = [e for e in captured if e["event"] == "fleet_entry_set_aside"]
    assert sorted(str(e["reason"])[:11] for e in set_aside[:3]) == ["entry 'a': ", "entry 'b': ", "entry 'c': "]


@BRAKE_ON_THE_FAKE
def test_an_entry_of_a_newer_format_leaves_the_brake_on(fake, fault_row):
    """Xid 79 on six nodes while the holds object carries entries this version cannot read: the brake
    still takes out 2, its bound, not all six."""
    fleet = agents(fake, fleet=True, brake=BRAKE, fleet_clock=Clock(1.7e9))
    correlate(fake, fleet_controller(fake))
    add_entries(fake, *newer_entries())
    falls_off_the_bus(fleet)
    braked(fault_row, "a holds entry of a newer format, Xid 79 on six", fake, fleet)


@BRAKE_ON_THE_FAKE
def test_a_holds_object_that_cannot_be_read_leaves_the_brake_on(fake, fault_row):
    """Xid 79 on six nodes while the holds object is damaged (its `written` unreadable): the brake counts
    from its own sources and takes out 2, not six."""
    fleet = agents(fake, fleet=True, brake=BRAKE, fleet_clock=Clock(1.7e9))
    correlate(fake, fleet_controller(fake))
    operator(fake).merge_patch(HOLDS_PATH, {"data": {"written": "yesterday"}})
    falls_off_the_bus(fleet)
    braked(fault_row, "the holds object damaged, Xid 79 on six", fake, fleet)


@BRAKE_ON_THE_FAKE
def test_holds_that_cannot_be_read_again_stand_until_their_own_expiry(fake, fault_row):
    """The holds read answers 503 (retried, still failing): the holds last read still keep their rule's
    taint off, and a damaged holds object does the same."""
    cluster, _ = fake
    fleet = agents(fake, fleet=True)
    storm(fake, fleet, fleet_controller(fake), gsp_timeouts)
    cluster.faults.fail_reads[HOLDS_PATH] = 503
    for agent in fleet:
        agent.settle(400.0)
    fault_row("503 on every holds read", held_tainted=len(tainted(fake, fleet)))
    del cluster.faults.fail_reads[HOLDS_PATH]
    operator(fake).merge_patch(HOLDS_PATH, {"data": {"written": "yesterday"}})
    for agent in fleet:
        agent.settle(600.0)
    fault_row("the holds object damaged after it was read", held_tainted=len(tainted(fake, fleet)))


@BRAKE_ON_THE_FAKE
def test_a_429_on_the_holds_read_is_retried(fake, fault_row):
    """The API server's priority and fairness answers the holds read 429 twice: the agent reads again
    within the pass and the hold holds."""
    cluster, _ = fake
    fleet = agents(fake, fleet=True)
    storm(fake, fleet, fleet_controller(fake), gsp_timeouts)
    fleet = [restart(agent) for agent in fleet]  # no holds read yet: only the retry can find the hold
    cluster.faults.fail_next_reads[HOLDS_PATH] = [429, 429] * len(fleet)
    for agent in fleet:
        agent.settle(400.0)
    fault_row("429 twice on the holds read of restarted agents", held_tainted=len(tainted(fake, fleet)))


@BRAKE_ON_THE_FAKE
def test_a_brake_that_cannot_count_lets_only_its_floor_through(fake, fault_row):
    """Listing the quarantined nodes fails (503) on every agent: Xid 79 on six nodes takes out the brake's
    floor of 2, ranked by the claims, never all six."""
    cluster, _ = fake
    fleet = agents(fake, fleet=True, brake=BRAKE, fleet_clock=Clock(1.7e9))
    cluster.faults.fail_reads["/api/v1/nodes"] = 503
    falls_off_the_bus(fleet)
    del cluster.faults.fail_reads["/api/v1/nodes"]
    braked(fault_row, "the brake's count unreadable, Xid 79 on six", fake, fleet)


def forged_unit(nodes: list[str], rule: str, domain: str, cls: FaultClass) -> dict[str, str]:
    """A unit as a controller's token could write it, published for `nodes`."""
    unit = Hold(f"{rule}/fabric-domain/{domain}", rule, cls, Dimension.FABRIC_DOMAIN, domain, "forged",
                frozenset(nodes), 0.0, 900.0, unit=True)
    return encode([unit], now=0.0, wall=1.7e9, writer="fleet-a")


@BRAKE_ON_THE_FAKE
def test_a_unit_for_a_hardware_rule_is_not_counted_as_one(fake, fault_row):
    """A unit published for Xid 79 (hardware, never a fabric fault) on six nodes of its fabric domain: each
    agent's own rules say it is no unit, so the brake counts the six as six and takes out its bound of 2."""
    fleet = agents(fake, fleet=True, brake=BRAKE, fleet_clock=Clock(1.7e9), fabric_domain="fabric-1")
    correlate(fake, fleet_controller(fake))
    names = [a.inventory.name for a in fleet]
    operator(fake).merge_patch(HOLDS_PATH, {"data": forged_unit(names, "xid-79", "fabric-1",
                                                                FaultClass.INTERCONNECT)})
    falls_off_the_bus(fleet)
    braked(fault_row, "a forged unit for Xid 79 (hardware) on six", fake, fleet)


@BRAKE_ON_THE_FAKE
def test_a_unit_of_another_fabric_domain_does_not_take_this_node_in(fake):
    """A unit for NVLink down on fabric domain A names a node whose own fabric domain is B: that agent
    counts itself as its own node (in the brake and the budget), one line says why, and the unit keeps its
    other nodes."""
    fleet = agents(fake, count=2, fleet=True, brake=BRAKE, fleet_clock=Clock(1.7e9), fabric_domain="fabric-B")
    correlate(fake, fleet_controller(fake))
    operator(fake).merge_patch(HOLDS_PATH, {"data": forged_unit(["n0", "n1", "n9"], "nvlink-link-down",
                                                                "fabric-A", FaultClass.INTERCONNECT)})
    with capture_logs() as captured:
        units = fleet[0].side.fleet.units()
    assert units == {"nvlink-link-down/fabric-domain/fabric-A": frozenset({"n1", "n9"})}
    assert any("whose fabric domain is fabric-B" in str(e.get("reason")) for e in captured)


def links_down_under_a_unit_of_fabric_a(fake: Any, own_domain: str) -> int:
    """Six agents of fabric domain `own_domain` under a unit published for NVLink down on fabric-A naming all
    six; every link of every node goes down: how many nodes are tainted."""
    from tests.integration.test_fleet_agents import links_down

    fleet = agents(fake, fleet=True, brake=BRAKE, fleet_clock=Clock(1.7e9), fabric_domain=own_domain)
    correlate(fake, fleet_controller(fake))
    names = [a.inventory.name for a in fleet]
    operator(fake).merge_patch(HOLDS_PATH, {"data": forged_unit(names, "nvlink-link-down", "fabric-A",
                                                                FaultClass.INTERCONNECT)})
    for agent in fleet:
        links_down(agent)
    return len(tainted(fake, fleet))


@BRAKE_ON_THE_FAKE
def test_a_unit_naming_nodes_of_another_fabric_domain_counts_them_as_their_own(fake, fault_row):
    """The six nodes' own domain is B: each claim states B, so no claim joins the unit and the brake takes out
    its bound of 2."""
    out = links_down_under_a_unit_of_fabric_a(fake, "fabric-B")
    fault_row("a unit naming six nodes of another fabric domain", over_brake_bound=max(0, out - 2),
              wrongly_untainted=max(0, 2 - out))


@BRAKE_ON_THE_FAKE
def test_a_unit_of_the_nodes_own_fabric_domain_still_counts_as_one(fake, fault_row):
    """The six nodes' own domain is A: their claims state it, the unit is one place, all six out."""
    out = links_down_under_a_unit_of_fabric_a(fake, "fabric-A")
    fault_row("a unit of the six nodes' own fabric domain", wrongly_untainted=6 - out)


def test_a_quarantined_agent_that_restarts_keeps_its_quarantine_time(fake):
    """A DaemonSet rollout restarts a quarantined agent an hour later: its quarantine label keeps the second
    it was first quarantined, so the brake does not count it as new."""
    clock = Clock(1.7e9)
    [agent] = agents(fake, count=1, fleet=True, brake=BRAKE, fleet_clock=clock)
    agent.fault(0, xid=79, at=1.0)
    label = fake[0].node("n0")["metadata"]["labels"][QUARANTINE_LABEL]
    clock.now += 3600.0
    agent = restart(agent)
    agent.settle(400.0)
    agent.fault(1, xid=79, at=500.0)
    assert fake[0].node("n0")["metadata"]["labels"][QUARANTINE_LABEL] == label


@BRAKE_ON_THE_FAKE
def test_an_agent_honours_a_hold_at_most_six_hours_from_its_own_first_sight(fake):
    """A hold published to expire in ten days (a writer's clock far ahead, or a forged entry) covers this
    node's fault for six hours from the agent's own first sight of it, then no longer."""
    clock = Clock(1.7e9)
    [agent] = agents(fake, count=1, fleet=True, fleet_clock=clock)
    correlate(fake, fleet_controller(fake))
    hold = Hold("xid-119/driver-version/570.86.15", "xid-119", FaultClass.DRIVER, Dimension.DRIVER_VERSION,
                "570.86.15", "forged", frozenset({"n0"}), 0.0, 10 * 86400.0)
    operator(fake).merge_patch(HOLDS_PATH, {"data": encode([hold], now=0.0, wall=1.7e9, writer="fleet-a")})
    gate = agent.side.fleet
    assert [h.id for h in gate.read(count=False).holds if h.expires_at > clock.now] == [hold.id]
    clock.now += 6 * 3600.0 + 1.0
    assert [h.id for h in gate.read(count=False).holds if h.expires_at > clock.now] == []


def restart_storm(fake: Any, settings: Any, *, earlier_version: bool = False) -> tuple[list[Any], Clock, Clock]:
    """GSP timeouts on n0 to n3, 65 s apart (the window is 60 s): each tainted alone. Then the
    controller restarts (a rollout, an OOM): the new leader's first pass. The agents' clocks and the
    controllers' wall clock move together; each controller has its own monotonic clock."""
    from agent.fleetctl.controller import FleetController
    from agent.k8s.events import EventRecorder

    wall, mono = Clock(1.7e9), Clock(1000.0)
    fleet = agents(fake, fleet=True, fleet_clock=wall)

    def controller(identity: str) -> FleetController:
        raw = RawApi(operator_client(fake[1]))
        return FleetController(raw, settings, identity=identity, clock=mono, wall=wall,
                               events=EventRecorder(raw, instance=identity, namespace=NS))

    first = controller("fleet-a")
    for agent in fleet[:4]:  # four: a cause must stand with any one node taken away (three would not)
        gsp_timeouts(agent)
        correlate(fake, first)
        agent.settle(agent.pipeline.due_at + 1.0)
        wall.now += 65.0
        mono.now += 65.0
    if earlier_version:  # the predecessor was a version that published no first sightings
        operator(fake).merge_patch(HOLDS_PATH, {"data": {SEEN_KEY: None}})
    correlate(fake, controller("fleet-b"))  # the restarted leader: every standing fault new to it
    return fleet, wall, mono


@pytest.mark.fake_only  # on the shared real control plane, earlier tests' GSP timeouts stand beside these
def test_a_controller_restart_puts_no_broken_node_back_in_service(fake, fault_row):
    """Four GSP timeouts 65 s apart, each tainted alone; the controller, of an earlier version that published no
    first sightings, restarts and sees all four at once: it holds the driver version, but the four nodes,
    quarantined before that hold started, stay tainted."""
    from dataclasses import replace as _replace

    from agent.fleet import CorrelationPolicy
    from tests.integration.test_fleet_agents import SETTINGS

    settings = _replace(SETTINGS, policy=CorrelationPolicy(min_nodes=3, window_seconds=60.0))
    fleet, _, _ = restart_storm(fake, settings, earlier_version=True)
    assert json.loads(operator(fake).get(HOLDS_PATH)["data"]["holds.json"])  # the hold that formed
    for agent in fleet:
        agent.settle(agent.pipeline.due_at + 1.0)
    now = tainted(fake, fleet)
    broken = {"n0", "n1", "n2", "n3"}
    fault_row("the controller restarts after four faults 65 s apart",
              wrongly_untainted=len(broken - set(now)), held_tainted=len(set(now) - broken))


@pytest.mark.fake_only  # the shared real control plane holds earlier tests' FleetCorrelation Events
def test_a_restarted_controller_takes_its_predecessors_first_sightings(fake, fault_row):
    """The same four GSP timeouts 65 s apart: the new leader places each where the old one first saw it,
    so it names no cause (no hold, no FleetCorrelation Event) for faults that never came together."""
    from dataclasses import replace as _replace

    from agent.fleet import CorrelationPolicy
    from tests.integration.test_fleet_agents import SETTINGS

    settings = _replace(SETTINGS, policy=CorrelationPolicy(min_nodes=3, window_seconds=60.0))
    restart_storm(fake, settings)
    data = operator(fake).get(HOLDS_PATH)["data"]
    assert json.loads(data["holds.json"]) == []
    fault_row("the restarted controller's word on those four faults", wrong_events=len(
        [e for e in fake[0].events() if e.get("reason") == "FleetCorrelation"]))


def test_a_controller_whose_clock_is_minutes_behind_hides_no_hold(fake, fault_row):
    """The controller's wall clock runs 15 minutes behind the agents' (its holds last 10 minutes): agents
    reading its object place each hold from when they saw it, so the hold still keeps every taint off."""
    fleet = agents(fake, fleet=True, fleet_clock=Clock(1.7e9 + 900.0))
    storm(fake, fleet, fleet_controller(fake, wall=1.7e9), gsp_timeouts)
    fault_row("the controller's clock 15 min behind the agents'", held_tainted=len(tainted(fake, fleet)))


def holds_reads(fake: Any) -> int:
    return sum(1 for method, path, _ in fake[0].log if method == "GET" and path == HOLDS_PATH)


@BRAKE_ON_THE_FAKE
def test_an_unreadable_holds_object_is_tried_once_a_cache_period_not_every_pass(fake):
    """The holds read fails (503, retried) for a minute: the passes within one cache period take the holds
    last read without asking again, and say why they stand; the next period tries once more."""
    cluster, _ = fake
    fleet = agents(fake, fleet=True)
    storm(fake, fleet, fleet_controller(fake), gsp_timeouts)
    clock = Clock(100.0)
    gate = FleetGate(RawApi(operator_client(fake[1])), namespace=NS, gpu_node_selector="", brake=None,
                     cache_seconds=10.0, clock=clock)
    standing = gate.read(count=False).holds
    assert standing
    cluster.faults.fail_reads[HOLDS_PATH] = 503
    clock.now += 11.0
    failed = gate.read(count=False)
    tried = holds_reads(fake)
    for _ in range(5):
        clock.now += 1.0
        again = gate.read(count=False)
    assert holds_reads(fake) == tried
    assert again.holds == failed.holds == standing and "503" in again.holds_error
    clock.now += 10.0
    gate.read(count=False)
    assert holds_reads(fake) > tried


@pytest.fixture
def nothing_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoped holds name none of their nodes (as past LISTED_NODES at fleet scale)."""
    from agent.fleet import published
    monkeypatch.setattr(published, "LISTED_NODES", 0)


def test_a_hold_scoped_by_its_driver_version_holds_nodes_it_does_not_name(fake, nothing_listed, fault_row):
    """Xid 119/120 on every node of one driver, the hold published by its key alone: each agent finds itself
    in it by its own driver version, and restarted agents (before their own first summary) too."""
    fleet = agents(fake, fleet=True)
    storm(fake, fleet, fleet_controller(fake), gsp_timeouts)
    published = [entry for entry in json.loads(operator(fake).get(HOLDS_PATH)["data"]["holds.json"])
                 if entry.get("dimension") == "driver-version"]  # the real control plane keeps other tests'
    assert published and all(entry["scope"] and entry["nodes"] == [] for entry in published)
    fault_row("a hold by its driver version alone", held_tainted=len(tainted(fake, fleet)))
    fleet = [restart(agent) for agent in fleet]
    for agent in fleet:
        agent.settle(400.0)
    fault_row("a hold by its driver version alone, agents restarted", held_tainted=len(tainted(fake, fleet)))


def test_a_scoped_hold_never_covers_a_node_of_another_driver(fake, nothing_listed, fault_row):
    """The same storm, and one node whose own NVML reads another driver: the hold's key is not its own, so
    its fault is its own, tainted."""
    fleet = agents(fake, fleet=True)
    storm(fake, fleet, fleet_controller(fake), gsp_timeouts)
    other = make_agent(fake[0], fake[1], gpu_node("odd", gpus=2), mode=Mode.QUARANTINE, fleet=True,
                       driver="575.51.03")
    gsp_timeouts(other)
    other.settle(400.0)
    fault_row("a hold by its driver version, a node of another driver", held_tainted=len(tainted(fake, fleet)),
              wrongly_untainted=len({other.inventory.name} - set(tainted(fake, [other]))))

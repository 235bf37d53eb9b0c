"""The disruption budget's rate bound on the fake API server and the real control plane, each agent with its
own client (its bound token on the real one): a storm disrupts at most R nodes within the window, a released
slot counts until the window has passed, a restart keeps the count, clocks hours off cannot overbook it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from agent.fleetapi.budget import LeaseBudget
from agent.fleetapi.budget_slots import RELEASED_ANNOTATION, SLOT_LABEL, slot_name
from agent.k8s.raw import RawApi, api_path
from agent.model import StepKind, StepResult
from agent.simulation.fake_apiserver import FakeCluster
from tests.k8s_helpers import agent_client, gpu_node, make_agent, operator_client, populate_any

pytestmark = pytest.mark.usefixtures("no_retry_sleep")

HOUR = 3600.0
LEASES = api_path("coordination.k8s.io", "v1", "leases", namespace="gpu-health")


class Clock:
    """One machine's clocks: a wall clock maybe hours off (only stamps), a monotonic clock from its own origin."""

    def __init__(self, skew: float = 0.0, origin: float = 1000.0) -> None:
        self.skew = skew
        self.origin = origin
        self.elapsed = 0.0

    def wall(self) -> float:
        return time.time() + self.skew

    def monotonic(self) -> float:
        return self.origin + self.elapsed


class Fleet:
    """GPU nodes and their agents' budget gates, one clock per machine; time passes for all alike."""

    def __init__(self, fake: Any, count: int, *, skews: list[float] | None = None) -> None:
        self.cluster, self.server = fake
        real = not isinstance(self.cluster, FakeCluster)
        self.names = [self.cluster.plane.unique("rate") if real else f"rate-{i}" for i in range(count)]
        for name in self.names:
            if real:
                self.cluster.plane.add_gpu_node(name)
            else:
                populate_any(self.cluster, gpu_node(name))
        self.clocks = {n: Clock(skew, origin=1000.0 + 7919.0 * i)
                       for i, (n, skew) in enumerate(zip(self.names, skews or [0.0] * count, strict=True))}
        self.operator = RawApi(operator_client(self.server))

    def gate(self, name: str, *, rate: int, max_nodes: int = 2) -> LeaseBudget:
        """A new agent process of the node (a restart: nothing remembered), on the node's clocks."""
        clock = self.clocks[name]
        return LeaseBudget(RawApi(agent_client(self.server, name)), node_name=name, namespace="gpu-health",
                           max_nodes=max_nodes, max_percent=0, max_per_hour=rate, clock=clock.wall,
                           monotonic=clock.monotonic)

    def advance(self, seconds: float) -> None:
        for clock in self.clocks.values():
            clock.elapsed += seconds

    def slot(self, name: str) -> dict[str, Any] | None:
        for lease in self.operator.get(LEASES).get("items") or []:
            if lease["metadata"]["name"] == slot_name(name):
                return dict(lease)
        return None

    def held(self) -> set[str]:
        """The slots that are taken, not released (what the concurrency bound counts)."""
        return {lease["metadata"]["name"] for lease in self.operator.get(LEASES).get("items") or []
                if (lease["metadata"].get("labels") or {}).get(SLOT_LABEL) == "true"
                and RELEASED_ANNOTATION not in (lease["metadata"].get("annotations") or {})}


def storm(fleet: Fleet, gates: dict[str, LeaseBudget], *, rounds: int, every: float,
          healed: frozenset[str] = frozenset()) -> tuple[set[str], int]:
    """Every node not yet disrupted (nor `healed` before) asks for its slot each round; a node granted it is
    disrupted briefly (a reset) and gives it back in the same round, so the concurrency bound frees up at once.
    The nodes that were disrupted, and the most slots held at once."""
    disrupted: set[str] = set()
    most = 0
    for _ in range(rounds):
        granted = [n for n in fleet.names if n not in disrupted | healed and gates[n].acquire().held]
        most = max(most, len(fleet.held()))
        disrupted.update(granted)
        for name in granted:
            gates[name].release()
        fleet.advance(every)
    return disrupted, most


def test_a_storm_disrupts_at_most_the_rate_bound_within_the_window_though_slots_free_up(fake):
    """6 nodes fault together, 2 slots, 3 an hour: over 50 minutes 3 nodes are disrupted, no more, although
    each gives its slot back at once; once the window has passed the next nodes proceed."""
    fleet = Fleet(fake, 6)
    gates = {n: fleet.gate(n, rate=3) for n in fleet.names}
    first, most = storm(fleet, gates, rounds=10, every=300.0)
    assert len(first) == 3
    assert most <= 2
    fleet.advance(HOUR)
    later, _ = storm(fleet, gates, rounds=1, every=0.0, healed=frozenset(first))
    assert len(later) == 2  # the concurrency bound's 2 slots, of the 3 the new window allows


def test_a_released_slot_counts_until_the_window_passes_then_the_next_node_proceeds(fake):
    """Rate 1: n1 disrupted and done; n2 is refused by the rate bound (slots free) until an hour after it first
    saw n1's take, then granted; n1's kept slot is deleted once its window has passed."""
    fleet = Fleet(fake, 2)
    n1, n2 = fleet.names
    first, second = fleet.gate(n1, rate=1), fleet.gate(n2, rate=1)
    assert first.acquire().held
    first.release()
    assert RELEASED_ANNOTATION in fleet.slot(n1)["metadata"]["annotations"]
    refused = second.acquire()
    assert (refused.held, refused.in_use, refused.recent, refused.rate) == (False, 0, 1, 1)
    fleet.advance(HOUR - 1)
    assert not second.acquire().held
    first.release()
    assert fleet.slot(n1) is not None
    fleet.advance(2)
    assert second.acquire().held
    first.release()
    assert fleet.slot(n1) is None


def test_a_restarted_agent_does_not_reset_its_count(fake):
    """n2's agent restarts after seeing n1's take: the new process counts it for a whole window from its own
    first list; n1's restarted agent keeps its released slot rather than deleting it."""
    fleet = Fleet(fake, 2)
    n1, n2 = fleet.names
    first = fleet.gate(n1, rate=1)
    assert first.acquire().held
    first.release()
    assert not fleet.gate(n2, rate=1).acquire().held
    fleet.advance(HOUR - 60)
    restarted = fleet.gate(n2, rate=1)
    assert not restarted.acquire().held
    fleet.gate(n1, rate=1).release()  # n1's new process, its first pass: nothing in its record
    assert fleet.slot(n1) is not None
    fleet.advance(HOUR - 1)
    assert not restarted.acquire().held
    fleet.advance(2)
    assert restarted.acquire().held


def test_a_node_re_taking_its_own_slot_within_the_window_counts_once(fake):
    """Rate 2: n1 and n2 disrupted and done; n1 faults again within the hour and is granted (it is one of the
    two), n3 is refused."""
    fleet = Fleet(fake, 3)
    n1, n2, n3 = fleet.names
    gates = {n: fleet.gate(n, rate=2) for n in fleet.names}
    for name in (n1, n2):
        assert gates[name].acquire().held
        gates[name].release()
    fleet.advance(600)
    assert gates[n1].acquire().held
    assert not gates[n3].acquire().held


def test_a_refused_re_take_does_not_extend_its_window(fake):
    """Rate 2, one slot: n1 done, n2 holding; n1 faults again and is refused (no slot): its take still dates
    from the first, so an hour on n3 and then n4 proceed (n1's second try counted would refuse n4)."""
    fleet = Fleet(fake, 4)
    n1, n2, n3, n4 = fleet.names
    gates = {n: fleet.gate(n, rate=2, max_nodes=1) for n in fleet.names}
    assert gates[n1].acquire().held
    gates[n1].release()
    assert gates[n2].acquire().held
    assert not gates[n3].acquire().held  # n3 and n4 see both takes now
    assert not gates[n4].acquire().held
    fleet.advance(1800)
    assert not gates[n1].acquire().held
    assert n1 not in {s.removeprefix("gpu-health-slot-") for s in fleet.held()}
    fleet.advance(1801)
    gates[n2].release()
    assert gates[n3].acquire().held
    gates[n3].release()
    assert gates[n4].acquire().held


@pytest.mark.parametrize("skews", [[6 * HOUR, -6 * HOUR, 3 * HOUR, -3 * HOUR, 0.0, HOUR]], ids=["6h"])
def test_clocks_hours_off_cannot_overbook_the_rate_bound(fake, skews):
    """Six agents whose wall clocks are each up to 6 h off (and whose monotonic clocks start apart), rate 2:
    a storm over 50 minutes disrupts 2 nodes; no stamp of another machine decides anything."""
    fleet = Fleet(fake, 6, skews=skews)
    gates = {n: fleet.gate(n, rate=2) for n in fleet.names}
    disrupted, most = storm(fleet, gates, rounds=10, every=300.0)
    assert len(disrupted) == 2
    assert most <= 2


def test_an_agent_blocked_by_the_rate_bound_says_so_and_proceeds_once_the_window_has_passed(fake):
    """Rate 1, two slots: n1's agent evicts; n2's agent taints at once but its eviction is blocked, journaled
    with the rate bound's reason; an hour on (its budget's clock) the retried eviction goes through."""
    cluster, server = fake
    clocks = [Clock(), Clock()]
    names = ([cluster.plane.unique("rate-agent") for _ in range(2)] if not isinstance(cluster, FakeCluster)
             else ["rate-a1", "rate-a2"])
    agents = [make_agent(cluster, server, gpu_node(name), max_nodes=2, max_percent=0, max_per_hour=1,
                         budget_clock=clock.monotonic) for name, clock in zip(names, clocks, strict=True)]
    first = {(a.step.kind, a.result) for a in agents[0].fault(0).actions}
    assert (StepKind.EVICT, StepResult.APPLIED) in first
    outcome = agents[1].fault(0).actions
    results = {a.step.kind: (a.result, a.message) for a in outcome}
    assert results[StepKind.TAINT][0] is StepResult.APPLIED
    assert results[StepKind.EVICT] == (StepResult.BLOCKED, "cluster-wide disruption rate bound reached: 1 nodes "
                                                           "newly disrupted within the hour (at most 1)")
    clocks[1].elapsed = HOUR + 1
    later = agents[1].settle(40.0).actions
    assert (StepKind.EVICT, StepResult.APPLIED) in {(a.step.kind, a.result) for a in later}
    for agent in agents:
        agent.close()


def test_a_re_take_within_the_window_counts_from_then_once_granted(fake):
    """Rate 2: n1 and n2 done at once; n1 again half an hour on (granted: counts once). An hour after the
    first takes n1's second counts still: n3 proceeds, n4 is refused."""
    fleet = Fleet(fake, 4)
    n1, n2, n3, n4 = fleet.names
    gates = {n: fleet.gate(n, rate=2) for n in fleet.names}
    for name in (n1, n2):
        assert gates[name].acquire().held
        gates[name].release()
    assert not gates[n3].acquire().held and not gates[n4].acquire().held
    fleet.advance(1800)
    assert gates[n1].acquire().held
    gates[n1].release()
    fleet.advance(1801)
    assert gates[n3].acquire().held
    gates[n3].release()
    refused = gates[n4].acquire()
    assert (refused.held, refused.recent) == (False, 2)


def test_the_gpu_node_count_lists_metadata_only(fake):
    """The budget counts the GPU nodes from a PartialObjectMetadataList, never from whole Node objects."""
    from agent.k8s.watch import METADATA_ONLY_LIST
    fleet = Fleet(fake, 3)
    api = agent_client(fleet.server, fleet.names[0])
    nodes: list[str] = []
    stream, request = api.stream, api.request

    def streamed(path: str, **kwargs: Any) -> Any:
        if path.endswith("/nodes"):
            nodes.append(str(kwargs.get("accept")))
        return stream(path, **kwargs)

    def requested(method: str, path: str, **kwargs: Any) -> bytes:
        if path.endswith("/nodes"):
            nodes.append(f"{method} whole Nodes")
        return bytes(request(method, path, **kwargs))

    api.stream, api.request = streamed, requested
    gate = LeaseBudget(RawApi(api), node_name=fleet.names[0], namespace="gpu-health", max_nodes=0,
                       max_percent=100)
    assert gate.acquire().limit >= 3
    assert nodes == [METADATA_ONLY_LIST]


def test_an_agent_deletes_its_kept_slot_once_the_window_has_passed(fake):
    """n1's agent evicts, an operator releases the GPU: the slot is released and kept (the rate bound counts
    it), and a pass an hour on (its budget's clock) deletes it."""
    from agent.cluster_side import request_release
    cluster, server = fake
    clock = Clock()
    name = cluster.plane.unique("rate-kept") if not isinstance(cluster, FakeCluster) else "rate-kept"
    inventory = gpu_node(name)
    agent = make_agent(cluster, server, inventory, max_per_hour=1, budget_clock=clock.monotonic)
    operator = RawApi(operator_client(server))

    def slot() -> dict[str, Any] | None:
        return next((lease for lease in operator.get(LEASES).get("items") or []
                     if lease["metadata"]["name"] == slot_name(name)), None)

    agent.fault(0)
    assert slot() is not None
    request_release(operator_client(server), name, "all")
    agent.pipeline.reconcile(20.0)
    kept = slot()
    assert kept is not None and RELEASED_ANNOTATION in kept["metadata"]["annotations"]
    clock.elapsed = HOUR - 1
    agent.settle(60.0)
    assert slot() is not None
    clock.elapsed = HOUR + 1
    agent.settle(100.0)
    assert slot() is None
    agent.close()


def test_a_node_an_old_agent_disrupted_counts_against_the_rate_during_a_rolling_upgrade(fake):
    """The shared Lease of an earlier version names a node its old agent disrupted: with rate 1 and slots free,
    a new agent's take is refused by the rate bound."""
    import json
    fleet = Fleet(fake, 2)
    old, new = fleet.names
    gate = fleet.gate(new, rate=1)  # (on the real server its agent's identity comes with the namespace)
    fleet.operator.create(LEASES, {"metadata": {"name": "gpu-health-disruption-budget", "annotations": {
        "gpu-health-agent.io/holders": json.dumps({old: 1.0e9})}}, "spec": {}})
    refused = gate.acquire()
    assert (refused.held, refused.in_use, refused.recent) == (False, 1, 1)


def test_two_nodes_racing_for_the_last_take_of_the_hour_do_not_both_get_it(fake):
    """Rate 2, n1 done: n2 and n3 both write their slot before either ranks; the one created later (or in the
    same second) yields, so at most one more node is disrupted within the hour."""
    fleet = Fleet(fake, 3)
    n1, n2, n3 = fleet.names
    gates = {n: fleet.gate(n, rate=2) for n in fleet.names}
    assert gates[n1].acquire().held
    gates[n1].release()
    gates[n2]._create_or_get()
    gates[n3]._create_or_get()
    granted = [gates[n2].acquire().held, gates[n3].acquire().held]
    assert granted.count(True) <= 1


def test_a_restarted_disrupted_node_refused_by_the_rate_alone_stays_counted_as_disrupted(fake):
    """Rate 1: n1 disrupted for hours, n2 taken within the hour; n1's agent restarts and its re-take is refused
    by the rate bound: n1's slot stays live (the concurrency bound still counts it), and n3 is refused."""
    fleet = Fleet(fake, 3)
    n1, n2, n3 = fleet.names
    first, second = fleet.gate(n1, rate=1), fleet.gate(n2, rate=1)
    assert first.acquire().held
    assert not second.acquire().held
    fleet.advance(HOUR + 1)
    assert first.acquire().held  # the renewal
    assert second.acquire().held
    refused = fleet.gate(n1, rate=1).acquire()
    assert (refused.held, refused.recent) == (False, 1)
    assert fleet.held() == {slot_name(n1), slot_name(n2)}
    assert not fleet.gate(n3, rate=1, max_nodes=2).acquire().held

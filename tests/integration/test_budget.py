"""The disruption budget against the fake API server: slots judged on the reader's own clock, retried
requests, and no slot kept that the record does not hold."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agent.fleetapi.brake_claims import CLAIM_PREFIX, BrakeClaims
from agent.fleetapi.budget import LeaseBudget
from agent.fleetapi.budget_slots import SLOT_LABEL, slot_name
from agent.k8s.client import client_for
from agent.k8s.errors import K8sError, status_error
from agent.k8s.node import DISRUPTION_LABEL
from agent.k8s.raw import RawApi
from agent.model import StepKind, StepResult
from agent.simulation.fake_apiserver.resources import RESOURCES
from tests.k8s_helpers import gpu_node, make_agent, populate_any, start_cluster

pytestmark = pytest.mark.usefixtures("no_retry_sleep")

HOURS = 3600.0
LEASE_RESOURCE = next(r for r in RESOURCES if r.plural == "leases")


def three_gpu_nodes() -> tuple[Any, Any]:
    """The fake API server with three GPU nodes (the budget's limit counts GPU nodes)."""
    cluster, server = start_cluster()
    for name in ("n1", "n2", "n3"):
        populate_any(cluster, gpu_node(name))
    return cluster, server


@pytest.fixture
def fake():
    cluster, server = three_gpu_nodes()
    yield cluster, server
    server.stop()


class Clock:
    """A machine's clocks: wall time (maybe hours off) and a monotonic clock that only this machine reads."""

    def __init__(self, skew: float = 0.0) -> None:
        self.skew = skew
        self.elapsed = 0.0

    def wall(self) -> float:
        import time
        return time.time() + self.skew

    def monotonic(self) -> float:
        return 1000.0 + self.elapsed


def budget(server: Any, node: str, clock: Clock, *, limit: int = 1, api: Any = None) -> LeaseBudget:
    return LeaseBudget(RawApi(api or client_for(server.url)), node_name=node, namespace="gpu-health",
                       max_nodes=limit, max_percent=0, clock=clock.wall, monotonic=clock.monotonic)


def slots(cluster: Any) -> set[str]:
    return {lease["metadata"]["name"] for lease in cluster.list_objects(LEASE_RESOURCE, "gpu-health")
            if (lease["metadata"].get("labels") or {}).get(SLOT_LABEL) == "true"}


@pytest.mark.parametrize("skew", [2.5 * HOURS, -2.5 * HOURS])
def test_a_reader_hours_off_does_not_take_a_live_slot_as_lapsed(fake, skew):
    """A node 2.5 h ahead or behind (back from a reboot before NTP) is refused the slot another holds."""
    cluster, server = fake
    holder, late = Clock(), Clock(skew)
    assert budget(server, "n1", holder).acquire().held
    reading = budget(server, "n2", late).acquire()
    assert (reading.held, reading.in_use, reading.limit) == (False, 1, 1)
    assert slots(cluster) == {slot_name("n1")}


@pytest.mark.parametrize("skew", [2.5 * HOURS, -2.5 * HOURS])
def test_a_holder_hours_off_keeps_its_fresh_slot(fake, skew):
    """A slot stamped by a clock 2.5 h ahead or behind is live to every reader: its stamp is never read."""
    cluster, server = fake
    assert budget(server, "n1", Clock(skew)).acquire().held
    assert not budget(server, "n2", Clock()).acquire().held
    assert slots(cluster) == {slot_name("n1")}


def test_a_slot_stamped_in_the_future_lapses_once_unrenewed_for_a_lifetime(fake):
    """A ghost stamped 31 years ahead blocks for one lifetime of the reader's own clock, not for ever."""
    cluster, server = fake
    future = "2057-01-01T00:00:00.000000Z"
    cluster.add("leases", {"metadata": {"name": slot_name("ghost"), "labels": {SLOT_LABEL: "true"}},
                           "spec": {"holderIdentity": "ghost", "leaseDurationSeconds": 7200,
                                    "acquireTime": future, "renewTime": future}},
                group="coordination.k8s.io", namespace="gpu-health")
    clock = Clock()
    reader = budget(server, "n2", clock)
    assert not reader.acquire().held
    clock.elapsed = 7199.0
    assert not reader.acquire().held
    clock.elapsed = 7201.0
    assert reader.acquire().held


def test_a_renewed_slot_stays_live_past_its_lifetime(fake):
    """Each renewal changes the slot, so a reader starts its lifetime again (leader election's rule)."""
    _, server = fake
    holder_clock, reader_clock = Clock(), Clock()
    holder, reader = budget(server, "n1", holder_clock), budget(server, "n2", reader_clock)
    assert holder.acquire().held
    for hour in range(1, 5):
        assert not reader.acquire().held
        reader_clock.elapsed = hour * 0.9 * 7200.0
        assert holder.acquire().held  # the renewal
    assert not reader.acquire().held


def test_two_nodes_racing_for_the_last_slot_do_not_both_get_it(fake):
    """Both create their slot before either ranks: the one created later (or in the same second) yields."""
    cluster, server = fake
    first, second = budget(server, "n1", Clock()), budget(server, "n2", Clock())
    first._create_or_get()
    second._create_or_get()
    granted = [first.acquire().held, second.acquire().held]
    assert granted.count(True) <= 1
    assert len(slots(cluster)) == granted.count(True)


class Faulty:
    """The agent's API client with one request (the `fail_at`-th matching one) answered 503, or carried out
    by the server and its answer lost (`after`)."""

    def __init__(self, api: Any, matches: Callable[[str, str], bool], *, after: bool = False,
                 times: int = 1) -> None:
        self.api = api
        self.matches = matches
        self.after = after
        self.times = times
        self.fail_at: int | None = None
        self.seen = 0
        self.failed = 0
        original = api.request

        def request(method: str, path: str, **kwargs: Any) -> bytes:
            hit = matches(method, path)
            if hit:
                self.seen += 1
            failing = hit and self.fail_at is not None and self.seen >= self.fail_at and self.failed < self.times
            if failing and not self.after:
                self.failed += 1
                raise status_error(503, "Service Unavailable", "")
            answer = original(method, path, **kwargs)
            if failing:
                self.failed += 1
                raise status_error(503, "Service Unavailable", "")
            return answer

        api.request = request


def lease_requests(method: str, path: str) -> bool:
    return "/leases" in path


def disrupted(agent: Any) -> bool:
    node = agent.pipeline.record.node
    return bool(node.reboot_requested or any(node.evicted.values()))


def budget_requests(cluster: Any, server: Any) -> int:
    """How many lease requests one fatal fault's remediation makes on a healthy API server."""
    probe = Faulty(client_for(server.url), lease_requests)
    agent = make_agent(cluster, server, gpu_node("n3"), populate_node=False, api_client=probe.api)
    agent.fault(0)
    agent.close()
    return probe.seen


@pytest.mark.parametrize("after", [False, True], ids=["refused", "answer-lost"])
def test_a_503_on_any_budget_request_leaks_no_slot(fake, after):
    """Whichever Lease request fails (refused, or done with its answer lost), after the next pass the slot
    exists exactly when the record says the node is disrupted, and another node can take a freed slot."""
    total = budget_requests(*fake)
    assert total >= 3
    for index in range(1, total + 1):
        cluster, server = start_cluster()
        try:
            faulty = Faulty(client_for(server.url), lease_requests, after=after, times=10**9)
            faulty.fail_at = index  # that request and every later one fails, past the retries' deadline
            agent = make_agent(cluster, server, gpu_node("n1"), api_client=faulty.api, max_nodes=1, max_percent=0)
            agent.fault(0)
            assert faulty.failed, index
            faulty.fail_at = None
            agent.pipeline.reconcile(10.0)  # the API is back: the next pass (still backing off the eviction)
            assert (slot_name("n1") in slots(cluster)) == disrupted(agent), index
            agent.pipeline.tick(40.0)  # the eviction retried
            assert (slot_name("n1") in slots(cluster)) == disrupted(agent), index
            agent.close()
        finally:
            server.stop()


def test_a_slot_the_record_does_not_hold_is_given_back_on_the_first_pass(fake):
    """A slot left by a process that died after writing it is released by the next agent of the node."""
    cluster, server = fake
    assert budget(server, "n1", Clock()).acquire().held
    agent = make_agent(cluster, server, gpu_node("n1"), populate_node=False)
    agent.pipeline.reconcile(1.0)
    assert slots(cluster) == set()


def test_a_transient_error_on_the_slot_write_is_retried_within_the_pass(fake):
    """One 503 on creating the slot: the eviction still happens in the same pass."""
    cluster, server = fake
    faulty = Faulty(client_for(server.url), lambda method, path: method == "POST" and path.endswith("/leases"))
    faulty.fail_at = 1
    agent = make_agent(cluster, server, gpu_node("n1"), populate_node=False, api_client=faulty.api)
    outcome = agent.fault(0)
    assert faulty.failed == 1
    assert {(a.step.kind, a.step.target): a.result for a in outcome.actions}[
        (StepKind.EVICT, "ml/n1-trainer-0")] is StepResult.APPLIED


def test_a_transient_error_on_reading_the_gate_is_retried_within_the_pass(fake):
    """One 503 on the gate's read (the list of slots and the pause): the eviction still happens in the same
    pass."""
    cluster, server = fake
    faulty = Faulty(client_for(server.url), lambda method, path: method == "GET" and path.endswith("/leases"))
    faulty.fail_at = 1
    agent = make_agent(cluster, server, gpu_node("n1"), populate_node=False, api_client=faulty.api)
    outcome = agent.fault(0)
    assert faulty.failed == 1
    assert {(a.step.kind, a.step.target): a.result for a in outcome.actions}[
        (StepKind.EVICT, "ml/n1-trainer-0")] is StepResult.APPLIED


def test_the_disruption_label_is_a_repaired_view_of_the_slot(fake):
    """A failed label write costs nothing but the label; the next pass puts it right."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), populate_node=False)
    original, calls = agent.side.gate.show, []

    def failing_once(holding: bool) -> None:
        calls.append(holding)
        if len(calls) == 1:
            raise status_error(503, "Service Unavailable", "")
        original(holding)

    agent.side.gate.show = failing_once
    agent.fault(0)
    assert slot_name("n1") in slots(cluster)
    assert DISRUPTION_LABEL not in cluster.node("n1")["metadata"].get("labels", {})
    agent.pipeline.tick(40.0)
    assert cluster.node("n1")["metadata"]["labels"][DISRUPTION_LABEL] == "active"


def test_the_guard_decides_on_one_read_of_the_gate_per_pass(fake):
    """A pass with several disruptive steps lists the Leases twice, to read the gate (the pause Lease is in that
    list) and to rank its slot after writing it, and never reads the pause Lease by name."""
    cluster, server = fake
    lists = Faulty(client_for(server.url), lambda method, path: method == "GET" and path.endswith("/leases"))
    pause = Faulty(lists.api, lambda method, path: method == "GET" and path.endswith("/gpu-health-pause"))
    agent = make_agent(cluster, server, gpu_node("n1"), populate_node=False, api_client=pause.api)
    outcome = agent.fault(0)
    disruptive = [a for a in outcome.actions if a.step.disruptive and a.result is StepResult.APPLIED]
    assert len(disruptive) >= 2
    assert (lists.seen, pause.seen) == (2, 0)


def test_a_slot_deleted_under_its_holder_is_ranked_again_not_assumed(fake):
    """An operator deletes n1's slot and n2 takes the budget: n1's next renewal does not overbook."""
    cluster, server = fake
    first, second = budget(server, "n1", Clock()), budget(server, "n2", Clock())
    assert first.acquire().held
    cluster.delete(LEASE_RESOURCE, "gpu-health", slot_name("n1"))
    assert second.acquire().held
    assert not first.acquire().held
    assert slots(cluster) == {slot_name("n2")}


def lapse_for(cluster: Any, server: Any, taker: str) -> LeaseBudget:
    """Time passes on the server, and `taker` watches every other slot go unrenewed for a lifetime, then takes
    the budget."""
    cluster.clock.now += 7300.0
    clock = Clock()
    gate = budget(server, taker, clock)
    assert not gate.acquire().held
    clock.elapsed = 7201.0
    assert gate.acquire().held
    return gate


def test_an_earlier_processs_slot_does_not_rank_ahead_of_a_node_that_took_the_budget_since(fake):
    """n1's slot, left unrenewed by a process that died, lapses for n2, which takes the budget; n1's next
    process ranks its old slot as taken now (behind n2), not by its old creationTimestamp."""
    cluster, server = fake
    assert budget(server, "n1", Clock()).acquire().held
    lapse_for(cluster, server, "n2")
    restarted = budget(server, "n1", Clock())
    assert not restarted.read().held
    assert not restarted.acquire().held
    assert slots(cluster) == {slot_name("n2")}


def test_a_holder_that_could_not_renew_for_a_lifetime_ranks_again(fake):
    """n1 cannot renew for a lifetime on its own clock (the API unreachable), n2 takes the budget meanwhile:
    n1's next renewal is refused rather than trusted."""
    cluster, server = fake
    clock = Clock()
    holder = budget(server, "n1", clock)
    assert holder.acquire().held
    lapse_for(cluster, server, "n2")
    clock.elapsed = 7201.0
    assert not holder.read().held
    assert not holder.acquire().held
    assert slots(cluster) == {slot_name("n2")}


def test_a_restarted_holder_keeps_its_slot_and_others_see_it_renewed(fake):
    """n1's next process re-takes its live slot in place (no gap another node could slip into), and the
    re-take is a change every reader sees, so n2 counts it for a new lifetime."""
    cluster, server = fake
    assert budget(server, "n1", Clock()).acquire().held
    uid = cluster.get(LEASE_RESOURCE, "gpu-health", slot_name("n1"))["metadata"]["uid"]
    clock = Clock()
    reader = budget(server, "n2", clock)
    assert not reader.acquire().held
    clock.elapsed = 7000.0
    assert budget(server, "n1", Clock()).acquire().held
    assert cluster.get(LEASE_RESOURCE, "gpu-health", slot_name("n1"))["metadata"]["uid"] == uid
    clock.elapsed = 7201.0
    assert not reader.acquire().held


def old_shared_lease(cluster: Any, holders: dict[str, float]) -> None:
    """The one shared budget Lease an earlier version wrote, its holders in an annotation."""
    import json
    cluster.add("leases", {"metadata": {"name": "gpu-health-disruption-budget",
                                        "annotations": {"gpu-health-agent.io/holders": json.dumps(holders)}},
                           "spec": {}}, group="coordination.k8s.io", namespace="gpu-health")


def test_a_node_an_old_agent_disrupted_counts_against_the_budget_during_a_rolling_upgrade(fake):
    """n1 holds a slot in the old shared Lease (its agent not yet upgraded): n2's new agent is refused."""
    cluster, server = fake
    old_shared_lease(cluster, {"n1": 1.0e9})
    reading = budget(server, "n2", Clock()).acquire()
    assert (reading.held, reading.in_use) == (False, 1)
    assert slots(cluster) == set()


def test_an_old_shared_lease_entry_lapses_once_unchanged_for_a_lifetime_and_never_blocks_its_own_node(fake):
    """The entry of n1 does not block n1's own new agent; for n2 it lapses a lifetime after it last changed."""
    cluster, server = fake
    old_shared_lease(cluster, {"n1": 1.0e9})
    clock = Clock()
    reader = budget(server, "n2", clock)
    assert not reader.acquire().held
    clock.elapsed = 7201.0
    assert budget(server, "n1", Clock()).acquire().held
    assert not reader.acquire().held  # n1's new slot now
    budget(server, "n1", Clock()).release()
    assert reader.acquire().held


def test_a_slot_written_but_not_ranked_is_ranked_by_the_next_acquire_without_writing_it_again(fake):
    """The list after the slot's create fails past its retries: the next acquire only lists, and grants it."""
    cluster, server = fake
    api = client_for(server.url)
    lists = Faulty(api, lambda method, path: method == "GET" and path.endswith("/leases"), times=10**9)
    writes = Faulty(api, lambda method, path: method in {"POST", "PATCH"} and "/leases" in path)
    gate = budget(server, "n1", Clock(), api=api)
    lists.fail_at = 1
    with pytest.raises(K8sError):
        gate.acquire()
    lists.fail_at = None
    assert gate.acquire().held
    assert writes.seen == 1
    assert slots(cluster) == {slot_name("n1")}


def test_a_slot_written_but_not_ranked_is_ranked_by_the_gate_reading_listed_after_it(fake):
    """The pass's gate reading listed the slots after the unranked write: the acquire that follows lists nothing."""
    cluster, server = fake
    api = client_for(server.url)
    lists = Faulty(api, lambda method, path: method == "GET" and path.endswith("/leases"), times=10**9)
    gate = budget(server, "n1", Clock(), api=api)
    lists.fail_at = 1
    with pytest.raises(K8sError):
        gate.acquire()
    lists.fail_at = None
    gate.read()
    listed = lists.seen
    assert gate.acquire().held
    assert lists.seen == listed
    assert slots(cluster) == {slot_name("n1")}


def test_the_gate_reads_the_slots_without_the_brakes_claims(fake):
    """The gate's one list of the Leases leaves out the quarantine brake's claims (a hundred in a fault storm,
    each a Lease in the same namespace), and still finds the slots."""
    _, server = fake
    raw = RawApi(client_for(server.url))
    for node in ("n1", "n2", "n3"):
        BrakeClaims(raw, node_name=node, namespace="gpu-health", window_seconds=300.0).rank(
            bound=10, units={}, unclaimed={})
    answers: list[str] = []
    original = raw.get

    def recorded(path: str, **kwargs: Any) -> Any:
        answer = original(path, **kwargs)
        answers.extend(str(i["metadata"]["name"]) for i in answer.get("items") or [])
        return answer

    raw.get = recorded  # type: ignore[method-assign]
    gate = LeaseBudget(raw, node_name="n1", namespace="gpu-health", max_nodes=1, max_percent=0)
    assert gate.acquire().held
    assert slot_name("n1") in answers and not [a for a in answers if a.startswith(CLAIM_PREFIX)]

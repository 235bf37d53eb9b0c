"""The disruption budget's rate bound, pure: which takes a reader counts within the window, and the guard."""

from __future__ import annotations

import dataclasses

from agent.fleetapi.budget_slots import RELEASED_ANNOTATION, Slot, Takings, within_rate
from agent.model import Step, StepKind, StepResult
from agent.remediation import AttemptHistory, ClusterView, GateReading, GuardPolicy, Mode, decide

HOUR = 3600.0
EVICT = Step(StepKind.EVICT, "ml/trainer-3", "holds faulty GPU")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def slot(node: str, *, uid: str = "", takes: int = 0, version: str = "1", released: bool = False) -> Slot:
    return Slot(f"gpu-health-slot-{node}", node, uid or f"uid-{node}", version, 1.0e9, takes, released)


def guard(gate: GateReading, step: Step = EVICT) -> tuple[StepResult | None, str]:
    decision = decide(step, policy=GuardPolicy(mode=Mode.REMEDIATE), cluster=ClusterView(gate=gate),
                      history=AttemptHistory(), now=1000.0)
    return decision.result, decision.reason


def test_a_take_counts_for_a_whole_window_after_this_reader_first_saw_it():
    """Seen at 100, the take counts until 100 + 1 h on this reader's clock, then no longer."""
    clock = Clock()
    takings = Takings(HOUR, clock)
    assert takings.recent([slot("n1")]) == [slot("n1")]
    clock.now += HOUR - 1
    assert takings.recent([slot("n1")]) == [slot("n1")]
    clock.now += 2
    assert takings.recent([slot("n1")]) == []


def test_a_renewal_or_a_release_is_no_new_take():
    """A new resourceVersion (a renewal) or the released mark keeps the take's first sighting."""
    clock = Clock()
    takings = Takings(HOUR, clock)
    takings.recent([slot("n1")])
    clock.now += HOUR + 1
    assert takings.recent([slot("n1", version="7", released=True)]) == []


def test_a_new_lease_transition_is_a_new_take():
    """A re-take (leaseTransitions counted up) counts for a window from when this reader sees it."""
    clock = Clock()
    takings = Takings(HOUR, clock)
    takings.recent([slot("n1")])
    clock.now += HOUR + 1
    assert takings.recent([slot("n1", takes=1)]) == [slot("n1", takes=1)]


def test_a_slot_recreated_under_the_same_name_is_a_new_take():
    """Deleted and created again (a new uid): a new take."""
    clock = Clock()
    takings = Takings(HOUR, clock)
    takings.recent([slot("n1")])
    clock.now += HOUR + 1
    assert takings.recent([slot("n1", uid="other")]) == [slot("n1", uid="other")]


def test_a_slot_gone_from_the_list_is_forgotten():
    """A refused take deleted is not counted; the same take listed again later starts a new window."""
    clock = Clock()
    takings = Takings(HOUR, clock)
    takings.recent([slot("n1")])
    clock.now += HOUR - 10
    assert takings.recent([]) == []
    assert takings.recent([slot("n1")]) == [slot("n1")]
    clock.now += 20
    assert takings.recent([slot("n1")]) == [slot("n1")]


def test_a_reader_that_starts_counts_every_slot_it_finds_for_a_whole_window():
    """A restarted reader knows no take's age: each counts a window from its first list (never less)."""
    clock = Clock()
    clock.now = 1.0e6
    takings = Takings(HOUR, clock)
    found = [slot("n1", released=True), slot("n2"), slot("n3", takes=4, released=True)]
    assert takings.recent(found) == found


def test_the_released_mark_is_read_from_the_annotation():
    """A slot given back and kept carries the released annotation; Slot.of reads it and the take."""
    lease = {"metadata": {"name": "gpu-health-slot-n1", "uid": "u", "resourceVersion": "3",
                          "creationTimestamp": "2026-01-01T00:00:00Z",
                          "annotations": {RELEASED_ANNOTATION: "2026-01-01T00:10:00.000000Z"}},
             "spec": {"holderIdentity": "n1", "leaseTransitions": 2}}
    read = Slot.of(lease)
    assert (read.released, read.takes) == (True, 2)
    assert not Slot.of({**lease, "metadata": {**lease["metadata"], "annotations": {}}}).released


def test_one_more_take_fits_while_fewer_than_the_bound_are_ahead():
    """Bound 3: 2 ahead fits, 3 do not; bound 0 is no bound."""
    assert within_rate(2, 3)
    assert not within_rate(3, 3)
    assert within_rate(10**6, 0)


def test_the_rate_bound_blocks_a_new_disruption_and_says_so():
    """Slots free but 3 nodes newly disrupted within the hour (bound 3): blocked by the gate, with the reason."""
    result, reason = guard(GateReading(in_use=0, limit=2, recent=3, rate=3))
    assert result is StepResult.BLOCKED
    assert reason == "cluster-wide disruption rate bound reached: 3 nodes newly disrupted within the hour (at most 3)"
    decision = decide(EVICT, policy=GuardPolicy(mode=Mode.REMEDIATE),
                      cluster=ClusterView(gate=GateReading(recent=3, rate=3)), history=AttemptHistory(), now=0.0)
    assert decision.by_gate


def test_a_node_holding_its_slot_is_not_newly_disrupted():
    """A held slot's next step (a reboot request after the eviction) proceeds past a spent rate bound."""
    assert guard(GateReading(held=True, recent=5, rate=3))[0] is None


def test_the_rate_bound_never_blocks_the_taint_or_clearing():
    """The taint (the quarantine brake's business) and clearing are no disruption."""
    spent = GateReading(recent=3, rate=3)
    for step in (Step(StepKind.TAINT, "node-1", "fatal"), Step(StepKind.UNTAINT, "node-1", "healthy"),
                 Step(StepKind.SET_CONDITION, "node-1", "fatal")):
        assert guard(spent, step)[0] is None, step.kind


def test_no_rate_bound_is_no_bound():
    """rate 0: any number of recent takes lets a step through."""
    assert guard(dataclasses.replace(GateReading(), recent=100, rate=0))[0] is None


def test_the_configured_rate_bound_reaches_the_budget_gate():
    """remediation.budget_max_nodes_per_hour (default 3) is the gate's rate bound."""
    from agent.cluster_side import build_cluster_side
    from agent.config import load_config
    from agent.k8s.client import client_for
    config = load_config(None, env={"NODE_NAME": "n1", "GPU_HEALTH_REMEDIATION__BUDGET_MAX_NODES_PER_HOUR": "5"})
    side = build_cluster_side(client_for("http://127.0.0.1:9"), config, on_stuck=lambda pod: None)
    assert side.gate.max_per_hour == 5
    assert load_config(None, env={"NODE_NAME": "n1"}).remediation.budget_max_nodes_per_hour == 3

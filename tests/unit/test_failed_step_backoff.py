"""A pass whose API requests failed is tried again soon (2 s, doubling per failing pass in a row, up to the
retry back-off), not after the full back-off a refusal gets."""

from __future__ import annotations

import itertools

import pytest

from agent.model import NodeInventory, PodRef, Signal, StepKind, StepResult
from agent.pipeline import LocalActuator, LocalGate, Pipeline
from agent.remediation import GateReading, GuardPolicy, Mode
from agent.remediation.backoff import failed_pass_delay
from tests.conftest import gpu, obs

NODE = NodeInventory("node-1", (gpu(0), gpu(1)), (PodRef("ml", "p0", "u0", (gpu(0).uuid,)),))


class FlakyGate(LocalGate):
    """A budget whose reads fail while `failing` (the API answering 503 past the retries)."""

    def __init__(self) -> None:
        self.failing = True
        self.spent = False
        self.reads = 0

    def read(self) -> GateReading:
        self.reads += 1
        if self.failing:
            raise RuntimeError("503 Service Unavailable")
        return GateReading(limit=0 if self.spent else 1)


class FlakyEvictions(LocalActuator):
    """Evictions the API refuses with an error (past the retries) while `failing`."""

    def __init__(self) -> None:
        self.failing = True

    def apply(self, step):  # type: ignore[no-untyped-def]
        if step.kind is StepKind.EVICT and self.failing:
            return StepResult.FAILED, "ApiError: 503 Service Unavailable"
        return super().apply(step)


def pipeline(rules, *, gate=None, actuator=None) -> Pipeline:  # type: ignore[no-untyped-def]
    return Pipeline(rules=rules, inventory=NODE, policy=GuardPolicy(mode=Mode.REMEDIATE), gate=gate,
                    actuator=actuator, retry_seconds=30.0)


def evictions(outcome) -> list[str]:  # type: ignore[no-untyped-def]
    return [str(a.result) for a in outcome.actions if a.step.kind is StepKind.EVICT]


def test_the_delay_starts_at_two_seconds_and_doubles_up_to_the_cap():
    """2, 4, 8, 16 s, then the cap; nothing owed before any failure."""
    assert [failed_pass_delay(n, cap_seconds=30.0) for n in range(7)] == [0.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


@pytest.mark.parametrize("failing", ["budget read", "eviction"])
def test_a_failed_request_is_tried_again_after_about_two_seconds(shipped_rules, failing):
    """The budget read or the eviction request failed (not a refusal): the eviction is tried again 2-2.5 s
    later, not after the 30-37.5 s back-off."""
    flaky = FlakyGate() if failing == "budget read" else FlakyEvictions()
    p = pipeline(shipped_rules, **{"gate" if failing == "budget read" else "actuator": flaky})
    assert evictions(p.handle(obs(Signal.XID, 79, 0.0), 0.0)) == ["blocked" if failing == "budget read" else "failed"]
    flaky.failing = False
    assert evictions(p.tick(2.5)) == ["planned"]


def test_the_wait_doubles_while_passes_keep_failing(shipped_rules):
    """Failing passes at 0 and ~2 s: the third comes at least 4 s after the second, and by 2.5 s x 2 after it."""
    gate = FlakyGate()
    p = pipeline(shipped_rules, gate=gate)
    p.handle(obs(Signal.XID, 79, 0.0), 0.0)
    p.tick(2.5)
    assert gate.reads == 2
    p.tick(6.4)
    assert gate.reads == 2
    p.tick(7.5)
    assert gate.reads == 3


def test_an_answered_pass_starts_the_wait_at_two_seconds_again(shipped_rules):
    """Two failing passes, then one answered (the budget spent: the full back-off), then a failure: the next
    pass comes about 2 s after it, not after the doubled 8 s."""
    gate = FlakyGate()
    p = pipeline(shipped_rules, gate=gate)
    p.handle(obs(Signal.XID, 79, 0.0), 0.0)
    p.tick(2.5)
    gate.failing, gate.spent = False, True
    assert evictions(p.tick(7.5)) == ["blocked"]
    assert gate.reads == 3
    gate.failing = True
    p.tick(45.0)  # past the spent budget's 30-37.5 s back-off
    assert gate.reads == 4
    p.tick(47.5)
    assert gate.reads == 5


class CountingGate(LocalGate):
    """A budget that always has room, counting the slot's takes and give-backs."""

    def __init__(self) -> None:
        self.acquires = 0
        self.releases = 0
        self.holding = False

    def read(self) -> GateReading:
        return GateReading(held=self.holding)

    def acquire(self, rules: frozenset[str] = frozenset()) -> GateReading:
        self.acquires += 1
        self.holding = True
        return GateReading(held=True)

    def release(self) -> None:
        self.releases += 1
        self.holding = False


class FlakyNodeWrites(FlakyEvictions):
    """The taint, the evictions and the reboot request refused with an error while `failing`: nothing disrupts
    the node yet."""

    def apply(self, step):  # type: ignore[no-untyped-def]
        if step.kind in {StepKind.TAINT, StepKind.REBOOT_REQUEST} and self.failing:
            return StepResult.FAILED, "ApiError: 503 Service Unavailable"
        return super().apply(step)


def test_a_slot_taken_for_an_eviction_whose_request_failed_is_kept_for_the_next_pass(shipped_rules):
    """The taint and the eviction failed after the slot was taken: the slot is not given back, and the next pass
    evicts on it without taking it again."""
    gate, flaky = CountingGate(), FlakyNodeWrites()
    p = pipeline(shipped_rules, gate=gate, actuator=flaky)
    assert evictions(p.handle(obs(Signal.XID, 79, 0.0), 0.0)) == ["failed"]
    assert (gate.acquires, gate.releases) == (1, 0)
    flaky.failing = False
    assert evictions(p.tick(2.5)) == ["planned"]
    assert (gate.acquires, gate.releases) == (1, 0)


def test_a_slot_kept_for_an_owed_eviction_is_given_back_once_it_is_no_longer_owed(shipped_rules):
    """The fault is released while its eviction still fails: the slot kept for it is given back."""
    gate = CountingGate()
    p = pipeline(shipped_rules, gate=gate, actuator=FlakyEvictions())
    p.handle(obs(Signal.XID, 79, 0.0), 0.0)
    p.handle(obs(Signal.OPERATOR_RELEASE, 1, 1.0), 1.0)
    p.tick(5.0)
    assert (gate.acquires, gate.releases, gate.holding) == (1, 1, False)


def test_the_wait_stays_short_while_a_fatal_step_is_owed(shipped_rules):
    """The budget unreadable for 60 s with an eviction owed: passes come at most 4-5 s apart, never 30 s."""
    gate = FlakyGate()
    p = pipeline(shipped_rules, gate=gate)
    p.handle(obs(Signal.XID, 79, 0.0), 0.0)
    read_at = [0.0]
    for tenth in range(1, 601):
        before = gate.reads
        p.tick(tenth / 10)
        if gate.reads > before:
            read_at.append(tenth / 10)
    assert max(b - a for a, b in itertools.pairwise(read_at)) <= 5.1

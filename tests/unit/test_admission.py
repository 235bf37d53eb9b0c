"""The guard decides each step once, on the pass's reading; the slot's write follows and reports back."""

from __future__ import annotations

from collections import Counter

import pytest

from agent.control import steps
from agent.model import Signal, StepKind, StepResult
from agent.pipeline import LocalActuator, Pipeline
from agent.remediation import GateReading, GuardPolicy, Mode
from tests.conftest import obs
from tests.unit.test_pipeline import NODE


class Applied(LocalActuator):
    """Applies every step, remembering their kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[StepKind] = []

    def apply(self, step):
        self.kinds.append(step.kind)
        return StepResult.APPLIED, "ok"


#: A slot the write took.
TAKEN = GateReading(held=True, in_use=1, limit=1)


class Gate:
    """Room on the read; the slot's write answers `taken`; what a pass takes and gives back is counted."""

    maybe_held = False
    lingering = False

    def __init__(self, taken: GateReading = TAKEN) -> None:
        self.taken = taken
        self.acquired = 0
        self.released = 0

    def read(self) -> GateReading:
        return GateReading(in_use=0, limit=1)

    def acquire(self, rules: frozenset[str] = frozenset()) -> GateReading:
        self.acquired += 1
        return self.taken

    def release(self) -> None:
        self.released += 1

    def show(self, holding: bool) -> None:
        return None


def _pass(rules, gate: Gate, actuator: Applied):
    p = Pipeline(rules=rules, inventory=NODE, policy=GuardPolicy(mode=Mode.REMEDIATE), actuator=actuator, gate=gate,
                 clock=lambda: 100.0)
    return p.handle(obs(Signal.XID, 79, 1.0), 1.0)


def test_the_guard_decides_a_disruptive_step_once_though_its_slot_is_written(shipped_rules, monkeypatch):
    """One decision per step: the slot's write follows it, the guard is not asked again on its answer."""
    asked: Counter[tuple[StepKind, str]] = Counter()
    decide = steps.decide

    def counted(step, **kwargs):
        asked[(step.kind, step.target)] += 1
        return decide(step, **kwargs)

    monkeypatch.setattr(steps, "decide", counted)
    outcome = _pass(shipped_rules, Gate(), Applied())
    evicted = {(a.step.kind, a.step.target): a.result for a in outcome.actions}
    assert evicted[(StepKind.EVICT, "ml/p0")] is StepResult.APPLIED
    assert asked[(StepKind.EVICT, "ml/p0")] == 1


@pytest.mark.parametrize(("taken", "reason"), [
    (GateReading(held=False, in_use=1, limit=1), "cluster-wide disruption budget exhausted"),
    (GateReading(error="Unavailable: 503"), "disruption budget unreadable: Unavailable: 503"),
])
def test_a_slot_the_write_could_not_take_blocks_the_step_with_its_answer(shipped_rules, taken, reason):
    """Another node took the last slot between the read and the write (or the write failed): the eviction is
    blocked, in the guard's words for that answer, and never attempted."""
    actuator = Applied()
    outcome = _pass(shipped_rules, Gate(taken), actuator)
    [evict] = [a for a in outcome.actions if a.step.kind is StepKind.EVICT]
    assert (evict.result, evict.message) == (StepResult.BLOCKED, reason)
    assert StepKind.EVICT not in actuator.kinds

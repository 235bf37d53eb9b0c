"""A pass's Node-mark steps wait for its one Node write and are journaled with what that write answered."""

from __future__ import annotations

from agent.model import Signal, StepKind, StepResult
from agent.pipeline import LocalActuator, Pipeline
from agent.remediation import GuardPolicy, Mode
from tests.conftest import obs
from tests.unit.test_pipeline import NODE


class _NodeWrites(LocalActuator):
    """Applies every step; the pass's Node write answers `refusal` ("" writes), and is counted."""

    def __init__(self) -> None:
        super().__init__()
        self.refusal = ""
        self.writes = 0
        self.order: list[str] = []

    def apply(self, step):
        self.order.append(str(step.kind))
        return StepResult.APPLIED, "ok"

    def write_node(self) -> str:
        self.writes += 1
        self.order.append("node write")
        return self.refusal


def _pipeline(rules, actuator: _NodeWrites) -> Pipeline:
    return Pipeline(rules=rules, inventory=NODE, policy=GuardPolicy(mode=Mode.QUARANTINE), actuator=actuator,
                    clock=lambda: 100.0, inline=False)


def test_a_refused_node_write_fails_the_steps_that_waited_for_it(shipped_rules):
    """The taint and conditions are FAILED with the refusal, and the record does not claim them."""
    actuator = _NodeWrites()
    p = _pipeline(shipped_rules, actuator)
    p.handle(obs(Signal.XID, 79, 1.0), 1.0)
    actuator.refusal = "Forbidden: refused by the admission policy"
    outcome = p.reconcile(1.0)
    marks = {a.step.kind: a for a in outcome.actions if a.step.kind in {StepKind.TAINT, StepKind.SET_CONDITION}}
    assert marks and {a.result for a in marks.values()} == {StepResult.FAILED}
    assert marks[StepKind.TAINT].message == actuator.refusal
    assert not p.record.node.tainted and not p.record.node.conditions


def test_steps_a_refused_node_write_failed_are_written_by_the_next_pass(shipped_rules):
    """Level-triggered: the record forgot them, so the next pass plans and writes them again."""
    actuator = _NodeWrites()
    p = _pipeline(shipped_rules, actuator)
    p.handle(obs(Signal.XID, 79, 1.0), 1.0)
    actuator.refusal = "Forbidden: refused"
    p.reconcile(1.0)
    actuator.refusal = ""
    again = p.reconcile(2.0)
    assert {(a.step.kind, a.result) for a in again.actions} >= {(StepKind.TAINT, StepResult.APPLIED),
                                                               (StepKind.SET_CONDITION, StepResult.APPLIED)}
    assert p.record.node.tainted


def test_the_taint_is_written_at_once_and_the_conditions_by_the_passs_last_write(shipped_rules):
    """Two Node writes in a quarantine's pass: the taint's, before anything else, and the pass's last, which
    carries the condition decided after it (its Event meanwhile is its own request)."""
    actuator = _NodeWrites()
    p = _pipeline(shipped_rules, actuator)
    p.handle(obs(Signal.XID, 79, 1.0), 1.0)
    p.reconcile(1.0)
    assert actuator.order == ["taint", "node write", "set_condition", "event", "node write"]

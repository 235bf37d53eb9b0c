"""AcceleratedHardwareReady: False only while a fault needs the node rebooted or replaced, written so that
its lastTransitionTime holds across repeats (the planner's step), behind a setting (off by default)."""

from __future__ import annotations

from agent.config import Config
from agent.model import Action, Severity, StepKind
from agent.remediation.planner import ActiveFault, ConditionState, NodeState, PlanOptions, plan
from agent.remediation.repair_condition import CONDITION, repair_condition_steps
from tests.unit.test_planner import NODE, active_of, fault


def _fault(action: Action, gpu: str = "GPU-0", rule: str = "xid-79") -> ActiveFault:
    return ActiveFault(rule, gpu, Severity.FATAL, action, "summary", 0.0)


def test_a_fault_that_needs_a_reboot_sets_the_condition_false():
    """A reboot_node fault: one CLEAR_CONDITION step (status False) naming the GPU and the rule."""
    [step] = repair_condition_steps([_fault(Action.REBOOT_NODE)], {})
    assert (step.kind, step.target) == (StepKind.CLEAR_CONDITION, CONDITION)
    assert "GPU-0: xid-79" in step.reason and step.details["reason"] == "AcceleratedHardwareNeedsRepair"


def test_a_fault_the_agent_repairs_itself_leaves_the_condition_true():
    """A reset or a quarantine is not a repair tool's business: the condition is (set) True."""
    [step] = repair_condition_steps([_fault(Action.RESET_GPU), _fault(Action.QUARANTINE, "GPU-1")], {})
    assert (step.kind, step.target) == (StepKind.SET_CONDITION, CONDITION)


def test_a_repeated_fault_writes_nothing_once_the_condition_says_so():
    """The same fault again, the condition already False with its message: no step (lastTransitionTime holds)."""
    [step] = repair_condition_steps([_fault(Action.REPLACE_GPU)], {})
    current = {CONDITION: ConditionState(False, str(step.details["message"]))}
    assert repair_condition_steps([_fault(Action.REPLACE_GPU)], current) == []


def test_a_reboot_request_keeps_the_condition_false():
    """A reset that did not recover (the agent asked for a reboot) needs the node rebooted: False."""
    [step] = repair_condition_steps([], {}, reboot_requested=True)
    assert step.kind is StepKind.CLEAR_CONDITION and "reboot requested" in step.reason


def test_the_planner_plans_the_condition_only_when_the_setting_is_on():
    """Off (the default): no AcceleratedHardwareReady step; on: the planner includes it."""
    v = fault(1, action=Action.REBOOT_NODE)
    off = plan([v], active_of(v), NodeState(), NODE, options=PlanOptions(node_name="node-1"))
    on = plan([v], active_of(v), NodeState(), NODE, options=PlanOptions(node_name="node-1", repair_condition=True))
    assert CONDITION not in {s.target for s in off}
    assert [s.kind for s in on if s.target == CONDITION] == [StepKind.CLEAR_CONDITION]
    assert Config().remediation.accelerated_hardware_condition is False

"""AcceleratedHardwareReady: False only while a fault needs the node rebooted or replaced, written so that
its lastTransitionTime holds across repeats (the planner's step), behind a setting (off by default)."""

from __future__ import annotations

from agent.config import Config
from agent.model import Action, Severity, StepKind
from agent.remediation.planner import PlanOptions, plan
from agent.remediation.repair_condition import CONDITION, repair_condition_steps
from agent.remediation.state import ActiveFault, ConditionState, NodeState
from tests.unit.test_planner import NODE, active_of, fault


def _fault(action: Action, gpu: str = "GPU-0", rule: str = "xid-79") -> ActiveFault:
    return ActiveFault(rule, gpu, Severity.FATAL, action, "summary", 0.0)


def test_a_fault_that_needs_a_reboot_sets_the_condition_false():
    """A reboot_node fault: one SET_CONDITION step (a problem reported) writing status False, naming GPU and rule."""
    [step] = repair_condition_steps([_fault(Action.REBOOT_NODE)], {})
    assert (step.kind, step.target, step.details["node_status"]) == (StepKind.SET_CONDITION, CONDITION, "False")
    assert "GPU-0: xid-79" in step.reason and step.details["reason"] == "AcceleratedHardwareNeedsRepair"


def test_a_fault_the_agent_repairs_itself_writes_nothing_on_a_healthy_node():
    """A reset or a quarantine is not a repair tool's business: no step while the condition reports no problem."""
    assert repair_condition_steps([_fault(Action.RESET_GPU), _fault(Action.QUARANTINE, "GPU-1")], {}) == []


def test_the_condition_turns_true_once_no_fault_needs_repair():
    """The problem reported earlier, now none: one CLEAR_CONDITION step writing status True."""
    [step] = repair_condition_steps([_fault(Action.RESET_GPU)], {CONDITION: ConditionState(True, "GPU-0: xid-79")})
    assert (step.kind, step.details["node_status"]) == (StepKind.CLEAR_CONDITION, "True")


def test_a_repeated_fault_writes_nothing_once_the_condition_says_so():
    """The same fault again, the problem already reported with its message: no step (lastTransitionTime holds)."""
    [step] = repair_condition_steps([_fault(Action.REPLACE_GPU)], {})
    current = {CONDITION: ConditionState(True, str(step.details["message"]))}
    assert repair_condition_steps([_fault(Action.REPLACE_GPU)], current) == []


def test_a_reboot_request_keeps_the_condition_false():
    """A reset that did not recover (the agent asked for a reboot) needs the node rebooted: False."""
    [step] = repair_condition_steps([], {}, reboot_requested=True)
    assert step.kind is StepKind.SET_CONDITION and "reboot requested" in step.reason


def test_the_planner_plans_the_condition_only_when_the_setting_is_on():
    """Off (the default): no AcceleratedHardwareReady step; on: the planner includes it."""
    v = fault(1, action=Action.REBOOT_NODE)
    off = plan([v], active_of(v), NodeState(), NODE, options=PlanOptions(node_name="node-1"))
    on = plan([v], active_of(v), NodeState(), NODE, options=PlanOptions(node_name="node-1", repair_condition=True))
    assert CONDITION not in {s.target for s in off}
    assert [s.kind for s in on if s.target == CONDITION] == [StepKind.SET_CONDITION]
    assert Config().remediation.accelerated_hardware_condition is False

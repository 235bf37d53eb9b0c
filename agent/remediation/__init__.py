"""Remediation logic: the planner (what to do) and the guard (whether it may be done now)."""

from agent.remediation.guard import AttemptHistory, ClusterView, Decision, GuardPolicy, Mode, decide
from agent.remediation.planner import ActiveFault, NodeState, PlanOptions, plan

__all__ = [
    "ActiveFault",
    "AttemptHistory",
    "ClusterView",
    "Decision",
    "GuardPolicy",
    "Mode",
    "NodeState",
    "PlanOptions",
    "decide",
    "plan",
]

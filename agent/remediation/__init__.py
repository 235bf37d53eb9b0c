"""Remediation logic: the planner (what to do) and the guard (whether it may be done now)."""

from agent.remediation.guard import (
    AttemptHistory,
    ClusterView,
    Decision,
    GateReading,
    GuardPolicy,
    Mode,
    decide,
    needs_gate,
)
from agent.remediation.planner import PlanOptions, plan
from agent.remediation.state import ActiveFault, NodeState

__all__ = [
    "ActiveFault",
    "AttemptHistory",
    "ClusterView",
    "Decision",
    "GateReading",
    "GuardPolicy",
    "Mode",
    "NodeState",
    "PlanOptions",
    "decide",
    "needs_gate",
    "plan",
]

"""AcceleratedHardwareReady, for node-repair tools: False only while a fault needs a node reboot or replacement."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from agent.model import Action, Step, StepKind, frozen_attrs

#: Karpenter's node repair watches this type on AWS (False for 10 minutes: the node is replaced);
#: Cluster API's MachineHealthCheck and medik8s NHC take any condition type (docs/operations.md).
CONDITION = "AcceleratedHardwareReady"
READY_REASON = "AcceleratedHardwareHealthy"
FAULT_REASON = "AcceleratedHardwareNeedsRepair"
#: The actions a repair tool's answer (reboot or replace the node) fits; a reset, a drain or a quarantine
#: alone is the agent's own work and leaves the condition True.
REPAIR_ACTIONS = frozenset({Action.REBOOT_NODE, Action.REPLACE_GPU})
_READY_MESSAGE = "no GPU fault needs the node rebooted or replaced"


class _Fault(Protocol):
    @property
    def action(self) -> Action: ...
    @property
    def gpu_key(self) -> str: ...
    @property
    def rule_id(self) -> str: ...


class _Condition(Protocol):
    @property
    def status(self) -> bool: ...
    @property
    def message(self) -> str: ...


def repair_message(faults: Iterable[_Fault], reboot_requested: bool) -> str:
    """Why the node needs repair: each fault's GPU and rule, at most 1 KiB; empty when nothing does."""
    parts = sorted({f"{f.gpu_key}: {f.rule_id} ({f.action})" for f in faults if f.action in REPAIR_ACTIONS})
    if reboot_requested:
        parts.append("reboot requested (a GPU reset did not recover it)")
    message = "; ".join(parts)
    return message if len(message) <= 1024 else message[:1020] + " ..."


def repair_condition_steps(faults: Iterable[_Fault], conditions: Mapping[str, _Condition], *,
                           reboot_requested: bool = False) -> list[Step]:
    """The step that moves AcceleratedHardwareReady to what the active faults say (none when it already
    says so). As for the agent's own conditions, SET_CONDITION reports the problem (here: status False,
    allowed in quarantine mode) and CLEAR_CONDITION withdraws it (status True; an absent condition stays
    absent); `conditions` holds whether each reports a problem. The node writer keeps lastTransitionTime
    while the status holds, so a repeated fault or a restarted agent changes at most the message."""
    message = repair_message(faults, reboot_requested)
    current = conditions.get(CONDITION)
    if message:
        if current is None or not current.status or current.message != message:
            return [Step(StepKind.SET_CONDITION, CONDITION, message,
                         details=frozen_attrs({"reason": FAULT_REASON, "message": message, "node_status": "False"}))]
    elif current is not None and current.status:
        return [Step(StepKind.CLEAR_CONDITION, CONDITION, _READY_MESSAGE,
                     details=frozen_attrs({"reason": READY_REASON, "message": _READY_MESSAGE, "node_status": "True"}))]
    return []

"""The Node-mark steps of one pass that wait for its one Node write, and the record's marks they changed."""

from __future__ import annotations

import dataclasses

from agent.control.shared import Shared
from agent.model import ActionRecord, StepKind, StepResult
from agent.remediation.state import ConditionState

#: Steps that only change the agent's marks on the Node: the guard decides each, their writes wait for the
#: pass's one Node write (StepRunner.flush_node), and they are journaled with what that write answered.
NODE_MARKS = frozenset({StepKind.SET_CONDITION, StepKind.CLEAR_CONDITION, StepKind.TAINT, StepKind.UNTAINT,
                        StepKind.REBOOT_REQUEST, StepKind.CLEAR_REBOOT_REQUEST, StepKind.MARK_REPLACEMENT,
                        StepKind.UNMARK_REPLACEMENT})
#: The marks a step that acts on the node's work (an eviction, a reset) must find written first.
_TAINTS = frozenset({StepKind.TAINT, StepKind.UNTAINT})
#: The record's Node marks (conditions, taint, reboot request, replacement, quarantine start).
_Marks = tuple[dict[str, ConditionState], bool, bool, set[str], float]


class WaitingMarks:
    """The steps the guard let past whose Node write waits for the pass's, already taken into the record, and
    the record's marks as they were before the first of them: what a refused write puts back."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.steps: list[ActionRecord] = []
        self._before: _Marks | None = None

    @property
    def taint(self) -> bool:
        """Whether the taint (or its removal) is among them."""
        return any(a.step.kind in _TAINTS for a in self.steps)

    def keep_marks(self) -> None:
        """Before a waiting step changes the record's marks (the caller holds the shared lock): the marks as
        they are, once a batch."""
        if self._before is None:
            node = self.shared.record.node
            self._before = (dict(node.conditions), node.tainted, node.reboot_requested, set(node.replacement),
                            node.quarantined_since)

    def settle(self, error: str) -> list[ActionRecord]:
        """The waiting steps with the write's answer: as they were, or failed with its refusal, the record's
        marks put back (so the next pass plans them again)."""
        steps, self.steps = self.steps, []
        if error:
            self._restore()
        self._before = None
        return [dataclasses.replace(a, result=StepResult.FAILED, message=error) if error else a for a in steps]

    def drop(self) -> None:
        """A pass cut short left them unwritten: the record forgets them."""
        if self.steps:
            self._restore()
        self.steps, self._before = [], None

    def _restore(self) -> None:
        if self._before is None:
            return
        with self.shared.lock:
            node = self.shared.record.node
            node.conditions, node.tainted, node.reboot_requested, node.replacement, node.quarantined_since = \
                self._before
            self.shared.save()

"""The control part's seams: the actuator and the cluster gate it acts through, their local stand-ins, the outcome."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from agent.model import ActionRecord, Step, StepResult, Verdict
from agent.remediation import GateReading
from agent.remediation.record import NodeObservation


class Actuator(Protocol):
    """Carries out steps on the node and reads it back. Raises nothing it can report."""

    def apply(self, step: Step) -> tuple[StepResult, str]: ...

    def observe(self, devices: bool = True) -> NodeObservation | None:
        """The real Node now (with `devices`, the per-GPU isolation's too; without, the last view stands);
        None where there is no cluster (local mode)."""
        ...

    def mirror(self, document: Mapping[str, object]) -> None:
        """Write the record to the Node (read-compare-patch)."""
        ...

    def consume_release(self, value: str) -> None:
        """Remove an operator's release request once it is in the durable record."""
        ...

    def consume_confirm(self, value: str) -> None:
        """Remove an operator's confirm of a braked taint once it is used, unused or expired."""
        ...

    def begin_batch(self) -> None:
        """A pass starts: the Node marks its steps, label and mirror ask for wait for `write_node`."""
        ...

    def write_node(self) -> str:
        """The waiting Node marks in one write (two where both the taint and a condition change); the
        refusal as one line, "" when written or when there was nothing to write."""
        ...


class ClusterGate(Protocol):
    """The cluster-wide disruption budget and pause: read once in a pass that has a disruptive step for the
    guard to decide; written (the slot taken, renewed, given back) only after the guard let the step past."""

    @property
    def maybe_held(self) -> bool:
        """Whether a slot this gate wrote may still be on the server unconfirmed: the pipeline then gives it
        back."""
        ...

    @property
    def lingering(self) -> bool:
        """Whether a released slot is kept for the rate bound's window: the pipeline calls release until it is
        gone."""
        ...

    def read(self) -> GateReading:
        """The pause and the budget's live slots; raises when the cluster cannot be read."""
        ...

    def acquire(self, rules: frozenset[str] = frozenset()) -> GateReading:
        """Take or renew this node's slot for the faults of `rules`; `held` False when the budget is spent
        (nothing is kept)."""
        ...

    def release(self) -> None: ...

    def show(self, holding: bool) -> None:
        """Make the node's disruption label say whether the node holds a slot."""
        ...


class LocalActuator:
    """Local mode (no cluster): every allowed step is recorded as planned, nothing is touched."""

    def apply(self, step: Step) -> tuple[StepResult, str]:
        return StepResult.PLANNED, "local mode: no cluster to act on"

    def observe(self, devices: bool = True) -> NodeObservation | None:
        return None

    def mirror(self, document: Mapping[str, object]) -> None:
        return None

    def consume_release(self, value: str) -> None:
        return None

    def consume_confirm(self, value: str) -> None:
        return None

    def begin_batch(self) -> None:
        return None

    def write_node(self) -> str:
        return ""


class LocalGate:
    """Local mode: a single node is its own cluster, so the budget is always there."""

    maybe_held = False
    lingering = False

    def read(self) -> GateReading:
        return GateReading()

    def acquire(self, rules: frozenset[str] = frozenset()) -> GateReading:
        return GateReading(held=True)

    def release(self) -> None:
        return None

    def show(self, holding: bool) -> None:
        return None


@dataclass(slots=True)
class Outcome:
    verdicts: list[Verdict] = field(default_factory=list)
    actions: list[ActionRecord] = field(default_factory=list)

    def extend(self, other: Outcome) -> None:
        self.verdicts.extend(other.verdicts)
        self.actions.extend(other.actions)

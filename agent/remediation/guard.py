"""Decides whether a planned step may run: mode, dry-run, opt-out, fleet holds, quarantine brake, pause,
cluster budget, attempt caps.

Pure: the caller passes what it knows of the cluster (opted out, and one reading of the cluster gate: the
pause Lease and the budget's live slots) and the history of attempts; the guard never blocks clearing, and
never lets a disruptive step past a pause, an unreadable gate, an exhausted budget or its rate bound. `needs_gate` says
whether a step gets as far as the gate, so the caller reads the cluster only for a step that may use it.
The fleet's word (agent.fleet.node_side.FleetView) comes as plain data: the faults a hold covers, which
`held_back` plans as notify-only (conditions and Events stay, no taint, eviction, reset or reboot), and why
the quarantine brake keeps a new taint waiting.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, TypeVar

from agent.model import Action, FaultClass, Step, StepKind, StepResult

if TYPE_CHECKING:
    from agent.remediation.state import ActiveFault, NodeState

K = TypeVar("K")
#: What a quarantining fault's condition says while the brake keeps the node's taint waiting.
BRAKED = "quarantine brake: the taint waits, docs/fleet.md"


class Mode(StrEnum):
    """How far the agent may go: record only, keep new work off, or remediate."""

    OBSERVE = "observe"
    QUARANTINE = "quarantine"
    REMEDIATE = "remediate"


CAPPED_STEPS = frozenset({StepKind.RESET_GPU, StepKind.REBOOT_REQUEST, StepKind.RUN_DIAGNOSTIC})
_ALLOWED_BY_MODE = {
    Mode.OBSERVE: frozenset({StepKind.EVENT}),
    Mode.QUARANTINE: frozenset(
        {StepKind.EVENT, StepKind.SET_CONDITION, StepKind.TAINT, StepKind.TAINT_DEVICE, StepKind.MARK_REPLACEMENT}
    ),
    Mode.REMEDIATE: frozenset(StepKind),
}


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    mode: Mode = Mode.QUARANTINE
    dry_run: bool = False
    max_attempts_per_hour: int = 3
    cooldown_seconds: float = 300.0


@dataclass(frozen=True, slots=True)
class GateReading:
    """One read of the cluster gate: the pause Lease, the budget's live slots, whether this node holds one."""

    paused: bool = False
    held: bool = False
    in_use: int = 0
    limit: int = 1
    #: Why the gate could not be read (after the retries); empty when it was.
    error: str = ""
    #: The rate bound: other nodes newly disrupted within the window (ranked ahead of this node's take), and
    #: the most there may be (0: no rate bound).
    recent: int = 0
    rate: int = 0

    @property
    def budget_available(self) -> bool:
        return self.held or self.in_use < self.limit

    @property
    def rate_available(self) -> bool:
        """A held slot is no new disruption; a new take needs fewer than `rate` taken ahead of it."""
        return self.held or self.rate <= 0 or self.recent < self.rate


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What the caller learnt from the cluster just before acting; `gate` is None when it was not read."""

    opted_out: bool = False
    gate: GateReading | None = None
    #: Why the quarantine brake keeps a new taint of this node waiting; "" when it does not.
    brake: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    """None as result means: go ahead and apply the step."""

    step: Step
    result: StepResult | None
    reason: str = ""
    #: Blocked by the cluster gate (pause, unreadable, budget spent): the caller backs off before asking again.
    by_gate: bool = False

    @property
    def proceed(self) -> bool:
        return self.result is None


@dataclass(slots=True)
class AttemptHistory:
    """When each disruptive step (kind, target) was last attempted; bounded per key."""

    attempts: dict[tuple[StepKind, str], deque[float]] = field(default_factory=dict)

    def record(self, step: Step, at: float) -> None:
        times = self.attempts.setdefault((step.kind, step.target), deque(maxlen=32))
        times.append(at)

    def recent(self, step: Step, now: float, within: float) -> list[float]:
        return [t for t in self.attempts.get((step.kind, step.target), ()) if now - t < within]


def needs_gate(step: Step, *, policy: GuardPolicy, opted_out: bool) -> bool:
    """Whether `decide` asks the cluster gate about `step`: a disruptive step that mode, dry-run and opt-out
    let past. Only then is the gate worth a read."""
    return _before_gate(step, policy=policy, opted_out=opted_out) is None


def _before_gate(step: Step, *, policy: GuardPolicy, opted_out: bool) -> Decision | None:
    if policy.dry_run:
        return Decision(step, StepResult.DRY_RUN, "dry-run: recorded what would be done")
    if step.kind.clearing:
        return Decision(step, None, "clearing is never blocked")
    if step.kind not in _ALLOWED_BY_MODE[policy.mode]:
        return Decision(step, StepResult.SKIPPED, f"mode {policy.mode} does not {step.kind}")
    if step.disruptive and policy.mode is not Mode.REMEDIATE:
        return Decision(step, StepResult.SKIPPED, f"mode {policy.mode} does not take pods off with NoExecute")
    if opted_out and step.kind is not StepKind.EVENT:
        return Decision(step, StepResult.SKIPPED, "node opted out of remediation by label")
    if not step.disruptive:
        return Decision(step, None)
    return None


def decide(step: Step, *, policy: GuardPolicy, cluster: ClusterView, history: AttemptHistory,
           now: float) -> Decision:
    """Whether `step` may run now, and if not, what to record instead and why."""
    early = _before_gate(step, policy=policy, opted_out=cluster.opted_out)
    if cluster.brake and quarantines(step) and (early is None or early.proceed):
        return Decision(step, StepResult.BLOCKED, cluster.brake)
    if early is not None:
        return early
    if refusal := _gate_closed(cluster.gate):
        return Decision(step, StepResult.BLOCKED, refusal, by_gate=True)
    recent = history.recent(step, now, 3600.0) if step.kind in CAPPED_STEPS else []
    if len(recent) >= policy.max_attempts_per_hour:
        return Decision(step, StepResult.BLOCKED,
                        f"attempt cap: {len(recent)} {step.kind} attempts on {step.target} within the hour")
    if recent and now - max(recent) < policy.cooldown_seconds:
        return Decision(step, StepResult.BLOCKED, f"cooldown: last {step.kind} on {step.target} too recent")
    if refusal := _gate_full(cluster.gate):
        return Decision(step, StepResult.BLOCKED, refusal, by_gate=True)
    return Decision(step, None)


def gate_refusal(gate: GateReading | None) -> str:
    """Why a gate reading refuses a disruptive step ("" when it lets it past): what the write that takes a
    slot reports back, in the words `decide` uses for the same reading."""
    return _gate_closed(gate) or _gate_full(gate)


def _gate_closed(gate: GateReading | None) -> str:
    if gate is None:
        return "disruption budget not read"
    if gate.error:
        return f"disruption budget unreadable: {gate.error}"
    if gate.paused:
        return "remediation paused cluster-wide"
    return ""


def _gate_full(gate: GateReading | None) -> str:
    if gate is None:
        return "disruption budget not read"
    if not gate.budget_available:
        return "cluster-wide disruption budget exhausted"
    if not gate.rate_available:
        return (f"cluster-wide disruption rate bound reached: {gate.recent} nodes newly disrupted within the hour "
                f"(at most {gate.rate})")
    return ""



def node_writes_refused(*, policy: GuardPolicy, cluster: ClusterView) -> str:
    """Why the agent's own bookkeeping may not be written to the Node (the record mirrored into its
    annotation, a release request consumed), or "" when it may: a dry run writes nothing to the Node, and an
    opted-out node gets Events only."""
    if policy.dry_run:
        return "dry-run: nothing is written to the Node"
    if cluster.opted_out:
        return "node opted out of remediation by label: Events only"
    return ""


def disrupted(node: NodeState, active: Collection[str], *, policy: GuardPolicy, opted_out: bool) -> bool:
    """Whether the node counts as disrupted, and so holds its budget slot: only where the agent acts
    (remediate mode, no dry run, not opted out), while a reboot is requested, pods were evicted off a GPU
    whose fault is still active (`active`: their GPU keys), or a NoExecute device taint removes a GPU's pods
    as an eviction would."""
    acting = policy.mode is Mode.REMEDIATE and not policy.dry_run and not opted_out
    return acting and (node.reboot_requested or any(node.evicted.get(k) for k in active) or
                       any(m.effect == "NoExecute" for m in node.device_taints.values()))


def quarantines(step: Step) -> bool:
    """A new taint (the node's, or a device's that keeps work off it): what the quarantine brake counts."""
    return step.kind is StepKind.TAINT or (step.kind is StepKind.TAINT_DEVICE and
                                           step.details.get("effect") in {"NoSchedule", "NoExecute"})


def held_back(faults: Mapping[K, ActiveFault], held: Mapping[tuple[str, str], str], *,
              braked: bool = False, judged: Collection[tuple[str, str]] | None = None) -> dict[K, ActiveFault]:
    """The faults as the planner sees them: one a fleet hold covers keeps its severity (its condition and
    Events) and says why it is held, but asks for nothing (no taint, eviction, reset or reboot request); a
    hardware fault is never held back, whatever the hold says. While the quarantine brake keeps the node's
    new taint waiting (`braked`), each fault that quarantines says so in its condition. A fault the fleet
    view was not read for (not in `judged`: recorded after the read) asks for nothing yet, whatever its class:
    the pass reads the view again for it at once (Reconciler._taint_first), so it neither slips past a hold,
    the settle or the brake, nor waits for long; its condition and Events go as ever."""
    planned: dict[K, ActiveFault] = {}
    for key, fault in faults.items():
        why = held.get((fault.gpu_key, fault.rule_id))
        if judged is not None and (fault.gpu_key, fault.rule_id) not in judged and \
                (fault.action.quarantines or fault.action.resets):
            planned[key] = dataclasses.replace(fault, action=Action.NOTIFY)
        elif why and fault.fault_class is not FaultClass.HARDWARE:
            planned[key] = dataclasses.replace(fault, action=Action.NOTIFY, summary=f"{fault.summary} ({why})")
        elif braked and fault.action.quarantines:
            planned[key] = dataclasses.replace(fault, summary=f"{fault.summary} ({BRAKED})")
        else:
            planned[key] = fault
    return planned

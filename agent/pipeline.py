"""One pass of the data flow: observation -> engine -> planner -> guard -> actuator -> records.

Shared by the daemon (real time, real sources) and `simulate` (virtual clock, scenario source), so
what a scenario shows is what the agent does.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from agent.engine import EngineState, RuleSet, evaluate, restore, tick
from agent.journal import Journal
from agent.metrics import Metrics
from agent.model import (
    NODE_KEY,
    Action,
    ActionRecord,
    GpuRef,
    NodeInventory,
    Observation,
    PodRef,
    Severity,
    Signal,
    Step,
    StepKind,
    StepResult,
    Verdict,
    VerdictKind,
    frozen_attrs,
)
from agent.remediation import (
    ActiveFault,
    AttemptHistory,
    ClusterView,
    GuardPolicy,
    NodeState,
    PlanOptions,
    decide,
    plan,
)
from agent.remediation.planner import next_settled

BOOT_CURSOR = "boot_id"
NODE_STATE_CURSOR = "node_state"
_FOLLOW_UP_PASSES = 2
_TOOK_EFFECT = frozenset({StepResult.APPLIED, StepResult.PLANNED, StepResult.DRY_RUN})


class Actuator(Protocol):
    """Carries out one step; returns the result and a message. Raises nothing it can report."""

    def apply(self, step: Step) -> tuple[StepResult, str]: ...

    def persist(self, node: NodeState, active: dict[tuple[str, str], ActiveFault]) -> None: ...


class ClusterGate(Protocol):
    """What the cluster says right now about a step: budget, pause, opt-out."""

    def view(self, step: Step) -> ClusterView: ...


class LocalActuator:
    """Local mode (no cluster): every allowed step is recorded as planned, nothing is touched."""

    def apply(self, step: Step) -> tuple[StepResult, str]:
        return StepResult.PLANNED, "local mode: no cluster to act on"

    def persist(self, node: NodeState, active: dict[tuple[str, str], ActiveFault]) -> None:
        return None


class LocalGate:
    """Local mode: a single node is its own cluster, so the budget is always there."""

    def view(self, step: Step) -> ClusterView:
        return ClusterView()


@dataclass(slots=True)
class Outcome:
    verdicts: list[Verdict] = field(default_factory=list)
    actions: list[ActionRecord] = field(default_factory=list)

    def extend(self, other: Outcome) -> None:
        self.verdicts.extend(other.verdicts)
        self.actions.extend(other.actions)


class Pipeline:
    """Holds the engine state, the node state and the attempt history of one node."""

    def __init__(
        self,
        *,
        rules: RuleSet,
        inventory: NodeInventory,
        policy: GuardPolicy,
        actuator: Actuator | None = None,
        gate: ClusterGate | None = None,
        journal: Journal | None = None,
        metrics: Metrics | None = None,
        node_state: NodeState | None = None,
        clock: Callable[[], float] = time.time,
        retry_seconds: float = 30.0,
        own_pod: str = "",
        pods: Callable[[], tuple[PodRef, ...]] | None = None,
        max_faulty_gpus: int = 2,
        replace_after_recoveries: int = 2,
        reset_settle_seconds: float = 10.0,
    ) -> None:
        self.rules = rules
        self.inventory = inventory
        self.policy = policy
        self.actuator: Actuator = actuator or LocalActuator()
        self.gate: ClusterGate = gate or LocalGate()
        self.journal = journal
        self.metrics = metrics
        self.node = node_state or NodeState()
        self.clock = clock
        self.retry_seconds = retry_seconds
        self.engine = EngineState()
        self.history = AttemptHistory()
        self.active: dict[tuple[str, str], ActiveFault] = {}
        self._options = PlanOptions(node_name=inventory.name, own_pod=own_pod, max_faulty_gpus=max_faulty_gpus,
                                    reset_settle_seconds=reset_settle_seconds)
        self.pods = pods
        self.replace_after_recoveries = replace_after_recoveries
        self._pending_events: list[Step] = []
        self._replan_at: float | None = None
        self._metrics_primed = False
        self._log = structlog.get_logger("agent.pipeline").bind(node=inventory.name)
        if journal is not None:
            if node_state is None:
                self.node = _saved_node_state(journal)
            self._restore(journal.active_faults(inventory.name))

    def restore_from_node(self, verdicts: list[Verdict]) -> None:
        """Faults the Node's state annotation holds (the truth across restarts) that the journal lacks."""
        self._restore([v for v in verdicts if (v.gpu_key, v.rule_id) not in self.active])

    def _restore(self, verdicts: list[Verdict]) -> None:
        known = [v for v in verdicts if self.rules.get(v.rule_id) is not None]
        restore(self.engine, known)
        if self.journal is not None and not self.engine.boot_id:
            self.engine.boot_id = self.journal.cursor(BOOT_CURSOR) or ""
        for verdict in known:
            self.active[(verdict.gpu_key, verdict.rule_id)] = ActiveFault.from_verdict(verdict)
        if known:
            self._replan_at = 0.0
            self._log.info("faults_restored", count=len(known))

    def handle(self, observation: Observation, now: float | None = None) -> Outcome:
        """Classify one observation and act on what it changes."""
        now = self.clock() if now is None else now
        if observation.gpu is not None:
            self._learn(observation.gpu)
            observation = dataclasses.replace(observation, gpu=self.inventory.resolve(observation.gpu))
        if self.metrics:
            self.metrics.observed(observation)
        verdicts = evaluate(observation, self.engine, now, rules=self.rules)
        if observation.signal is Signal.BOOT and self.journal is not None and self.engine.boot_id:
            self._safely("journal_boot_failed", self.journal.set_cursor, BOOT_CURSOR, self.engine.boot_id)
        return self._after(verdicts, now, latency_from=observation.at)

    def tick(self, now: float | None = None) -> Outcome:
        """Let time pass: quiet windows may clear faults; blocked steps are retried."""
        now = self.clock() if now is None else now
        verdicts = tick(self.engine, now, rules=self.rules)
        if verdicts or (self._replan_at is not None and now >= self._replan_at):
            return self._after(verdicts, now, latency_from=None)
        return Outcome()

    def replace_rules(self, rules: RuleSet) -> None:
        self.rules = rules
        if self.metrics:
            self.metrics.rules_loaded.set(len(rules.rules))

    def _learn(self, gpu: GpuRef) -> None:
        """A source that knows a GPU's whole identity (NVML, DCGM) teaches it to the inventory, so a
        kernel-log record that names only the PCI bus id is resolved to the same GPU."""
        if not gpu.uuid or not gpu.pci_bus_id or gpu.mig_parent_uuid or gpu.index is None:
            return
        if any(known.uuid == gpu.uuid for known in self.inventory.gpus):
            return
        gpus = tuple(sorted((*self.inventory.gpus, gpu), key=lambda g: (g.index is None, g.index or 0)))
        self.inventory = dataclasses.replace(self.inventory, gpus=gpus)
        self._metrics_primed = False

    def occurrences(self, gpu_key: str, rule_id: str) -> int:
        state = self.engine.rules.get((gpu_key, rule_id))
        return state.occurrences if state else 0

    def gpu_statuses(self) -> dict[str, str]:
        """healthy | degraded | fatal | unknown for every GPU of the inventory and every faulty key."""
        statuses = {gpu.key: "healthy" for gpu in self.inventory.gpus}
        for fault in self.active.values():
            status = _status_of(fault.severity)
            keys = list(statuses) if fault.gpu_key == NODE_KEY else [fault.gpu_key]
            for key in keys:
                if _STATUS_RANK[status] > _STATUS_RANK[statuses.get(key, "healthy")]:
                    statuses[key] = status
        return statuses

    def _after(self, verdicts: list[Verdict], now: float, latency_from: float | None) -> Outcome:
        verdicts = [self._escalate(v) for v in verdicts]
        for verdict in verdicts:
            self._record_verdict(verdict, now, latency_from)
        evicting = [v for v in verdicts if v.kind is VerdictKind.FAULT and v.action.rank >= Action.RESET_WHEN_IDLE.rank]
        if self.pods is not None and evicting:
            self.refresh_pods()
        self.node.forget_cleared({key for key, _ in self.active})
        steps = [*self._pending_events, *plan(verdicts, self.active, self.node, self.inventory,
                                              options=self._options, now=now)]
        self._pending_events = []
        actions = [self._carry_out(step, now) for step in steps]
        for _ in range(_FOLLOW_UP_PASSES):
            # Steps that wait on others (a reset waits for the GPU's pods to be gone) come in a further pass.
            if not any(a.result in _TOOK_EFFECT and a.step.kind is StepKind.EVICT for a in actions[-len(steps):]):
                break
            steps = plan([], self.active, self.node, self.inventory, options=self._options, now=now)
            if not steps:
                break
            actions += [self._carry_out(step, now) for step in steps]
        # An Event the API refused is sent again on the next pass (bounded), not lost.
        self._pending_events = [a.step for a in actions
                                if a.step.kind is StepKind.EVENT and a.result is StepResult.FAILED][-100:]
        if actions:
            self._safely("persist_failed", self.actuator.persist, self.node, self.active)
            if self.journal is not None:
                self._safely("journal_state_failed", self.journal.set_cursor, NODE_STATE_CURSOR,
                             json.dumps(self.node.to_json(), sort_keys=True))
        tainted = any(a.step.kind is StepKind.TAINT and a.result is StepResult.APPLIED for a in actions)
        if tainted and latency_from is not None and self.metrics:
            self.metrics.detection_to_quarantine.observe(max(0.0, self.clock() - latency_from))
        for action in actions:
            if action.step.kind is StepKind.RESET_GPU and action.result is StepResult.APPLIED:
                # The reset command succeeded: that is the verified reset the reset-recovery rules wait for.
                gpu = self.inventory.gpu_by_key(action.step.gpu_key)
                reset = Observation(Signal.GPU_RESET, 1, now, "remediation", gpu, frozen_attrs({"by": "agent"}))
                more = evaluate(reset, self.engine, now, rules=self.rules)
                if more:
                    follow = self._after(more, now, latency_from=None)
                    verdicts, actions = [*verdicts, *follow.verdicts], [*actions, *follow.actions]
        retry = any(a.result in {StepResult.BLOCKED, StepResult.FAILED} for a in actions) or bool(self._pending_events)
        self._replan_at = now + self.retry_seconds if retry else None
        settled = next_settled(self.active.values(), self.node, self._options, now)
        if settled is not None:
            self._replan_at = min(settled, self._replan_at) if self._replan_at is not None else settled
        if self.metrics and (verdicts or actions or not self._metrics_primed):
            self._metrics_primed = True
            self.metrics.set_gpu_status(self.gpu_statuses())
            self.metrics.set_active([f.severity for f in self.active.values()])
        return Outcome(verdicts, actions)

    def _escalate(self, verdict: Verdict) -> Verdict:
        """A fault that comes back after N verified recoveries of the same GPU needs replacing."""
        if verdict.kind is VerdictKind.CLEARED:
            why = str(verdict.evidence.get("why", ""))
            if why in {"verified GPU reset", "new boot"} and verdict.action.quarantines:
                self.node.recoveries[verdict.gpu_key] = self.node.recoveries.get(verdict.gpu_key, 0) + 1
            return verdict
        count = self.node.recoveries.get(verdict.gpu_key, 0)
        if not verdict.action.quarantines or count < self.replace_after_recoveries or \
                verdict.action is Action.REPLACE_GPU:
            return verdict
        evidence = {**verdict.evidence, "recoveries": count, "escalated_from": str(verdict.action)}
        return dataclasses.replace(verdict, action=Action.REPLACE_GPU, evidence=frozen_attrs(evidence),
                                   summary=f"{verdict.summary} (returned after {count} verified recoveries: "
                                           "needs replacement)")

    def refresh_pods(self) -> None:
        if self.pods is None:
            return
        try:
            pods = self.pods()
        except Exception as exc:  # noqa: BLE001 - an unreadable pod list keeps the last one
            self._log.warning("pods_refresh_failed", error=str(exc))
            return
        self.inventory = dataclasses.replace(self.inventory, pods=pods)

    def _record_verdict(self, verdict: Verdict, now: float, latency_from: float | None) -> None:
        key = (verdict.gpu_key, verdict.rule_id)
        if verdict.kind is VerdictKind.FAULT:
            self.active[key] = ActiveFault.from_verdict(verdict)
        else:
            ended = self.active.pop(key, None)
            if ended is not None and ended.action.quarantines and self.metrics:
                self.metrics.time_to_recovery.observe(max(0.0, now - ended.since))
        log = self._log.bind(gpu=verdict.gpu_key, rule_id=verdict.rule_id)
        level = "warning" if verdict.kind is VerdictKind.FAULT and verdict.severity.rank >= Severity.WARNING.rank \
            else "info"
        getattr(log, level)("verdict", kind=str(verdict.kind), severity=str(verdict.severity),
                            action=str(verdict.action), fault_class=str(verdict.fault_class),
                            summary=verdict.summary)
        if self.journal:
            self._safely("journal_verdict_failed", self.journal.record_verdict, self.inventory.name, verdict)
        if self.metrics:
            latency = now - latency_from if latency_from is not None else None
            self.metrics.judged(verdict, latency)

    def _carry_out(self, step: Step, now: float) -> ActionRecord:
        try:
            cluster = self.gate.view(step) if step.kind.disruptive else ClusterView()
        except Exception as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
            cluster = ClusterView(budget_available=False)
            self._log.warning("cluster_view_failed", step=str(step.kind), error=str(exc))
        decision = decide(step, policy=self.policy, cluster=cluster, history=self.history, now=now)
        if decision.proceed:
            if step.kind.disruptive:
                self.history.record(step, now)
            try:
                result, message = self.actuator.apply(step)
            except Exception as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
                result, message = StepResult.FAILED, f"{type(exc).__name__}: {exc}"
                if self.metrics:
                    self.metrics.step_errors.labels(str(step.kind)).inc()
        else:
            result, message = decision.result or StepResult.SKIPPED, decision.reason
        if result in _TOOK_EFFECT:
            self.node.apply(step)
            if step.kind.disruptive:
                # Written at once, so a restart right after this step does not repeat it.
                self._safely("persist_failed", self.actuator.persist, self.node, self.active)
        record = ActionRecord(step=step, result=result, at=now, message=message)
        self._log.bind(gpu=step.gpu_key, rule_id=step.rule_id).info(
            "step", kind=str(step.kind), target=step.target, result=str(result), message=message)
        if self.journal:
            self._safely("journal_action_failed", self.journal.record_action, self.inventory.name, record)
        if self.metrics:
            self.metrics.acted(record)
        return record

    def _safely(self, event: str, func: Callable[..., Any], *args: Any) -> None:
        try:
            func(*args)
        except Exception as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
            self._log.error(event, error=str(exc))


def _saved_node_state(journal: Journal) -> NodeState:
    """What local mode last recorded of its remediation state (a cluster reads it from the Node instead)."""
    try:
        saved = json.loads(journal.cursor(NODE_STATE_CURSOR) or "{}")
    except ValueError:
        saved = {}
    return NodeState.from_json(saved if isinstance(saved, dict) else {})


_STATUS_RANK = {"healthy": 0, "unknown": 1, "degraded": 2, "fatal": 3}


def _status_of(severity: Severity) -> str:
    if severity is Severity.FATAL:
        return "fatal"
    if severity is Severity.DEGRADED:
        return "degraded"
    if severity is Severity.UNKNOWN:
        return "unknown"
    return "healthy"

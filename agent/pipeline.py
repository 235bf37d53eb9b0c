"""One node's data flow: observation -> engine -> durable record; record -> planner -> guard -> actuator.

Two halves that share one `NodeRecord` under a lock. `handle` and `tick` classify and write the record
(local, fast, never an API call) and acknowledge the input with it. `reconcile` is level-triggered: it
reads the real Node, computes what the record calls for (conditions, taint, evictions, reset, reboot
request, replacement mark, budget slot, owed Events, the mirrored record) and converges. The daemon runs
`reconcile` on its own thread, so a slow or hung API server never stops detection; `simulate` and the
tests run it inline after each change, so what a scenario shows is what the agent does.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.diagnostics import DiagnosticOutcome, outcome_of
from agent.drill import DRILL_PREFIX, DRILL_SECONDS, contain
from agent.engine import EngineState, RuleSet, evaluate, restore, tick
from agent.journal import Journal
from agent.logs import get_logger
from agent.metrics import Metrics
from agent.model import (
    LIFECYCLE_SIGNALS,
    NODE_KEY,
    Action,
    ActionRecord,
    AttrValue,
    FaultClass,
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
    new_observation,
    normalise_pci,
)
from agent.remediation import (
    ActiveFault,
    AttemptHistory,
    ClusterView,
    Decision,
    GateReading,
    GuardPolicy,
    Mode,
    NodeState,
    PlanOptions,
    decide,
    needs_gate,
    plan,
)
from agent.remediation.guard import node_writes_refused
from agent.remediation.planner import next_settled, pods_on_faulty_gpus, verdict_events
from agent.remediation.record import NodeObservation, NodeRecord, OwedEvent, is_truncated, mirror_of
from agent.remediation.recoveries import family_of
from agent.remediation.resets import reset_by_driver_log, unclean
from agent.remediation.spread import APPLICATION_XIDS, LocationRepeats, WorkloadSpread
from agent.sources.checkpoint import InputCheckpoint
from agent.sources.kmsg import KernelLogCheckpoint

BOOT_CURSOR = "boot_id"
#: Why a fault cleared whose recovery the driver reported done (no reset): not a recovery of the GPU's hardware.
DRIVER_RECOVERED = "recovery reported done by the driver, verified by a clean poll"
NODE_STATE_CURSOR = "node_state"
_ROUNDS = 3
_RESET_WHEN_IDLE = frozenset({Action.RESET_WHEN_IDLE, Action.QUARANTINE_RESET_WHEN_IDLE})
_TOOK_EFFECT = frozenset({StepResult.APPLIED, StepResult.PLANNED, StepResult.DRY_RUN})


class Actuator(Protocol):
    """Carries out steps on the node and reads it back. Raises nothing it can report."""

    def apply(self, step: Step) -> tuple[StepResult, str]: ...

    def observe(self) -> NodeObservation | None:
        """The real Node now; None where there is no cluster (local mode)."""
        ...

    def mirror(self, document: Mapping[str, object]) -> None:
        """Write the record to the Node (read-compare-patch)."""
        ...

    def consume_release(self, value: str) -> None:
        """Remove an operator's release request once it is in the durable record."""
        ...


class ClusterGate(Protocol):
    """The cluster-wide disruption budget and pause: read once in a pass that has a disruptive step for the
    guard to decide; written (the slot taken, renewed, given back) only after the guard let the step past."""

    #: Whether a slot this gate wrote may still be on the server unconfirmed: the pipeline then gives it back.
    maybe_held: bool

    def read(self) -> GateReading:
        """The pause and the budget's live slots; raises when the cluster cannot be read."""
        ...

    def acquire(self) -> GateReading:
        """Take or renew this node's slot; `held` False when the budget is spent (nothing is kept)."""
        ...

    def release(self) -> None: ...

    def show(self, holding: bool) -> None:
        """Make the node's disruption label say whether the node holds a slot."""
        ...


class LocalActuator:
    """Local mode (no cluster): every allowed step is recorded as planned, nothing is touched."""

    def apply(self, step: Step) -> tuple[StepResult, str]:
        return StepResult.PLANNED, "local mode: no cluster to act on"

    def observe(self) -> NodeObservation | None:
        return None

    def mirror(self, document: Mapping[str, object]) -> None:
        return None

    def consume_release(self, value: str) -> None:
        return None


class LocalGate:
    """Local mode: a single node is its own cluster, so the budget is always there."""

    maybe_held = False

    def read(self) -> GateReading:
        return GateReading()

    def acquire(self) -> GateReading:
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


class Pipeline:
    """Holds the engine state and the durable record of one node, and reconciles the node to the record."""

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
        clock: Callable[[], float] = time.time,
        retry_seconds: float = 30.0,
        sync_seconds: float = 30.0,
        slot_renew_seconds: float = 600.0,
        own_pod: str = "",
        pods: Callable[[], tuple[PodRef, ...]] | None = None,
        max_faulty_gpus: int = 2,
        replace_after_recoveries: int = 2,
        reset_settle_seconds: float = 10.0,
        reset_verify_seconds: float = 300.0,
        recovery_window_days: float = 30.0,
        diagnose: bool = False,
        repair_condition: bool = False,
        diagnostic_available: bool | None = None,
        inline: bool = True,
        rng: random.Random | None = None,
        on_released: Callable[[Verdict], None] | None = None,
        checkpoints: Sequence[InputCheckpoint] | None = None,
    ) -> None:
        self.rules = rules
        #: The sources' input checkpoints (default: the kernel log's), each opaque: an observation that moves
        #: one is acknowledged in the journal transaction that records what it changed.
        self.checkpoints: tuple[InputCheckpoint, ...] = (tuple(checkpoints) if checkpoints is not None
                                                         else (KernelLogCheckpoint(),))
        #: Told of each fault an operator released, so a source can forget what it remembers of it (NVML's
        #: memory of a GPU the node had: released, a missing GPU must not come back at the next poll).
        self.on_released = on_released
        self.inventory = inventory
        self.policy = policy
        self.actuator: Actuator = actuator or LocalActuator()
        self.gate: ClusterGate = gate or LocalGate()
        self.journal = journal
        self.metrics = metrics
        self.clock = clock
        self.retry_seconds = retry_seconds
        self.sync_seconds = sync_seconds
        self.slot_renew_seconds = slot_renew_seconds
        self.engine = EngineState()
        self.spread = WorkloadSpread()
        self.locations = LocationRepeats()
        self.history = AttemptHistory()
        self._options = PlanOptions(node_name=inventory.name, own_pod=own_pod, max_faulty_gpus=max_faulty_gpus,
                                    reset_settle_seconds=reset_settle_seconds, pods_live=pods is not None,
                                    diagnose=diagnose, repair_condition=repair_condition)
        self.pods = pods
        #: A diagnostic can decide the repeat patterns (one is configured; a scenario may stand in for it).
        self.diagnostic_available = diagnose if diagnostic_available is None else diagnostic_available
        self.replace_after_recoveries = replace_after_recoveries
        self.recovery_window_seconds = recovery_window_days * 86400.0
        self.reset_verify_seconds = reset_verify_seconds
        self.inline = inline
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        #: Set whenever the record changed: the reconciler thread wakes on it.
        self.wake = threading.Event()
        #: Set, under the lock, with every verdict recorded: a pass under way drops what is left of a plan made
        #: before it, taints first where the verdict calls for it, and plans again (see _carry_out_plan).
        self._new_verdict = threading.Event()
        self._lock = threading.RLock()
        self._pass = threading.Lock()
        self._due_at = 0.0
        self._backoff_until = 0.0
        self._renewed_at: float | None = None
        #: This pass's one reading of the cluster gate (None until a step needs it).
        self._gate_reading: GateReading | None = None
        #: Whether this node holds its slot as far as this process knows (the label shows it).
        self._holding = False
        self._passes = 0
        self._pass_verdicts: list[Verdict] = []
        #: What the last plan that called for nothing was made from, and until when time cannot change it.
        self._quiet_plan: tuple[tuple[object, ...], float] | None = None
        self._metrics_primed = False
        #: Journal writes failing now, by kind, with the last error (empty when every kind's last write worked).
        self.journal_failing: Mapping[str, str] = {}
        self._journal_state = threading.Lock()
        #: Each step last skipped, and why: a skip is logged and journaled once per change, not every pass;
        #: and the skips this pass came to (a step no longer planned is forgotten at the end of the pass).
        self._skipped: dict[tuple[StepKind, str, str, str], str] = {}
        self._skipped_now: set[tuple[StepKind, str, str, str]] = set()
        #: The release request last handled where the guard refuses Node writes (it stays on the Node).
        self._release_handled = ""
        self._log = get_logger("agent.pipeline").bind(node=inventory.name)
        self.record, self.fresh = self._load(journal)
        self._restore_engine(list(self.record.faults.values()))
        self._merge_gpus(self.record.gpus)

    # ---- the record ----
    @property
    def active(self) -> dict[tuple[str, str], ActiveFault]:
        return self.record.faults

    @property
    def node(self) -> NodeState:
        return self.record.node

    def _load(self, journal: Journal | None) -> tuple[NodeRecord, bool]:
        """The journal's record; an older journal's active faults and node state; else a fresh record."""
        if journal is None:
            return NodeRecord(), True
        document = self._safely("journal_read_failed", journal.record, self.inventory.name)
        if isinstance(document, dict):
            record = NodeRecord.from_json(document)
            for checkpoint in self.checkpoints:
                written = self._safely("journal_read_failed", journal.cursor, checkpoint.name)
                if isinstance(written, str) and checkpoint.newer(written, record.cursors.get(checkpoint.name)):
                    record.cursors[checkpoint.name] = written  # acknowledged alone, after the record's last write
            return record, False
        record = NodeRecord()
        legacy = self._safely("journal_read_failed", journal.active_faults, self.inventory.name) or []
        for verdict in legacy:
            record.faults[(verdict.gpu_key, verdict.rule_id)] = self._fault_of(verdict)
        saved = self._safely("journal_read_failed", journal.cursor, NODE_STATE_CURSOR)
        try:
            state = json.loads(saved) if saved else {}
        except ValueError:
            state = {}
        record.node = NodeState.from_json(state if isinstance(state, dict) else {})
        for name in (BOOT_CURSOR, *(checkpoint.name for checkpoint in self.checkpoints)):
            value = self._safely("journal_read_failed", journal.cursor, name)
            if value:
                record.cursors[name] = str(value)
        return record, not (legacy or saved)

    def _restore_engine(self, faults: list[ActiveFault]) -> None:
        restore(self.engine, [f.to_verdict() for f in faults])
        for fault in faults:
            self._pin_recovery(fault)
        self.engine.boot_id = self.record.cursors.get(BOOT_CURSOR, self.engine.boot_id)
        if faults:
            self._log.info("faults_restored", count=len(faults))

    def _merge_gpus(self, gpus: tuple[GpuRef, ...]) -> None:
        known = {g.uuid for g in self.inventory.gpus}
        extra = tuple(g for g in gpus if g.uuid and g.uuid not in known)
        if extra:
            merged = sorted((*self.inventory.gpus, *extra), key=lambda g: (g.index is None, g.index or 0))
            self.inventory = dataclasses.replace(self.inventory, gpus=tuple(merged))

    def _save(self) -> None:
        """The record (and with it the input cursors) to the journal: before acknowledging, before acting."""
        self.record.generation += 1
        self.record.gpus = self.inventory.gpus
        if self.journal is not None:
            self._journaled("record", "journal_record_failed", self.journal.save_record, self.inventory.name,
                            self.record.to_json(), cursors=self.record.cursors)

    def _save_checkpoints(self, names: list[str]) -> None:
        """An input that changed nothing else is acknowledged by writing its checkpoint alone: one small
        transaction, not the whole record (a storm of distinct kernel-log lines wrote the whole record once a
        line)."""
        if self.journal is not None:
            self._journaled("record", "journal_record_failed", self.journal.set_cursors,
                            {name: self.record.cursors[name] for name in names})

    # ---- classification (never touches the API) ----
    def handle(self, observation: Observation, now: float | None = None) -> Outcome:
        """Classify one observation, record what it changes, acknowledge it; reconcile inline if configured."""
        now = self.clock() if now is None else now
        with self._lock:
            gpus_before = self.inventory.gpus
            verifying_before = dict(self.record.node.verifying)
            verdicts = self._classify(observation, now)
            acknowledged = self._acknowledge(observation)
            if verdicts or self.inventory.gpus != gpus_before or \
                    self.record.node.verifying != verifying_before or \
                    self.inventory.gpus != self.record.gpus:
                self._save()
            elif acknowledged:
                self._save_checkpoints(acknowledged)
        return self._after(verdicts, now)

    def tick(self, now: float | None = None) -> Outcome:
        """Let time pass: quiet windows may clear faults; a reconciliation pass runs when one is due."""
        now = self.clock() if now is None else now
        with self._lock:
            verdicts = [self._escalate(v) for v in [*tick(self.engine, now, rules=self.rules),
                                                   *self._orphans_quiet(now)]]
            for verdict in verdicts:
                self._record_verdict(verdict, now, None)
            verdicts += self._drills_ended(now)
            verdicts += self._resets_unverified(now)
            if verdicts:
                self._save()
        return self._after(verdicts, now)

    def _after(self, verdicts: list[Verdict], now: float) -> Outcome:
        if verdicts:
            self.wake.set()
        self._update_metrics(bool(verdicts))
        outcome = Outcome(verdicts, [])
        if self.inline and (verdicts or now >= self._due_at):
            outcome.extend(self.reconcile(now))
        return outcome

    def _classify(self, observation: Observation, now: float) -> list[Verdict]:
        replaced: list[Verdict] = []
        if observation.gpu is not None:
            replaced = self._board_replaced(self._learn(observation.gpu), observation.gpu, now)
            resolved = self.inventory.resolve(observation.gpu)
            if resolved is not observation.gpu:
                observation = new_observation(observation.signal, observation.value, observation.at,
                                              observation.source, resolved, observation.attrs, observation.count)
        if self.metrics:
            self.metrics.observed(observation)
        observation = self._not_the_gpus_if_elsewhere(observation)
        observation = self._repeat_facts(observation)
        observation = self._contained_if_so(observation)
        if observation.signal is Signal.OPERATOR_RELEASE and observation.source == "operator":
            self.record.node.recoveries.release(observation.gpu_key)
        previous_boot = self.engine.boot_id
        verdicts = evaluate(observation, self.engine, now, rules=self.rules)
        verdicts += self._orphan_clears(observation, previous_boot, now)
        if observation.signal is Signal.BOOT and self.engine.boot_id:
            self.record.cursors[BOOT_CURSOR] = self.engine.boot_id
        # A drill's verdict is held to notify (condition, Event, metrics) unless it was a full drill.
        verdicts = [contain(self._escalate(_in_family_of(v, observation))) for v in verdicts]
        for verdict in verdicts:
            self._record_verdict(verdict, now, observation.at)
        if observation.signal is Signal.OPERATOR_RELEASE and observation.source == "operator" and self.on_released:
            for verdict in verdicts:
                self._safely("release_hook_failed", self.on_released, verdict)
        return replaced + verdicts + self._verify_reset(observation, now) + self._diagnostic_passed(observation, now)

    def _diagnostic_passed(self, observation: Observation, now: float) -> list[Verdict]:
        """A passing diagnostic releases the GPU's faults that waited for one (recovery `diagnostic`)."""
        if observation.signal is not Signal.DIAGNOSTIC or observation.value != 1:
            return []
        key = observation.gpu_key
        verdicts: list[Verdict] = []
        for (gpu_key, rule_id), fault in list(self.record.faults.items()):
            if gpu_key == key and fault.recovery == "diagnostic":
                verdicts += self._release_one(rule_id, fault.gpu or observation.gpu, now, source="diagnostic",
                                              by="a passing diagnostic")
        return verdicts

    def _release_one(self, rule_id: str, gpu: GpuRef | None, now: float, *, source: str, by: str) -> list[Verdict]:
        """One fault released by the agent itself (a passing diagnostic, the end of a drill): that rule only."""
        release = Observation(Signal.OPERATOR_RELEASE, 1, now, source, gpu, frozen_attrs({"by": by, "rule": rule_id}))
        return self._classify(release, now)

    # ---- GPU resets: verified by a clean poll, escalated when they fail ----
    def _verify_reset(self, observation: Observation, now: float) -> list[Verdict]:
        """A reset awaits a clean poll of its GPU; a reset by someone else (the driver's Xid 154 line) too."""
        key = observation.gpu_key
        node = self.record.node
        if reset_by_driver_log(observation) and key not in node.verifying and \
                any(f.recovery in {"reset", "recovered"} for (k, _), f in self.record.faults.items() if k == key):
            node.verifying[key] = now
            self._log.bind(gpu=key).info("reset_seen_in_driver_log", awaiting="a clean poll")
            return []
        since = node.verifying.get(key)
        if observation.signal is not Signal.GPU_POLLED or since is None or observation.at <= since:
            return []
        reasons = unclean(observation)
        if reasons:
            self._log.bind(gpu=key).info("reset_not_verified_yet", poll="; ".join(reasons))
            return []
        del node.verifying[key]
        awaiting = {f.recovery for (k, _), f in self.record.faults.items() if k == key} & {"reset", "recovered"}
        attrs = {"by": "a reset verified by a clean poll"}
        if awaiting == {"recovered"}:  # no reset: the driver reported the recovery it asked of someone else done
            attrs = {"by": "the driver's report verified by a clean poll", "why": DRIVER_RECOVERED}
        reset = Observation(Signal.GPU_RESET, 1, now, "remediation", observation.gpu, frozen_attrs(attrs))
        return self._classify(reset, now)

    def _diagnosed(self, action: ActionRecord, now: float) -> bool:
        """A diagnostic that gave a verdict becomes a `diagnostic` observation: pass releases, fail is a fault."""
        outcome = outcome_of(action.message)
        if outcome is DiagnosticOutcome.INCONCLUSIVE:
            return False
        key = action.step.gpu_key
        result = Observation(Signal.DIAGNOSTIC, 1 if outcome is DiagnosticOutcome.PASS else 0, now, "diagnostic",
                             self.inventory.gpu_by_key(key), frozen_attrs({"message": action.message}))
        with self._lock:
            self.record.node.diagnosed.add(key)
            verdicts = self._classify(result, now)
            self._save()
        self._pass_verdicts.extend(verdicts)
        return bool(verdicts)

    def _reset_failed(self, gpu: GpuRef | None, now: float, message: str) -> list[Verdict]:
        """A reset that failed is a fault of the family of the fault it was for (a driver fault's failed reset
        says nothing about the GPU's hardware, so it never counts towards a replacement)."""
        key = gpu.key if gpu is not None else NODE_KEY
        attrs: dict[str, AttrValue] = {"message": message, "when_idle_only": self._only_reset_when_idle(key)}
        wanting = [f for (k, _), f in self.record.faults.items()
                   if k == key and (f.action.resets or f.recovery in {"reset", "recovered"})]
        if wanting:
            worst = max(wanting, key=lambda f: (f.action.rank, family_of(f.fault_class) != ""))
            attrs["fault_class"] = str(worst.fault_class)
        failed = Observation(Signal.RESET_FAILED, 1, now, "remediation", gpu, frozen_attrs(attrs))
        return self._classify(failed, now)

    def _only_reset_when_idle(self, key: str) -> bool:
        """Whether every fault acting on this GPU asks only for a reset once it is idle (a pending row remap or
        page retirement, a contained Xid 94): then a failed reset keeps the GPU out, it does not call for a
        reboot that would disrupt the node's other GPUs (rules/node.yaml gpu-reset-failed-when-idle)."""
        acting = [f.action for (k, _), f in self.record.faults.items()
                  if k == key and (f.action.resets or f.action.quarantines)]
        return bool(acting) and all(a in _RESET_WHEN_IDLE for a in acting)

    def _resets_unverified(self, now: float) -> list[Verdict]:
        """A reset with no clean poll within the deadline failed: the node needs a reboot."""
        verdicts: list[Verdict] = []
        verifying = self.record.node.verifying
        for key, since in list(verifying.items()):
            if key in verifying and now - since >= self.reset_verify_seconds:  # a verdict below may end another
                del verifying[key]
                verdicts += self._reset_failed(self.inventory.gpu_by_key(key), now,
                                               f"no clean poll within {self.reset_verify_seconds:g}s of the reset")
        return verdicts

    def _not_the_gpus_if_elsewhere(self, observation: Observation) -> Observation:
        """NVIDIA's Xid 31 workflow: a repeat on one GPU points at the GPU only while the same workload does not
        fault elsewhere. A workload whose application Xids hit another GPU within the hour is the application's:
        it counts toward no GPU's distinct-workload window, and what it counted already is taken back."""
        workload = observation.attrs.get("workload")
        if observation.signal is not Signal.XID or int(observation.value) not in APPLICATION_XIDS or \
                not isinstance(workload, str) or not workload:
            return observation
        elsewhere = self.spread.note(workload, observation.gpu_key, observation.at)
        if not elsewhere:
            return observation
        counting = self.rules.counting_distinct("workload")
        for gpu_key in elsewhere:  # only these rules on these GPUs: not every rule's state on every observation
            for rule_id in counting:
                state = self.engine.rules.get((gpu_key, rule_id))
                if state is not None and not state.active:
                    state.distinct.pop(workload, None)
        self.locations.forget(workload)
        attrs = {k: v for k, v in observation.attrs.items() if k != "workload"}
        attrs["workload_elsewhere"] = workload
        return new_observation(observation.signal, observation.value, observation.at, observation.source,
                               observation.gpu, frozen_attrs(attrs), observation.count)

    def _repeat_facts(self, observation: Observation) -> Observation:
        """What the repeat patterns of application Xids (NVIDIA's WORKFLOW_XID_13/31) need beyond the line: how
        many workloads (owners) hit this GPC/TPC within the window (`sm_location_workloads`, Xid 13), and
        `no_diagnostic` where no diagnostic is configured, so that a pattern only a diagnostic can decide is
        reported instead of quarantining for ever."""
        if observation.signal is not Signal.XID or int(observation.value) not in APPLICATION_XIDS:
            return observation
        attrs = dict(observation.attrs)
        workload, location = attrs.get("workload"), attrs.get("sm_location")
        if isinstance(workload, str) and workload and isinstance(location, str) and location:
            attrs["sm_location_workloads"] = self.locations.note(observation.gpu_key, location, workload,
                                                                 observation.at)
        if not self.diagnostic_available:
            attrs["no_diagnostic"] = True
        if len(attrs) == len(observation.attrs):
            return observation
        return new_observation(observation.signal, observation.value, observation.at, observation.source,
                               observation.gpu, frozen_attrs(attrs), observation.count)

    def _contained_if_so(self, observation: Observation) -> Observation:
        """A volatile DBE on a GPU whose contained incident is active (Xid 94, or the driver's drain-and-reset)
        is that incident's error, counted by NVML: it names the incident (`contained_by`), so the ECC rule defers
        to it (nobody evicted, the reset once idle) instead of resetting the GPU under its co-tenants."""
        if observation.signal is not Signal.ECC_DBE:
            return observation
        key = observation.gpu_key
        contained = sorted(rule_id for (gpu_key, rule_id), f in self.record.faults.items()
                           if gpu_key == key and f.action is Action.QUARANTINE_RESET_WHEN_IDLE)
        if not contained:
            return observation
        attrs = {**observation.attrs, "contained_by": contained[0]}
        return new_observation(observation.signal, observation.value, observation.at, observation.source,
                               observation.gpu, frozen_attrs(attrs), observation.count)

    def _drills_ended(self, now: float) -> list[Verdict]:
        """A drill's fault ends by itself once its alert has had time to fire: released, that fault only."""
        verdicts: list[Verdict] = []
        for (gpu_key, rule_id), fault in list(self.record.faults.items()):
            if not fault.summary.startswith(DRILL_PREFIX) or now - fault.since < DRILL_SECONDS:
                continue
            state = self.engine.rules.get((gpu_key, rule_id))
            if state is not None and state.occurrences > 1:
                continue  # the same fault came again during the drill: it is real, an operator releases it
            verdicts += self._release_one(rule_id, fault.gpu, now, source="drill", by="the end of the drill")
        return verdicts

    def _acknowledge(self, observation: Observation) -> list[str]:
        """Move the checkpoints this observation passes (the names moved). Each is written in the same journal
        transaction as what the observation changed, or alone (_save_checkpoints): never before it is
        classified nor later, since a kernel-log record read again after a crash would be classified without
        what the agent knew in memory (which workloads faulted elsewhere, the windows)."""
        moved = []
        for checkpoint in self.checkpoints:
            value = checkpoint.position(observation, self.engine.boot_id)
            if value is not None and checkpoint.newer(value, self.record.cursors.get(checkpoint.name)):
                self.record.cursors[checkpoint.name] = value
                moved.append(checkpoint.name)
        return moved

    def _orphan_clears(self, observation: Observation, previous_boot: str, now: float) -> list[Verdict]:
        """Faults whose rule a reload renamed or removed clear by the recovery they were raised with."""
        if observation.signal not in LIFECYCLE_SIGNALS:
            return []
        cleared = []
        for (key, rule_id), fault in list(self.record.faults.items()):
            if self.rules.get(rule_id) is not None:
                continue
            if observation.signal is Signal.BOOT:
                boot_id = str(observation.attrs.get("boot_id", ""))
                why = "new boot" if previous_boot and boot_id != previous_boot and \
                    fault.recovery in {"boot", "reset", "recovered"} else ""
            elif observation.signal is Signal.GPU_RESET:
                why = "verified GPU reset" if observation.value and observation.gpu_key == key and \
                    fault.recovery in {"reset", "recovered"} else ""
            else:
                why = f"released by {observation.attrs.get('by', 'operator')}" \
                    if observation.gpu_key in {NODE_KEY, key} else ""
            if why:
                cleared.append(self._orphan_cleared(fault, now, why))
        return cleared

    def _orphans_quiet(self, now: float) -> list[Verdict]:
        return [self._orphan_cleared(f, now, f"quiet for {f.quiet_seconds:g}s")
                for (_, rule_id), f in list(self.record.faults.items())
                if self.rules.get(rule_id) is None and f.recovery == "quiet" and f.quiet_seconds > 0
                and now - f.since >= f.quiet_seconds]

    def _orphan_cleared(self, fault: ActiveFault, now: float, why: str) -> Verdict:
        self.engine.forget(fault.gpu_key, fault.rule_id)
        return Verdict(VerdictKind.CLEARED, fault.rule_id, fault.gpu_key, Severity.OK, fault.action,
                       fault.fault_class, now, f"cleared: {why}", fault.gpu,
                       frozen_attrs({"occurrences": fault.occurrences, "active_since": fault.since, "why": why}))

    def replace_rules(self, rules: RuleSet) -> None:
        with self._lock:
            self.rules = rules
        if self.metrics:
            self.metrics.rules_loaded.set(len(rules.rules))

    def _learn(self, gpu: GpuRef) -> GpuRef | None:
        """A source that knows a GPU's whole identity (NVML, DCGM) teaches it to the inventory, so a
        kernel-log record that names only the PCI bus id, or a lost GPU NVML knows only by index, is
        resolved to the same GPU. The inventory is part of the durable record. Returns the GPU it took the
        place of: another UUID at the same PCI address (a new board in the slot)."""
        if not gpu.uuid or not gpu.pci_bus_id or gpu.mig_parent_uuid or gpu.index is None:
            return None
        if any(known.uuid == gpu.uuid for known in self.inventory.gpus):
            return None
        wanted = normalise_pci(gpu.pci_bus_id)
        before = next((g for g in self.inventory.gpus if g.uuid and g.pci_bus_id and
                       normalise_pci(g.pci_bus_id) == wanted), None)
        others = tuple(g for g in self.inventory.gpus if g.index != gpu.index)
        gpus = tuple(sorted((*others, gpu), key=lambda g: (g.index is None, g.index or 0)))
        self.inventory = dataclasses.replace(self.inventory, gpus=gpus)
        self._metrics_primed = False
        return before

    def _board_replaced(self, old: GpuRef | None, new: GpuRef, now: float) -> list[Verdict]:
        """A GPU marked for replacement whose slot now holds a board with another UUID was replaced: the old
        board's faults end (its recovery history goes with it). Only a replacement mark is so cleared: a GPU that
        merely reads with another UUID while not marked keeps whatever else it had (it is the new board's now)."""
        if old is None or old.uuid == new.uuid:
            return []
        faults = [(rule_id, f) for (key, rule_id), f in self.record.faults.items() if key == old.key]
        if not any(f.action is Action.REPLACE_GPU for _, f in faults):
            return []
        self._log.bind(gpu=old.key).info("gpu_replaced", new_uuid=new.uuid, pci=new.pci_bus_id)
        self.record.node.recoveries.release(old.key)
        by = f"a new board in its slot: {new.uuid} at PCI {new.pci_bus_id} replaced {old.uuid}"
        release = Observation(Signal.OPERATOR_RELEASE, 1, now, "inventory", GpuRef(uuid=old.uuid),
                              frozen_attrs({"by": by}))
        verdicts = self._classify(release, now)
        for verdict in verdicts:
            if self.on_released:
                self._safely("release_hook_failed", self.on_released, verdict)
        return verdicts

    def occurrences(self, gpu_key: str, rule_id: str) -> int:
        state = self.engine.rules.get((gpu_key, rule_id))
        return state.occurrences if state else 0

    def gpu_statuses(self) -> dict[str, str]:
        """healthy | degraded | fatal | unknown for every GPU of the inventory and every faulty key."""
        statuses = {gpu.key: "healthy" for gpu in self.inventory.gpus}
        for fault in list(self.record.faults.values()):
            status = _status_of(fault.severity)
            keys = list(statuses) if fault.gpu_key == NODE_KEY else [fault.gpu_key]
            for key in keys:
                if _STATUS_RANK[status] > _STATUS_RANK[statuses.get(key, "healthy")]:
                    statuses[key] = status
        return statuses

    def _escalate(self, verdict: Verdict) -> Verdict:
        """A fault that comes back after N verified recoveries of the same GPU from faults of the same family,
        within the window, needs replacing (application, driver and telemetry faults never count)."""
        recoveries = self.record.node.recoveries
        if verdict.kind is VerdictKind.CLEARED:
            why = str(verdict.evidence.get("why", ""))
            ended = self.record.faults.get((verdict.gpu_key, verdict.rule_id))
            fault_class = ended.fault_class if ended is not None else verdict.fault_class
            if why in {"verified GPU reset", "new boot"} and verdict.action.quarantines:
                recoveries.add(verdict.gpu_key, fault_class, verdict.at)
            return verdict
        if not verdict.action.quarantines or verdict.action is Action.REPLACE_GPU:
            return verdict
        count = recoveries.count(verdict.gpu_key, verdict.fault_class, now=verdict.at,
                                 window_seconds=self.recovery_window_seconds)
        if count < self.replace_after_recoveries:
            return verdict
        evidence = {**verdict.evidence, "recoveries": count, "escalated_from": str(verdict.action)}
        return dataclasses.replace(verdict, action=Action.REPLACE_GPU, evidence=frozen_attrs(evidence),
                                   summary=f"{verdict.summary} (returned after {count} verified recoveries from "
                                           f"{verdict.fault_class} faults: needs replacement)")

    def _fault_of(self, verdict: Verdict) -> ActiveFault:
        """The fault as the record keeps it. One escalated to a replacement clears only by an operator's release
        (or a new board): not by the reset or boot that its rule's fault clears by, which it outlived."""
        if verdict.action is Action.REPLACE_GPU and "escalated_from" in verdict.evidence:
            return ActiveFault.from_verdict(verdict, recovery="operator")
        rule = self.rules.get(verdict.rule_id)
        recovery = rule.recovery.kind if rule is not None else ""
        quiet = float(rule.recovery.quiet_seconds or 0.0) if rule is not None else 0.0
        return ActiveFault.from_verdict(verdict, recovery=recovery, quiet_seconds=quiet)

    def _pin_recovery(self, fault: ActiveFault) -> None:
        """The engine clears this fault as the record says, where that differs from its rule's recovery."""
        rule = self.rules.get(fault.rule_id)
        if rule is not None and fault.recovery == "operator" and rule.recovery.kind != "operator":
            self.engine.pin_recovery(fault.gpu_key, fault.rule_id, fault.recovery)

    def _record_verdict(self, verdict: Verdict, now: float, latency_from: float | None) -> None:
        self._new_verdict.set()  # with the record's change, under the same lock: no pass sees one without the other
        key = (verdict.gpu_key, verdict.rule_id)
        if verdict.kind is VerdictKind.FAULT:
            fault = self.record.faults[key] = self._fault_of(verdict)
            self._pin_recovery(fault)
        else:
            ended = self.record.faults.pop(key, None)
            if ended is not None and ended.action.quarantines and self.metrics:
                self.metrics.time_to_recovery.observe(max(0.0, now - ended.since))
        faults = self.record.faults
        still_held = None if self._options.pods_live else pods_on_faulty_gpus(faults.values(), self.inventory,
                                                                             self._options)
        self.record.node.forget_cleared({k for k, _ in faults}, still_held=still_held)
        for step in verdict_events([verdict], self.inventory, self.inventory.name):
            self.record.owe(OwedEvent.of(step, salt=f"{verdict.kind}@{verdict.at}"))
        log = self._log.bind(gpu=verdict.gpu_key, rule_id=verdict.rule_id)
        level = "warning" if verdict.kind is VerdictKind.FAULT and verdict.severity.rank >= Severity.WARNING.rank \
            else "info"
        getattr(log, level)("verdict", kind=str(verdict.kind), severity=str(verdict.severity),
                            action=str(verdict.action), fault_class=str(verdict.fault_class),
                            summary=verdict.summary)
        if self.journal:
            self._journaled("verdict", "journal_verdict_failed", self.journal.record_verdict, self.inventory.name,
                            verdict)
        if self.metrics:
            latency = now - latency_from if latency_from is not None else None
            self.metrics.judged(verdict, latency)

    # ---- reconciliation (the only half that talks to the API) ----
    @property
    def due_at(self) -> float:
        """When the next reconciliation pass is due (the reconciler also wakes on every change)."""
        return self._due_at

    def start(self) -> bool:
        """Read the Node once and adopt its record where it is newer (or the journal had none)."""
        return self._observe_and_adopt(self.clock()) is not None

    def reconcile(self, now: float | None = None) -> Outcome:
        """One level-triggered pass: read the Node, converge it to the record, deliver owed Events. Returns
        the steps taken and the verdicts they led to (a release read from the Node, a verified reset)."""
        with self._pass:
            now = self.clock() if now is None else now
            self._pass_verdicts = []
            self._gate_reading = None
            observed = self._observe_and_adopt(now)
            opted_out = observed.opted_out if observed is not None else False
            # The taint first: it keeps new work off the GPU and needs neither the pod list nor the Events.
            self._new_verdict.clear()
            actions = self._taint_first(now, opted_out)
            if self.pods is not None and self._wants_pods():
                self.refresh_pods()
            for _ in range(_ROUNDS):
                with self._lock:
                    steps = self._plan(now)
                done, preempted = self._carry_out_plan(steps, now, opted_out)
                actions += done
                if not (self._progressed(done, now) or preempted):
                    break
                if self.pods is not None:
                    self.refresh_pods()
            actions += self._deliver_owed(now, opted_out)
            actions += self._taint_if_wanted(opted_out)
            self._hold_slot(observed, now, opted_out)
            self._forget_skips()
            with self._lock:
                if actions:
                    self._save()
                document = mirror_of(self.record.to_json())
                worth_mirroring = bool(self.record.faults or self.record.owed or self.record.node.to_json()
                                       != NodeState().to_json())
            if observed is not None and (observed.record is not None or worth_mirroring) and \
                    not _same_record(observed.record, document) and \
                    not node_writes_refused(policy=self.policy, cluster=ClusterView(opted_out=opted_out)):
                self._safely("mirror_failed", self.actuator.mirror, document)
            self._schedule(actions, now)
            self._passes += 1
            self._update_metrics(bool(actions))
            return Outcome(self._pass_verdicts, actions)

    def _plan(self, now: float) -> list[Step]:
        """The planner's steps; not planned again while its inputs (faults, node state, inventory) are those of
        the last plan that called for nothing and no settling reset came due: that plan would be the same."""
        faults = self._resolved_faults()
        inputs = (faults, self.record.node.to_json(), self.inventory, self._options)
        quiet = self._quiet_plan
        if quiet is not None and quiet[0] == inputs and now < quiet[1]:
            return []
        steps = plan([], faults, self.record.node, self.inventory, options=self._options, now=now)
        settled = next_settled(faults.values(), self.record.node, self._options, now)
        self._quiet_plan = None if steps else (inputs, settled if settled is not None else float("inf"))
        return steps

    def _carry_out_plan(self, steps: list[Step], now: float, opted_out: bool) -> tuple[list[ActionRecord], bool]:
        """The steps in order, and whether a new verdict preempted them: a plan made before it is stale (it may
        lift the taint a new fault needs, or evict for a GPU just released), so the rest of it is dropped, the
        taint a new fault calls for goes at once, and the next round plans again."""
        done: list[ActionRecord] = []
        for step in steps:
            if self._new_verdict.is_set():
                return done + self._taint_if_wanted(opted_out), True
            record = self._carry_out(step, now, opted_out)
            if record is not None:
                done.append(record)
        return done, False

    def _taint_if_wanted(self, opted_out: bool) -> list[ActionRecord]:
        """After a verdict recorded while this pass was under way, the taint a new fault calls for (when one is
        due), before the pass's remaining writes: a scheduler stops placing work on the GPU as soon as possible."""
        if not self._new_verdict.is_set():
            return []
        self._new_verdict.clear()
        return self._taint_first(self.clock(), opted_out)

    def _taint_first(self, now: float, opted_out: bool) -> list[ActionRecord]:
        """The plan's taint step (plan() puts it first) carried out before the slower reads and reports."""
        with self._lock:
            faults = self._resolved_faults()
            if self.record.node.tainted or not any(f.action.quarantines for f in faults.values()):
                return []  # no taint is due: nothing to plan twice
            steps = self._plan(now)
        first = steps[0] if steps and steps[0].kind is StepKind.TAINT else None
        record = self._carry_out(first, now, opted_out) if first is not None else None
        return [record] if record is not None else []

    def _observe_and_adopt(self, now: float) -> NodeObservation | None:
        observed = self._safely("node_unreadable", self.actuator.observe)
        if not isinstance(observed, NodeObservation):
            return None
        with self._lock:
            self._adopt(observed)
            self.record.node = observed.actual(self.record.node)
            if observed.devices is not None:
                self._options = dataclasses.replace(self._options, devices=observed.devices)
        refused = node_writes_refused(policy=self.policy, cluster=ClusterView(opted_out=observed.opted_out))
        if observed.release and not (refused and observed.release == self._release_handled):
            target = observed.release.split("@", 1)[0].strip() or "all"
            gpu = None if target in {"all", NODE_KEY} else GpuRef(uuid=target)
            release = Observation(Signal.OPERATOR_RELEASE, 1, now, "operator", gpu,
                                  frozen_attrs({"by": "annotation gpu-health-agent.io/release"}))
            with self._lock:
                verdicts = self._classify(release, now)
                self._save()
                document = mirror_of(self.record.to_json())
            self._pass_verdicts.extend(verdicts)
            # The Node's copy says "released" before the request goes: a journal lost now cannot bring the
            # fault back. Not mirrored: the request stays and the next pass handles it again (idempotent).
            # Where the guard refuses Node writes (dry-run, opt-out) the request stays, handled once here.
            if refused:
                self._release_handled = observed.release
            elif self._safely("mirror_failed", self.actuator.mirror, document) is not False:
                self._safely("release_not_consumed", self.actuator.consume_release, observed.release)
            if verdicts:
                self.wake.set()
        return observed

    def _adopt(self, observed: NodeObservation) -> None:
        """The Node's copy of the record wins when it is newer, or when this process started without one."""
        if observed.record is None:
            self.fresh = False
            return
        theirs = NodeRecord.from_json(observed.record)
        if not (theirs.generation > self.record.generation or (self.fresh and (theirs.faults or theirs.generation))):
            self.fresh = False
            return
        mine = self.record
        truncated = is_truncated(observed.record)  # the Node kept only part: what this process holds stays
        merged = NodeRecord(generation=max(theirs.generation, mine.generation), faults=dict(theirs.faults),
                            node=theirs.node, owed=list(theirs.owed), gpus=theirs.gpus,
                            cursors={**mine.cursors, **theirs.cursors} if truncated else dict(theirs.cursors))
        if self.fresh or truncated:
            for key, fault in mine.faults.items():
                merged.faults.setdefault(key, fault)
            for event in mine.owed:
                merged.owe(event)
        self.record = merged
        self.fresh = False
        self._restore_engine([f for k, f in merged.faults.items() if k not in mine.faults])
        for key in set(mine.faults) - set(merged.faults):
            self.engine.forget(*key)
        self._merge_gpus(merged.gpus)
        self._save()
        self._log.info("record_adopted_from_node", generation=theirs.generation, faults=len(merged.faults))

    def _resolved_faults(self) -> dict[tuple[str, str], ActiveFault]:
        """Faults raised before the GPU's UUID was known get it from the inventory now, if it knows it."""
        resolved = {}
        for key, fault in self.record.faults.items():
            unresolved = fault.gpu is not None and not fault.gpu.uuid
            resolved[key] = dataclasses.replace(fault, gpu=self.inventory.resolve(fault.gpu)) \
                if unresolved and fault.gpu is not None else fault
        return resolved

    def _wants_pods(self) -> bool:
        with self._lock:  # the source thread changes the record meanwhile
            return any(f.action.rank >= Action.RESET_WHEN_IDLE.rank for f in self.record.faults.values()) or \
                any(e.pending_pod for e in self.record.owed)

    def _progressed(self, done: list[ActionRecord], now: float) -> bool:
        """Evictions that took effect, a diagnostic's verdict or a failed reset may let further steps proceed;
        a reset command that succeeded waits for the clean poll that verifies it."""
        progressed = False
        for action in done:
            kind, result = action.step.kind, action.result
            if kind is StepKind.EVICT and result in _TOOK_EFFECT:
                progressed = True
            elif kind is StepKind.RESET_GPU and result is StepResult.APPLIED:
                with self._lock:
                    self.record.node.verifying[action.step.gpu_key] = now
                    self._save()
            elif kind is StepKind.RESET_GPU and result is StepResult.FAILED:
                gpu = self.inventory.gpu_by_key(action.step.gpu_key)
                with self._lock:
                    self.record.node.resets.add(action.step.gpu_key)  # not retried: the reboot takes over
                    verdicts = self._reset_failed(gpu, now, f"the reset command failed: {action.message}")
                    self._save()
                self._pass_verdicts.extend(verdicts)
                progressed = progressed or bool(verdicts)
            elif kind is StepKind.RUN_DIAGNOSTIC and result is StepResult.APPLIED:
                progressed = self._diagnosed(action, now) or progressed
        return progressed

    def _carry_out(self, step: Step, now: float, opted_out: bool) -> ActionRecord | None:
        """The guard decides, on the pass's one reading of the cluster gate (read only for a step that gets as
        far as the gate); a step it lets past takes its budget slot first, and the guard decides again on
        what that write found (another node may have taken the last slot meanwhile)."""
        gated = needs_gate(step, policy=self.policy, opted_out=opted_out)
        if gated and now < self._backoff_until:
            return None  # backing off: not attempted, not recorded again
        cluster = ClusterView(opted_out=opted_out, gate=self._read_gate() if gated else None)
        decision = decide(step, policy=self.policy, cluster=cluster, history=self.history, now=now)
        if decision.proceed and step.disruptive and not (self._renewed_at is not None and cluster.gate is not None
                                                          and cluster.gate.held):
            decision = self._take_slot(step, now, cluster)
        result: StepResult | None = decision.result
        message = decision.reason
        if decision.by_gate:
            self._backoff_until = now + self.retry_seconds * self.rng.uniform(1.0, 1.25)
        if result is None:
            result, message = self._apply(step, now)
        with self._lock:
            if result in _TOOK_EFFECT:
                self.record.node.apply(step)
            if step.kind is StepKind.EVICT:
                self._settle_eviction_event(step, result)
            if step.kind.disruptive and result in _TOOK_EFFECT:
                self._save()  # at once, so a restart right after this step does not repeat it
        if result is StepResult.BLOCKED and step.kind is StepKind.EVICT and now >= self._backoff_until:
            self._backoff_until = now + self.retry_seconds * self.rng.uniform(1.0, 1.25)
        if not self._skip_changed(step, result, message):
            return None  # skipped again for the same reason: logged and journaled when it first was
        return self._recorded(step, result, message, now)

    def _skip_changed(self, step: Step, result: StepResult, message: str) -> bool:
        """Whether this outcome is news: anything but a skip is; a skip is when the step was not skipped for
        the same reason the last time it came up (see _forget_skips)."""
        key = (step.kind, step.target, step.gpu_key, step.rule_id)
        if result is not StepResult.SKIPPED:
            self._skipped.pop(key, None)
            return True
        self._skipped_now.add(key)
        if self._skipped.get(key) == message:
            return False
        self._skipped[key] = message
        return True

    def _forget_skips(self) -> None:
        """At the end of a pass: a skipped step this pass did not come to again (its fault ended, the plan
        changed) is forgotten, so when it comes back it is skipped, and said so, again."""
        self._skipped = {k: v for k, v in self._skipped.items() if k in self._skipped_now}
        self._skipped_now = set()

    def _read_gate(self) -> GateReading:
        """The pass's one read of the cluster gate; an unreadable gate is a reading the guard blocks on."""
        if self._gate_reading is None:
            try:
                self._gate_reading = self.gate.read()
            except Exception as exc:  # noqa: BLE001 - isolation: an unreadable budget blocks, never crashes
                self._gate_reading = GateReading(error=f"{type(exc).__name__}: {exc}")
        return self._gate_reading

    def _take_slot(self, step: Step, now: float, cluster: ClusterView) -> Decision:
        """Write the slot the guard allowed, then let the guard decide on what the write found."""
        before = cluster.gate or GateReading()
        try:
            after = dataclasses.replace(self.gate.acquire(), paused=before.paused)
        except Exception as exc:  # noqa: BLE001 - isolation: an unreadable budget blocks, never crashes
            after = GateReading(error=f"{type(exc).__name__}: {exc}")
        self._gate_reading = after
        if after.held:
            self._renewed_at = now
            self._holding = True
        return decide(step, policy=self.policy, cluster=dataclasses.replace(cluster, gate=after),
                      history=self.history, now=now)

    def _apply(self, step: Step, now: float) -> tuple[StepResult, str]:
        if step.disruptive:
            self.history.record(step, now)
        if step.kind is StepKind.EVICT:
            with self._lock:  # the intent first: the Event is owed whatever happens next
                self.record.owe(self._eviction_event(step, pending=True))
                self._save()
        try:
            return self.actuator.apply(step)
        except Exception as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
            if self.metrics:
                self.metrics.step_errors.labels(str(step.kind)).inc()
            return StepResult.FAILED, f"{type(exc).__name__}: {exc}"

    def _eviction_event(self, step: Step, *, pending: bool) -> OwedEvent:
        event = Step(StepKind.EVENT, f"pod/{step.target}", step.reason, rule_id=step.rule_id, gpu_key=step.gpu_key,
                     details=frozen_attrs({"reason": "EvictedForGpuFault", "type": "Warning"}))
        return OwedEvent.of(event, salt="evicted", pending_pod=step.target if pending else "")

    def _settle_eviction_event(self, step: Step, result: StepResult) -> None:
        pending = self._eviction_event(step, pending=True)
        self.record.acknowledge(pending.id)
        if result is StepResult.APPLIED:
            self.record.owe(self._eviction_event(step, pending=False))

    def _deliver_owed(self, now: float, opted_out: bool) -> list[ActionRecord]:
        """Owed Events, oldest first; one the API refuses stops the rest until the next pass."""
        with self._lock:
            owed = list(self.record.owed)
        present = {p.key for p in self.inventory.pods if not p.terminating}
        actions = []
        for event in owed:
            actions += self._taint_if_wanted(opted_out)  # a fault's taint does not wait behind Events
            if event.pending_pod and event.pending_pod in present:
                with self._lock:
                    if event.gpu_key not in {k for k, _ in self.record.faults}:
                        self.record.acknowledge(event.id)  # the fault ended before its eviction
                continue
            step = event.step()  # a pending eviction's pod is gone: its Event is due
            decision = decide(step, policy=self.policy, cluster=ClusterView(opted_out=opted_out),
                              history=self.history, now=now)
            result, message = (decision.result, decision.reason) if decision.result else self._apply(step, now)
            if result is StepResult.FAILED:
                actions.append(self._recorded(step, result, message, now))
                break
            with self._lock:
                self.record.acknowledge(event.id)
            actions.append(self._recorded(step, result, message, now))
        return actions

    def _hold_slot(self, observed: NodeObservation | None, now: float, opted_out: bool) -> None:
        """A node holds its budget slot while it is disrupted (pods moved off a faulty GPU, a reboot
        requested) and renews it; a node that is not disrupted gives it back, whatever took it."""
        acting = self.policy.mode is Mode.REMEDIATE and not self.policy.dry_run and not opted_out
        with self._lock:  # the source thread changes the record meanwhile
            node = self.record.node
            active = {k for k, _ in self.record.faults}
            disrupted = acting and (node.reboot_requested or any(node.evicted.get(k) for k in active) or
                                    any(m.effect == "NoExecute" for m in node.device_taints.values()))
        try:
            if disrupted:
                if self._renewed_at is None or now - self._renewed_at >= self.slot_renew_seconds:
                    previous, self._renewed_at = self._renewed_at, now
                    try:
                        held = self.gate.acquire().held
                    except Exception:
                        self._renewed_at = previous  # a transient failure: the next pass tries again
                        raise
                    self._holding = held
                    if not held:
                        self._log.warning("slot_not_renewed", reason="budget spent while the node is disrupted")
            elif self._renewed_at is not None or self.gate.maybe_held or (observed is not None and (
                    observed.holds_slot or self._passes == 0)):
                self.gate.release()  # a slot the record does not call for is given back, whatever wrote it
                self._renewed_at = None
                self._holding = False
            if observed is not None and observed.holds_slot != self._holding:
                self.gate.show(self._holding)  # the label is a view of the slot, repaired here
        except Exception as exc:  # noqa: BLE001 - the next pass tries again
            self._log.warning("budget_slot_failed", error=f"{type(exc).__name__}: {exc}")

    def _schedule(self, actions: list[ActionRecord], now: float) -> None:
        retry = any(a.result in {StepResult.BLOCKED, StepResult.FAILED} for a in actions) or bool(self.record.owed)
        due = now + self.sync_seconds
        if retry:
            due = min(due, max(self._backoff_until, now + self.retry_seconds * self.rng.uniform(1.0, 1.25)))
        with self._lock:  # the source thread changes the record meanwhile
            settled = next_settled(list(self.record.faults.values()), self.record.node, self._options, now)
        self._due_at = min(due, settled) if settled is not None else due

    def _recorded(self, step: Step, result: StepResult, message: str, now: float) -> ActionRecord:
        record = ActionRecord(step=step, result=result, at=now, message=message)
        self._log.bind(gpu=step.gpu_key, rule_id=step.rule_id).info(
            "step", kind=str(step.kind), target=step.target, result=str(result), message=message)
        if self.journal:
            self._journaled("action", "journal_action_failed", self.journal.record_action, self.inventory.name,
                            record)
        if self.metrics:
            self.metrics.acted(record)
            if step.kind in {StepKind.TAINT, StepKind.TAINT_DEVICE} and result is StepResult.APPLIED:
                since = min((f.since if f.observed_at is None else f.observed_at
                             for f in self.record.faults.values() if f.action.quarantines), default=None)
                if since is not None:
                    self.metrics.detection_to_quarantine.observe(max(0.0, self.clock() - since))
        return record

    def refresh_pods(self) -> None:
        if self.pods is None:
            return
        try:
            pods = self.pods()
        except Exception as exc:  # noqa: BLE001 - an unreadable pod list keeps the last one
            self._log.warning("pods_refresh_failed", error=str(exc))
            return
        with self._lock:
            self.inventory = dataclasses.replace(self.inventory, pods=pods)

    def _update_metrics(self, changed: bool) -> None:
        if self.metrics and (changed or not self._metrics_primed):
            self._metrics_primed = True
            self.metrics.set_gpu_status(self.gpu_statuses())
            self.metrics.set_active([f.severity for f in list(self.record.faults.values())])

    def _journaled(self, kind: str, event: str, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """One journal write; what failed is kept by kind (record, verdict, action) until that kind is written
        again: /healthz fails meanwhile (a full disk must not read healthy)."""
        try:
            func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - isolation: a failed write is reported, detection goes on
            error = f"{type(exc).__name__}: {exc}"
            self._log.error(event, error=error)
            with self._journal_state:  # replaced whole, never changed in place: /healthz reads it unlocked
                self.journal_failing = {**self.journal_failing, kind: error}
            if self.metrics:
                self.metrics.journal_write_failures.labels(kind).inc()
            return
        if kind in self.journal_failing:
            with self._journal_state:
                self.journal_failing = {k: v for k, v in self.journal_failing.items() if k != kind}
            self._log.info("journal_writes_recovered", kind=kind)

    def _safely(self, event: str, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """func(...), or False (logged) when it raised."""
        try:
            return func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
            self._log.error(event, error=f"{type(exc).__name__}: {exc}")
            return False


def _same_record(mirrored: Mapping[str, object] | None, document: Mapping[str, object]) -> bool:
    """Equal but for the generation counter (a pass that changed nothing on the Node writes nothing)."""
    if mirrored is None:
        return False
    return {k: v for k, v in mirrored.items() if k != "generation"} == \
        {k: v for k, v in document.items() if k != "generation"}


def _in_family_of(verdict: Verdict, observation: Observation) -> Verdict:
    """A failed reset's fault takes the family of the fault whose reset failed (the observation says which)."""
    family = observation.attrs.get("fault_class")
    if observation.signal is not Signal.RESET_FAILED or verdict.kind is not VerdictKind.FAULT or \
            not isinstance(family, str) or family not in FaultClass.__members__.values():
        return verdict
    return dataclasses.replace(verdict, fault_class=FaultClass(family))


_STATUS_RANK = {"healthy": 0, "unknown": 1, "degraded": 2, "fatal": 3}


def _status_of(severity: Severity) -> str:
    if severity is Severity.FATAL:
        return "fatal"
    if severity is Severity.DEGRADED:
        return "degraded"
    if severity is Severity.UNKNOWN:
        return "unknown"
    return "healthy"

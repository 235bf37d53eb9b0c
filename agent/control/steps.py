"""One step at a time: the guard decides on the pass's one gate reading, the budget slot, the actuator, the journal."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from agent.control.feedback import TOOK_EFFECT
from agent.control.held import HeldResets
from agent.control.seams import Actuator, ClusterGate
from agent.control.shared import Shared
from agent.control.waiting import NODE_MARKS, WaitingMarks
from agent.model import ActionRecord, Step, StepKind, StepResult
from agent.remediation import AttemptHistory, ClusterView, Decision, GateReading, GuardPolicy, decide, needs_gate
from agent.remediation.guard import disrupted, gate_refusal, quarantines
from agent.remediation.record import NodeObservation, OwedEvent

#: The message of a disruptive step's action row written before the actuator runs it.
STARTED = "started: the result is journaled when it returns"


class StepRunner:
    """Carries out the reconciler's steps through the guard and the cluster gate, and journals each outcome."""

    def __init__(self, shared: Shared, *, policy: GuardPolicy, actuator: Actuator, gate: ClusterGate,
                 rng: random.Random, retry_seconds: float, slot_renew_seconds: float) -> None:
        self.shared = shared
        self.policy = policy
        self.actuator = actuator
        self.gate = gate
        self.rng = rng
        self.retry_seconds = retry_seconds
        self.slot_renew_seconds = slot_renew_seconds
        self.history = AttemptHistory()
        self.backoff_until = 0.0
        self.held = HeldResets(cooldown_seconds=policy.cooldown_seconds,
                               max_attempts_per_hour=policy.max_attempts_per_hour)
        self._renewed_at: float | None = None
        #: This pass's one reading of the cluster gate (None until a step needs it).
        self.gate_reading: GateReading | None = None
        #: Whether this node holds its slot as far as this process knows (the label shows it).
        self._holding = False
        #: Each step last skipped, and why: a skip is logged and journaled once per change, not every pass;
        #: and the skips this pass came to (a step no longer planned is forgotten at the end of the pass).
        self._skipped: dict[tuple[StepKind, str, str, str], str] = {}
        self._skipped_now: set[tuple[StepKind, str, str, str]] = set()
        #: A disruptive step this pass was kept from by a failed request (the gate unreadable, the slot's
        #: write unanswered, the step's own request): it is owed, so the slot written for it is kept and the
        #: failed-pass back-off stays short. The last pass's word stands in a pass that backs off.
        self.owes_disruption = False
        self._owed_before = False
        #: Called when a new quarantine's claim on the brake is refused (the reconciler's brake waits: the Event).
        self.on_claim_refused: Callable[[], None] = lambda: None
        #: The Node-mark steps of this pass whose write waits for the pass's Node write.
        self.waiting = WaitingMarks(shared)

    def begin_pass(self) -> None:
        """A new pass: no gate reading yet, nothing owed until this pass finds it so, and its Node writes held
        for one write (a pass cut short left its marks unwritten: the record forgets them)."""
        self.gate_reading = None
        self._owed_before, self.owes_disruption = self.owes_disruption, False
        self.waiting.drop()
        self.actuator.begin_batch()

    def flush_node(self, now: float, *, reopen: bool) -> list[ActionRecord]:
        """The pass's Node marks (its steps', the budget label's, the mirror's) in one write; the steps that
        waited for it journaled with its answer (a refusal fails them all and restores the record's marks, so
        the next pass plans them again). `reopen`: later writes of the pass wait for its next flush."""
        error = self.actuator.write_node()
        if reopen:
            self.actuator.begin_batch()
        if error:
            self.shared.log.warning("node_write_failed", error=error, steps=len(self.waiting.steps))
        settled = self.waiting.settle(error)
        self.owes_disruption = self.owes_disruption or any(error and a.step.disruptive for a in settled)
        return [self.recorded(a.step, a.result, a.message, a.at) for a in settled]

    def carry_out(self, step: Step, now: float, opted_out: bool) -> ActionRecord | None:
        """The guard decides once, on the pass's one reading of the cluster gate (read only for a step that gets
        as far as the gate) and the fleet's word; the writes its yes calls for follow (`_admit`) and report
        back: a refused one blocks the step with its answer."""
        if step.kind is StepKind.RESET_GPU and self.held.waiting(step.gpu_key, now):
            return None  # found held: asked again once the cooldown has passed, not recorded meanwhile
        gated = needs_gate(step, policy=self.policy, opted_out=opted_out)
        if gated and now < self.backoff_until:
            self.owes_disruption = self.owes_disruption or (step.disruptive and self._owed_before)
            return None  # backing off: not attempted, not recorded again
        cluster = ClusterView(opted_out=opted_out, gate=self._read_gate() if gated else None,
                              brake=self.shared.fleet_view.brake)
        decision = decide(step, policy=self.policy, cluster=cluster, history=self.history, now=now)
        if decision.proceed:
            decision = self._admit(step, now, cluster, decision)
        result: StepResult | None = decision.result
        message = decision.reason
        if decision.by_gate:
            self.backoff_until = now + self.retry_seconds * self.rng.uniform(1.0, 1.25)
        waits = False
        if result is None:
            result, message = self._apply(step, now)
            if step.kind is StepKind.RESET_GPU:
                result, message = self.held.bounded(step, result, message, now)
            waits = step.kind in NODE_MARKS and result in TOOK_EFFECT
        if step.disruptive and (result is StepResult.FAILED or (decision.by_gate and self._gate_failed())):
            self.owes_disruption = True
        shared = self.shared
        with shared.lock:
            if waits:
                self.waiting.keep_marks()
            if result in TOOK_EFFECT:
                shared.record.node.apply(step)
                if shared.fleet is not None:  # the quarantine's start, on the clock its summary publishes
                    shared.record.node.mark_quarantine(shared.fleet.wall())
            if step.kind is StepKind.EVICT:
                self._settle_eviction_event(step, result)
            if step.kind is StepKind.RESET_GPU and result not in TOOK_EFFECT and result is not StepResult.FAILED:
                shared.record.node.resets.discard(step.gpu_key)  # not attempted after all: the intent is withdrawn
            if step.kind is StepKind.RESET_GPU and result is not StepResult.APPLIED:
                shared.record.node.mig_expected.pop(step.gpu_key, None)  # no reset to verify
            if step.disruptive and result in TOOK_EFFECT:
                shared.save()  # at once, so a restart right after this step does not repeat it
        if result is StepResult.BLOCKED and step.kind is StepKind.EVICT and now >= self.backoff_until:
            self.backoff_until = now + self.retry_seconds * self.rng.uniform(1.0, 1.25)
        if not self._skip_changed(step, result, message):
            return None  # skipped again for the same reason: logged and journaled when it first was
        if waits:  # journaled with the answer of the pass's Node write
            self.waiting.steps.append(ActionRecord(step=step, result=result, at=now, message=message))
            return None
        return self.recorded(step, result, message, now)

    def _skip_changed(self, step: Step, result: StepResult, message: str) -> bool:
        """Whether this outcome is news: anything but a skip is; a skip is when the step was not skipped for
        the same reason the last time it came up (see forget_skips)."""
        key = (step.kind, step.target, step.gpu_key, step.rule_id)
        if result is not StepResult.SKIPPED:
            self._skipped.pop(key, None)
            return True
        self._skipped_now.add(key)
        if self._skipped.get(key) == message:
            return False
        self._skipped[key] = message
        return True

    def forget_skips(self) -> None:
        """At the end of a pass: a skipped step this pass did not come to again (its fault ended, the plan
        changed) is forgotten, so when it comes back it is skipped, and said so, again."""
        self._skipped = {k: v for k, v in self._skipped.items() if k in self._skipped_now}
        self._skipped_now = set()

    def _gate_failed(self) -> bool:
        return self.gate_reading is not None and bool(self.gate_reading.error)

    def _read_gate(self) -> GateReading:
        """The pass's one read of the cluster gate; an unreadable gate is a reading the guard blocks on."""
        if self.gate_reading is None:
            try:
                self.gate_reading = self.gate.read()
            except Exception as exc:  # noqa: BLE001 - isolation: an unreadable budget blocks, never crashes
                self.gate_reading = GateReading(error=f"{type(exc).__name__}: {exc}")
        return self.gate_reading

    def _admit(self, step: Step, now: float, cluster: ClusterView, allowed: Decision) -> Decision:
        """The writes the guard's yes calls for, in order, each reporting back: the brake's claim for a new
        quarantine, the budget slot for a disruptive step on a node that does not hold one yet. A refused
        write blocks the step with its answer; the guard is not asked again."""
        if quarantines(step) and self.shared.fleet_view.claim and (refusal := self._claim_place()):
            return Decision(step, StepResult.BLOCKED, refusal)
        holds = self._renewed_at is not None and cluster.gate is not None and cluster.gate.held
        if step.disruptive and not holds and (refusal := self._take_slot(step, now, cluster)):
            return Decision(step, StepResult.BLOCKED, refusal, by_gate=True)
        return allowed

    def _claim_place(self) -> str:
        """Claim this new quarantine's place in the brake's count (exact, where agents counting at once each
        see room); the refusal, "" when the place is taken."""
        shared = self.shared
        refusal = shared.fleet.claim(shared.inventory.name) if shared.fleet is not None else ""
        shared.fleet_view = dataclasses.replace(shared.fleet_view, claim=False, brake=refusal)
        if refusal:
            self.on_claim_refused()
        return refusal

    def _take_slot(self, step: Step, now: float, cluster: ClusterView) -> str:
        """Write the slot the guard allowed; what the write found, as the gate's refusal ("" when held or
        when the answer still leaves room: another node may have taken the last slot meanwhile)."""
        before = cluster.gate or GateReading()
        try:
            after = dataclasses.replace(self.gate.acquire((self._disrupting_rules() | {step.rule_id}) - {""}),
                                        paused=before.paused)
        except Exception as exc:  # noqa: BLE001 - isolation: an unreadable budget blocks, never crashes
            after = GateReading(error=f"{type(exc).__name__}: {exc}")
        self.gate_reading = after
        if after.held:
            self._renewed_at = now
            self._holding = True
        return gate_refusal(after)

    def _disrupting_rules(self) -> frozenset[str]:
        """The rules of the node's active faults that take a disruptive step (what its slot is held for: the
        budget counts a fleet unit's slot as the unit's only when that is the unit's rule alone)."""
        with self.shared.lock:
            return frozenset(f.rule_id for f in self.shared.record.faults.values()
                             if f.action.quarantines or f.action.resets)

    def _apply(self, step: Step, now: float) -> tuple[StepResult, str]:
        if step.disruptive:
            self.history.record(step, now)
            self._intend(step, now)
        if step.kind is StepKind.EVICT:
            with self.shared.lock:  # the intent first: the Event is owed whatever happens next
                self.shared.record.owe(OwedEvent.for_eviction(step, pending=True))
                self.shared.save()
        try:
            return self.actuator.apply(step)
        except Exception as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
            if self.shared.metrics:
                self.shared.metrics.step_errors.labels(str(step.kind)).inc()
            return StepResult.FAILED, f"{type(exc).__name__}: {exc}"

    def _intend(self, step: Step, now: float) -> None:
        """A disruptive step's attempt goes to the journal before the actuator runs it (an action row, its result
        pending), and a reset's to the record too, as awaiting its clean poll: an agent restarted while the reset
        runs verifies it (or escalates when no clean poll comes), it does not reset the GPU again."""
        shared, store = self.shared, self.shared.store
        if store.journal is not None:
            store.journaled("action", "journal_action_failed", store.journal.record_action, shared.inventory.name,
                            ActionRecord(step=step, result=StepResult.PLANNED, at=now, message=STARTED))
        if step.kind is not StepKind.RESET_GPU:
            return
        with shared.lock:
            node = shared.record.node
            node.resets.add(step.gpu_key)
            geometry = shared.mig_seen.get(step.gpu_key, 0)
            if geometry:  # recorded before the reset destroys the instances: verified once as many are back
                node.mig_expected[step.gpu_key] = geometry
            before = node.verifying.get(step.gpu_key)
            node.verifying[step.gpu_key] = now  # in the journal only: this process awaits the command's result
            shared.save()
            if before is None:
                del node.verifying[step.gpu_key]
            else:
                node.verifying[step.gpu_key] = before

    def _settle_eviction_event(self, step: Step, result: StepResult) -> None:
        pending = OwedEvent.for_eviction(step, pending=True)
        self.shared.record.acknowledge(pending.id)
        if result is StepResult.APPLIED:
            self.shared.record.owe(OwedEvent.for_eviction(step, pending=False))

    def deliver_owed(self, now: float, opted_out: bool,
                     taint_if_wanted: Callable[[bool], list[ActionRecord]]) -> list[ActionRecord]:
        """Owed Events, oldest first; one the API refuses stops the rest until the next pass."""
        shared = self.shared
        with shared.lock:
            owed = list(shared.record.owed)
        present = {p.key for p in shared.inventory.pods if not p.terminating}
        actions = []
        for event in owed:
            actions += taint_if_wanted(opted_out)  # a fault's taint does not wait behind Events
            if event.pending_pod and event.pending_pod in present:
                with shared.lock:
                    if event.gpu_key not in {k for k, _ in shared.record.faults}:
                        shared.record.acknowledge(event.id)  # the fault ended before its eviction
                continue
            step = event.step()  # a pending eviction's pod is gone: its Event is due
            decision = decide(step, policy=self.policy, cluster=ClusterView(opted_out=opted_out),
                              history=self.history, now=now)
            result, message = (decision.result, decision.reason) if decision.result else self._apply(step, now)
            if result is StepResult.FAILED:
                actions.append(self.recorded(step, result, message, now))
                break
            with shared.lock:
                shared.record.acknowledge(event.id)
            actions.append(self.recorded(step, result, message, now))
        return actions

    def hold_slot(self, observed: NodeObservation | None, now: float, opted_out: bool, first_pass: bool) -> None:
        """A node holds its budget slot while it is disrupted (pods moved off a faulty GPU, a reboot
        requested) and renews it; a node that is not disrupted gives it back, whatever took it."""
        with self.shared.lock:  # the source thread changes the record meanwhile
            holds = disrupted(self.shared.record.node, {k for k, _ in self.shared.record.faults},
                              policy=self.policy, opted_out=opted_out)
        try:
            if holds:
                if self._renewed_at is None or now - self._renewed_at >= self.slot_renew_seconds:
                    previous, self._renewed_at = self._renewed_at, now
                    try:
                        held = self.gate.acquire(self._disrupting_rules()).held
                    except Exception:
                        self._renewed_at = previous  # a transient failure: the next pass tries again
                        raise
                    self._holding = held
                    if not held:
                        self.shared.log.warning("slot_not_renewed", reason="budget spent while the node is disrupted")
            elif not self.owes_disruption and (self._renewed_at is not None or self.gate.maybe_held or
                                               self.gate.lingering or (
                    observed is not None and (observed.holds_slot or first_pass))):
                self.gate.release()  # a slot the record does not call for is given back, whatever wrote it
                self._renewed_at = None
                self._holding = False
            if observed is not None and observed.holds_slot != self._holding:
                self.gate.show(self._holding)  # the label is a view of the slot, repaired here
        except Exception as exc:  # noqa: BLE001 - the next pass tries again
            self.shared.log.warning("budget_slot_failed", error=f"{type(exc).__name__}: {exc}")

    def recorded(self, step: Step, result: StepResult, message: str, now: float) -> ActionRecord:
        shared, store = self.shared, self.shared.store
        record = ActionRecord(step=step, result=result, at=now, message=message)
        shared.log.bind(gpu=step.gpu_key, rule_id=step.rule_id).info(
            "step", kind=str(step.kind), target=step.target, result=str(result), message=message)
        if store.journal:
            store.journaled("action", "journal_action_failed", store.journal.record_action, shared.inventory.name,
                            record)
        if shared.metrics:
            shared.metrics.acted(record)
            if step.kind in {StepKind.TAINT, StepKind.TAINT_DEVICE} and result is StepResult.APPLIED:
                since = min((f.since if f.observed_at is None else f.observed_at
                             for f in shared.record.faults.values() if f.action.quarantines), default=None)
                if since is not None:
                    shared.metrics.detection_to_quarantine.observe(max(0.0, shared.clock() - since))
        return record

"""The classifier: observation -> engine -> durable record, acknowledged with it. Local, fast, never the API."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from agent.control.enrich import Enricher
from agent.control.feedback import Feedback
from agent.control.record_store import BOOT_CURSOR, RecordStore
from agent.control.shared import Shared
from agent.drill import contain
from agent.engine import CONTAINED_BY, evaluate, restore, tick, withdraw
from agent.model import (
    Action,
    FaultClass,
    GpuRef,
    Observation,
    Severity,
    Signal,
    Verdict,
    VerdictKind,
    frozen_attrs,
    new_observation,
    normalise_pci,
)
from agent.remediation import ActiveFault
from agent.remediation.planner import pods_on_faulty_gpus, reset_required_events, verdict_events
from agent.remediation.record import OwedEvent
from agent.sources.checkpoint import InputCheckpoint


class Classifier:
    """Judges each observation against the rules and keeps what it changes in the record (under the lock)."""

    def __init__(self, shared: Shared, *, checkpoints: Sequence[InputCheckpoint], replace_after_recoveries: int,
                 recovery_window_seconds: float, reset_verify_seconds: float,
                 diagnostic_available: bool, on_released: Callable[[Verdict], None] | None) -> None:
        self.shared = shared
        self.checkpoints = tuple(checkpoints)
        self.replace_after_recoveries = replace_after_recoveries
        self.recovery_window_seconds = recovery_window_seconds
        #: Told of each fault an operator released, so a source can forget what it remembers of it (NVML's
        #: memory of a GPU the node had: released, a missing GPU must not come back at the next poll).
        self.on_released = on_released
        self.enricher = Enricher(shared, diagnostic_available=diagnostic_available)
        self.feedback = Feedback(shared, classify=self.classify, reset_verify_seconds=reset_verify_seconds)

    @property
    def store(self) -> RecordStore:
        return self.shared.store

    def handle(self, observation: Observation, now: float) -> list[Verdict]:
        """Classify one observation, record what it changes, acknowledge it."""
        shared = self.shared
        with shared.lock:
            gpus_before = shared.inventory.gpus
            verifying_before = dict(shared.record.node.verifying)
            verdicts = self.classify(observation, now)
            acknowledged = self._acknowledge(observation)
            if verdicts or shared.inventory.gpus != gpus_before or \
                    shared.record.node.verifying != verifying_before or \
                    shared.inventory.gpus != shared.record.gpus:
                shared.save()
            elif acknowledged:
                self.store.save_checkpoints(acknowledged)
        return verdicts

    def tick(self, now: float) -> list[Verdict]:
        """Let time pass: quiet windows may clear faults, drills end, unverified resets fail."""
        shared, feedback = self.shared, self.feedback
        with shared.lock:
            verdicts = [self._escalate(v) for v in [*tick(shared.engine, now, rules=shared.rules),
                                                   *feedback.orphans_quiet(now)]]
            for verdict in verdicts:
                self._record_verdict(verdict, now, None)
            verdicts += feedback.drills_ended(now)
            verdicts += feedback.resets_unverified(now)
            if verdicts:
                shared.save()
        return verdicts

    def classify(self, observation: Observation, now: float) -> list[Verdict]:
        shared = self.shared
        replaced: list[Verdict] = []
        if observation.gpu is not None:
            replaced = self._board_replaced(self._learn(observation.gpu), observation.gpu, now)
            resolved = shared.inventory.resolve(observation.gpu)
            if resolved is not observation.gpu:
                observation = new_observation(observation.signal, observation.value, observation.at,
                                              observation.source, resolved, observation.attrs, observation.count)
        if shared.metrics:
            shared.metrics.observed(observation)
        observation = self.enricher.enrich(observation)
        if observation.signal is Signal.OPERATOR_RELEASE and observation.source == "operator":
            shared.record.node.recoveries.release(observation.gpu_key)
        previous_boot = shared.engine.boot_id
        verdicts = evaluate(observation, shared.engine, now, rules=shared.rules)
        verdicts += self._governed(verdicts, observation, now)
        verdicts += self.feedback.orphan_clears(observation, previous_boot, now)
        if observation.signal is Signal.BOOT and shared.engine.boot_id:
            shared.record.cursors[BOOT_CURSOR] = shared.engine.boot_id
        # A drill's verdict is held to notify (condition, Event, metrics) unless it was a full drill.
        verdicts = [contain(self._escalate(_in_family_of(v, observation))) for v in verdicts]
        for verdict in verdicts:
            self._record_verdict(verdict, now, observation.at)
        if observation.signal is Signal.OPERATOR_RELEASE and observation.source == "operator" and self.on_released:
            for verdict in verdicts:
                self.store.safely("release_hook_failed", self.on_released, verdict)
        return replaced + verdicts + self.feedback.after_observation(observation, now)

    def _governed(self, verdicts: list[Verdict], observation: Observation, now: float) -> list[Verdict]:
        """One incident, one verdict: a contained incident raised now (a `contains` rule: Xid 94, the driver's
        drain-and-reset) governs the errors of its GPU judged without it within the settle window (its own DBE,
        Xid 48, Xid 64, seen first). Each is judged again naming the incident: the fault it raised ends (CLEARED,
        why says so) and its contained rule decides (nobody evicted; reset once idle). Nothing was evicted for
        them meanwhile: evictions wait the same window (PlanOptions.incident_settle_seconds)."""
        shared = self.shared
        out: list[Verdict] = []
        for verdict in verdicts:
            rule = shared.rules.get(verdict.rule_id)
            if verdict.kind is not VerdictKind.FAULT or rule is None or not rule.contains:
                continue
            for governed in self.enricher.governed(verdict.gpu_key, observation.at, verdict.rule_id):
                why = (f"judged with the contained incident {verdict.rule_id} seen "
                       f"{abs(observation.at - governed.at) * 1000:.0f} ms from it (one incident)")
                ended = [v for rule_id in self._uncontained_rules(governed, verdict.gpu_key, now)
                         if (v := withdraw(shared.engine, verdict.gpu_key, rule_id, now, rules=shared.rules,
                                           why=why)) is not None]
                if ended:
                    out += ended + evaluate(governed, shared.engine, now, rules=shared.rules)
        return out

    def _uncontained_rules(self, observation: Observation, gpu_key: str, now: float) -> list[str]:
        """The rules that judge this observation only while no contained incident governs it, and whose fault on
        the GPU was raised within the settle window (an older one is another incident's)."""
        shared = self.shared
        since = now - shared.options.incident_settle_seconds
        code = int(observation.value) if observation.signal is Signal.XID else None
        faults = shared.record.faults
        return [r.id for r in shared.rules.for_signal(observation.signal)
                if (code is None or not r.codes or code in r.codes)
                and any(c.field == CONTAINED_BY and c.op == "absent" for c in r.when)
                and (fault := faults.get((gpu_key, r.id))) is not None and fault.since >= since]

    def _acknowledge(self, observation: Observation) -> list[str]:
        """Move the checkpoints this observation passes (the names moved). Each is written in the same journal
        transaction as what the observation changed, or alone (RecordStore.save_checkpoints): never before it is
        classified nor later, since a kernel-log record read again after a crash would be classified without
        what the agent knew in memory (which workloads faulted elsewhere, the windows)."""
        moved = []
        cursors = self.shared.record.cursors
        for checkpoint in self.checkpoints:
            value = checkpoint.position(observation, self.shared.engine.boot_id)
            if value is not None and checkpoint.newer(value, cursors.get(checkpoint.name)):
                cursors[checkpoint.name] = value
                moved.append(checkpoint.name)
        return moved

    def restore_engine(self, faults: list[ActiveFault]) -> None:
        """The engine's state for faults the record holds (at start, or adopted from the Node's copy)."""
        engine = self.shared.engine
        restore(engine, [f.to_verdict() for f in faults])
        for fault in faults:
            self._pin_recovery(fault)
        engine.boot_id = self.shared.record.cursors.get(BOOT_CURSOR, engine.boot_id)
        if faults:
            self.shared.log.info("faults_restored", count=len(faults))

    def _learn(self, gpu: GpuRef) -> GpuRef | None:
        """A source that knows a GPU's whole identity (NVML, DCGM) teaches it to the inventory, so a
        kernel-log record that names only the PCI bus id, or a lost GPU NVML knows only by index, is
        resolved to the same GPU. The inventory is part of the durable record. Returns the GPU it took the
        place of: another UUID at the same PCI address (a new board in the slot)."""
        shared = self.shared
        if not gpu.uuid or not gpu.pci_bus_id or gpu.mig_parent_uuid or gpu.index is None:
            return None
        if any(known.uuid == gpu.uuid for known in shared.inventory.gpus):
            return None
        wanted = normalise_pci(gpu.pci_bus_id)
        before = next((g for g in shared.inventory.gpus if g.uuid and g.pci_bus_id and
                       normalise_pci(g.pci_bus_id) == wanted), None)
        others = tuple(g for g in shared.inventory.gpus if g.index != gpu.index)
        gpus = tuple(sorted((*others, gpu), key=lambda g: (g.index is None, g.index or 0)))
        shared.inventory = dataclasses.replace(shared.inventory, gpus=gpus)
        shared.metrics_primed = False
        return before

    def _board_replaced(self, old: GpuRef | None, new: GpuRef, now: float) -> list[Verdict]:
        """A GPU marked for replacement whose slot now holds a board with another UUID was replaced: the old
        board's faults end (its recovery history goes with it). Only a replacement mark is so cleared: a GPU that
        merely reads with another UUID while not marked keeps whatever else it had (it is the new board's now)."""
        if old is None or old.uuid == new.uuid:
            return []
        faults = [(rule_id, f) for (key, rule_id), f in self.shared.record.faults.items() if key == old.key]
        if not any(f.action is Action.REPLACE_GPU for _, f in faults):
            return []
        self.shared.log.bind(gpu=old.key).info("gpu_replaced", new_uuid=new.uuid, pci=new.pci_bus_id)
        self.shared.record.node.recoveries.release(old.key)
        by = f"a new board in its slot: {new.uuid} at PCI {new.pci_bus_id} replaced {old.uuid}"
        release = Observation(Signal.OPERATOR_RELEASE, 1, now, "inventory", GpuRef(uuid=old.uuid),
                              frozen_attrs({"by": by}))
        verdicts = self.classify(release, now)
        for verdict in verdicts:
            if self.on_released:
                self.store.safely("release_hook_failed", self.on_released, verdict)
        return verdicts

    def _escalate(self, verdict: Verdict) -> Verdict:
        """A fault that comes back after N verified recoveries of the same GPU from faults of the same family,
        within the window, needs replacing (application, driver and telemetry faults never count)."""
        recoveries = self.shared.record.node.recoveries
        if verdict.kind is VerdictKind.CLEARED:
            why = str(verdict.evidence.get("why", ""))
            ended = self.shared.record.faults.get((verdict.gpu_key, verdict.rule_id))
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

    def fault_of(self, verdict: Verdict) -> ActiveFault:
        """The fault as the record keeps it. One escalated to a replacement clears only by an operator's release
        (or a new board): not by the reset or boot that its rule's fault clears by, which it outlived."""
        if verdict.action is Action.REPLACE_GPU and "escalated_from" in verdict.evidence:
            return ActiveFault.from_verdict(verdict, recovery="operator")
        rule = self.shared.rules.get(verdict.rule_id)
        recovery = rule.recovery.kind if rule is not None else ""
        quiet = float(rule.recovery.quiet_seconds or 0.0) if rule is not None else 0.0
        return ActiveFault.from_verdict(verdict, recovery=recovery, quiet_seconds=quiet)

    def _pin_recovery(self, fault: ActiveFault) -> None:
        """The engine clears this fault as the record says, where that differs from its rule's recovery."""
        rule = self.shared.rules.get(fault.rule_id)
        if rule is not None and fault.recovery == "operator" and rule.recovery.kind != "operator":
            self.shared.engine.pin_recovery(fault.gpu_key, fault.rule_id, fault.recovery)

    def _record_verdict(self, verdict: Verdict, now: float, latency_from: float | None) -> None:
        shared = self.shared
        shared.new_verdict.set()  # with the record's change, under the same lock: no pass sees one without the other
        record = shared.record
        key = (verdict.gpu_key, verdict.rule_id)
        if verdict.kind is VerdictKind.FAULT:
            fault = record.faults[key] = self.fault_of(verdict)
            self._pin_recovery(fault)
        else:
            ended = record.faults.pop(key, None)
            if ended is not None and ended.action.quarantines and shared.metrics:
                shared.metrics.time_to_recovery.observe(max(0.0, now - ended.since))
        still_held = None if shared.options.pods_live else pods_on_faulty_gpus(record.faults.values(), shared.inventory,
                                                                     shared.options)
        record.node.forget_cleared({k for k, _ in record.faults}, still_held=still_held)
        for step in [*verdict_events([verdict], shared.inventory, shared.inventory.name),
                     *reset_required_events([verdict], record.faults, shared.options)]:
            record.owe(OwedEvent.of(step, salt=f"{verdict.kind}@{verdict.at}"))
        log = shared.log.bind(gpu=verdict.gpu_key, rule_id=verdict.rule_id)
        level = "warning" if verdict.kind is VerdictKind.FAULT and verdict.severity.rank >= Severity.WARNING.rank \
            else "info"
        getattr(log, level)("verdict", kind=str(verdict.kind), severity=str(verdict.severity),
                            action=str(verdict.action), fault_class=str(verdict.fault_class),
                            summary=verdict.summary)
        journal = self.store.journal
        if journal:
            self.store.journaled("verdict", "journal_verdict_failed", journal.record_verdict, shared.inventory.name,
                                 verdict)
        if shared.metrics:
            latency = now - latency_from if latency_from is not None else None
            shared.metrics.judged(verdict, latency)

    def occurrences(self, gpu_key: str, rule_id: str) -> int:
        state = self.shared.engine.rules.get((gpu_key, rule_id))
        return state.occurrences if state else 0


def _in_family_of(verdict: Verdict, observation: Observation) -> Verdict:
    """A failed reset's fault takes the family of the fault whose reset failed (the observation says which)."""
    family = observation.attrs.get("fault_class")
    if observation.signal is not Signal.RESET_FAILED or verdict.kind is not VerdictKind.FAULT or \
            not isinstance(family, str) or family not in FaultClass.__members__.values():
        return verdict
    return dataclasses.replace(verdict, fault_class=FaultClass(family))

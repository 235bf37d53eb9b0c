"""The reconciler, on one thread: observe the Node -> the steps the record calls for -> guard -> act -> record."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping

from agent.control.brake_waits import BrakeWaits
from agent.control.classifier import Classifier
from agent.control.seams import Outcome
from agent.control.shared import Shared
from agent.control.steps import StepRunner
from agent.control.waiting import NODE_MARKS
from agent.model import (
    NODE_KEY,
    Action,
    ActionRecord,
    GpuRef,
    Observation,
    PodRef,
    Signal,
    Step,
    StepKind,
    StepResult,
    Verdict,
    frozen_attrs,
)
from agent.remediation import ClusterView, NodeState, plan
from agent.remediation.backoff import OWED_CAP_SECONDS, failed_pass_delay
from agent.remediation.guard import node_writes_refused
from agent.remediation.planner import awaiting_reset, next_settled
from agent.remediation.record import NodeObservation, mirror_of

_ROUNDS = 3
#: Reads of the fleet view in one pass's start while a verdict lands during the read (its fault unjudged).
_VIEW_READS = 3


class Reconciler:
    """Level-triggered: each pass converges the real Node to the record and delivers the Events it owes."""

    def __init__(self, shared: Shared, *, classifier: Classifier, runner: StepRunner, sync_seconds: float,
                 pods: Callable[[], tuple[PodRef, ...]] | None,
                 offered: Callable[[], frozenset[str] | None] | None = None) -> None:
        self.shared = shared
        self.classifier = classifier
        self.runner = runner
        self.sync_seconds = sync_seconds
        self.pods = pods
        #: The GPUs the kubelet may still give a new pod (agent.k8s.pods.PodFinder.offered); None: no kubelet.
        self.offered = offered
        self.due_at = 0.0
        self._pass = threading.Lock()
        self._passes = 0
        #: Failing passes in a row (agent.remediation.backoff): each doubles the wait before the next, to a cap.
        self._failing_passes = 0
        self._pass_verdicts: list[Verdict] = []
        #: What the last plan that called for nothing was made from, and until when time cannot change it.
        self._quiet_plan: tuple[tuple[object, ...], float] | None = None
        #: The release request last handled where the guard refuses Node writes (it stays on the Node).
        self._release_handled = ""
        #: The quarantine brake's waits: their Event, an operator's confirm (agent/control/brake_waits.py).
        self.brake = BrakeWaits(shared, runner.actuator)
        runner.on_claim_refused = self.brake.claim_refused
        #: Whether the per-GPU isolation's view (published GPUs, the agent's DeviceTaintRules) was read once.
        self._devices_read = False

    def reconcile(self, now: float | None = None) -> Outcome:
        """One level-triggered pass: read the Node, converge it to the record, deliver owed Events. Returns
        the steps taken and the verdicts they led to (a release read from the Node, a verified reset)."""
        shared, runner = self.shared, self.runner
        with self._pass:
            now = shared.clock() if now is None else now
            self._pass_verdicts = []
            runner.begin_pass()
            observed = self.observe_and_adopt(now)
            opted_out = observed.opted_out if observed is not None else False
            self.brake.observed(observed.confirm if observed is not None else "")
            # The taint first: it keeps new work off the GPU and needs neither the pod list nor the Events.
            shared.new_verdict.clear()
            actions = self._taint_first(now, opted_out)
            if self.pods is not None and self._wants_pods():
                self.refresh_pods()
            for _ in range(_ROUNDS):
                with shared.lock:
                    steps = self._plan(now)
                done, preempted = self._carry_out_plan(steps, now, opted_out)
                actions += done
                progressed, verdicts = self.classifier.feedback.after_actions(done, now)
                self._pass_verdicts.extend(verdicts)
                if not (progressed or preempted):
                    break
                if self.pods is not None:
                    self.refresh_pods()
            actions += runner.deliver_owed(now, opted_out, self._taint_if_wanted)
            actions += self._taint_if_wanted(opted_out)
            writes_refused = bool(node_writes_refused(policy=runner.policy, cluster=ClusterView(opted_out=opted_out)))
            self.brake.end_pass(writes_refused=writes_refused)
            runner.hold_slot(observed, now, opted_out, first_pass=self._passes == 0)
            if shared.fleet is not None and not writes_refused:
                shared.fleet.tidy()  # this node's claim on the brake, once its window has passed
            runner.forget_skips()
            self._mirror(observed, writes_refused, bool(actions) or bool(runner.waiting.steps))
            actions += runner.flush_node(now, reopen=False)  # the pass's Node changes, in one write
            self._schedule(actions, now)
            self._passes += 1
            shared.update_metrics(bool(actions))
            return Outcome(self._pass_verdicts, actions)

    def _mirror(self, observed: NodeObservation | None, writes_refused: bool, acted: bool) -> None:
        """The record to the Node's annotation where it differs (never where the guard refuses Node writes)."""
        shared = self.shared
        with shared.lock:
            if acted:
                shared.save()
            record = shared.record
            document = mirror_of(record.to_json())
            worth_mirroring = bool(record.faults or record.owed or record.node.to_json() != NodeState().to_json())
        # With the fleet view on, also a healthy node's, once (no record on the Node yet): its fleet summary, in
        # the same patch, makes the node count in its groups (driver, model, fabric domain) before it faults,
        # so a correlated cause's hold covers its healthy nodes too.
        publishes = shared.fleet is not None
        if observed is not None and (observed.record is not None or worth_mirroring or publishes) and \
                not _same_record(observed.record, document) and not writes_refused:
            shared.store.safely("mirror_failed", self.runner.actuator.mirror, document)

    def _schedule(self, actions: list[ActionRecord], now: float) -> None:
        runner = self.runner
        unreadable = runner.gate_reading is not None and bool(runner.gate_reading.error)
        failed = unreadable or any(a.result is StepResult.FAILED for a in actions)
        # Failing passes in a row (a request that failed past its retries, not a refusal); a pass that asked
        # and was answered ends the run, a pass that asked nothing leaves it as it is.
        asked = bool(actions) or runner.gate_reading is not None
        self._failing_passes = self._failing_passes + 1 if failed else 0 if asked else self._failing_passes
        retry = any(a.result in {StepResult.BLOCKED, StepResult.FAILED} for a in actions) or \
            bool(self.shared.record.owed)
        due = now + self.sync_seconds
        if failed:  # soon, doubling while the failures go on (2 s, 4 s, ... up to retry_seconds)
            cap = min(runner.retry_seconds, OWED_CAP_SECONDS) if runner.owes_disruption else runner.retry_seconds
            soon = now + failed_pass_delay(self._failing_passes, cap_seconds=cap) * \
                runner.rng.uniform(1.0, 1.25)
            if unreadable:  # every gate block of this pass was the failure: the gated steps are asked again too
                runner.backoff_until = min(runner.backoff_until, soon)
            due = min(due, soon)
        elif retry:
            due = min(due, max(runner.backoff_until, now + runner.retry_seconds * runner.rng.uniform(1.0, 1.25)))
        fleet, settle_until = self.shared.fleet, self.brake.settle_until
        if fleet is not None and settle_until is not None:  # a holdable fault's settle ends: act on its word then
            due = min(due, now + max(0.0, settle_until - fleet.clock()))
        with self.shared.lock:  # the source thread changes the record meanwhile
            settled = next_settled(list(self.shared.record.faults.values()), self.shared.record.node,
                                   self.shared.options, now)
        self.due_at = min(due, settled) if settled is not None else due

    def _plan(self, now: float) -> list[Step]:
        """The planner's steps; not planned again while its inputs (faults, node state, inventory) are those of
        the last plan that called for nothing and no settling reset came due: that plan would be the same."""
        shared = self.shared
        faults = shared.resolved_faults()
        inputs = (faults, shared.record.node.to_json(), shared.inventory, shared.options)
        quiet = self._quiet_plan
        if quiet is not None and quiet[0] == inputs and now < quiet[1]:
            return []
        steps = plan([], faults, shared.record.node, shared.inventory, options=shared.options, now=now)
        settled = next_settled(faults.values(), shared.record.node, shared.options, now)
        self._quiet_plan = None if steps else (inputs, settled if settled is not None else float("inf"))
        return steps

    def _carry_out_plan(self, steps: list[Step], now: float, opted_out: bool) -> tuple[list[ActionRecord], bool]:
        """The steps in order, and whether a new verdict preempted them: a plan made before it is stale (it may
        lift the taint a new fault needs, or evict for a GPU just released), so the rest of it is dropped, the
        taint a new fault calls for goes at once, and the next round plans again."""
        done: list[ActionRecord] = []
        for step in steps:
            if self.shared.new_verdict.is_set():
                return done + self._taint_if_wanted(opted_out), True
            if step.kind not in NODE_MARKS and step.kind is not StepKind.EVENT and self.runner.waiting.taint:
                done += self.runner.flush_node(now, reopen=True)  # an eviction or a reset finds the taint there
            record = self.runner.carry_out(step, now, opted_out)
            if record is not None:
                done.append(record)
        return done, False

    def _taint_if_wanted(self, opted_out: bool) -> list[ActionRecord]:
        """After a verdict recorded while this pass was under way, the taint a new fault calls for (when one is
        due), before the pass's remaining writes: a scheduler stops placing work on the GPU as soon as possible."""
        if not self.shared.new_verdict.is_set():
            return []
        self.shared.new_verdict.clear()
        return self._taint_first(self.shared.clock(), opted_out)

    def _taint_first(self, now: float, opted_out: bool) -> list[ActionRecord]:
        """The plan's taint step (plan() puts it first) carried out before the slower reads and reports. First
        the fleet's word on the faults as they are now (at the start of a pass, and after each new verdict)."""
        shared = self.shared
        for _ in range(_VIEW_READS):  # a verdict landing during the read is judged by the next, not a pass later
            with shared.lock:
                node, active = shared.record.node, list(shared.record.faults.values())
                quarantined = node.tainted or any(m.effect != "None" for m in node.device_taints.values())
            view = shared.fleet_view = self.brake.view(active, quarantined=quarantined)
            with shared.lock:
                if view.judged is None or all((f.gpu_key, f.rule_id) in view.judged
                                              for f in shared.record.faults.values()):
                    break
        with shared.lock:
            faults = shared.resolved_faults()
            if shared.record.node.tainted or not any(f.action.quarantines for f in faults.values()):
                return []  # no taint is due: nothing to plan twice
            steps = self._plan(now)
        first = steps[0] if steps and steps[0].kind is StepKind.TAINT else None
        record = self.runner.carry_out(first, now, opted_out) if first is not None else None
        # Written at once (with what else waits): the taint keeps new work off the GPU before anything else.
        landed = self.runner.flush_node(now, reopen=True) if self.runner.waiting.taint else []
        return ([record] if record is not None else []) + landed

    def observe_and_adopt(self, now: float) -> NodeObservation | None:
        """Read the Node; adopt its copy of the record where newer; take in an operator's release request."""
        shared, runner = self.shared, self.runner
        observed = shared.store.safely("node_unreadable", runner.actuator.observe, self._wants_devices())
        if not isinstance(observed, NodeObservation):
            return None
        self._devices_read = self._devices_read or observed.devices is not None or observed.device_taints is not None
        with shared.lock:
            self._adopt(observed.record)
            shared.record.node = observed.actual(shared.record.node)
            if observed.devices is not None:
                shared.options = dataclasses.replace(shared.options, devices=observed.devices)
        self._read_offered()
        refused = node_writes_refused(policy=runner.policy, cluster=ClusterView(opted_out=observed.opted_out))
        if observed.release and not (refused and observed.release == self._release_handled):
            target = observed.release.split("@", 1)[0].strip() or "all"
            gpu = None if target in {"all", NODE_KEY} else GpuRef(uuid=target)
            release = Observation(Signal.OPERATOR_RELEASE, 1, now, "operator", gpu,
                                  frozen_attrs({"by": "annotation gpu-health-agent.io/release"}))
            with shared.lock:
                verdicts = self.classifier.classify(release, now)
                shared.save()
                document = mirror_of(shared.record.to_json())
            self._pass_verdicts.extend(verdicts)
            # The Node's copy says "released" before the request goes: a journal lost now cannot bring the
            # fault back. Not mirrored: the request stays and the next pass handles it again (idempotent).
            # Where the guard refuses Node writes (dry-run, opt-out) the request stays, handled once here.
            if refused:
                self._release_handled = observed.release
            elif shared.store.safely("mirror_failed", runner.actuator.mirror, document) is not False:
                shared.store.safely("release_not_consumed", runner.actuator.consume_release, observed.release)
            if verdicts:
                shared.wake.set()
        return observed

    def _adopt(self, document: Mapping[str, object] | None) -> None:
        """The Node's copy of the record, where the store takes it: the engine follows the faults it changed."""
        shared = self.shared
        adopted = shared.store.adopt(document)
        if adopted is None:
            return
        self.classifier.restore_engine(adopted.brought)
        for key in adopted.ended:
            shared.engine.forget(*key)
        shared.merge_gpus(shared.record.gpus)
        shared.save()
        shared.log.info("record_adopted_from_node", generation=adopted.generation, faults=len(shared.record.faults))

    def _read_offered(self) -> None:
        """Which GPUs the kubelet still offers, asked only while a GPU waits for a reset the mode never runs
        (whether the device plugin keeps it off decides whether the node must be tainted instead)."""
        shared = self.shared
        with shared.lock:
            waiting = bool(awaiting_reset(shared.record.faults.values(), shared.options))
        offered = self.offered() if waiting and self.offered is not None else None
        with shared.lock:
            if offered != shared.options.offered:
                shared.options = dataclasses.replace(shared.options, offered=offered)

    def _wants_devices(self) -> bool:
        """The DRA reads (two lists a pass) only where they can matter: once at start (rules an earlier agent
        left), then while a fault is active or a device mark is on the record; a healthy node makes none."""
        with self.shared.lock:  # the source thread changes the record meanwhile
            return not self._devices_read or bool(self.shared.record.faults) or \
                bool(self.shared.record.node.device_taints)

    def _wants_pods(self) -> bool:
        with self.shared.lock:  # the source thread changes the record meanwhile
            return any(f.action.rank >= Action.RESET_WHEN_IDLE.rank for f in self.shared.record.faults.values()) or \
                any(e.pending_pod for e in self.shared.record.owed)

    def refresh_pods(self) -> None:
        if self.pods is None:
            return
        try:
            pods = self.pods()
        except Exception as exc:  # noqa: BLE001 - an unreadable pod list keeps the last one
            self.shared.log.warning("pods_refresh_failed", error=str(exc))
            return
        with self.shared.lock:
            self.shared.inventory = dataclasses.replace(self.shared.inventory, pods=pods)


def _same_record(mirrored: Mapping[str, object] | None, document: Mapping[str, object]) -> bool:
    """Equal but for the generation counter (a pass that changed nothing on the Node writes nothing)."""
    if mirrored is None:
        return False
    return {k: v for k, v in mirrored.items() if k != "generation"} == \
        {k: v for k, v in document.items() if k != "generation"}

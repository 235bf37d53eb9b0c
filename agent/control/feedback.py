"""Feedback: action results and elapsed time turned into observations (resets, diagnostics, drills, orphans)."""

from __future__ import annotations

from collections.abc import Callable

from agent.control.shared import Shared
from agent.diagnostics import DiagnosticOutcome, DiagnosticResult
from agent.drill import DRILL_PREFIX, DRILL_SECONDS
from agent.engine import reset_clears
from agent.model import (
    LIFECYCLE_SIGNALS,
    NODE_KEY,
    Action,
    ActionRecord,
    AttrValue,
    GpuRef,
    Observation,
    Severity,
    Signal,
    StepKind,
    StepResult,
    Verdict,
    VerdictKind,
    frozen_attrs,
)
from agent.remediation import ActiveFault
from agent.remediation.recoveries import family_of
from agent.remediation.resets import driver_log_recovery, unclean

#: Why a fault cleared whose recovery the driver reported done (no reset): not a recovery of the GPU's hardware.
DRIVER_RECOVERED = "recovery reported done by the driver, verified by a clean poll"
_RESET_WHEN_IDLE = frozenset({Action.RESET_WHEN_IDLE, Action.QUARANTINE_RESET_WHEN_IDLE})
TOOK_EFFECT = frozenset({StepResult.APPLIED, StepResult.PLANNED, StepResult.DRY_RUN})

Classify = Callable[[Observation, float], list[Verdict]]


class Feedback:
    """Turns action results and elapsed time into observations for the classifier (called under the lock)."""

    def __init__(self, shared: Shared, *, classify: Classify, reset_verify_seconds: float) -> None:
        self.shared = shared
        self.classify = classify
        self.reset_verify_seconds = reset_verify_seconds

    # ---- action results (the reconciler thread) ----
    def after_actions(self, done: list[ActionRecord], now: float) -> tuple[bool, list[Verdict]]:
        """Whether further steps may now proceed (evictions took effect, a diagnostic's verdict, a failed reset),
        and the verdicts the results led to; a reset command that succeeded waits for the clean poll."""
        progressed, verdicts = False, []
        shared = self.shared
        for action in done:
            kind, result = action.step.kind, action.result
            if kind is StepKind.EVICT and result in TOOK_EFFECT:
                progressed = True
            elif kind is StepKind.RESET_GPU and result is StepResult.APPLIED:
                with shared.lock:
                    shared.record.node.verifying[action.step.gpu_key] = now
                    shared.save()
            elif kind is StepKind.RESET_GPU and result is StepResult.FAILED:
                gpu = shared.inventory.gpu_by_key(action.step.gpu_key)
                with shared.lock:
                    shared.record.node.resets.add(action.step.gpu_key)  # not retried: the reboot takes over
                    failed = self.reset_failed(gpu, now, f"the reset command failed: {action.message}")
                    shared.save()
                verdicts += failed
                progressed = progressed or bool(failed)
            elif kind is StepKind.RUN_DIAGNOSTIC and result is StepResult.APPLIED:
                diagnosed = self._diagnosed(action, now)
                verdicts += diagnosed
                progressed = bool(diagnosed) or progressed
        return progressed, verdicts

    def _diagnosed(self, action: ActionRecord, now: float) -> list[Verdict]:
        """A diagnostic that gave a verdict becomes a `diagnostic` observation with its depth (`level`, `eud`): a
        pass releases (or, short of NVIDIA's EUD, only downgrades), a failure is a fault."""
        diagnosed = DiagnosticResult.of_message(action.message)
        if diagnosed.outcome is DiagnosticOutcome.INCONCLUSIVE:
            return []
        key = action.step.gpu_key
        result = Observation(Signal.DIAGNOSTIC, 1 if diagnosed.outcome is DiagnosticOutcome.PASS else 0, now,
                             "diagnostic", self.shared.inventory.gpu_by_key(key),
                             frozen_attrs({"message": action.message, "level": diagnosed.level, "eud": diagnosed.eud}))
        with self.shared.lock:
            self.shared.record.node.diagnosed.add(key)
            verdicts = self.classify(result, now)
            self.shared.save()
        return verdicts

    # ---- after an observation was judged (the classifier) ----
    def after_observation(self, observation: Observation, now: float) -> list[Verdict]:
        return self._verify_reset(observation, now) + self._diagnostic_passed(observation, now)

    def _diagnostic_passed(self, observation: Observation, now: float) -> list[Verdict]:
        """A passing diagnostic releases the GPU's faults that waited for one (recovery `diagnostic`). One short of
        NVIDIA's EUD (`shallow`, the enricher's: below level 3, or no eud test passed) only downgrades: it lifts
        their quarantine, and the GPU stays suspected (gpu-diagnostic-shallow-pass, degraded, raised by the same
        observation) until a diagnostic at that depth passes or an operator releases it."""
        if observation.signal is not Signal.DIAGNOSTIC or observation.value != 1:
            return []
        key = observation.gpu_key
        shallow = observation.attrs.get("shallow")
        by = "a passing diagnostic"
        if shallow:
            by = (f"a passing diagnostic short of NVIDIA's EUD ({shallow}): the quarantine lifted, the GPU still "
                  "suspected (gpu-diagnostic-shallow-pass)")
        verdicts: list[Verdict] = []
        for (gpu_key, rule_id), fault in list(self.shared.record.faults.items()):
            if gpu_key == key and fault.recovery == "diagnostic" and (not shallow or fault.action.quarantines):
                verdicts += self.release_one(rule_id, fault.gpu or observation.gpu, now, source="diagnostic", by=by)
        return verdicts

    def release_one(self, rule_id: str, gpu: GpuRef | None, now: float, *, source: str, by: str) -> list[Verdict]:
        """One fault released by the agent itself (a passing diagnostic, the end of a drill): that rule only."""
        release = Observation(Signal.OPERATOR_RELEASE, 1, now, source, gpu, frozen_attrs({"by": by, "rule": rule_id}))
        return self.classify(release, now)

    def _verify_reset(self, observation: Observation, now: float) -> list[Verdict]:
        """A reset awaits a clean poll of its GPU; a reset by someone else (the driver's Xid 154 line) too. A
        recovery the driver reports done that is no reset (Xid 154 5 -> 0, the IMEX domain) awaits one too, and
        that poll verifies only it: each recovery action is its own requirement (a GSP timeout still wants its
        reset)."""
        key = observation.gpu_key
        record = self.shared.record
        node = record.node
        reported = driver_log_recovery(observation)
        if reported and any(f.recovery in {"reset", "recovered"} for (k, _), f in record.faults.items() if k == key):
            if reported == "reset":
                node.recovering.discard(key)
            elif key not in node.verifying:
                node.recovering.add(key)
            if key not in node.verifying:
                node.verifying[key] = now
                self.shared.log.bind(gpu=key).info("reset_seen_in_driver_log", awaiting="a clean poll",
                                                   reported=reported)
            return []
        since = node.verifying.get(key)
        if observation.signal is Signal.GPU_POLLED and since is None and key not in node.mig_expected:
            self._note_mig_geometry(key, observation)
        if observation.signal is not Signal.GPU_POLLED or since is None or observation.at <= since:
            return []
        reasons = unclean(observation, mig_expected=node.mig_expected.get(key, 0))
        if reasons:
            self.shared.log.bind(gpu=key).info("reset_not_verified_yet", poll="; ".join(reasons))
            return []
        del node.verifying[key]
        node.mig_expected.pop(key, None)
        recovered_only = key in node.recovering and key not in node.resets  # the agent reset nothing either
        node.recovering.discard(key)
        awaiting = {f.recovery for (k, _), f in record.faults.items() if k == key} & {"reset", "recovered"}
        attrs = {"by": "a reset verified by a clean poll"}
        if recovered_only:
            attrs = {"by": "the driver's report verified by a clean poll", "why": DRIVER_RECOVERED,
                     "clears": "recovered"}
        elif awaiting == {"recovered"}:  # no reset: the driver reported the recovery it asked of someone else done
            attrs = {"by": "the driver's report verified by a clean poll", "why": DRIVER_RECOVERED}
        reset = Observation(Signal.GPU_RESET, 1, now, "remediation", observation.gpu, frozen_attrs(attrs))
        return self.classify(reset, now)

    def _note_mig_geometry(self, key: str, poll: Observation) -> None:
        """A MIG GPU's MIG devices as this poll (outside a reset) counted them: what its next reset restores."""
        mig = poll.attrs.get("mig_devices")
        if isinstance(mig, int | float) and mig > 0:
            self.shared.mig_seen[key] = int(mig)
        else:
            self.shared.mig_seen.pop(key, None)

    def reset_failed(self, gpu: GpuRef | None, now: float, message: str) -> list[Verdict]:
        """A reset that failed is a fault of the family of the fault it was for (a driver fault's failed reset
        says nothing about the GPU's hardware, so it never counts towards a replacement)."""
        key = gpu.key if gpu is not None else NODE_KEY
        attrs: dict[str, AttrValue] = {"message": message, "when_idle_only": self._only_reset_when_idle(key)}
        wanting = [f for (k, _), f in self.shared.record.faults.items()
                   if k == key and (f.action.resets or f.recovery in {"reset", "recovered"})]
        if wanting:
            worst = max(wanting, key=lambda f: (f.action.rank, family_of(f.fault_class) != ""))
            attrs["fault_class"] = str(worst.fault_class)
        failed = Observation(Signal.RESET_FAILED, 1, now, "remediation", gpu, frozen_attrs(attrs))
        return self.classify(failed, now)

    def _only_reset_when_idle(self, key: str) -> bool:
        """Whether every fault acting on this GPU asks only for a reset once it is idle (a pending row remap or
        page retirement, a contained Xid 94): then a failed reset keeps the GPU out, it does not call for a
        reboot that would disrupt the node's other GPUs (rules/node.yaml gpu-reset-failed-when-idle)."""
        acting = [f.action for (k, _), f in self.shared.record.faults.items()
                  if k == key and (f.action.resets or f.action.quarantines)]
        return bool(acting) and all(a in _RESET_WHEN_IDLE for a in acting)

    # ---- the clock (tick) ----
    def resets_unverified(self, now: float) -> list[Verdict]:
        """A reset with no clean poll within the deadline failed: the node needs a reboot."""
        verdicts: list[Verdict] = []
        verifying = self.shared.record.node.verifying
        for key, since in list(verifying.items()):
            if key in verifying and now - since >= self.reset_verify_seconds:  # a verdict below may end another
                del verifying[key]
                self.shared.record.node.mig_expected.pop(key, None)
                self.shared.record.node.recovering.discard(key)
                verdicts += self.reset_failed(self.shared.inventory.gpu_by_key(key), now,
                                              f"no clean poll within {self.reset_verify_seconds:g}s of the reset")
        return verdicts

    def drills_ended(self, now: float) -> list[Verdict]:
        """A drill's fault ends by itself once its alert has had time to fire: released, that fault only."""
        verdicts: list[Verdict] = []
        for (gpu_key, rule_id), fault in list(self.shared.record.faults.items()):
            if not fault.summary.startswith(DRILL_PREFIX) or now - fault.since < DRILL_SECONDS:
                continue
            state = self.shared.engine.rules.get((gpu_key, rule_id))
            if state is not None and state.occurrences > 1:
                continue  # the same fault came again during the drill: it is real, an operator releases it
            verdicts += self.release_one(rule_id, fault.gpu, now, source="drill", by="the end of the drill")
        return verdicts

    # ---- faults whose rule a reload renamed or removed ----
    def orphan_clears(self, observation: Observation, previous_boot: str, now: float) -> list[Verdict]:
        """Faults whose rule a reload renamed or removed clear by the recovery they were raised with."""
        if observation.signal not in LIFECYCLE_SIGNALS:
            return []
        cleared = []
        for (key, rule_id), fault in list(self.shared.record.faults.items()):
            if self.shared.rules.get(rule_id) is not None:
                continue
            if observation.signal is Signal.BOOT:
                boot_id = str(observation.attrs.get("boot_id", ""))
                why = "new boot" if previous_boot and boot_id != previous_boot and \
                    fault.recovery in {"boot", "reset", "recovered"} else ""
            elif observation.signal is Signal.GPU_RESET:
                why = "verified GPU reset" if observation.value and observation.gpu_key == key and \
                    fault.recovery in reset_clears(observation) else ""
            else:
                why = f"released by {observation.attrs.get('by', 'operator')}" \
                    if observation.gpu_key in {NODE_KEY, key} else ""
            if why:
                cleared.append(self._orphan_cleared(fault, now, why))
        return cleared

    def orphans_quiet(self, now: float) -> list[Verdict]:
        return [self._orphan_cleared(f, now, f"quiet for {f.quiet_seconds:g}s")
                for (_, rule_id), f in list(self.shared.record.faults.items())
                if self.shared.rules.get(rule_id) is None and f.recovery == "quiet" and f.quiet_seconds > 0
                and now - f.since >= f.quiet_seconds]

    def _orphan_cleared(self, fault: ActiveFault, now: float, why: str) -> Verdict:
        self.shared.engine.forget(fault.gpu_key, fault.rule_id)
        return Verdict(VerdictKind.CLEARED, fault.rule_id, fault.gpu_key, Severity.OK, fault.action,
                       fault.fault_class, now, f"cleared: {why}", fault.gpu,
                       frozen_attrs({"occurrences": fault.occurrences, "active_since": fault.since, "why": why}))

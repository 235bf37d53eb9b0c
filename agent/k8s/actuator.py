"""Carries out remediation steps on the cluster: conditions, the taint, evictions, reboot requests; a GPU reset
through the GPU edge's procedure it is given."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.diagnostics import DiagnosticOutcome, DiagnosticRunner
from agent.fleet import NodeSummary
from agent.fleet.published import QUARANTINE_LABEL, SUMMARY_ANNOTATION, quarantine_label
from agent.k8s.bodies import ObjectReference
from agent.k8s.errors import K8sError
from agent.k8s.events import EventRecorder
from agent.k8s.evictions import EvictionOutcome, Evictor
from agent.k8s.isolation import DeviceIsolator
from agent.k8s.node import (
    CONDITION_REBOOT,
    CONFIRM_ANNOTATION,
    REBOOT_ANNOTATION,
    RELEASE_ANNOTATION,
    REPLACE_ANNOTATION,
    REPLACEMENT_LABEL,
    STATE_ANNOTATION,
    NodeWriter,
)
from agent.model import Step, StepKind, StepResult
from agent.remediation.record import NodeObservation
from agent.timefmt import rfc3339

#: The GPU edge's reset procedure (agent/gpu/reset.py ResetProcedure): GPU UUID in, (done, what happened) out;
#: done None: not attempted, the GPU still held (not idle yet): the step is blocked, asked again, never failed.
ResetRunner = Callable[[str], tuple[bool | None, str]]

_ACTIONS = {
    StepKind.EVENT: "Record", StepKind.SET_CONDITION: "SetCondition", StepKind.CLEAR_CONDITION: "ClearCondition",
    StepKind.TAINT: "Taint", StepKind.UNTAINT: "Untaint", StepKind.TAINT_DEVICE: "TaintDevice",
    StepKind.UNTAINT_DEVICE: "UntaintDevice", StepKind.EVICT: "Evict", StepKind.RESET_GPU: "ResetGpu",
    StepKind.REBOOT_REQUEST: "RequestReboot", StepKind.CLEAR_REBOOT_REQUEST: "ClearRebootRequest",
    StepKind.MARK_REPLACEMENT: "MarkReplacement", StepKind.UNMARK_REPLACEMENT: "UnmarkReplacement",
    StepKind.RUN_DIAGNOSTIC: "RunDiagnostic",
}


def unwired_reset(uuid: str) -> tuple[bool | None, str]:
    """The reset of an actuator no reset procedure was given to (agent/gpu/reset.py builds the real one)."""
    return False, f"no reset procedure wired: {uuid} not reset"


@dataclass(slots=True)
class K8sActuator:
    """Applies planner steps through the Kubernetes API; each failure is reported, none stops the others."""

    writer: NodeWriter
    events: EventRecorder
    evictor: Evictor
    reset: ResetRunner = unwired_reset
    reboot_sentinel: str = ""
    on_stuck: Callable[[str], None] = lambda pod: None
    opt_out_label: str = ""
    #: Runs a GPU diagnostic (remediation.diagnostic_command); None: none configured.
    diagnose: DiagnosticRunner | None = None
    #: Per-GPU isolation through DRA (with `isolation: node` it only deletes rules left from an earlier
    #: setting); None where no cluster is behind the actuator (tests, simulate without DRA).
    devices: DeviceIsolator | None = None
    #: The fleet summary of a mirrored record (agent.fleet.summariser.Summariser); None: none is published.
    summarise: Callable[[Mapping[str, object]], NodeSummary] | None = None

    def observe(self, devices: bool = True) -> NodeObservation:
        """The Node (the agent's marks, the mirrored record, a release request, the opt-out) from the live
        watch's cache or one GET, and with per-GPU isolation (when `devices`) the node's published GPUs and
        the agent's DeviceTaintRules."""
        observed = self.writer.read().observation(opt_out_label=self.opt_out_label)
        if self.devices is None or not devices:
            return observed
        isolation, rules = self.devices.read()
        return dataclasses.replace(observed, devices=isolation, device_taints=rules)

    def mirror(self, document: Mapping[str, object]) -> None:
        """The record, and with a summariser the fleet summary and the brake's quarantine label, in one write
        (the same refusal guards all three)."""
        if self.summarise is None:
            self.writer.save_record(document, join_batch=True)
            return
        text = json.dumps(document, sort_keys=True, separators=(",", ":"))
        summary = self.summarise(document)
        self.writer.set_metadata(labels={QUARANTINE_LABEL: quarantine_label(summary.quarantined_since)},
                                 annotations={STATE_ANNOTATION: text, SUMMARY_ANNOTATION: summary.to_json()},
                                 join_batch=True)

    def consume_release(self, value: str) -> None:
        """Remove the release request, unless the operator wrote a new one meanwhile."""
        self._consume(RELEASE_ANNOTATION, value)

    def consume_confirm(self, value: str) -> None:
        """Remove the operator's confirm of a braked taint, unless a new one was written meanwhile."""
        self._consume(CONFIRM_ANNOTATION, value)

    def _consume(self, annotation: str, value: str) -> None:
        if self.writer.staged_annotation(annotation) == value:
            self.writer.set_metadata(annotations={annotation: None}, join_batch=True)

    def begin_batch(self) -> None:
        """The Node writes of the pass now starting wait for `write_node` (agent.k8s.node NodeWriter.flush)."""
        self.writer.begin_batch()

    def write_node(self) -> str:
        """The pass's Node marks in one write (two where both the taint and a condition change); the API's
        refusal as one line, "" when written or nothing was to be written."""
        try:
            self.writer.flush()
        except K8sError as exc:
            return str(exc)
        return ""

    def apply(self, step: Step) -> tuple[StepResult, str]:
        try:
            return self._apply(step)
        except K8sError as exc:
            return StepResult.FAILED, str(exc)

    def _apply(self, step: Step) -> tuple[StepResult, str]:
        kind, details = step.kind, step.details
        if kind is StepKind.EVENT:
            regarding = self._regarding(step.target, uid=str(details.get("target_uid", "")))
            self.events.record(regarding=regarding, reason=str(details.get("reason", "GpuHealth")),
                               action=_ACTIONS[kind], note=step.reason, type_=str(details.get("type", "Warning")),
                               event_id=str(details.get("event_id", "")))
            return StepResult.APPLIED, "event recorded"
        if kind in {StepKind.SET_CONDITION, StepKind.CLEAR_CONDITION}:
            # SET reports a problem, CLEAR withdraws it: a problem condition's status, unless the step says
            # which status means that (AcceleratedHardwareReady: a problem is False).
            reported = kind is StepKind.SET_CONDITION
            status = str(details.get("node_status", "True" if reported else "False")) == "True"
            changed = self.writer.set_condition(step.target, status=status, create=reported,
                                                reason=str(details.get("reason", "GpuHealth")),
                                                message=str(details.get("message", step.reason)), join_batch=True)
            return StepResult.APPLIED, "condition set" if changed else "condition already so"
        if kind is StepKind.TAINT:
            changed = self.writer.set_taint(True, join_batch=True)
            return StepResult.APPLIED, "taint added" if changed else "taint already present"
        if kind is StepKind.UNTAINT:
            changed = self.writer.set_taint(False, join_batch=True)
            return StepResult.APPLIED, "taint removed" if changed else "no taint of ours"
        if kind in {StepKind.TAINT_DEVICE, StepKind.UNTAINT_DEVICE}:
            if self.devices is None:
                return StepResult.SKIPPED, "no DeviceTaintRules here"
            return self.devices.apply(step)
        if kind is StepKind.EVICT:
            return self._evict(step)
        if kind is StepKind.RESET_GPU:
            ok, message = self.reset(step.target)
            if ok is None:
                return StepResult.BLOCKED, f"GPU still held, not idle yet: {message}"
            return (StepResult.APPLIED if ok else StepResult.FAILED), message
        if kind is StepKind.RUN_DIAGNOSTIC:
            if self.diagnose is None:
                return StepResult.SKIPPED, "no diagnostic command configured"
            result = self.diagnose(step.target)
            # Applied: the diagnostic gave a verdict (the message says which, and how deep); failed: it decided
            # nothing.
            return (StepResult.FAILED if result.outcome is DiagnosticOutcome.INCONCLUSIVE else StepResult.APPLIED), \
                result.message()
        if kind is StepKind.REBOOT_REQUEST:
            return self._reboot(True, step.reason)
        if kind is StepKind.CLEAR_REBOOT_REQUEST:
            return self._reboot(False, step.reason)
        if kind in {StepKind.MARK_REPLACEMENT, StepKind.UNMARK_REPLACEMENT}:
            return self._replacement(step.target, kind is StepKind.MARK_REPLACEMENT)
        return StepResult.SKIPPED, f"no actuator for {kind}"

    def _regarding(self, target: str, uid: str = "") -> ObjectReference:
        if target.startswith("pod/"):
            namespace, _, name = target[4:].partition("/")
            pod: ObjectReference = {"kind": "Pod", "apiVersion": "v1", "namespace": namespace, "name": name}
            if uid:
                pod["uid"] = uid  # `kubectl describe pod` selects its Events by the pod's uid
            return pod
        return {"kind": "Node", "apiVersion": "v1", "name": self.writer.name}

    def _evict(self, step: Step) -> tuple[StepResult, str]:
        namespace, _, name = step.target.partition("/")
        if step.target in self.evictor.stuck:
            return StepResult.SKIPPED, "eviction stuck on its disruption budget; waiting for a human"
        result = self.evictor.evict(namespace, name, uid=str(step.details.get("pod_uid", "")))
        if result.outcome in {EvictionOutcome.EVICTED, EvictionOutcome.GONE}:
            return StepResult.APPLIED, result.message  # its Event is owed in the durable record
        if result.outcome is EvictionOutcome.WAITING:
            return StepResult.BLOCKED, result.message
        self.on_stuck(step.target)
        regarding = self._regarding(f"pod/{step.target}", uid=str(step.details.get("pod_uid", "")))
        self.events.record(regarding=regarding, reason="EvictionStuck", action="Evict", note=result.message)
        return StepResult.FAILED, result.message

    def _reboot(self, wanted: bool, reason: str) -> tuple[StepResult, str]:
        self.writer.set_condition(CONDITION_REBOOT, status=wanted,
                                  reason="GpuRebootRequired" if wanted else "GpuRebootNotRequired",
                                  message=reason, join_batch=True)
        self.writer.set_metadata(annotations={REBOOT_ANNOTATION: rfc3339() if wanted else None}, join_batch=True)
        if self.reboot_sentinel:
            sentinel = Path(self.reboot_sentinel)
            try:
                if wanted:
                    sentinel.touch()
                else:
                    sentinel.unlink(missing_ok=True)
            except OSError as exc:
                return StepResult.FAILED, f"reboot sentinel {sentinel}: {exc.strerror}"
        return StepResult.APPLIED, "reboot requested" if wanted else "reboot request withdrawn"

    def _replacement(self, gpu: str, wanted: bool) -> tuple[StepResult, str]:
        listed = {g for g in (self.writer.staged_annotation(REPLACE_ANNOTATION) or "").split(",") if g}
        listed = listed | {gpu} if wanted else listed - {gpu}
        self.writer.set_metadata(labels={REPLACEMENT_LABEL: "true" if listed else None},
                                 annotations={REPLACE_ANNOTATION: ",".join(sorted(listed)) or None}, join_batch=True)
        return StepResult.APPLIED, "marked for replacement" if wanted else "replacement mark removed"

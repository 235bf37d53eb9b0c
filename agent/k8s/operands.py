"""Pauses the GPU Operator's operands on the agent's own Node for a GPU reset, and puts them back.

The GPU Operator deploys each operand as a DaemonSet whose pods select `nvidia.com/gpu.deploy.<operand>=true`
and honours a value already on a node (controllers/state_manager.go: "If a required state label already
exists on the node, honor the current value"). Its own tools pause an operand by moving the label off `true`
(k8s-driver-manager: `paused-for-driver-upgrade`, mig-manager: `paused-for-mig-change`); the DaemonSet
controller then deletes the pod. The agent does the same with `paused-for-gpu-reset`, only for labels that
are `true` (an operand someone disabled or paused stays as it is), and records the original values in an
annotation in the same write, so a crash mid-reset is undone at the next start. Restoring puts back only
labels still at the agent's value: a label someone changed meanwhile is theirs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.k8s.node import PREFIX, NodeWriter
from agent.k8s.node_marks import RESET_PAUSE_TAINT
from agent.k8s.raw import RawApi, api_path
from agent.k8s.retry import with_retries

PAUSED_VALUE = "paused-for-gpu-reset"
PAUSED_ANNOTATION = f"{PREFIX}/paused-operands"
#: The operand whose pause makes the kubelet fail a GPU pod it admits meanwhile (UnexpectedAdmissionError): while
#: it is paused the Node carries the short NoSchedule taint RESET_PAUSE_TAINT.
DEVICE_PLUGIN_LABEL = "nvidia.com/gpu.deploy.device-plugin"
#: The operands that hold the GPUs open on a GPU Operator node (the driver, toolkit and validator do not).
OPERAND_LABELS = (
    "nvidia.com/gpu.deploy.device-plugin",
    "nvidia.com/gpu.deploy.gpu-feature-discovery",
    "nvidia.com/gpu.deploy.dcgm-exporter",
    "nvidia.com/gpu.deploy.dcgm",
)


@dataclass(slots=True)
class OperandPauser:
    """OperandControl (agent/gpu/reset.py) through the agent's Node writer and its pod listing."""

    writer: NodeWriter
    raw: RawApi
    labels: Sequence[str] = OPERAND_LABELS
    #: How long the paused operands' pods get to terminate (their grace period included).
    wait_seconds: float = 120.0
    poll_seconds: float = 2.0
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    #: Known that nothing of ours is paused (read so, or restored): a restore then reads nothing, so it can be
    #: asked every reconcile pass. Only this agent writes the record, so nobody else makes it stale.
    _clear: bool = field(default=False, init=False)

    def pause(self) -> str:
        self.restore()  # what a crashed run left first: its labels are at our value, and their record is in it
        view = self.writer.read()
        running = [key for key in self.labels if view.labels.get(key) == "true"]
        if not running:
            return "no GPU Operator operand to pause on this node"
        record = json.dumps({key: "true" for key in running}, sort_keys=True)
        self._clear = False  # before the write: one that lands but whose answer is lost still gets restored
        # One patch: the original values are on the Node in the same write that changes them, and so is the taint
        # that keeps new pods off while the device plugin is away (a GPU pod admitted then fails, kubernetes#119248).
        self.writer.set_metadata(labels=dict.fromkeys(running, PAUSED_VALUE),
                                 annotations={PAUSED_ANNOTATION: record},
                                 pause_taint=True if DEVICE_PLUGIN_LABEL in running else None)
        names = ", ".join(key.split("gpu.deploy.", 1)[-1] for key in running)
        kept_off = (f"; new pods kept off the node until the device plugin is back ({RESET_PAUSE_TAINT}:NoSchedule)"
                    if DEVICE_PLUGIN_LABEL in running else "")
        left = self._await_gone(running)
        if left:
            return f"paused {names}; after {self.wait_seconds:g}s still on the node: {', '.join(left)}{kept_off}"
        return f"paused {names} (their pods are gone){kept_off}"

    def restore(self) -> str:
        if self._clear:
            return ""
        view = self.writer.read()
        text = view.annotations.get(PAUSED_ANNOTATION)
        if text is None:
            if RESET_PAUSE_TAINT in view.taint_keys:  # a pause ended by hand (the record removed): the taint too
                self.writer.set_metadata(pause_taint=False)
            self._clear = True
            return "reset pause taint removed" if RESET_PAUSE_TAINT in view.taint_keys else ""
        try:
            recorded = json.loads(text)
        except ValueError:
            recorded = {}
        if not isinstance(recorded, dict):
            recorded = {}
        labels: dict[str, str | None] = {str(key): str(value) for key, value in recorded.items()
                                         if view.labels.get(str(key)) == PAUSED_VALUE}
        # The taint goes in the same write as the labels: the device plugin's DaemonSet pod, recreated once its
        # label is back, need not tolerate it.
        self.writer.set_metadata(labels=labels, annotations={PAUSED_ANNOTATION: None}, pause_taint=False)
        self._clear = True
        lifted = " and lifted the reset pause taint" if RESET_PAUSE_TAINT in view.taint_keys else ""
        return (f"restored {len(labels)} operand label(s)" if labels else "operand record cleared") + lifted

    def _await_gone(self, keys: Sequence[str]) -> list[str]:
        """The pods on this node that select one of the paused labels, until none is left or time is up."""
        deadline = self.clock() + self.wait_seconds
        while True:
            left = self._selecting(keys)
            if not left or self.clock() >= deadline:
                return left
            self.sleep(self.poll_seconds)

    def _selecting(self, keys: Sequence[str]) -> list[str]:
        listed = with_retries(lambda: self.raw.get(api_path("", "v1", "pods"),
                                                   query={"fieldSelector": f"spec.nodeName={self.writer.name}"}))
        left = []
        for item in listed.get("items") or []:
            spec, meta = item.get("spec") or {}, item.get("metadata") or {}
            if (item.get("status") or {}).get("phase") in {"Succeeded", "Failed"}:
                continue
            selector = spec.get("nodeSelector") or {}
            if any(selector.get(key) == "true" for key in keys):
                left.append(f"{meta.get('namespace', '')}/{meta.get('name', '')}")
        return sorted(left)

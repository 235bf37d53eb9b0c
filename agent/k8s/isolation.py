"""Per-GPU isolation on the cluster: what the planner may isolate by device this pass, and the device taint steps."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from agent.k8s.dra import (
    GPU_ANNOTATION,
    DeviceTaintEffect,
    DeviceTainter,
    devices_of_gpu,
    discover_rule_version,
    rule_device,
)
from agent.k8s.errors import Forbidden, K8sError
from agent.k8s.raw import JsonDocument, RawApi
from agent.logs import get_logger
from agent.model import DeviceRef, Step, StepKind, StepResult
from agent.remediation.state import DeviceIsolation, DeviceMark, device_of

log = get_logger("agent.k8s.isolation")
Setting = Literal["node", "device", "auto"]
#: How long `auto` trusts "no DeviceTaintRule API" or "no GPU of this node in ResourceSlices" before asking again.
REDISCOVER_SECONDS = 300.0
NO_RULE_API = ("the API server serves no DeviceTaintRules (resource.k8s.io absent, or the DeviceTaintRule API "
               "is off)")


class DeviceIsolator:
    """Discovers the served resource.k8s.io version once, reads the node's published GPUs and the agent's rules
    each pass, and creates or deletes exactly the DeviceTaintRules the planner asks for."""

    def __init__(self, raw: RawApi, *, node_name: str, taint_key: str, setting: Setting = "auto",
                 effect: Literal["NoSchedule", "NoExecute"] = "NoSchedule", mark_degraded: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.raw = raw
        self.node = node_name
        self.key = taint_key
        self.setting = setting
        self.effect = effect
        self.mark_degraded = mark_degraded
        self.tainter: DeviceTainter | None = None
        self.clock = clock
        self._discover_after = 0.0
        self._slices_after = 0.0
        self._no_slices = f"no GPU of node {node_name} is published in ResourceSlices"
        self._waiting_why = self._no_slices
        self._devices: dict[str, tuple[DeviceRef, ...]] = {}

    def _tainter(self) -> DeviceTainter | None:
        """The rule API's served version is discovered once; its absence is asked again every few minutes."""
        if self.tainter is None and self.clock() >= self._discover_after:
            version = discover_rule_version(self.raw)  # an API error propagates: asked again next pass
            if version is None:
                self._discover_after = self.clock() + REDISCOVER_SECONDS
            else:
                log.info("device_isolation_version", version=version)
                self.tainter = DeviceTainter(self.raw, node_name=self.node, taint_key=self.key, version=version)
        return self.tainter

    def read(self) -> tuple[DeviceIsolation | None, dict[DeviceRef, DeviceMark] | None]:
        """What the planner may isolate by device, and the agent's rules now; (None, None) when unreadable,
        so a passing API error keeps the last view instead of flipping the node between the two isolations."""
        if self.setting == "node":
            return None, None  # no DRA reads: rules left from an earlier setting are deleted when the record says
        if self.setting == "auto" and not self._devices and self.clock() < self._slices_after:
            return self._unavailable(self._waiting_why), None  # auto without DRA here: looked again in a while
        try:
            tainter = self._tainter()
            if tainter is None:
                self._devices = {}
                return self._unavailable(NO_RULE_API), {}
            published = tainter.published()
            rules = tainter.owned()
        except Forbidden as exc:
            self._devices = {}
            why = f"the agent may not read DRA objects (apply daemonset/dra): {exc}"
            # `auto` without the DRA grants (the base manifests): asked again in a while, not every pass.
            self._slices_after, self._waiting_why = self.clock() + REDISCOVER_SECONDS, why
            return self._unavailable(why), {}
        except K8sError as exc:
            log.warning("device_isolation_unreadable", error=str(exc))
            return None, None
        uuids = {p.uuid for p in published} | {p.parent_uuid for p in published if p.parent_uuid}
        self._devices = {uuid: tuple(devices_of_gpu(published, uuid)) for uuid in uuids}
        if not published and self.setting == "auto":
            self._slices_after, self._waiting_why = self.clock() + REDISCOVER_SECONDS, self._no_slices
            return self._unavailable(self._no_slices), _marks(rules)
        return DeviceIsolation(self._devices, effect=self.effect, mark_degraded=self.mark_degraded), _marks(rules)

    def _unavailable(self, why: str) -> DeviceIsolation:
        """Node isolation this pass: with `device` the planner says why in an Event, with `auto` it is the
        expected outcome on a node without DRA."""
        return DeviceIsolation(unavailable=why, effect=self.effect, mark_degraded=self.mark_degraded,
                               silent=self.setting == "auto")

    def apply(self, step: Step) -> tuple[StepResult, str]:
        try:
            tainter = self._tainter()  # with `node`, discovered only for a rule left from an earlier setting
        except Forbidden as exc:
            return StepResult.FAILED, f"the agent may not use DeviceTaintRules (apply daemonset/dra): {exc}"
        if tainter is None:
            return StepResult.FAILED, NO_RULE_API
        device = device_of(step)
        if step.kind is StepKind.TAINT_DEVICE:
            done = tainter.ensure(device, effect=DeviceTaintEffect(str(step.details.get("effect", "NoSchedule"))),
                                  gpu_uuid=str(step.details.get("gpu_uuid", "")), reason=step.reason)
            return StepResult.APPLIED, f"DeviceTaintRule for {device} {done} ({tainter.version})"
        removed = tainter.remove(device)
        return StepResult.APPLIED, f"DeviceTaintRule for {device} " + ("deleted" if removed else "already gone")

    def gpus_by_pod(self, namespaces: Iterable[str],
                    claimed: Mapping[tuple[str, str], list[tuple[str, str, str]]]) -> dict[tuple[str, str], set[str]]:
        """The GPU UUIDs each pod holds through DRA: its allocated ResourceClaims, and the devices the kubelet's
        PodResources lists for it; empty where DRA is not served or not readable."""
        tainter = self.tainter
        if tainter is None or not self._devices:
            return {}  # no rule API, or no GPU of this node published (as of the last pass): nothing to map
        by_device: dict[DeviceRef, set[str]] = {}
        for uuid, devices in self._devices.items():
            for device in devices:
                by_device.setdefault(device, set()).add(uuid)
        held: dict[tuple[str, str], set[DeviceRef]] = {
            key: {DeviceRef(*d) for d in devices} for key, devices in claimed.items()}
        try:
            for holder in tainter.claim_holders(namespaces):
                held.setdefault((holder.namespace, holder.name), set()).update(holder.devices)
        except K8sError as exc:
            log.warning("resource_claims_unreadable", error=str(exc))
        return {key: set().union(*(by_device.get(d, set()) for d in devices))
                for key, devices in held.items() if devices}


def _marks(rules: Iterable[JsonDocument]) -> dict[DeviceRef, DeviceMark]:
    marks = {}
    for rule in rules:
        device = rule_device(rule)
        if device is None:
            continue
        annotations = (rule.get("metadata") or {}).get("annotations") or {}
        taint = (rule.get("spec") or {}).get("taint") or {}
        marks[device] = DeviceMark(str(annotations.get(GPU_ANNOTATION, "")), str(taint.get("effect", "")))
    return marks

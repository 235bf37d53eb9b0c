"""Per-GPU isolation through Dynamic Resource Allocation: finds a GPU's device in the node's ResourceSlices
and taints exactly that device with a DeviceTaintRule the agent owns (resource.k8s.io v1, v1beta2, v1alpha3).

The mapping from slices and claims is pure; `DeviceTainter` is the only part that writes, and only rules
that carry the agent's label for its own node.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from agent.k8s.errors import Conflict, NotFound
from agent.k8s.raw import JsonDocument, RawApi
from agent.model import DeviceRef

__all__ = ["DeviceRef", "DeviceTaintEffect", "DeviceTainter", "PublishedGpu", "claim_holders", "devices_of_gpu",
           "discover_rule_version", "published_gpus", "rule_device"]

GROUP = "resource.k8s.io"
RULE_VERSIONS = ("v1", "v1beta2", "v1alpha3")  # newest first: GA in 1.37, beta in 1.36, alpha before
MANAGED_BY = "app.kubernetes.io/managed-by"
AGENT = "gpu-health-agent"
NODE_LABEL = "gpu-health-agent.io/node"
GPU_ANNOTATION = "gpu-health-agent.io/gpu"
REASON_ANNOTATION = "gpu-health-agent.io/reason"
UUID_ATTRIBUTES = ("uuid", "gpu.nvidia.com/uuid")
PARENT_ATTRIBUTES = ("parentUUID", "gpu.nvidia.com/parentUUID")


class DeviceTaintEffect(StrEnum):
    """What a device taint does to claims that do not tolerate it (NoExecute is an explicit opt-in)."""

    NONE = "None"
    NO_SCHEDULE = "NoSchedule"
    NO_EXECUTE = "NoExecute"


@dataclass(frozen=True, slots=True)
class PublishedGpu:
    """A GPU or MIG device as the DRA driver published it, with the GPU it belongs to."""

    ref: DeviceRef
    uuid: str
    parent_uuid: str = ""


def _attribute(attributes: dict[str, Any], names: tuple[str, ...]) -> str:
    for name in names:
        value = attributes.get(name)
        if isinstance(value, dict) and isinstance(value.get("string"), str):
            return str(value["string"])
    return ""


def published_gpus(slices: Iterable[JsonDocument], node_name: str) -> list[PublishedGpu]:
    """Every device with a GPU UUID in the node's ResourceSlices (v1 `attributes`, v1beta1 `basic.attributes`)."""
    found: list[PublishedGpu] = []
    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("nodeName") != node_name:
            continue
        driver, pool = str(spec.get("driver", "")), str((spec.get("pool") or {}).get("name", ""))
        for device in spec.get("devices") or []:
            attributes = device.get("attributes") or (device.get("basic") or {}).get("attributes") or {}
            uuid = _attribute(attributes, UUID_ATTRIBUTES)
            if uuid and device.get("name"):
                found.append(PublishedGpu(DeviceRef(driver, pool, str(device["name"])), uuid,
                                          _attribute(attributes, PARENT_ATTRIBUTES)))
    return found


def devices_of_gpu(published: Iterable[PublishedGpu], uuid: str) -> list[DeviceRef]:
    """The devices that expose a GPU: the whole GPU and each MIG device cut from it, or one MIG device."""
    return sorted({p.ref for p in published if uuid in (p.uuid, p.parent_uuid)})


@dataclass(frozen=True, slots=True)
class ClaimHolder:
    """A pod that holds a device through an allocated ResourceClaim."""

    namespace: str
    name: str
    uid: str
    devices: tuple[DeviceRef, ...]


def claim_holders(claims: Iterable[JsonDocument]) -> list[ClaimHolder]:
    """The pods each allocated ResourceClaim is reserved for, with the devices allocated to it."""
    holders: list[ClaimHolder] = []
    for claim in claims:
        status = claim.get("status") or {}
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        devices = tuple(sorted({DeviceRef(str(r.get("driver", "")), str(r.get("pool", "")),
                                          str(r.get("device", ""))) for r in results}))
        if not devices:
            continue
        namespace = str((claim.get("metadata") or {}).get("namespace", ""))
        for consumer in status.get("reservedFor") or []:
            if consumer.get("resource") == "pods" and not consumer.get("apiGroup"):
                holders.append(ClaimHolder(namespace, str(consumer.get("name", "")), str(consumer.get("uid", "")),
                                           devices))
    return holders


_NOT_NAME = re.compile(r"[^a-z0-9.-]+")


def rule_name(node_name: str, device: DeviceRef) -> str:
    """A DNS-subdomain name, one per node and device, so a restart finds the rule it made instead of adding one."""
    raw = f"gpu-health.{node_name}.{device.device}".lower()
    name = _NOT_NAME.sub("-", raw).strip("-.")
    return name[:253].rstrip("-.")


def desired_rule(*, version: str, node_name: str, device: DeviceRef, key: str, effect: DeviceTaintEffect,
                 gpu_uuid: str, reason: str) -> JsonDocument:
    """The DeviceTaintRule that takes exactly this device out, labelled as the agent's for this node."""
    return {
        "apiVersion": f"{GROUP}/{version}",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": rule_name(node_name, device),
            "labels": {MANAGED_BY: AGENT, NODE_LABEL: node_name},
            "annotations": {GPU_ANNOTATION: gpu_uuid, REASON_ANNOTATION: reason[:1000]},
        },
        "spec": {
            "deviceSelector": {"driver": device.driver, "pool": device.pool, "device": device.device},
            "taint": {"key": key, "value": "true", "effect": str(effect)},
        },
    }


def rule_device(rule: JsonDocument) -> DeviceRef | None:
    selector = (rule.get("spec") or {}).get("deviceSelector") or {}
    if not all(selector.get(k) for k in ("driver", "pool", "device")):
        return None
    return DeviceRef(str(selector["driver"]), str(selector["pool"]), str(selector["device"]))


def discover_rule_version(raw: RawApi) -> str | None:
    """The newest resource.k8s.io version this server serves DeviceTaintRules in, or None (no DRA, or off)."""
    try:
        group = raw.get(f"/apis/{GROUP}")
    except NotFound:
        return None
    served = {str(v.get("version")) for v in group.get("versions") or []}
    for version in RULE_VERSIONS:
        if version not in served:
            continue
        resources = raw.get(f"/apis/{GROUP}/{version}").get("resources") or []
        if any(r.get("name") == "devicetaintrules" for r in resources):
            return version
    return None


class DeviceTainter:
    """Reads the node's published GPUs and claims, and converges the agent's DeviceTaintRules for the node."""

    def __init__(self, raw: RawApi, *, node_name: str, taint_key: str, version: str) -> None:
        self.raw = raw
        self.node = node_name
        self.key = taint_key
        self.version = version

    @property
    def _rules_path(self) -> str:
        return f"/apis/{GROUP}/{self.version}/devicetaintrules"

    def published(self) -> list[PublishedGpu]:
        slices = self.raw.get(f"/apis/{GROUP}/{self.version}/resourceslices",
                              query={"fieldSelector": f"spec.nodeName={self.node}"})
        return published_gpus(slices.get("items") or [], self.node)

    def claim_holders(self, namespaces: Iterable[str]) -> list[ClaimHolder]:
        holders: list[ClaimHolder] = []
        for namespace in sorted(set(namespaces)):
            claims = self.raw.get(f"/apis/{GROUP}/{self.version}/namespaces/{namespace}/resourceclaims")
            holders.extend(claim_holders(claims.get("items") or []))
        return holders

    def owned(self) -> list[JsonDocument]:
        listed = self.raw.get(self._rules_path,
                              query={"labelSelector": f"{MANAGED_BY}={AGENT},{NODE_LABEL}={self.node}"})
        return list(listed.get("items") or [])

    def ensure(self, device: DeviceRef, *, effect: DeviceTaintEffect, gpu_uuid: str, reason: str) -> str:
        """Create or correct the rule for this device; returns 'created', 'updated' or 'unchanged'."""
        want = desired_rule(version=self.version, node_name=self.node, device=device, key=self.key,
                            effect=effect, gpu_uuid=gpu_uuid, reason=reason)
        path = f"{self._rules_path}/{want['metadata']['name']}"
        try:
            have = self.raw.get(path)
        except NotFound:
            try:
                self.raw.create(self._rules_path, want)
                return "created"
            except Conflict:
                have = self.raw.get(path)  # made by an earlier incarnation a moment ago: converge it below
        if (have.get("spec") or {}).get("deviceSelector") == want["spec"]["deviceSelector"] and \
                _same_taint((have.get("spec") or {}).get("taint") or {}, want["spec"]["taint"]):
            return "unchanged"
        patch = {"metadata": {"resourceVersion": (have.get("metadata") or {}).get("resourceVersion", ""),
                              "labels": want["metadata"]["labels"],
                              "annotations": want["metadata"]["annotations"]},
                 "spec": want["spec"]}
        self.raw.merge_patch(path, patch)
        return "updated"

    def remove(self, device: DeviceRef) -> bool:
        """Delete the agent's rule for this device; False when there was none (already cleared)."""
        path = f"{self._rules_path}/{rule_name(self.node, device)}"
        try:
            have = self.raw.get(path)
        except NotFound:
            return False
        labels = (have.get("metadata") or {}).get("labels") or {}
        if labels.get(MANAGED_BY) != AGENT or labels.get(NODE_LABEL) != self.node:
            return False  # same name, someone else's rule: never remove what the agent did not set
        try:
            self.raw.delete(path, resource_version=str((have.get("metadata") or {}).get("resourceVersion", "")))
        except NotFound:
            return False
        return True


def _same_taint(have: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(have.get(k) == want.get(k) for k in ("key", "value", "effect"))

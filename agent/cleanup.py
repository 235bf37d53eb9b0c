"""Undo: finds and removes every mark the agent may have left in a cluster, and nothing it did not set.

What the agent sets, and so what this removes: its own taint (by key), the cordon it set (only where its
`cordoned` annotation says so), its node conditions, its labels and annotations, DeviceTaintRules it
labelled as managed by it, and its budget Leases. Operators' marks stay: other taints, a cordon without the
agent's annotation, the opt-out label, the pause Lease (an operator's switch, reported, not removed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from agent.fleet.published import QUARANTINE_LABEL, SUMMARY_ANNOTATION
from agent.fleetapi.brake_claims import CLAIM_LABEL
from agent.fleetapi.budget import PAUSE_LEASE
from agent.fleetapi.budget_slots import BUDGET_LEASE, SLOT_LABEL
from agent.k8s.bodies import ConditionDirective, Node, NodePatch, as_node, as_node_list, as_pod_list
from agent.k8s.errors import NotFound
from agent.k8s.node import (
    AGENT_CONDITIONS,
    CONFIRM_ANNOTATION,
    CORDONED_ANNOTATION,
    DISRUPTION_LABEL,
    REBOOT_ANNOTATION,
    RELEASE_ANNOTATION,
    REPLACE_ANNOTATION,
    REPLACEMENT_LABEL,
    STATE_ANNOTATION,
)
from agent.k8s.node_marks import RESET_PAUSE_TAINT
from agent.k8s.raw import RawApi, api_path
from agent.k8s.retry import on_conflict

AGENT_LABELS = (REPLACEMENT_LABEL, DISRUPTION_LABEL, QUARANTINE_LABEL)
AGENT_ANNOTATIONS = (STATE_ANNOTATION, CORDONED_ANNOTATION, REBOOT_ANNOTATION, REPLACE_ANNOTATION,
                     RELEASE_ANNOTATION, CONFIRM_ANNOTATION, SUMMARY_ANNOTATION)
# DeviceTaintRules the agent creates carry this label; the API versions are tried newest first.
MANAGED_BY = "app.kubernetes.io/managed-by=gpu-health-agent"
DEVICE_TAINT_GROUP = "resource.k8s.io"
DEVICE_TAINT_VERSIONS = ("v1", "v1beta2", "v1beta1", "v1alpha3")


@dataclass(frozen=True, slots=True)
class Mark:
    """One thing the agent left: where it is, what it is, and how to say it."""

    kind: str  # taint, cordon, condition, label, annotation, devicetaintrule, lease
    target: str  # node/NAME, devicetaintrule/NAME, lease/NAMESPACE/NAME
    name: str
    detail: str = ""

    def line(self) -> str:
        return f"{self.target}: {self.kind} {self.name}{' (' + self.detail + ')' if self.detail else ''}"


@dataclass(frozen=True, slots=True)
class Scope:
    """Which nodes, and the agent's configured names (a customised taint key is still the agent's)."""

    taint_key: str
    namespace: str
    nodes: tuple[str, ...] = ()  # empty: every node


class Cleaner:
    """Lists the agent's marks (read-only), then removes them one by one with read-compare-patch."""

    @classmethod
    def connect(cls, api_client: Any, scope: Scope) -> Cleaner:
        return cls(RawApi(api_client), scope)

    def __init__(self, raw: RawApi, scope: Scope) -> None:
        self.raw = raw
        self.scope = scope
        self.leases = api_path("coordination.k8s.io", "v1", "leases", namespace=scope.namespace)

    # ---- finding ----
    def agent_pods(self) -> list[str]:
        """Agent pods still running in its namespace: they would put their marks straight back."""
        pods = as_pod_list(self.raw.get(api_path("", "v1", "pods", namespace=self.scope.namespace),
                                        query={"labelSelector": "app.kubernetes.io/name=gpu-health-agent"}))
        return [str(p["metadata"]["name"]) for p in pods.get("items") or []]

    def find(self, *, progress: Callable[[str], None] = lambda line: None) -> list[Mark]:
        nodes = self._nodes()
        progress(f"reading {len(nodes)} node(s)")
        marks = [mark for node in nodes for mark in node_marks(node, self.scope.taint_key)]
        if not self.scope.nodes:
            progress("reading DeviceTaintRules and Leases")
            marks.extend(self._device_taint_rules())
            marks.extend(self._leases())
        return marks

    def pause_lease_present(self) -> bool:
        try:
            self.raw.get(f"{self.leases}/{PAUSE_LEASE}")
        except NotFound:
            return False
        return True

    def _nodes(self) -> list[Node]:
        if self.scope.nodes:
            return [self._raw_node(name) for name in self.scope.nodes]
        return list(as_node_list(self.raw.get(api_path("", "v1", "nodes"))).get("items") or [])

    def _raw_node(self, name: str) -> Node:
        return as_node(self.raw.get(api_path("", "v1", "nodes", name=name)))

    def _device_taint_rules(self) -> Iterator[Mark]:
        version = self.device_taint_version()
        if version is None:
            return
        listed = self.raw.get(api_path(DEVICE_TAINT_GROUP, version, "devicetaintrules"),
                              query={"labelSelector": MANAGED_BY})
        for item in listed.get("items") or []:
            yield Mark("devicetaintrule", f"devicetaintrule/{item['metadata']['name']}", item["metadata"]["name"],
                       f"{DEVICE_TAINT_GROUP}/{version}")

    def device_taint_version(self) -> str | None:
        """The served resource.k8s.io version with DeviceTaintRules, or None (DRA device taints are off)."""
        for version in DEVICE_TAINT_VERSIONS:
            try:
                self.raw.get(api_path(DEVICE_TAINT_GROUP, version, "devicetaintrules"), query={"limit": "1"})
            except NotFound:
                continue
            return version
        return None

    def _leases(self) -> Iterator[Mark]:
        for label, what in ((SLOT_LABEL, "a node's disruption-budget slot"),
                            (CLAIM_LABEL, "a node's quarantine-brake claim")):
            listed = self.raw.get(self.leases, query={"labelSelector": f"{label}=true"})
            for item in listed.get("items") or []:
                name = str(item["metadata"]["name"])
                yield Mark("lease", f"lease/{self.scope.namespace}/{name}", name, what)
        try:  # the one shared budget Lease of earlier versions
            self.raw.get(f"{self.leases}/{BUDGET_LEASE}")
        except NotFound:
            return
        yield Mark("lease", f"lease/{self.scope.namespace}/{BUDGET_LEASE}", BUDGET_LEASE, "the disruption budget")

    # ---- removing ----
    def remove(self, mark: Mark) -> bool:
        """Remove one mark; False when it was already gone (someone else, or the agent, cleared it)."""
        if mark.kind == "devicetaintrule":
            version = mark.detail.rsplit("/", 1)[1]
            return self._delete(lambda: self.raw.delete(api_path(DEVICE_TAINT_GROUP, version, "devicetaintrules",
                                                                 name=mark.name)))
        if mark.kind == "lease":
            return self._delete(lambda: self.raw.delete(f"{self.leases}/{mark.name}"))
        node_name = mark.target.removeprefix("node/")
        return bool(on_conflict(lambda: self._patch_node(node_name, mark)))

    def _patch_node(self, node_name: str, mark: Mark) -> bool:
        node = self._raw_node(node_name)
        if (mark.kind, mark.name) not in {(m.kind, m.name) for m in node_marks(node, self.scope.taint_key)}:
            return False
        version = node["metadata"]["resourceVersion"]
        if mark.kind == "condition":
            delete: ConditionDirective = {"type": mark.name, "$patch": "delete"}
            patch: NodePatch = {"metadata": {"resourceVersion": version}, "status": {"conditions": [delete]}}
            self.raw.strategic_patch(api_path("", "v1", "nodes", name=node_name, subresource="status"), patch)
            return True
        body: NodePatch = {"metadata": {"resourceVersion": version}}
        if mark.kind == "taint":
            taints = [t for t in node.get("spec", {}).get("taints") or [] if t.get("key") != mark.name]
            body["spec"] = {"taints": taints or None}
        elif mark.kind == "cordon":
            body["spec"] = {"unschedulable": None}
            body["metadata"]["annotations"] = {CORDONED_ANNOTATION: None}
        elif mark.kind == "label":
            body["metadata"]["labels"] = {mark.name: None}
        else:
            body["metadata"]["annotations"] = {mark.name: None}
        self.raw.strategic_patch(api_path("", "v1", "nodes", name=node_name), body)
        return True

    @staticmethod
    def _delete(call: Callable[[], object]) -> bool:
        try:
            call()
        except NotFound:
            return False
        return True


def node_marks(node: Node, taint_key: str) -> list[Mark]:
    """The agent's marks on one Node, in the order they are best removed (taint first: work may return)."""
    meta, spec = node.get("metadata", {}), node.get("spec", {})
    target = f"node/{meta.get('name', '')}"
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    marks = [Mark("taint", target, t["key"], f"{t.get('value', '')}:{t.get('effect', '')}")
             for t in spec.get("taints") or [] if t.get("key") in {taint_key, RESET_PAUSE_TAINT}]
    if spec.get("unschedulable") and CORDONED_ANNOTATION in annotations:
        marks.append(Mark("cordon", target, "unschedulable",
                          f"cordoned by the agent at {annotations[CORDONED_ANNOTATION]}"))
    marks.extend(Mark("condition", target, c["type"], f"status {c.get('status')}")
                 for c in (node.get("status", {}).get("conditions") or []) if c.get("type") in AGENT_CONDITIONS)
    marks.extend(Mark("label", target, key, labels[key]) for key in AGENT_LABELS if key in labels)
    cordon_annotation_kept = any(m.kind == "cordon" for m in marks)
    marks.extend(Mark("annotation", target, key) for key in AGENT_ANNOTATIONS
                 if key in annotations and not (key == CORDONED_ANNOTATION and cordon_annotation_kept))
    return marks

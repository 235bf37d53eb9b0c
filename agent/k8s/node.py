"""The agent's own marks on its Node: conditions, its taint, its cordon, labels and the state annotation.

Every write is compare-patch against the Node as last observed (the previous GET, the answer of the
previous write, or the watch's last event: agent.k8s.node_cache), under that observation's resourceVersion:
a 409 reads the Node again and retries, so a fault costs one PATCH and no GET. Nothing is written when a
fresh read (a GET, or the Node a live watch vouches for) says the Node already is as it should be; taints
and cordons the agent did not set are never touched.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from agent.fleet.published import QUARANTINE_LABEL, quarantined_since
from agent.k8s.bodies import MetadataPatch, Node, NodeCondition, NodePatch, as_node
from agent.k8s.errors import Conflict
from agent.k8s.node_cache import NodeCache
from agent.k8s.raw import RawApi, api_path
from agent.k8s.retry import on_conflict, with_retries
from agent.remediation.record import NodeObservation
from agent.remediation.state import ConditionState
from agent.timefmt import rfc3339

PREFIX = "gpu-health-agent.io"
STATE_ANNOTATION = f"{PREFIX}/state"
CORDONED_ANNOTATION = f"{PREFIX}/cordoned"
REBOOT_ANNOTATION = f"{PREFIX}/reboot-requested"
REPLACE_ANNOTATION = f"{PREFIX}/replace-gpus"
RELEASE_ANNOTATION = f"{PREFIX}/release"
#: An operator's confirm of a taint the quarantine brake keeps waiting (`gpu-health-agent fleet confirm`):
#: written by the operator, only ever removed by the agent (daemonset/admission-policy.yaml).
CONFIRM_ANNOTATION = f"{PREFIX}/brake-confirm"
REPLACEMENT_LABEL = f"{PREFIX}/needs-replacement"
DISRUPTION_LABEL = f"{PREFIX}/disruption"
CONDITION_REBOOT = "GpuRebootRequired"
AGENT_CONDITIONS = ("GpuFatalFault", "GpuDegraded", "GpuUnreadable", CONDITION_REBOOT, "AcceleratedHardwareReady")
#: Conditions whose True means healthy: the agent reports a problem on them as False.
POSITIVE_CONDITIONS = frozenset({"AcceleratedHardwareReady"})




@dataclass(frozen=True, slots=True)
class NodeView:
    """What the agent needs to know of its Node, read in one GET (or from a live watch's cache)."""

    name: str
    labels: dict[str, str]
    annotations: dict[str, str]
    taint_keys: set[str]
    conditions: dict[str, NodeCondition]

    taint_key: str = ""

    def observation(self, *, opt_out_label: str = "") -> NodeObservation:
        """The agent's marks as the Node shows them, and the record mirrored in the state annotation."""
        # Whether each reports a problem (True for the agent's own; False for AcceleratedHardwareReady).
        conditions = {name: ConditionState((c.get("status") == "True") != (name in POSITIVE_CONDITIONS),
                                           str(c.get("message", "")))
                      for name in AGENT_CONDITIONS if (c := self.conditions.get(name)) is not None}
        replacement = frozenset(g for g in self.annotations.get(REPLACE_ANNOTATION, "").split(",") if g)
        return NodeObservation(
            conditions=conditions, tainted=self.taint_key in self.taint_keys,
            reboot_requested=REBOOT_ANNOTATION in self.annotations, replacement=replacement,
            record=saved_record(self), release=self.annotations.get(RELEASE_ANNOTATION, ""),
            confirm=self.annotations.get(CONFIRM_ANNOTATION, ""),
            opted_out=bool(opt_out_label) and self.labels.get(opt_out_label) == "true",
            holds_slot=DISRUPTION_LABEL in self.labels,
            quarantine_label=quarantined_since(self.labels.get(QUARANTINE_LABEL)))


#: A patch built from the Node as observed, or None when the Node already is as wanted.
PatchBuilder = Callable[[Node], NodePatch | None]


class NodeWriter:
    """Reads and patches one Node; remembers the Node as the last read or write left it."""

    def __init__(self, raw: RawApi, node_name: str, *, taint_key: str, taint_effect: str = "NoSchedule",
                 cordon: bool = False, deadline_seconds: float | None = None, seen: NodeCache | None = None) -> None:
        self.raw = raw
        self.name = node_name
        self.taint_key = taint_key
        self.taint_effect = taint_effect
        self.cordon = cordon
        self.deadline = deadline_seconds
        self.path = api_path("", "v1", "nodes", name=node_name)
        #: The Node as the last GET, PATCH or watch event showed it; a live watch (agent.k8s.node_watch)
        #: vouches that it is current.
        self.seen = seen or NodeCache()

    def read(self) -> NodeView:
        """The Node as a live watch keeps it, else with one GET."""
        body = self.seen.current() or self._raw()
        meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
        return NodeView(
            name=self.name,
            labels=dict(meta.get("labels") or {}),
            annotations=dict(meta.get("annotations") or {}),
            taint_keys={t.get("key", "") for t in spec.get("taints") or []},
            conditions={c["type"]: c for c in status.get("conditions") or [] if "type" in c},
            taint_key=self.taint_key,
        )

    def _raw(self) -> Node:
        node = as_node(with_retries(lambda: self.raw.get(self.path), deadline_seconds=self.deadline))
        self.seen.offer(node)
        return node

    # ---- conditions ----
    def set_condition(self, kind: str, *, status: bool, reason: str, message: str, create: bool | None = None) -> bool:
        """Set one condition; keep lastTransitionTime while the status holds. False: nothing to do. An absent
        condition is created only when `create` (default: when `status`, as a problem condition is)."""

        def build(node: Node) -> NodePatch | None:
            current = next((c for c in node.get("status", {}).get("conditions") or [] if c.get("type") == kind),
                           None)
            wanted = "True" if status else "False"
            if current is None and not (status if create is None else create):
                return None
            if current is not None and (current.get("status"), current.get("reason"), current.get("message")) == (
                    wanted, reason, message):
                return None
            now = rfc3339()
            transition = current.get("lastTransitionTime") if current and current.get("status") == wanted else now
            condition: NodeCondition = {"type": kind, "status": wanted, "reason": reason, "message": message[:1024],
                         "lastHeartbeatTime": now, "lastTransitionTime": transition or now}
            return {"status": {"conditions": [condition]}}

        return self._write(build, status=True)

    # ---- taint and cordon ----
    def set_taint(self, present: bool, *, value: str = "gpu-fault") -> bool:
        """Add or remove the agent's own taint (and cordon, when configured); other taints stay."""

        def build(node: Node) -> NodePatch | None:
            spec = node.get("spec", {})
            taints = list(spec.get("taints") or [])
            ours = [t for t in taints if t.get("key") == self.taint_key]
            annotations = node["metadata"].get("annotations") or {}
            patch: NodePatch = {"metadata": {}, "spec": {}}
            if present and not ours:
                patch["spec"]["taints"] = [*taints, {"key": self.taint_key, "value": value,
                                                     "effect": self.taint_effect, "timeAdded": rfc3339()}]
            elif not present and ours:
                patch["spec"]["taints"] = [t for t in taints if t.get("key") != self.taint_key]
            if self.cordon and present and not spec.get("unschedulable"):
                patch["spec"]["unschedulable"] = True
                patch["metadata"]["annotations"] = {CORDONED_ANNOTATION: rfc3339()}
            if not present and CORDONED_ANNOTATION in annotations:
                # Uncordon only what the agent cordoned.
                patch["spec"]["unschedulable"] = None
                patch["metadata"]["annotations"] = {CORDONED_ANNOTATION: None}
            if not patch["spec"] and "annotations" not in patch["metadata"]:
                return None
            return patch

        return self._write(build)

    # ---- labels and annotations ----
    def set_metadata(self, *, labels: dict[str, str | None] | None = None,
                     annotations: dict[str, str | None] | None = None) -> bool:
        """Set (or, with None, remove) labels and annotations; nothing is written when they already match."""

        def build(node: Node) -> NodePatch | None:
            meta = node["metadata"]
            changes: MetadataPatch = {}
            if delta := _delta(meta.get("labels") or {}, labels or {}):
                changes["labels"] = delta
            if delta := _delta(meta.get("annotations") or {}, annotations or {}):
                changes["annotations"] = delta
            return {"metadata": changes} if changes else None

        return self._write(build)

    def save_record(self, document: Mapping[str, object]) -> bool:
        """The Node's copy of the durable record (the journal's twin; the newer generation wins)."""
        text = json.dumps(document, sort_keys=True, separators=(",", ":"))
        return self.set_metadata(annotations={STATE_ANNOTATION: text})

    def _write(self, build: PatchBuilder, *, status: bool = False) -> bool:
        """Patch what `build` asks of the Node as last observed, under its resourceVersion. No GET first: a
        stale observation answers 409, and the retry reads the Node again; an observation that says nothing
        is to be done is confirmed by a fresh read (a GET, or the Node a live watch vouches for) before the
        writer says so (idempotent, never blind)."""
        path = f"{self.path}/status" if status else self.path

        def attempt() -> bool:
            node = self.seen.node
            patch = build(node) if node is not None else None
            if node is None or patch is None:
                node = self.seen.current() if patch is None and node is not None else None
                node = node or self._raw()
                patch = build(node)
                if patch is None:
                    return False
            patch.setdefault("metadata", {})["resourceVersion"] = node["metadata"]["resourceVersion"]
            with self.seen.writing():
                try:
                    self.seen.offer(as_node(self.raw.strategic_patch(path, patch)))
                except Conflict:
                    self.seen.forget()  # changed since observed: the next attempt reads it again
                    raise
            return True

        return bool(with_retries(lambda: on_conflict(attempt), deadline_seconds=self.deadline))


def _delta(current: Mapping[str, str], wanted: Mapping[str, str | None]) -> dict[str, str | None]:
    """The entries of `wanted` that change `current` (None removes one that is there)."""
    return {k: v for k, v in wanted.items() if current.get(k) != v and not (v is None and k not in current)}


def saved_record(view: NodeView) -> dict[str, object] | None:
    """The record mirrored in the state annotation (None when absent or unreadable)."""
    text = view.annotations.get(STATE_ANNOTATION)
    try:
        saved = json.loads(text) if text else None
    except ValueError:
        return None
    return saved if isinstance(saved, dict) else None

"""The agent's own marks on its Node: conditions, its taint, its cordon, labels and the state annotation.

Every write is read-compare-patch with the resourceVersion precondition, retried on conflict; nothing
is written when the Node already says what it should; taints and cordons the agent did not set are
never touched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agent.k8s.errors import api_call
from agent.k8s.retry import on_conflict, with_retries
from agent.remediation.planner import ConditionState, NodeState

PREFIX = "gpu-health-agent.io"
STATE_ANNOTATION = f"{PREFIX}/state"
CORDONED_ANNOTATION = f"{PREFIX}/cordoned"
REBOOT_ANNOTATION = f"{PREFIX}/reboot-requested"
REPLACE_ANNOTATION = f"{PREFIX}/replace-gpus"
RELEASE_ANNOTATION = f"{PREFIX}/release"
REPLACEMENT_LABEL = f"{PREFIX}/needs-replacement"
DISRUPTION_LABEL = f"{PREFIX}/disruption"
CONDITION_REBOOT = "GpuRebootRequired"
AGENT_CONDITIONS = ("GpuFatalFault", "GpuDegraded", "GpuUnreadable", CONDITION_REBOOT)


def rfc3339(at: datetime | None = None) -> str:
    return (at or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the agent needs to know of its Node, read in one GET."""

    name: str
    labels: dict[str, str]
    annotations: dict[str, str]
    taint_keys: set[str]
    conditions: dict[str, dict[str, Any]]

    def node_state(self, taint_key: str) -> NodeState:
        """The agent's marks as a NodeState: the annotation first, the node's own fields as the truth."""
        try:
            saved = json.loads(self.annotations.get(STATE_ANNOTATION, "{}"))
        except ValueError:
            saved = {}
        remediation = saved.get("remediation") if isinstance(saved, dict) else None
        state = NodeState.from_json(remediation if isinstance(remediation, dict) else {})
        state.tainted = taint_key in self.taint_keys
        for name in AGENT_CONDITIONS:
            condition = self.conditions.get(name)
            if condition is not None:
                state.conditions[name] = ConditionState(condition.get("status") == "True",
                                                        str(condition.get("message", "")))
        state.reboot_requested = REBOOT_ANNOTATION in self.annotations
        return state


class NodeWriter:
    """Reads and patches one Node."""

    def __init__(self, core: Any, node_name: str, *, taint_key: str, taint_effect: str = "NoSchedule",
                 cordon: bool = False, deadline_seconds: float | None = None) -> None:
        self.core = core
        self.name = node_name
        self.taint_key = taint_key
        self.taint_effect = taint_effect
        self.cordon = cordon
        self.deadline = deadline_seconds

    def read(self) -> NodeView:
        body = self._raw()
        meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
        return NodeView(
            name=self.name,
            labels=dict(meta.get("labels") or {}),
            annotations=dict(meta.get("annotations") or {}),
            taint_keys={t.get("key", "") for t in spec.get("taints") or []},
            conditions={c["type"]: c for c in status.get("conditions") or [] if "type" in c},
        )

    def _raw(self) -> dict[str, Any]:
        response = with_retries(lambda: api_call(self.core.read_node, self.name, _preload_content=False),
                                deadline_seconds=self.deadline)
        return dict(json.loads(response.data))

    # ---- conditions ----
    def set_condition(self, kind: str, *, status: bool, reason: str, message: str) -> bool:
        """Set one problem condition; keep lastTransitionTime while the status holds. False: nothing to do."""

        def attempt() -> bool:
            node = self._raw()
            current = next((c for c in node.get("status", {}).get("conditions") or [] if c.get("type") == kind),
                           None)
            wanted = "True" if status else "False"
            if current is None and not status:
                return False
            if current is not None and (current.get("status"), current.get("reason"), current.get("message")) == (
                    wanted, reason, message):
                return False
            now = rfc3339()
            transition = current.get("lastTransitionTime") if current and current.get("status") == wanted else now
            condition = {"type": kind, "status": wanted, "reason": reason, "message": message[:1024],
                         "lastHeartbeatTime": now, "lastTransitionTime": transition or now}
            patch = {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
                     "status": {"conditions": [condition]}}
            api_call(self.core.patch_node_status, self.name, patch)
            return True

        return self._write(attempt)

    # ---- taint and cordon ----
    def set_taint(self, present: bool, *, value: str = "gpu-fault") -> bool:
        """Add or remove the agent's own taint (and cordon, when configured); other taints stay."""

        def attempt() -> bool:
            node = self._raw()
            spec = node.get("spec", {})
            taints = list(spec.get("taints") or [])
            ours = [t for t in taints if t.get("key") == self.taint_key]
            annotations = node["metadata"].get("annotations") or {}
            patch: dict[str, Any] = {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"]}, "spec": {}}
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
                return False
            api_call(self.core.patch_node, self.name, patch)
            return True

        return self._write(attempt)

    # ---- labels and annotations ----
    def set_metadata(self, *, labels: dict[str, str | None] | None = None,
                     annotations: dict[str, str | None] | None = None) -> bool:
        """Set (or, with None, remove) labels and annotations; nothing is written when they already match."""

        def attempt() -> bool:
            node = self._raw()
            meta = node["metadata"]
            changes: dict[str, Any] = {}
            for field, wanted in (("labels", labels or {}), ("annotations", annotations or {})):
                current = meta.get(field) or {}
                delta = {k: v for k, v in wanted.items()
                         if current.get(k) != v and not (v is None and k not in current)}
                if delta:
                    changes[field] = delta
            if not changes:
                return False
            api_call(self.core.patch_node, self.name,
                     {"metadata": {"resourceVersion": meta["resourceVersion"], **changes}})
            return True

        return self._write(attempt)

    def save_state(self, state: NodeState, faults: list[dict[str, Any]]) -> bool:
        """The durable record the agent reads back after a restart: active faults and remediation state."""
        document = json.dumps({"faults": faults, "remediation": state.to_json()}, sort_keys=True,
                              separators=(",", ":"))
        return self.set_metadata(annotations={STATE_ANNOTATION: document})

    def _write(self, attempt: Any) -> bool:
        return bool(with_retries(lambda: on_conflict(attempt), deadline_seconds=self.deadline))


def saved_faults(view: NodeView) -> list[dict[str, Any]]:
    """The active faults recorded in the state annotation (empty when absent or unreadable)."""
    try:
        saved = json.loads(view.annotations.get(STATE_ANNOTATION, "{}"))
    except ValueError:
        return []
    faults = saved.get("faults") if isinstance(saved, dict) else None
    return [f for f in faults if isinstance(f, dict)] if isinstance(faults, list) else []

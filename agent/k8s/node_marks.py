"""The agent's marks on its Node as one desired value, and the pure diff that makes it at most two patches.

`NodeMarks` is what a pass decided the Node should show of the agent's (its taint, its conditions, the labels
and annotations it owns: the state mirror, the disruption and quarantine labels, the reboot request, the
replacement mark, a consumed release); nothing else of the Node is in it, so nothing else is ever written.
`node_patches` diffs it against the Node as observed: the taint (and cordon) is spec, written to the Node
itself; the conditions are status, written to its status subresource, which the API server's Node status
strategy lets change metadata too but never spec (and the Node itself never status). So a pass that changes
both spec and status writes twice (the floor: one request cannot change both), any other pass once: the
labels and annotations ride with the status patch where there is one, else with the spec patch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.k8s.bodies import MetadataPatch, Node, NodeCondition, NodePatch, NodeSpecPatch

#: The annotation that says the agent cordoned the Node (agent.k8s.node CORDONED_ANNOTATION).
CORDONED = "gpu-health-agent.io/cordoned"
#: The short NoSchedule taint that keeps new pods off while a GPU reset has the device plugin paused: a GPU pod
#: admitted then fails with UnexpectedAdmissionError (kubernetes#119248, #133382). Its own key, so it never
#: touches the quarantine taint, and it goes in the same write that ends the pause.
RESET_PAUSE_TAINT = "gpu-health-agent.io/gpu-reset-pause"
RESET_PAUSE_VALUE = "device-plugin-paused"


@dataclass(frozen=True, slots=True)
class ConditionWant:
    """One condition as wanted: its status on the Node, reason and message; `create`: an absent one is added."""

    status: bool
    reason: str
    message: str
    create: bool


@dataclass(slots=True)
class NodeMarks:
    """The agent's own marks a pass wants on its Node; a later want of the same mark replaces an earlier one."""

    #: Whether the agent's taint is wanted (None: this pass has no word on it).
    taint: bool | None = None
    conditions: dict[str, ConditionWant] = field(default_factory=dict)
    #: None removes a label or annotation.
    labels: dict[str, str | None] = field(default_factory=dict)
    annotations: dict[str, str | None] = field(default_factory=dict)
    #: Whether the reset pause's taint (RESET_PAUSE_TAINT) is wanted (None: no word on it).
    pause_taint: bool | None = None

    def merge(self, other: NodeMarks) -> None:
        """Take in `other`'s wants over these."""
        self.taint = self.taint if other.taint is None else other.taint
        self.pause_taint = self.pause_taint if other.pause_taint is None else other.pause_taint
        self.conditions.update(other.conditions)
        self.labels.update(other.labels)
        self.annotations.update(other.annotations)

    def empty(self) -> bool:
        return self.taint is None and self.pause_taint is None and not (self.conditions or self.labels
                                                                           or self.annotations)


@dataclass(frozen=True, slots=True)
class TaintOptions:
    """The agent's taint as configured: its key and effect, and whether it cordons too."""

    key: str
    effect: str = "NoSchedule"
    cordon: bool = False
    value: str = "gpu-fault"


@dataclass(frozen=True, slots=True)
class NodePatches:
    """The writes that converge a Node to the marks: to the Node (spec and metadata) and to its status."""

    main: NodePatch | None = None
    status: NodePatch | None = None

    def empty(self) -> bool:
        return self.main is None and self.status is None


def node_patches(marks: NodeMarks, node: Node, *, taint: TaintOptions, now: str) -> NodePatches:
    """What must change on `node` (as observed) for it to show `marks`; nothing the agent does not own."""
    spec, cordon_annotations = _taint_spec(marks.taint, node, taint, now) if marks.taint is not None else ({}, {})
    if marks.pause_taint is not None:
        _pause_taint_spec(marks.pause_taint, spec, node, now)
    conditions = [c for kind, want in marks.conditions.items() if (c := _condition(node, kind, want, now)) is not None]
    meta = node.get("metadata", {})
    metadata: MetadataPatch = {}
    if delta := _delta(meta.get("labels") or {}, marks.labels):
        metadata["labels"] = delta
    if delta := _delta(meta.get("annotations") or {}, marks.annotations):
        metadata["annotations"] = delta
    status: NodePatch | None = None
    if conditions:
        status = {"status": {"conditions": list(conditions)}}
        if metadata:
            status["metadata"] = metadata
            metadata = {}
    main: NodePatch | None = None
    if spec or cordon_annotations or metadata:
        if cordon_annotations:
            metadata["annotations"] = {**metadata.get("annotations", {}), **cordon_annotations}
        main = {"metadata": metadata}
        if spec:
            main["spec"] = spec
    return NodePatches(main=main, status=status)


def _taint_spec(present: bool, node: Node, taint: TaintOptions,
                now: str) -> tuple[NodeSpecPatch, dict[str, str | None]]:
    """The spec change (the agent's taint added or removed, other taints kept; cordon) and its annotation."""
    spec = node.get("spec", {})
    taints = list(spec.get("taints") or [])
    ours = [t for t in taints if t.get("key") == taint.key]
    annotations = node.get("metadata", {}).get("annotations") or {}
    patch: NodeSpecPatch = {}
    marked: dict[str, str | None] = {}
    if present and not ours:
        patch["taints"] = [*taints, {"key": taint.key, "value": taint.value, "effect": taint.effect,
                                     "timeAdded": now}]
    elif not present and ours:
        patch["taints"] = [t for t in taints if t.get("key") != taint.key]
    if taint.cordon and present and not spec.get("unschedulable"):
        patch["unschedulable"] = True
        marked[CORDONED] = now
    if not present and CORDONED in annotations:
        # Uncordon only what the agent cordoned.
        patch["unschedulable"] = None
        marked[CORDONED] = None
    return patch, marked


def _pause_taint_spec(present: bool, spec: NodeSpecPatch, node: Node, now: str) -> None:
    """The reset pause's taint added to or removed from the taints `spec` already writes (else the Node's)."""
    taints = list(spec["taints"] or []) if "taints" in spec else list(node.get("spec", {}).get("taints") or [])
    ours = any(t.get("key") == RESET_PAUSE_TAINT for t in taints)
    if present and not ours:
        spec["taints"] = [*taints, {"key": RESET_PAUSE_TAINT, "value": RESET_PAUSE_VALUE, "effect": "NoSchedule",
                                    "timeAdded": now}]
    elif not present and ours:
        spec["taints"] = [t for t in taints if t.get("key") != RESET_PAUSE_TAINT]


def _condition(node: Node, kind: str, want: ConditionWant, now: str) -> NodeCondition | None:
    """The condition to write, or None when it already is as wanted (or is absent and not to be created).
    lastTransitionTime is kept while the status holds."""
    current = next((c for c in node.get("status", {}).get("conditions") or [] if c.get("type") == kind), None)
    wanted = "True" if want.status else "False"
    if current is None and not want.create:
        return None
    if current is not None and (current.get("status"), current.get("reason"), current.get("message")) == (
            wanted, want.reason, want.message):
        return None
    transition = current.get("lastTransitionTime") if current and current.get("status") == wanted else now
    return {"type": kind, "status": wanted, "reason": want.reason, "message": want.message[:1024],
            "lastHeartbeatTime": now, "lastTransitionTime": transition or now}


def _delta(current: Mapping[str, str], wanted: Mapping[str, str | None]) -> dict[str, str | None]:
    """The entries of `wanted` that change `current` (None removes one that is there)."""
    return {k: v for k, v in wanted.items() if current.get(k) != v and not (v is None and k not in current)}

"""The one durable record of a node: what is wrong, what was done, what is owed, how far inputs were read.

Pure: the pipeline keeps one `NodeRecord`, writes it to the journal before it acknowledges an input or
takes an action, and the reconciler mirrors it to the Node's state annotation. Either copy can rebuild
the other: the copy with the higher `generation` wins.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.model import Action, DeviceRef, GpuRef, Severity, Step, StepKind, frozen_attrs
from agent.model_json import gpu_from_dict, gpu_to_dict
from agent.remediation.state import ActiveFault, ConditionState, DeviceIsolation, DeviceMark, NodeState

#: At most this many Events wait for delivery; the oldest are dropped (and counted) beyond it.
MAX_OWED_EVENTS = 200
#: The most the Node's state annotation holds. The API server refuses a Node whose annotations total more
#: than 256 KiB (keys and values, apimachinery's TotalAnnotationSizeLimitB); this leaves 160 KiB to others.
MIRROR_MAX_BYTES = 96 * 1024
#: Input cursors a bounded mirror leaves out: an input acknowledged only in the journal is read again by a
#: process that lost the journal, so the faults the mirror could not keep are raised again from it.
REPLAYED_CURSORS = frozenset({"kmsg"})
#: What a bounded mirror says it left out, and where the whole record is.
TRUNCATED = "truncated"


@dataclass(frozen=True, slots=True)
class OwedEvent:
    """An Event the agent owes: sent, folded into a series, until the API acknowledged it.

    `id` is deterministic, and the Event is created under a name made from it, so a resend after a crash
    finds the first one (409) instead of creating a second. `pending_pod` holds an EvictedForGpuFault
    back until its eviction was applied or the pod is gone.
    """

    id: str
    target: str
    reason: str
    type: str
    note: str
    rule_id: str = ""
    gpu_key: str = ""
    pending_pod: str = ""
    #: The uid of the pod the Event regards, when known (`kubectl describe pod` selects Events by it).
    target_uid: str = ""

    @classmethod
    def of(cls, step: Step, *, salt: str = "", pending_pod: str = "", target_uid: str = "") -> OwedEvent:
        reason = str(step.details.get("reason", "GpuHealth"))
        digest = hashlib.sha256(f"{step.target}|{reason}|{step.rule_id}|{step.gpu_key}|{step.reason}|{salt}"
                                .encode()).hexdigest()[:20]
        return cls(digest, step.target, reason, str(step.details.get("type", "Warning")), step.reason,
                   step.rule_id, step.gpu_key, pending_pod, target_uid)

    @classmethod
    def for_eviction(cls, evict: Step, *, pending: bool) -> OwedEvent:
        """The EvictedForGpuFault Event an EVICT step owes; `pending` holds it back until the pod is gone.

        Salted with the pod's uid: a pod recreated under the same name and evicted again (a StatefulSet's, the
        same fault on the same GPU within the Event's hour) gets an Event of its own, not a 409 on the last."""
        uid = str(evict.details.get("pod_uid", ""))
        event = Step(StepKind.EVENT, f"pod/{evict.target}", evict.reason, rule_id=evict.rule_id,
                     gpu_key=evict.gpu_key, details=frozen_attrs({"reason": "EvictedForGpuFault", "type": "Warning"}))
        return cls.of(event, salt=f"evicted:{uid}" if uid else "evicted", pending_pod=evict.target if pending else "",
                      target_uid=uid)

    def step(self) -> Step:
        details: dict[str, str] = {"reason": self.reason, "type": self.type, "event_id": self.id}
        if self.target_uid:
            details["target_uid"] = self.target_uid
        return Step(StepKind.EVENT, self.target, self.note, rule_id=self.rule_id, gpu_key=self.gpu_key,
                    details=frozen_attrs(details))

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "target": self.target, "reason": self.reason, "type": self.type, "note": self.note,
                "rule_id": self.rule_id, "gpu_key": self.gpu_key, "pending_pod": self.pending_pod,
                **({"target_uid": self.target_uid} if self.target_uid else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> OwedEvent:
        return cls(str(data["id"]), str(data["target"]), str(data["reason"]), str(data.get("type", "Warning")),
                   str(data.get("note", "")), str(data.get("rule_id", "")), str(data.get("gpu_key", "")),
                   str(data.get("pending_pod", "")), str(data.get("target_uid", "")))


@dataclass(slots=True)
class NodeRecord:
    """Active faults by (GPU key, rule id), remediation facts, owed Events, the GPU inventory, input cursors."""

    generation: int = 0
    faults: dict[tuple[str, str], ActiveFault] = field(default_factory=dict)
    node: NodeState = field(default_factory=NodeState)
    owed: list[OwedEvent] = field(default_factory=list)
    gpus: tuple[GpuRef, ...] = ()
    cursors: dict[str, str] = field(default_factory=dict)

    def owe(self, event: OwedEvent) -> None:
        if any(e.id == event.id for e in self.owed):
            return
        self.owed.append(event)
        del self.owed[:-MAX_OWED_EVENTS]

    def acknowledge(self, event_id: str) -> None:
        self.owed = [e for e in self.owed if e.id != event_id]

    def to_json(self) -> dict[str, object]:
        return {
            "generation": self.generation,
            "faults": [f.to_dict() for f in sorted(self.faults.values(), key=lambda f: (f.gpu_key, f.rule_id))],
            "remediation": self.node.to_json(),
            "owed": [e.to_dict() for e in self.owed],
            "gpus": [gpu_to_dict(g) for g in self.gpus],
            "cursors": dict(sorted(self.cursors.items())),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> NodeRecord:
        """Whatever of the document is readable; a malformed entry is skipped, never fatal."""
        record = cls()
        generation = data.get("generation")
        record.generation = generation if isinstance(generation, int) else 0
        for entry in _dicts(data.get("faults")):
            try:
                fault = ActiveFault.from_dict(entry)
            except (KeyError, ValueError, TypeError):
                continue
            record.faults[(fault.gpu_key, fault.rule_id)] = fault
        remediation = data.get("remediation")
        record.node = NodeState.from_json(dict(remediation) if isinstance(remediation, Mapping) else {})
        for entry in _dicts(data.get("owed")):
            try:
                record.owed.append(OwedEvent.from_dict(entry))
            except KeyError:
                continue
        gpus = []
        for entry in _dicts(data.get("gpus")):
            try:
                gpu = gpu_from_dict(entry)
            except ValueError:
                continue
            if gpu is not None:
                gpus.append(gpu)
        record.gpus = tuple(gpus)
        cursors = data.get("cursors")
        if isinstance(cursors, Mapping):
            record.cursors = {str(k): str(v) for k, v in cursors.items()}
        return record


def mirror_of(document: Mapping[str, object], *, max_bytes: int = MIRROR_MAX_BYTES) -> dict[str, object]:
    """The record as the Node's state annotation holds it: whole when it fits in `max_bytes`; otherwise the
    remediation facts, the inventory and the cursors (less the replayed ones), the faults that fit in this
    order (each GPU's worst first, then by action, severity and newest), the newest owed Events that fit,
    and a `truncated` entry with the counts of everything (faults by severity) and what was left out."""
    if _size(document) <= max_bytes:
        return dict(document)
    faults = _dicts(document.get("faults"))
    owed = _dicts(document.get("owed"))
    cursors = document.get("cursors")
    kept_cursors = {str(k): v for k, v in cursors.items() if k not in REPLAYED_CURSORS} \
        if isinstance(cursors, Mapping) else {}
    marker: dict[str, object] = {
        "faults": len(faults), "kept_faults": 0, "owed": len(owed), "kept_owed": 0,
        "severities": dict(sorted(Counter(str(f.get("severity", "")) for f in faults).items())),
        "cursors_left_out": sorted(set(cursors or {}) & REPLAYED_CURSORS) if isinstance(cursors, Mapping) else [],
        "full_record": "the node's journal (journal_path); docs/remediation.md, The record",
    }
    base = {**document, "faults": [], "owed": [], "cursors": kept_cursors, TRUNCATED: marker}
    budget = max_bytes - _size(base) - 32  # the kept counts' digits
    kept: list[Mapping[str, object]] = []
    for fault in _by_priority(faults):
        cost = _size(fault) + 1
        if cost <= budget:
            kept.append(fault)
            budget -= cost
    kept_owed: list[Mapping[str, object]] = []
    for event in reversed(owed):  # newest first
        cost = _size(event) + 1
        if cost > budget:
            break
        kept_owed.append(event)
        budget -= cost
    marker["kept_faults"], marker["kept_owed"] = len(kept), len(kept_owed)
    order = {id(f): i for i, f in enumerate(faults)}
    base["faults"] = sorted(kept, key=lambda f: order[id(f)])
    base["owed"] = list(reversed(kept_owed))
    return base


def is_truncated(document: Mapping[str, object]) -> bool:
    """Whether a mirrored record is a bounded one (some faults or Events live only in the journal)."""
    return isinstance(document.get(TRUNCATED), Mapping)


def _by_priority(faults: list[Mapping[str, object]]) -> list[Mapping[str, object]]:
    """Each GPU's worst fault first (what its isolation and the node's condition follow), then the rest by
    action, severity, and newest first."""
    def rank(fault: Mapping[str, object]) -> tuple[int, int, float]:
        action = Action(str(fault.get("action"))) if fault.get("action") in set(Action) else Action.NONE
        severity = Severity(str(fault.get("severity"))) if fault.get("severity") in set(Severity) else Severity.OK
        since = fault.get("since")
        return -action.rank, -severity.rank, -(float(since) if isinstance(since, int | float) else 0.0)

    ordered = sorted(faults, key=rank)
    worst: dict[str, Mapping[str, object]] = {}
    for fault in ordered:
        worst.setdefault(str(fault.get("gpu_key", "")), fault)
    firsts = {id(f) for f in worst.values()}
    return [*worst.values(), *(f for f in ordered if id(f) not in firsts)]


def _size(document: object) -> int:
    """Bytes of the document as the Node writer serialises it (compact, sorted keys, UTF-8)."""
    return len(json.dumps(document, sort_keys=True, separators=(",", ":")).encode())


def _dicts(value: object) -> list[Mapping[str, object]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


@dataclass(frozen=True, slots=True)
class NodeObservation:
    """What one read of the real Node says: the agent's marks on it, the mirrored record, an operator's
    release request and confirm of a braked taint, the opt-out label, and whether the node is labelled as
    holding a budget slot."""

    conditions: Mapping[str, ConditionState]
    tainted: bool
    reboot_requested: bool
    replacement: frozenset[str]
    record: Mapping[str, object] | None = None
    release: str = ""
    opted_out: bool = False
    holds_slot: bool = False
    #: The agent's DeviceTaintRules for this node as the API lists them; None when not read (node isolation).
    device_taints: Mapping[DeviceRef, DeviceMark] | None = None
    #: What per-GPU isolation the cluster allows now; None when not read (node isolation, or unreadable).
    devices: DeviceIsolation | None = None
    #: An operator's confirm of the taint the quarantine brake keeps waiting (agent.fleet.confirm); "" none.
    confirm: str = ""
    #: The quarantine's start the Node's label shows (its wall-clock second; 0: none): what a record that
    #: lacks it (an earlier version's, or a lost journal) takes, so the start is never stamped anew.
    quarantine_label: float = 0.0

    def actual(self, facts: NodeState) -> NodeState:
        """The record's remediation facts with what the Node itself shows in place of the marks."""
        return NodeState(conditions=dict(self.conditions), tainted=self.tainted,
                         evicted={k: set(v) for k, v in facts.evicted.items()}, resets=set(facts.resets),
                         reboot_requested=self.reboot_requested, replacement=set(self.replacement),
                         recoveries=facts.recoveries.copy(), verifying=dict(facts.verifying),
                         recovering=set(facts.recovering), diagnosed=set(facts.diagnosed),
                         mig_expected=dict(facts.mig_expected),
                         device_taints=dict(facts.device_taints if self.device_taints is None else self.device_taints),
                         quarantined_since=facts.quarantined_since or self.quarantine_label)

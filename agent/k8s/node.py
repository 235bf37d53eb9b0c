"""The agent's own marks on its Node: conditions, its taint, its cordon, labels and the state annotation.

Every write is compare-patch against the Node as last observed (the previous GET, the answer of the
previous write, or the watch's last event: agent.k8s.node_cache), under that observation's resourceVersion:
a 409 reads the Node again and retries, so a fault costs one PATCH and no GET. Nothing is written when a
fresh read (a GET, or the Node a live watch vouches for) says the Node already is as it should be; taints
and cordons the agent did not set are never touched. A reconcile pass opens a batch (`begin_batch`): the marks
its steps, its budget label and its mirror ask for wait there and go in one write at its end (`flush`; two
where the pass changes both the taint and a condition: agent.k8s.node_marks says why).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from agent.fleet.published import QUARANTINE_LABEL, quarantined_since
from agent.k8s.bodies import Node, NodeCondition, as_node
from agent.k8s.errors import Conflict
from agent.k8s.node_cache import NodeCache
from agent.k8s.node_marks import CORDONED, ConditionWant, NodeMarks, TaintOptions, node_patches
from agent.k8s.raw import RawApi, api_path
from agent.k8s.retry import on_conflict, with_retries
from agent.remediation.record import NodeObservation
from agent.remediation.state import ConditionState
from agent.timefmt import rfc3339

PREFIX = "gpu-health-agent.io"
STATE_ANNOTATION = f"{PREFIX}/state"
CORDONED_ANNOTATION = CORDONED
REBOOT_ANNOTATION = f"{PREFIX}/reboot-requested"
REPLACE_ANNOTATION = f"{PREFIX}/replace-gpus"
RELEASE_ANNOTATION = f"{PREFIX}/release"
#: An operator's confirm of a taint the quarantine brake keeps waiting (`gpu-health-agent fleet confirm`):
#: written by the operator, only ever removed by the agent (daemonset/admission-policy.yaml).
CONFIRM_ANNOTATION = f"{PREFIX}/brake-confirm"
REPLACEMENT_LABEL = f"{PREFIX}/needs-replacement"
DISRUPTION_LABEL = f"{PREFIX}/disruption"
CONDITION_REBOOT = "GpuRebootRequired"
AGENT_CONDITIONS = ("GpuFatalFault", "GpuDegraded", "GpuUnreadable", CONDITION_REBOOT, "GpuResetRequired",
                    "AcceleratedHardwareReady")
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


class NodeWriter:
    """Reads and patches one Node; remembers the Node as the last read or write left it."""

    def __init__(self, raw: RawApi, node_name: str, *, taint_key: str, taint_effect: str = "NoSchedule",
                 cordon: bool = False, deadline_seconds: float | None = None, seen: NodeCache | None = None) -> None:
        self.raw = raw
        self.name = node_name
        self.taint_key = taint_key
        self.taint_effect = taint_effect
        self.cordon = cordon
        self.taint = TaintOptions(taint_key, taint_effect, cordon)
        self.deadline = deadline_seconds
        self.path = api_path("", "v1", "nodes", name=node_name)
        #: The Node as the last GET, PATCH or watch event showed it; a live watch (agent.k8s.node_watch)
        #: vouches that it is current.
        self.seen = seen or NodeCache()
        #: One pass's marks while its batch is open (begin_batch .. flush), and the thread that opened it.
        self._batch: NodeMarks | None = None
        self._batch_thread = 0

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

    # ---- one pass's marks, written together ----
    def begin_batch(self) -> None:
        """From now on, marks asked for with `join_batch` on this thread wait for `flush` (one pass's writes)."""
        self._batch = NodeMarks()
        self._batch_thread = threading.get_ident()

    def flush(self) -> bool:
        """Write the batch's marks (at most a patch to the Node and one to its status) and close the batch;
        False: the Node already showed them. Raises the API's error, the batch closed all the same."""
        marks, self._batch = self._batch, None
        return marks is not None and not marks.empty() and self.write(marks)

    def staged_annotation(self, key: str) -> str | None:
        """An annotation as the open batch wants it, else as the Node shows it (None: absent)."""
        if self._batching() and self._batch is not None and key in self._batch.annotations:
            return self._batch.annotations[key]
        return self.read().annotations.get(key)

    def _batching(self) -> bool:
        return self._batch is not None and self._batch_thread == threading.get_ident()

    def _want(self, marks: NodeMarks, join_batch: bool) -> bool:
        """Write `marks` now, or add them to the open batch (then: whether the Node as last seen lacks them)."""
        if join_batch and self._batching() and self._batch is not None:
            self._batch.merge(marks)
            node = self.seen.node
            return node is None or not node_patches(marks, node, taint=self.taint, now=rfc3339()).empty()
        return self.write(marks)

    # ---- conditions ----
    def set_condition(self, kind: str, *, status: bool, reason: str, message: str, create: bool | None = None,
                      join_batch: bool = False) -> bool:
        """Set one condition; keep lastTransitionTime while the status holds. False: nothing to do. An absent
        condition is created only when `create` (default: when `status`, as a problem condition is)."""
        want = ConditionWant(status, reason, message, status if create is None else create)
        return self._want(NodeMarks(conditions={kind: want}), join_batch)

    # ---- taint and cordon ----
    def set_taint(self, present: bool, *, join_batch: bool = False) -> bool:
        """Add or remove the agent's own taint (and cordon, when configured); other taints stay."""
        return self._want(NodeMarks(taint=present), join_batch)

    # ---- labels and annotations ----
    def set_metadata(self, *, labels: dict[str, str | None] | None = None,
                     annotations: dict[str, str | None] | None = None, pause_taint: bool | None = None,
                     join_batch: bool = False) -> bool:
        """Set (or, with None, remove) labels and annotations, and with `pause_taint` add or remove the reset
        pause's taint in the same write; nothing is written when they already match."""
        return self._want(NodeMarks(labels=dict(labels or {}), annotations=dict(annotations or {}),
                                    pause_taint=pause_taint), join_batch)

    def save_record(self, document: Mapping[str, object], *, join_batch: bool = False) -> bool:
        """The Node's copy of the durable record (the journal's twin; the newer generation wins)."""
        text = json.dumps(document, sort_keys=True, separators=(",", ":"))
        return self.set_metadata(annotations={STATE_ANNOTATION: text}, join_batch=join_batch)

    def write(self, marks: NodeMarks) -> bool:
        """Patch what `marks` ask of the Node as last observed, under its resourceVersion: the spec (taint,
        cordon) to the Node, the conditions to its status subresource, labels and annotations with the status
        patch where there is one (agent.k8s.node_marks). No GET first: a stale observation answers 409, and
        the retry reads the Node again and diffs anew; an observation that says nothing is to be done is
        confirmed by a fresh read (a GET, or the Node a live watch vouches for) before the writer says so
        (idempotent, never blind)."""

        def attempt() -> bool:
            node = self.seen.node
            patches = node_patches(marks, node, taint=self.taint, now=rfc3339()) if node is not None else None
            if node is None or patches is None or patches.empty():
                node = self.seen.current() if patches is not None else None
                node = node or self._raw()
                patches = node_patches(marks, node, taint=self.taint, now=rfc3339())
                if patches.empty():
                    return False
            for path, patch in ((self.path, patches.main), (f"{self.path}/status", patches.status)):
                if patch is None:
                    continue
                patch.setdefault("metadata", {})["resourceVersion"] = node["metadata"]["resourceVersion"]
                with self.seen.writing():
                    try:
                        node = as_node(self.raw.strategic_patch(path, patch))
                    except Conflict:
                        self.seen.forget()  # changed since observed: the next attempt reads it again
                        raise
                    self.seen.offer(node)
            return True

        return bool(with_retries(lambda: on_conflict(attempt), deadline_seconds=self.deadline))


def saved_record(view: NodeView) -> dict[str, object] | None:
    """The record mirrored in the state annotation (None when absent or unreadable)."""
    text = view.annotations.get(STATE_ANNOTATION)
    try:
        saved = json.loads(text) if text else None
    except ValueError:
        return None
    return saved if isinstance(saved, dict) else None

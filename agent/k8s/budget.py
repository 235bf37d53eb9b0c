"""The cluster-wide disruption budget: one small Lease per disrupted node, counted by every agent.

A node must hold a slot before a disruptive step (eviction, GPU reset, reboot request), and renews it
while it stays disrupted. A slot is a Lease `gpu-health-slot-<node>` labelled as a budget slot, which only
that node's agent creates, renews and deletes (the admission policy holds every agent to its own: the
node named in its bound token). No agent's clock decides anything:
  - a slot's life is judged as Kubernetes leader election judges a lease: by how long this reader has seen
    it unchanged (uid and resourceVersion) on its own monotonic clock. A slot first seen counts as live
    for a whole lifetime; the stamps in it (renewTime) are written for people and never read, so a stamp
    from a clock hours ahead or behind, or in the future, neither erases nor blocks anything for long;
  - two agents taking the last slot at once: each creates its slot first, then lists the live slots and
    counts those created no later than its own (the API server's creationTimestamp, one clock; equal
    seconds count against both). An agent with `limit` or more ahead deletes its slot and waits. The last
    slot created sees every other, so no more than `limit` slots are ever granted together;
  - a slot this process did not confirm (an earlier process's, or its own unrenewed for most of a lifetime,
    which other readers may have let lapse and given away) is re-taken: written again in place (a change
    every reader sees, so it is live to all from then) and ranked as taken now, behind every other live
    slot. Its old creationTimestamp never lets it jump ahead of a node that took a slot meanwhile.
Every request is retried on transient errors (bounded, jittered, under a deadline). A slot this agent may
have written but not confirmed as granted is remembered (`maybe_held`) until it is deleted, so the
pipeline gives it back. A second Lease, written only by an operator, pauses all disruption cluster-wide.
The node label `gpu-health-agent.io/disruption` is a view of the slot, set and repaired by `show`.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

from agent.k8s.errors import Conflict, NotFound
from agent.k8s.node import DISRUPTION_LABEL
from agent.k8s.raw import JsonDocument, RawApi, api_path
from agent.k8s.retry import on_conflict, with_retries
from agent.remediation.guard import GateReading

PAUSE_LEASE = "gpu-health-pause"
#: The one shared Lease of earlier versions (holders in an annotation). While it exists (a rolling upgrade:
#: nodes an old agent disrupted), every other node's entry in it counts as a slot, judged like one (live
#: until seen unchanged for a lifetime); no agent may write it any more, and cleanup removes it.
BUDGET_LEASE = "gpu-health-disruption-budget"
LEGACY_HOLDERS_ANNOTATION = "gpu-health-agent.io/holders"
SLOT_PREFIX = "gpu-health-slot-"
SLOT_LABEL = "gpu-health-agent.io/budget-slot"

T = TypeVar("T")


def slot_name(node: str) -> str:
    return SLOT_PREFIX + node


def budget_limit(*, gpu_nodes: int, max_nodes: int, max_percent: float) -> int:
    """The most nodes that may be disrupted at once: the tighter of N nodes and P % of GPU nodes (at least 1
    while there is any GPU node, so a single broken node can always be handled)."""
    bounds = []
    if max_nodes > 0:
        bounds.append(max_nodes)
    if max_percent > 0:
        bounds.append(max(1, math.floor(gpu_nodes * max_percent / 100)))
    return min(bounds) if bounds and gpu_nodes > 0 else 0


@dataclass(frozen=True, slots=True)
class Slot:
    """One budget slot as the API server lists it."""

    name: str
    holder: str
    uid: str
    version: str
    #: The server's creationTimestamp in seconds since the epoch (None: unreadable, ranked first).
    created: float | None

    @classmethod
    def of(cls, lease: JsonDocument) -> Slot:
        meta = lease.get("metadata") or {}
        return cls(str(meta.get("name", "")), str((lease.get("spec") or {}).get("holderIdentity") or ""),
                   str(meta.get("uid", "")), str(meta.get("resourceVersion", "")),
                   _epoch(meta.get("creationTimestamp")))


class Sightings:
    """When this reader last saw each slot change, on its own monotonic clock (leader election's rule)."""

    def __init__(self, ttl_seconds: float, monotonic: Callable[[], float]) -> None:
        self.ttl = ttl_seconds
        self.monotonic = monotonic
        self._seen: dict[str, tuple[tuple[str, str], float]] = {}

    def live(self, slots: Iterable[Slot], *, own: str = "") -> list[Slot]:
        """The slots not seen unchanged for a whole lifetime; `own` (this node's) is live while it exists."""
        now = self.monotonic()
        seen: dict[str, tuple[tuple[str, str], float]] = {}
        listed = list(slots)
        for slot in listed:
            key = (slot.uid, slot.version)
            before = self._seen.get(slot.name)
            seen[slot.name] = (key, before[1] if before is not None and before[0] == key else now)
        self._seen = seen  # a slot gone from the list is forgotten; seen again, it starts a new lifetime
        return [s for s in listed if s.name == own or now - seen[s.name][1] < self.ttl]


def legacy_slots(lease: JsonDocument) -> list[Slot]:
    """The holders of an earlier version's shared budget Lease as slots: each entry's stamp is its version
    (an old agent's renewal changes it), and each ranks ahead of every slot (it was taken first)."""
    meta = lease.get("metadata") or {}
    try:
        holders = json.loads((meta.get("annotations") or {}).get(LEGACY_HOLDERS_ANNOTATION) or "{}")
    except ValueError:
        holders = {}
    if not isinstance(holders, dict):
        return []
    return [Slot(f"{BUDGET_LEASE}/{node}", str(node), str(meta.get("uid", "")), str(stamp), None)
            for node, stamp in sorted(holders.items())]


def ahead_of(own: Slot, live: Iterable[Slot], *, retaken: bool = False) -> int:
    """Live slots created no later than `own` (ties and unreadable stamps count against it); a re-taken slot
    ranks as taken now: every other live slot is ahead of it."""
    return sum(1 for s in live if s.name != own.name and
               (retaken or s.created is None or own.created is None or s.created <= own.created))


class LeaseBudget:
    """ClusterGate for the pipeline: the pause Lease and this node's budget slot."""

    def __init__(self, raw: RawApi, *, node_name: str, namespace: str, max_nodes: int, max_percent: float,
                 gpu_node_selector: str = "nvidia.com/gpu.present=true", ttl_seconds: float = 7200.0,
                 count_seconds: float = 300.0, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, deadline_seconds: float | None = None,
                 on_usage: Callable[[int, int], None] = lambda in_use, limit: None,
                 rng: random.Random | None = None) -> None:
        self.raw = raw
        self.leases = api_path("coordination.k8s.io", "v1", "leases", namespace=namespace)
        self.node = node_name
        self.slot = slot_name(node_name)
        self.namespace = namespace
        self.max_nodes = max_nodes
        self.max_percent = max_percent
        self.selector = gpu_node_selector
        self.ttl = ttl_seconds
        self.count_seconds = count_seconds
        #: Wall clock: only for the stamps people read (renewTime); never for a decision.
        self.clock = clock
        self.monotonic = monotonic
        self.deadline = deadline_seconds
        self.on_usage = on_usage
        #: The retries' jitter (seedable: a seeded run draws the same waits whatever ran before it).
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        self.sightings = Sightings(ttl_seconds, monotonic)
        self._limit = 0
        self._counted_at: float | None = None
        #: This process confirmed its slot as granted (renewals then only renew) ...
        self._granted = False
        #: ... by a write sent at this monotonic time; trusted for `confirm_fraction` of a lifetime after it
        #: (other readers let a slot lapse a lifetime after they see its last write, never sooner).
        self._confirmed_at = 0.0
        self.confirm_fraction = 0.9
        #: This process may have a slot on the server it has not confirmed or given back.
        self.maybe_held = False
        #: The slot this process wrote (created, or re-taken) and has not ranked yet, as the write answered:
        #: a later acquire goes on from the ranking (one list) instead of writing it again.
        self._written: tuple[Slot, bool] | None = None
        self._written_at = 0.0
        #: The live slots as the gate's last reading listed them after that write (None: no such list): a list
        #: made any time after the write ranks it, so the acquire that follows need not list again.
        self._listed: list[Slot] | None = None

    # ---- reading ----
    def read(self) -> GateReading:
        """The pause Lease and the live slots, in one go (three requests at most, each retried)."""
        if self._paused():
            return GateReading(paused=True, held=self._granted, limit=self._limit or 1)
        slots = self._slots()
        if self._written is not None:
            self._listed = slots
        others = len([s for s in slots if s.name != self.slot])
        own = next((s for s in slots if s.name == self.slot), None)
        if own is not None and self._confirmed():
            return GateReading(held=True, in_use=others, limit=self._limit or 1)
        self._count_gpu_nodes()
        # A slot of ours this process has not confirmed counts as what it would rank re-taken: behind all.
        held = own is not None and ahead_of(own, slots, retaken=True) < self._limit
        self.on_usage(len(slots), self._limit)
        return GateReading(held=held, in_use=others, limit=self._limit)

    def holders(self) -> dict[str, float]:
        """The live slots' holders, with the server's creation time (tests and the fleet observer)."""
        return {s.holder or s.name: s.created or 0.0 for s in self._slots()}

    # ---- writing: only this node's slot ----
    def acquire(self) -> GateReading:
        """Take (or renew) this node's slot; `held` False when the budget is spent (the slot is given back)."""
        if self._confirmed():
            try:
                self._renew()
                return GateReading(held=True, limit=self._limit or 1)
            except NotFound:  # deleted under us (an operator): a new slot is ranked like any other
                self._granted = False
        self._granted = False
        own, created, sent, slots = self._written_and_listed()
        self._count_gpu_nodes()
        ahead = ahead_of(own, slots, retaken=not created)
        others = len([s for s in slots if s.name != self.slot])
        self._written = None
        if ahead < self._limit:
            self._granted, self._confirmed_at = True, sent
            self.on_usage(others + 1, self._limit)
            return GateReading(held=True, in_use=others, limit=self._limit)
        self._delete()
        self.on_usage(others, self._limit)
        return GateReading(held=False, in_use=others, limit=self._limit)

    def _written_and_listed(self) -> tuple[Slot, bool, float, list[Slot]]:
        """This node's slot written (or the one an earlier call wrote and could not rank, while the list still
        shows it unchanged), whether it was created, when the write was sent, and the live slots listed after
        it. Ranking by a list made any time after the write is the rule: every slot created later saw ours."""
        for _ in range(2):
            if self._written is not None and self.monotonic() - self._written_at >= self.ttl * self.confirm_fraction:
                self._written = None  # unrenewed so long that other readers may have let it lapse: written again
            if self._written is None:
                sent = self.monotonic()
                document, created = self._create_or_get()
                if not created:  # there already (maybe an earlier process's): re-taken in place, ranked as new
                    self._retake(document)
                self._written, self._written_at, self._listed = (Slot.of(document), created), sent, None
            own, created = self._written
            slots, self._listed = self._listed if self._listed is not None else self._slots(), None
            listed = next((s for s in slots if s.name == own.name), None)
            if listed is not None and listed.uid == own.uid:
                return own, created, self._written_at, slots
            self._written = None  # deleted or replaced since (an operator): written again
        raise NotFound(f"budget slot {self.slot} gone each time it was written", status=404)

    def release(self) -> None:
        """Give the slot back (clearing is never blocked, and a healthy node holds nothing)."""
        if not (self._granted or self.maybe_held):
            try:  # nothing known of a slot here: look before writing (a restarted agent, a node never disrupted)
                self._retried(lambda: self.raw.get(f"{self.leases}/{self.slot}"))
            except NotFound:
                return
        self._delete()

    def show(self, holding: bool) -> None:
        """The node label as a view of the slot: set while holding, removed otherwise."""
        path = api_path("", "v1", "nodes", name=self.node)
        body = {"metadata": {"labels": {DISRUPTION_LABEL: "active" if holding else None}}}
        self._retried(lambda: self.raw.strategic_patch(path, body))

    # ---- requests ----
    def _paused(self) -> bool:
        try:
            self._retried(lambda: self.raw.get(f"{self.leases}/{PAUSE_LEASE}"))
        except NotFound:
            return False
        return True

    def _slots(self) -> list[Slot]:
        """The live slots: the labelled slot Leases and the other nodes' entries in an earlier version's shared
        Lease, in one list of the namespace's Leases (a handful: slots, the pause, the fleet's leader)."""
        listed = self._retried(lambda: self.raw.get(self.leases))
        slots: list[Slot] = []
        for item in listed.get("items") or []:
            meta = item.get("metadata") or {}
            if (meta.get("labels") or {}).get(SLOT_LABEL) == "true":
                slots.append(Slot.of(item))
            elif meta.get("name") == BUDGET_LEASE:
                slots.extend(s for s in legacy_slots(item) if s.holder != self.node)
        return self.sightings.live(slots, own=self.slot)

    def _confirmed(self) -> bool:
        """This process granted its slot and wrote it recently enough that no reader can have let it lapse."""
        return self._granted and self.monotonic() - self._confirmed_at < self.ttl * self.confirm_fraction

    def _create_or_get(self) -> tuple[JsonDocument, bool]:
        """This node's slot, and whether this request created it (False: it was there, or a retried create
        landed; either way it is then re-taken, which only ever ranks it later)."""
        body = {"metadata": {"name": self.slot, "namespace": self.namespace, "labels": {SLOT_LABEL: "true"}},
                "spec": {"holderIdentity": self.node, "leaseDurationSeconds": int(self.ttl),
                         "acquireTime": _micro(self.clock()), "renewTime": _micro(self.clock())}}
        self.maybe_held = True  # from here until the slot is confirmed or deleted

        def create() -> tuple[JsonDocument, bool]:
            for _ in range(3):
                try:
                    return self.raw.create(self.leases, body), True
                except Conflict:  # ours already (an earlier pass or process, or a retried create that landed)
                    try:
                        return self.raw.get(f"{self.leases}/{self.slot}"), False
                    except NotFound:
                        continue  # deleted between the two: create again
            return self.raw.create(self.leases, body), True

        return self._retried(create)

    def _retake(self, lease: JsonDocument) -> None:
        """Write an existing slot again so that it changes for every reader (leaseTransitions counts up, so
        the write is never a no-op the server would not version), whatever its stamps say."""
        transitions = (lease.get("spec") or {}).get("leaseTransitions")
        now = _micro(self.clock())
        body = {"spec": {"acquireTime": now, "renewTime": now,
                         "leaseTransitions": (transitions if isinstance(transitions, int) else 0) + 1}}
        self._patch(body)

    def _renew(self) -> None:
        body = {"spec": {"renewTime": _micro(self.clock())}}
        sent = self.monotonic()
        self._patch(body)
        self._confirmed_at = sent

    def _delete(self) -> None:
        def delete() -> None:
            with contextlib.suppress(NotFound):
                self.raw.delete(f"{self.leases}/{self.slot}")

        self._retried(delete)
        self._granted = False
        self.maybe_held = False
        self._written, self._listed = None, None

    def _patch(self, body: JsonDocument) -> None:
        """A merge patch of this node's slot. Only this agent writes it: a 409 (a conflict answered anyway) is
        simply sent again."""
        on_conflict(lambda: self._retried(lambda: self.raw.merge_patch(f"{self.leases}/{self.slot}", body)),
                    rng=self.rng)

    def _retried(self, func: Callable[[], T]) -> T:
        """A budget request retried on transient errors (jittered from this gate's random state, bounded by
        the deadline)."""
        return with_retries(func, deadline_seconds=self.deadline, rng=self.rng)

    def _count_gpu_nodes(self) -> None:
        """A list call: made at most every few minutes, so a blocked node stays cheap for the API server."""
        now = self.monotonic()
        if self._counted_at is not None and now - self._counted_at < self.count_seconds and self._limit:
            return
        nodes = self._retried(lambda: self.raw.get(api_path("", "v1", "nodes"),
                                                  query={"labelSelector": self.selector}))
        self._limit = budget_limit(gpu_nodes=len(nodes.get("items") or []), max_nodes=self.max_nodes,
                                   max_percent=self.max_percent)
        self._counted_at = now


def _epoch(stamp: object) -> float | None:
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _micro(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(at))

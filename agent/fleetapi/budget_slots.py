"""The budget's slots as read: one Lease each, how each reader first saw it, its takes, and the ranking."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from agent.fleet.unit import UNIT_ANNOTATION
from agent.fleetapi.budget_units import Units, counted_as, distinct
from agent.k8s.bodies import Lease, LeasePatch, LeaseSpec
from agent.k8s.raw import JsonDocument
from agent.timefmt import parse_rfc3339

#: The one shared Lease of earlier versions (holders in an annotation). While it exists (a rolling upgrade:
#: nodes an old agent disrupted), every other node's entry in it counts as a slot, judged like one (live
#: until seen unchanged for a lifetime); no agent may write it any more, and cleanup removes it.
BUDGET_LEASE = "gpu-health-disruption-budget"
LEGACY_HOLDERS_ANNOTATION = "gpu-health-agent.io/holders"
#: On a slot given back and kept for the rate bound's window (its value a stamp for people, never read).
RELEASED_ANNOTATION = "gpu-health-agent.io/released"
SLOT_PREFIX = "gpu-health-slot-"
SLOT_LABEL = "gpu-health-agent.io/budget-slot"



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
    #: spec.leaseTransitions: with the uid, which take of the slot this is (every take changes it).
    takes: int = 0
    #: Given back and kept only for the rate bound's window: no longer a node disrupted.
    released: bool = False
    #: The fleet unit its holder says it is disrupted with, for people (the count reads the published units).
    unit: str = ""

    @classmethod
    def of(cls, lease: JsonDocument) -> Slot:
        meta = lease.get("metadata") or {}
        spec = lease.get("spec") or {}
        transitions = spec.get("leaseTransitions")
        annotations = meta.get("annotations") or {}
        return cls(str(meta.get("name", "")), str(spec.get("holderIdentity") or ""),
                   str(meta.get("uid", "")), str(meta.get("resourceVersion", "")),
                   epoch(meta.get("creationTimestamp")), transitions if isinstance(transitions, int) else 0,
                   RELEASED_ANNOTATION in annotations, str(annotations.get(UNIT_ANNOTATION) or ""))


def new_slot(node: str, *, namespace: str, ttl_seconds: float, unit: str, now: str) -> Lease:
    """The slot Lease `node`'s agent creates: labelled, held by the node, with the unit it is taken out with."""
    return {"metadata": {"name": slot_name(node), "namespace": namespace, "labels": {SLOT_LABEL: "true"},
                         "annotations": {UNIT_ANNOTATION: unit} if unit else {}},
            "spec": {"holderIdentity": node, "leaseDurationSeconds": int(ttl_seconds), "acquireTime": now,
                     "renewTime": now}}


def retake_patch(slot: Slot, *, reused: bool, unit: str, now: str) -> LeasePatch:
    """An existing slot (as read) written again: a new take (leaseTransitions + 1) unless `reused`, the unit
    written or removed, the released mark removed."""
    spec: LeaseSpec = {"acquireTime": now, "renewTime": now}
    if not reused:
        spec["leaseTransitions"] = slot.takes + 1
    annotations: dict[str, str | None] = {UNIT_ANNOTATION: unit or None}
    if slot.released:
        annotations[RELEASED_ANNOTATION] = None
    return {"spec": spec, "metadata": {"annotations": annotations}}


def renew_patch(*, unit: str, now: str) -> LeasePatch:
    return {"metadata": {"annotations": {UNIT_ANNOTATION: unit or None}}, "spec": {"renewTime": now}}


def release_patch(*, now: str) -> LeasePatch:
    """Given back with the rate bound: marked released (a stamp for people) and kept."""
    return {"metadata": {"annotations": {RELEASED_ANNOTATION: now}}, "spec": {"renewTime": now}}


def carry_patch(takes: int) -> LeasePatch:
    """A reused take granted: a new leaseTransitions, so every reader counts it from now."""
    return {"spec": {"leaseTransitions": takes}}


class Sightings:
    """When this reader last saw each slot change, on its own monotonic clock (leader election's rule)."""

    def __init__(self, ttl_seconds: float, monotonic: Callable[[], float]) -> None:
        self.ttl = ttl_seconds
        self.monotonic = monotonic
        self._seen: dict[str, tuple[tuple[str, str], float]] = {}

    def live(self, slots: Iterable[Slot], *, own: str = "") -> list[Slot]:
        """The slots not seen unchanged for a whole lifetime; `own` (this node's) is live while it exists."""
        now = self.monotonic()
        listed = list(slots)
        # A slot gone from the list is forgotten; seen again, it starts a new lifetime.
        self._seen = seen = first_seen(self._seen, listed, lambda s: (s.uid, s.version), now)
        return [s for s in listed if s.name == own or now - seen[s.name][1] < self.ttl]


K = TypeVar("K")


def first_seen(before: Mapping[str, tuple[K, float]], slots: Iterable[Slot], key: Callable[[Slot], K],
               now: float) -> dict[str, tuple[K, float]]:
    """Each listed slot's `key` and when this reader first saw it with that key (kept from `before` while the
    key is unchanged, else `now`); slots not listed are dropped."""
    seen: dict[str, tuple[K, float]] = {}
    for slot in slots:
        value = key(slot)
        earlier = before.get(slot.name)
        seen[slot.name] = (value, earlier[1] if earlier is not None and earlier[0] == value else now)
    return seen


class Takings:
    """When this reader first saw each slot's current take (uid and leaseTransitions), on its own monotonic
    clock: a take counts against the rate bound until this reader has seen it for a whole window. A take first
    seen (a restarted reader) counts for a whole window from then; a renewal or a release is no new take."""

    def __init__(self, window_seconds: float, monotonic: Callable[[], float]) -> None:
        self.window = window_seconds
        self.monotonic = monotonic
        self._seen: dict[str, tuple[tuple[str, int], float]] = {}

    def recent(self, slots: Iterable[Slot]) -> list[Slot]:
        """The slots (held or released) whose take this reader first saw less than a window ago; a slot gone
        from the list is forgotten (a refused take deleted, a released slot whose window passed)."""
        now = self.monotonic()
        listed = list(slots)
        self._seen = seen = first_seen(self._seen, listed, lambda s: (s.uid, s.takes), now)
        return [s for s in listed if now - seen[s.name][1] < self.window]


def within_rate(taken_ahead: int, max_per_window: int) -> bool:
    """Whether one more take fits the rate bound: fewer than the bound taken ahead of it (0: no bound)."""
    return max_per_window <= 0 or taken_ahead < max_per_window


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


def listed_slots(items: Iterable[JsonDocument], *, node: str) -> tuple[list[Slot], list[Slot]]:
    """From one list of the namespace's Leases: the labelled slot Leases, and the entries of nodes other than
    `node` in an earlier version's shared Lease (disrupted by an old agent)."""
    slots: list[Slot] = []
    legacy: list[Slot] = []
    for item in items:
        meta = item.get("metadata") or {}
        if (meta.get("labels") or {}).get(SLOT_LABEL) == "true":
            slots.append(Slot.of(item))
        elif meta.get("name") == BUDGET_LEASE:
            legacy.extend(s for s in legacy_slots(item) if s.holder != node)
    return slots, legacy


def ahead_of(own: Slot, live: Iterable[Slot], *, retaken: bool = False, units: Units | None = None) -> int:
    """Live slots created no later than `own` (ties and unreadable stamps count against it); a re-taken slot
    ranks as taken now: every other live slot is ahead of it. The slots of one published unit (`units`) are
    one, and `own`'s unit is not ahead of it (a later slot of a unit joins its place)."""
    units = units or {}
    return distinct([s for s in live if s.name != own.name and
                     (retaken or s.created is None or own.created is None or s.created <= own.created)],
                    units, besides=counted_as(own, units))


def epoch(stamp: object) -> float | None:
    """Seconds since the epoch of an RFC 3339 stamp (a creationTimestamp); None where it is none."""
    if not isinstance(stamp, str):
        return None
    try:
        return parse_rfc3339(stamp)
    except ValueError:
        return None

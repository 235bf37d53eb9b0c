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

The rate bound (at most `max_per_hour` nodes newly disrupted within `window_seconds`) is counted on the same
Leases: a slot given back is kept, annotated as released, until its holder has seen a window pass, and each
reader counts a slot's take (its uid and leaseTransitions, which every take changes and a release does not)
until it has seen that take unchanged for a window on its own monotonic clock. A take is ranked on both
bounds in the one list after its write; a node re-taking its own released slot within the window is that one
take still (it counts once); a refused take of a slot that was there is released again, never deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from agent.fleet.unit import UNIT_ANNOTATION, unit_of_node
from agent.k8s.brake_claims import CLAIM_LABEL
from agent.k8s.budget_slots import (
    BUDGET_LEASE,
    RELEASED_ANNOTATION,
    SLOT_LABEL,
    Sightings,
    Slot,
    Takings,
    ahead_of,
    budget_limit,
    legacy_slots,
    slot_name,
    within_rate,
)
from agent.k8s.budget_units import Units, UnitView, counted_as, distinct
from agent.k8s.errors import Conflict, NotFound
from agent.k8s.node import DISRUPTION_LABEL, NodeWriter
from agent.k8s.raw import JsonDocument, RawApi, api_path
from agent.k8s.retry import on_conflict, with_retries
from agent.k8s.watch import ListWatch, WatchOptions
from agent.remediation.guard import GateReading

PAUSE_LEASE = "gpu-health-pause"

T = TypeVar("T")


class LeaseBudget:
    """ClusterGate for the pipeline: the pause Lease and this node's budget slot."""

    def __init__(self, raw: RawApi, *, node_name: str, namespace: str, max_nodes: int, max_percent: float,
                 max_per_hour: int = 0, window_seconds: float = 3600.0,
                 gpu_node_selector: str = "nvidia.com/gpu.present=true", ttl_seconds: float = 7200.0,
                 count_seconds: float = 300.0, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, deadline_seconds: float | None = None,
                 on_usage: Callable[[int, int], None] = lambda in_use, limit: None,
                 rng: random.Random | None = None, units: Callable[[], Units] | None = None,
                 census: Callable[[str], int | None] | None = None, node: NodeWriter | None = None) -> None:
        self.raw = raw
        self.leases = api_path("coordination.k8s.io", "v1", "leases", namespace=namespace)
        self.node = node_name
        self.slot = slot_name(node_name)
        self.namespace = namespace
        self.max_nodes = max_nodes
        self.max_percent = max_percent
        #: The rate bound: at most this many nodes newly disrupted within `window` (0: no bound).
        self.max_per_hour = max_per_hour
        self.window = window_seconds
        self.selector = gpu_node_selector
        self.ttl = ttl_seconds
        self.count_seconds = count_seconds
        #: The GPU nodes by a live fleet controller's census for a selector (agent.k8s.fleet_gate), None where
        #: it has none: then this agent lists them itself.
        self.census = census
        #: The agent's writer of its Node: the label goes through it, so its view of the Node stays current
        #: (None: a patch of its own, which leaves that view stale and the writer's next patch a 409).
        self.node_writer = node
        #: Wall clock: only for the stamps people read (renewTime); never for a decision.
        self.clock = clock
        self.monotonic = monotonic
        self.deadline = deadline_seconds
        self.on_usage = on_usage
        #: The retries' jitter (seedable: a seeded run draws the same waits whatever ran before it).
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        self.sightings = Sightings(ttl_seconds, monotonic)
        self.takings = Takings(window_seconds, monotonic)
        #: The fleet units as this node reads them published (agent.k8s.fleet_gate): their slots count as one.
        self.units = UnitView(units, window_seconds=window_seconds, monotonic=monotonic)
        #: The rules of the faults the node's slot is taken or renewed for (the last acquire's).
        self._rules: frozenset[str] = frozenset()
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
        #: The live and the recently taken slots as the gate's last reading listed them after that write (None:
        #: no such list): a list made any time after the write ranks it, so the acquire that follows need not
        #: list again.
        self._listed: tuple[list[Slot], list[Slot]] | None = None
        #: The take this process wrote (uid, leaseTransitions, when its answer came): every reader counts it
        #: from then on or later.
        self._took: tuple[str, int, float] | None = None
        #: The slot's re-take reused that take (its own released slot within the window): carried forward once
        #: granted, so that readers count it a window from now.
        self._carry = False
        #: A slot given back is released, not deleted (the rate bound counts it): it was granted, or was there.
        self._keep = False
        #: This node's released slot is kept from this monotonic time, and deleted a window after it.
        self._kept_from: float | None = None
        #: The slot this process re-took was live (not released): one the rate bound alone refuses stays so.
        self._retook_live = False

    @property
    def lingering(self) -> bool:
        """A released slot of this node is kept for the rate bound's window (release deletes it once due)."""
        return self._kept_from is not None

    # ---- reading ----
    def read(self) -> GateReading:
        """The pause Lease and the live slots, from one list of the namespace's Leases (retried)."""
        live, recent, paused = self._listing()
        if paused:
            return GateReading(paused=True, held=self._granted, limit=self._limit or 1, rate=self.max_per_hour)
        if self._written is not None:
            self._listed = live, recent
        own = next((s for s in live if s.name == self.slot), None)
        units = self.units.refresh()
        others = self._others(own, live, units)
        taken = self._others(own, recent, self.units.recent())
        if own is not None and self._confirmed():
            return GateReading(held=True, in_use=others, limit=self._limit or 1, recent=taken, rate=self.max_per_hour)
        self._count_gpu_nodes()
        # A slot of ours this process has not confirmed counts as what it would rank re-taken: behind all.
        held = (own is not None and ahead_of(own, live, retaken=True, units=units) < self._limit and
                within_rate(taken, self.max_per_hour))
        self.on_usage(distinct(live, units), self._limit)
        return GateReading(held=held, in_use=others, limit=self._limit, recent=taken, rate=self.max_per_hour)

    def _others(self, own: Slot | None, slots: Iterable[Slot], units: Units) -> int:
        """The disruptions besides this node's (its unit's slots are its own too)."""
        mine = counted_as(own, units) if own is not None else self._unit_key(units)
        return distinct([s for s in slots if s.name != self.slot], units, besides=mine)

    def _unit_key(self, units: Units) -> str:
        unit = self._my_unit(units)
        return "unit/" + unit if unit else self.slot

    def _my_unit(self, units: Units) -> str:
        """The published unit this node's slot is taken for: one naming the node, whose rule is every rule the
        node is disrupted for (`acquire`'s rules); "" when none, or the node is disrupted for another rule."""
        unit = unit_of_node(units, self.node)
        rule = unit.split("/", 1)[0]
        return unit if unit and self._rules and self._rules <= {rule} else ""

    def holders(self) -> dict[str, float]:
        """The live slots' holders, with the server's creation time (tests and the fleet observer)."""
        return {s.holder or s.name: s.created or 0.0 for s in self._slots()}

    # ---- writing: only this node's slot ----
    def acquire(self, rules: frozenset[str] = frozenset()) -> GateReading:
        """Take (or renew) this node's slot, for the faults of `rules`; `held` False when the budget is spent
        (the slot is given back)."""
        self._rules = rules
        if self._confirmed():
            try:
                self._renew()
                return GateReading(held=True, limit=self._limit or 1, rate=self.max_per_hour)
            except NotFound:  # deleted under us (an operator): a new slot is ranked like any other
                self._granted = False
        self._granted = False
        if self._kept_due():
            self._delete()  # its window passed: a new take is a new slot
        units = self.units.refresh()
        own, created, sent, (live, recent) = self._written_and_listed()
        self._count_gpu_nodes()
        ahead = ahead_of(own, live, retaken=not created, units=units)
        taken = ahead_of(own, recent, retaken=not created, units=self.units.recent())
        others = self._others(own, live, units)
        written, self._written = self._written, None
        if ahead < self._limit and within_rate(taken, self.max_per_hour):
            if self._carry:  # the take this re-take reused is counted a window from now by every reader
                self._bump(own)
            self._granted, self._confirmed_at, self._keep, self._retook_live = True, sent, True, False
            self.on_usage(others + 1, self._limit)
            return GateReading(held=True, in_use=others, limit=self._limit, recent=taken, rate=self.max_per_hour)
        if ahead < self._limit and self._retook_live:
            # Refused by the rate alone, a slot that was live (a restarted agent of a disrupted node): it stays
            # live, so the concurrency bound still counts the node, and the next acquire ranks it again.
            self._written = written
        else:
            self._give_back()
        self.on_usage(others, self._limit)
        return GateReading(held=False, in_use=others, limit=self._limit, recent=taken, rate=self.max_per_hour)

    def _written_and_listed(self) -> tuple[Slot, bool, float, tuple[list[Slot], list[Slot]]]:
        """This node's slot written (or the one an earlier call wrote and could not rank, while the list still
        shows it unchanged), whether it was created, when the write was sent, and the live and recently taken
        slots listed after it. Ranking by a list made any time after the write is the rule: every slot created
        later saw ours."""
        for _ in range(2):
            if self._written is not None and self.monotonic() - self._written_at >= self.ttl * self.confirm_fraction:
                self._written = None  # unrenewed so long that other readers may have let it lapse: written again
            if self._written is None:
                sent = self.monotonic()
                document, created = self._create_or_get()
                own = Slot.of(document)
                if created:  # dated when the answer came (the take landed no later): its hour ends no sooner
                    self._took, self._carry, self._retook_live = (own.uid, own.takes, self.monotonic()), False, False
                else:  # there already (maybe an earlier process's): re-taken in place, ranked as new
                    self._keep = True
                    own = self._retake(document)
                self._written, self._written_at, self._listed = (own, created), sent, None
            own, created = self._written
            (live, recent), self._listed = self._listed if self._listed is not None else self._list(), None
            listed = next((s for s in live if s.name == own.name), None)
            if listed is not None and listed.uid == own.uid:
                return own, created, self._written_at, (live, recent)
            self._written = None  # deleted or replaced since (an operator): written again
        raise NotFound(f"budget slot {self.slot} gone each time it was written", status=404)

    def release(self) -> None:
        """Give the slot back (clearing is never blocked, and a healthy node holds nothing): deleted, or with
        the rate bound released and kept until its window has passed (then a later call deletes it)."""
        if self._kept_from is not None:
            if self._kept_due():
                self._delete()
            return
        if not (self._granted or self.maybe_held):
            try:  # nothing known of a slot here: look before writing (a restarted agent, a node never disrupted)
                found = Slot.of(self._retried(lambda: self.raw.get(f"{self.leases}/{self.slot}")))
            except NotFound:
                return
            self._keep = True  # an earlier process's: it may have disrupted within the window
            if found.released and self.max_per_hour > 0:
                self._kept_from = self.monotonic()  # counted for a window from now, as every reader first seeing it
                return
        self._give_back()

    def show(self, holding: bool) -> None:
        """The node label as a view of the slot: set while holding, removed otherwise (within a pass, in the
        pass's one Node write)."""
        value = "active" if holding else None
        if self.node_writer is not None:
            self.node_writer.set_metadata(labels={DISRUPTION_LABEL: value}, join_batch=True)
            return
        path = api_path("", "v1", "nodes", name=self.node)
        body = {"metadata": {"labels": {DISRUPTION_LABEL: value}}}
        self._retried(lambda: self.raw.strategic_patch(path, body))

    # ---- requests ----
    def _slots(self) -> list[Slot]:
        return self._list()[0]

    def _list(self) -> tuple[list[Slot], list[Slot]]:
        live, recent, _ = self._listing()
        return live, recent

    def _listing(self) -> tuple[list[Slot], list[Slot], bool]:
        """The live slots, the recently taken ones, and whether the pause Lease is there, from one list of the
        namespace's Leases but the brake's claims (a handful: slots, the pause, the fleet's leader; the claims,
        a hundred in a fault storm, are agent.k8s.brake_claims'): the labelled slot Leases not released, and
        the other nodes' entries in an earlier version's shared Lease (disrupted by an old agent: recent while
        they are live)."""
        listed = self._retried(lambda: self.raw.get(self.leases, query={"labelSelector": f"!{CLAIM_LABEL}"}))
        slots: list[Slot] = []
        legacy: list[Slot] = []
        paused = False
        for item in listed.get("items") or []:
            meta = item.get("metadata") or {}
            if (meta.get("labels") or {}).get(SLOT_LABEL) == "true":
                slots.append(Slot.of(item))
            elif meta.get("name") == BUDGET_LEASE:
                legacy.extend(s for s in legacy_slots(item) if s.holder != self.node)
            paused = paused or meta.get("name") == PAUSE_LEASE
        live = self.sightings.live([s for s in slots if not s.released] + legacy, own=self.slot)
        if self.max_per_hour <= 0:
            return live, [], paused
        return live, self.takings.recent(slots) + [s for s in live if s in legacy], paused

    def _confirmed(self) -> bool:
        """This process granted its slot and wrote it recently enough that no reader can have let it lapse."""
        return self._granted and self.monotonic() - self._confirmed_at < self.ttl * self.confirm_fraction

    def _kept_due(self) -> bool:
        return self._kept_from is not None and self.monotonic() - self._kept_from >= self.window

    def _create_or_get(self) -> tuple[JsonDocument, bool]:
        """This node's slot, and whether this request created it (False: it was there, or a retried create
        landed; either way it is then re-taken, which only ever ranks it later)."""
        body = {"metadata": {"name": self.slot, "namespace": self.namespace, "labels": {SLOT_LABEL: "true"},
                             "annotations": self._unit_annotation()},
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

    def _retake(self, lease: JsonDocument) -> Slot:
        """Write an existing slot again so that it changes for every reader, whatever its stamps say: a new
        take (leaseTransitions counts up, so the write is never a no-op the server would not version), or, for
        this node's released slot whose take this process wrote within the window, that take again (the
        released mark removed is the change; it counts once)."""
        slot = Slot.of(lease)
        took = self._took
        reused = (slot.released and took is not None and took[:2] == (slot.uid, slot.takes) and
                  self.monotonic() - took[2] < self.window)
        now = _micro(self.clock())
        body: JsonDocument = {"spec": {"acquireTime": now, "renewTime": now},
                              "metadata": {"annotations": self._unit_annotation(clear=True)}}
        if not reused:
            body["spec"]["leaseTransitions"] = slot.takes + 1
        if slot.released:
            body["metadata"]["annotations"][RELEASED_ANNOTATION] = None
        self._patch(body)
        self._kept_from, self._carry, self._retook_live = None, reused, not slot.released
        unit = self._my_unit(self.units.live)
        if reused:
            return dataclasses.replace(slot, released=False, unit=unit)
        self._took = (slot.uid, slot.takes + 1, self.monotonic())
        return dataclasses.replace(slot, takes=slot.takes + 1, released=False, unit=unit)

    def _bump(self, own: Slot) -> None:
        """A reused take granted: counted as a take from now (a new leaseTransitions) by every reader."""
        self._patch({"spec": {"leaseTransitions": own.takes + 1}})
        self._took, self._carry = (own.uid, own.takes + 1, self.monotonic()), False

    def _unit_annotation(self, *, clear: bool = False) -> dict[str, str | None]:
        """The slot's unit annotation: the published unit this node is taken out with (None: remove it)."""
        unit = self._my_unit(self.units.live)
        return {UNIT_ANNOTATION: unit} if unit else {UNIT_ANNOTATION: None} if clear else {}

    def _renew(self) -> None:
        self.units.refresh()
        body = {"metadata": {"annotations": self._unit_annotation(clear=True)},
                "spec": {"renewTime": _micro(self.clock())}}
        sent = self.monotonic()
        self._patch(body)
        self._confirmed_at = sent

    def _give_back(self) -> None:
        """With the rate bound, a slot that was granted or was there already is released and kept (it counts
        within the window); any other (a refused new slot) is deleted."""
        if self.max_per_hour > 0 and self._keep:
            self._release_kept()
        else:
            self._delete()

    def _release_kept(self) -> None:
        now = _micro(self.clock())
        try:
            self._patch({"metadata": {"annotations": {RELEASED_ANNOTATION: now}}, "spec": {"renewTime": now}})
        except NotFound:  # deleted under us (an operator): nothing left to keep
            self._delete()
            return
        took = self._took
        self._granted = False
        self.maybe_held = False
        self._written, self._listed, self._carry, self._retook_live = None, None, False, False
        self._kept_from = took[2] if took is not None else self.monotonic()

    def _delete(self) -> None:
        def delete() -> None:
            with contextlib.suppress(NotFound):
                self.raw.delete(f"{self.leases}/{self.slot}")

        self._retried(delete)
        self._granted = False
        self.maybe_held = False
        self._written, self._listed = None, None
        self._took, self._carry, self._keep, self._kept_from, self._retook_live = None, False, False, None, False

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
        """The GPU nodes: a live fleet controller's census for this selector where there is one (read with the
        fleet view, no request of its own), else a metadata-only list of them (names and labels, not whole
        Nodes) made at most every few minutes, so a blocked node stays cheap for the API server. At fleet
        scale the list is most of a disrupting agent's cost: every node's metadata, once per agent."""
        counted = self.census(self.selector) if self.census is not None else None
        if counted:  # a census of none is no census: this node is one
            self._limit = budget_limit(gpu_nodes=counted, max_nodes=self.max_nodes, max_percent=self.max_percent)
            return
        now = self.monotonic()
        if self._counted_at is not None and now - self._counted_at < self.count_seconds and self._limit:
            return
        listing = ListWatch(self.raw.api_client, api_path("", "v1", "nodes"),
                            WatchOptions(label_selector=self.selector, metadata_only=True))
        items, _ = self._retried(listing.list_all)
        self._limit = budget_limit(gpu_nodes=len(items), max_nodes=self.max_nodes, max_percent=self.max_percent)
        self._counted_at = now


def _micro(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(at))

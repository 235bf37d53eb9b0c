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
Every request is retried on transient errors (bounded, jittered, under a deadline). What this process knows
of its own slot is one value (agent.fleetapi.budget_state: FREE, UNSURE, TAKING, HELD, KEPT) moved by one
transition after each request; a slot it may have written and not confirmed as granted (`maybe_held`:
UNSURE, TAKING, HELD) is given back by the pipeline until it is released or deleted. A second Lease,
written only by an operator, pauses all disruption cluster-wide.
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
import random
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from agent.fleetapi.brake_claims import CLAIM_LABEL
from agent.fleetapi.budget_count import GpuNodeCount
from agent.fleetapi.budget_slots import (
    Sightings,
    Slot,
    Takings,
    ahead_of,
    carry_patch,
    listed_slots,
    new_slot,
    release_patch,
    renew_patch,
    retake_patch,
    slot_name,
    within_rate,
)
from agent.fleetapi.budget_state import Lists, Phase, SlotState, Take, Written
from agent.fleetapi.budget_units import Units, UnitView, counted_as, distinct, own_key, taken_for
from agent.k8s.bodies import LeasePatch
from agent.k8s.errors import Conflict, NotFound
from agent.k8s.node import DISRUPTION_LABEL, NodeWriter
from agent.k8s.raw import JsonDocument, RawApi, api_path
from agent.k8s.retry import on_conflict, with_retries
from agent.remediation.guard import GateReading
from agent.timefmt import rfc3339_micro

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
        #: The rate bound: at most this many nodes newly disrupted within `window` (0: no bound).
        self.max_per_hour = max_per_hour
        self.window = window_seconds
        self.ttl = ttl_seconds
        #: The GPU nodes by a live fleet controller's census for a selector (agent.fleetapi.fleet_gate), None where
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
        #: The fleet units as this node reads them published (agent.fleetapi.fleet_gate): their slots count as one.
        self.units = UnitView(units, window_seconds=window_seconds, monotonic=monotonic)
        #: The rules of the faults the node's slot is taken or renewed for (the last acquire's).
        self._rules: frozenset[str] = frozenset()
        self.gpu_nodes = GpuNodeCount(raw, selector=gpu_node_selector, max_nodes=max_nodes, max_percent=max_percent,
                                  count_seconds=count_seconds, monotonic=monotonic, deadline_seconds=deadline_seconds,
                                  rng=self.rng)
        #: Other readers let a slot lapse a lifetime after they see its last write, never sooner: this process
        #: trusts a write of its own for this fraction of a lifetime after sending it.
        self.confirm_fraction = 0.9
        #: What this process knows of its slot (agent.fleetapi.budget_state): one value, moved by one transition
        #: after each request.
        self.state = SlotState()

    @property
    def maybe_held(self) -> bool:
        """A slot this process wrote may be on the server, not confirmed or given back (the pipeline gives it
        back)."""
        return self.state.maybe_held

    @property
    def lingering(self) -> bool:
        """A released slot of this node is kept for the rate bound's window (release deletes it once due)."""
        return self.state.lingering

    # ---- reading ----
    def read(self) -> GateReading:
        """The pause Lease and the live slots, from one list of the namespace's Leases (retried)."""
        live, recent, paused = self._listing()
        if paused:
            return self._reading(self.state.phase is Phase.HELD, paused=True, limit=self.gpu_nodes.limit or 1)
        if self.state.phase is Phase.TAKING:
            self.state = self.state.listed((live, recent))
        own = next((s for s in live if s.name == self.slot), None)
        units = self.units.refresh()
        others = self._others(own, live, units)
        taken = self._others(own, recent, self.units.recent())
        if own is not None and self._confirmed():
            return self._reading(True, others, taken, limit=self.gpu_nodes.limit or 1)
        self.gpu_nodes.refresh(self.census)
        self.on_usage(distinct(live, units), self.gpu_nodes.limit)
        return self._reading(own is not None and self._ranks(own, live, taken, units), others, taken)

    def _ranks(self, own: Slot, live: list[Slot], taken: int, units: Units) -> bool:
        """A slot of ours this process has not confirmed counts as what it would rank re-taken: behind all."""
        ahead = ahead_of(own, live, retaken=True, units=units)
        return ahead < self.gpu_nodes.limit and within_rate(taken, self.max_per_hour)

    def _reading(self, held: bool, in_use: int = 0, recent: int = 0, *, paused: bool = False,
                 limit: int | None = None) -> GateReading:
        limit = self.gpu_nodes.limit if limit is None else limit
        return GateReading(paused=paused, held=held, in_use=in_use, limit=limit, recent=recent, rate=self.max_per_hour)

    def _others(self, own: Slot | None, slots: Iterable[Slot], units: Units) -> int:
        """The disruptions besides this node's (its unit's slots are its own too)."""
        mine = counted_as(own, units) if own is not None else own_key(units, node=self.node, slot=self.slot,
                                                                               rules=self._rules)
        return distinct([s for s in slots if s.name != self.slot], units, besides=mine)

    def _my_unit(self, units: Units) -> str:
        return taken_for(units, node=self.node, rules=self._rules)

    def holders(self) -> dict[str, float]:
        """The live slots' holders, with the server's creation time (tests and the fleet observer)."""
        return {s.holder or s.name: s.created or 0.0 for s in self._listing()[0]}

    # ---- writing: only this node's slot ----
    def acquire(self, rules: frozenset[str] = frozenset()) -> GateReading:
        """Take (or renew) this node's slot, for the faults of `rules`; `held` False when the budget is spent
        (the slot is given back)."""
        self._rules = rules
        if self._confirmed():
            try:
                self._renew()
                return self._reading(True, limit=self.gpu_nodes.limit or 1)
            except NotFound:  # deleted under us (an operator): a new slot is ranked like any other
                pass
        if self.state.phase is Phase.HELD:  # lapsed (unconfirmed too long) or gone: ranked again
            self.state = self.state.sent()
        if self.state.kept_due(self.monotonic(), self.window):
            self._delete()  # its window passed: a new take is a new slot
        units = self.units.refresh()
        written, (live, recent) = self._written_and_listed()
        own = written.slot
        self.gpu_nodes.refresh(self.census)
        ahead = ahead_of(own, live, retaken=not written.created, units=units)
        taken = ahead_of(own, recent, retaken=not written.created, units=self.units.recent())
        others = self._others(own, live, units)
        if ahead < self.gpu_nodes.limit and within_rate(taken, self.max_per_hour):
            self._grant(written)
            self.on_usage(others + 1, self.gpu_nodes.limit)
            return self._reading(True, others, taken)
        # Refused by the rate alone, a slot that was live (a restarted agent of a disrupted node) stays TAKING:
        # the concurrency bound still counts the node, and the next acquire ranks it again.
        if not (ahead < self.gpu_nodes.limit and written.was_live):
            self.state = self.state.sent()
            self._give_back()
        self.on_usage(others, self.gpu_nodes.limit)
        return self._reading(False, others, taken)

    def _grant(self, written: Written) -> None:
        """TAKING → HELD, trusted from when the write was sent; a reused take is first carried forward."""
        take = None
        if written.carry:  # the take this re-take reused is counted a window from now by every reader
            self.state = self.state.sent()
            self._patch(carry_patch(written.slot.takes + 1))
            take = Take(written.slot.uid, written.slot.takes + 1, self.monotonic())
        self.state = self.state.granted(confirmed_at=written.sent_at, take=take)

    def _written_and_listed(self) -> tuple[Written, Lists]:
        """This node's slot written (or the one an earlier call wrote and could not rank, while the list still
        shows it unchanged), and the live and recently taken slots listed after it. Ranking by a list made any
        time after the write is the rule: every slot created later saw ours."""
        for _ in range(2):
            if not self.state.fresh(self.monotonic(), self.ttl * self.confirm_fraction):
                self._write()  # none, or unrenewed so long that other readers may have let it lapse
            written = self.state.write()
            lists = written.lists if written.lists is not None else self._listing()[:2]
            self.state = self.state.listed(None)
            listed = next((s for s in lists[0] if s.name == written.slot.name), None)
            if listed is not None and listed.uid == written.slot.uid:
                return written, lists
            self.state = self.state.sent()  # deleted or replaced since (an operator): written again
        raise NotFound(f"budget slot {self.slot} gone each time it was written", status=404)

    def _write(self) -> None:
        """UNSURE → TAKING: the slot created, or (there already, maybe an earlier process's) re-taken in place
        and ranked as new."""
        sent = self.monotonic()
        document, created = self._create_or_get()
        if created:  # dated when the answer came (the take landed no later): its hour ends no sooner
            self.state = self.state.created(Slot.of(document), sent_at=sent, at=self.monotonic())
        else:
            self.state = self.state.found()
            self._retake(document, sent)

    def release(self) -> None:
        """Give the slot back (clearing is never blocked, and a healthy node holds nothing): deleted, or with
        the rate bound released and kept until its window has passed (then a later call deletes it)."""
        if self.state.lingering:
            if self.state.kept_due(self.monotonic(), self.window):
                self._delete()
            return
        if not self.state.maybe_held:
            try:  # nothing known of a slot here: look before writing (a restarted agent, a node never disrupted)
                found = Slot.of(self._retried(lambda: self.raw.get(f"{self.leases}/{self.slot}")))
            except NotFound:
                return
            self.state = self.state.found()  # an earlier process's: it may have disrupted within the window
            if found.released and self.max_per_hour > 0:
                self.state = self.state.released(self.monotonic())  # counted a window from now, as by every reader
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
    def _listing(self) -> tuple[list[Slot], list[Slot], bool]:
        """The live slots, the recently taken ones, and whether the pause Lease is there, from one list of the
        namespace's Leases but the brake's claims (a handful: slots, the pause, the fleet's leader; the claims,
        a hundred in a fault storm, are agent.fleetapi.brake_claims'): the labelled slot Leases not released, and
        the other nodes' entries in an earlier version's shared Lease (disrupted by an old agent: recent while
        they are live)."""
        listed = self._retried(lambda: self.raw.get(self.leases, query={"labelSelector": f"!{CLAIM_LABEL}"}))
        items = listed.get("items") or []
        slots, legacy = listed_slots(items, node=self.node)
        paused = any((item.get("metadata") or {}).get("name") == PAUSE_LEASE for item in items)
        live = self.sightings.live([s for s in slots if not s.released] + legacy, own=self.slot)
        if self.max_per_hour <= 0:
            return live, [], paused
        return live, self.takings.recent(slots) + [s for s in live if s in legacy], paused

    def _confirmed(self) -> bool:
        """This process granted its slot and wrote it recently enough that no reader can have let it lapse."""
        return self.state.confirmed(self.monotonic(), self.ttl * self.confirm_fraction)

    def _create_or_get(self) -> tuple[JsonDocument, bool]:
        """This node's slot, and whether this request created it (False: it was there, or a retried create
        landed; either way it is then re-taken, which only ever ranks it later)."""
        body = new_slot(self.node, namespace=self.namespace, ttl_seconds=self.ttl,
                        unit=self._my_unit(self.units.live), now=rfc3339_micro(self.clock()))
        self.state = self.state.sent()  # UNSURE from here until the slot is ranked, confirmed or deleted

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

    def _retake(self, lease: JsonDocument, sent: float) -> None:
        """UNSURE → TAKING: an existing slot written again so that it changes for every reader, whatever its
        stamps say: a new take (leaseTransitions counts up, so the write is never a no-op the server would not
        version), or, for this node's released slot whose take this process wrote within the window, that take
        again (the released mark removed is the change; it counts once)."""
        slot = Slot.of(lease)
        reused = self.state.reuses(slot, self.monotonic(), self.window)
        unit = self._my_unit(self.units.live)
        body = retake_patch(slot, reused=reused, unit=unit, now=rfc3339_micro(self.clock()))
        self._patch(body)
        self.state = self.state.retaken(slot, reused=reused, unit=unit, sent_at=sent, at=self.monotonic())

    def _renew(self) -> None:
        """HELD → HELD: the slot's renewTime (and unit) written."""
        self.units.refresh()
        body = renew_patch(unit=self._my_unit(self.units.live), now=rfc3339_micro(self.clock()))
        sent = self.monotonic()
        self._patch(body)
        self.state = self.state.renewed(confirmed_at=sent)

    def _give_back(self) -> None:
        """With the rate bound, a slot that was granted or was there already is released and kept (it counts
        within the window); any other (a refused new slot) is deleted."""
        if self.max_per_hour > 0 and self.state.counted:
            self._release_kept()
        else:
            self._delete()

    def _release_kept(self) -> None:
        """→ UNSURE while the release is in flight (nothing held if its answer is lost) → KEPT."""
        body = release_patch(now=rfc3339_micro(self.clock()))
        self.state = self.state.sent()
        try:
            self._patch(body)
        except NotFound:  # deleted under us (an operator): nothing left to keep
            self._delete()
            return
        self.state = self.state.released(self.monotonic())

    def _delete(self) -> None:
        """Every state → FREE once the delete is answered (until then the state stands: a renewal, or the
        ranking's list, notices a slot gone)."""
        def delete() -> None:
            with contextlib.suppress(NotFound):
                self.raw.delete(f"{self.leases}/{self.slot}")

        self._retried(delete)
        self.state = self.state.deleted()

    def _patch(self, body: LeasePatch) -> None:
        """A merge patch of this node's slot. Only this agent writes it: a 409 (a conflict answered anyway) is
        simply sent again."""
        on_conflict(lambda: self._retried(lambda: self.raw.merge_patch(f"{self.leases}/{self.slot}", body)),
                    rng=self.rng)

    def _retried(self, func: Callable[[], T]) -> T:
        """A budget request retried on transient errors (jittered from this gate's random state, bounded by
        the deadline)."""
        return with_retries(func, deadline_seconds=self.deadline, rng=self.rng)


"""The agent's reader of the fleet view: the holds ConfigMap by name (with the controller's word on what it
heard and its census for the brake), and for the quarantine brake the quarantined nodes: with a live
controller's census, one metadata-only list of the nodes that carry the quarantine label; without one, of
every GPU node's summary. Both cached, so a blocked node stays cheap."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from agent.errors import InputError
from agent.fleet import BrakePolicy, Dimension, Hold, NodeSummary, brake_bound
from agent.fleet.brake import quarantined_within
from agent.fleet.correlate import FABRIC_WIDE_KEY
from agent.fleet.node_side import FleetReading, brake_refusal
from agent.fleet.published import (
    HOLDS_CONFIGMAP,
    QUARANTINE_LABEL,
    SUMMARY_ANNOTATION,
    WRITTEN_KEY,
    Census,
    decode_all,
    decode_census,
    decode_heard,
    quarantined_since,
)
from agent.fleet.unit import UNIT_CLASSES, by_unit, live_units
from agent.fleetapi.brake_claims import BrakeClaims
from agent.k8s.errors import K8sError, NotFound
from agent.k8s.raw import JsonDocument, RawApi, api_path
from agent.k8s.retry import with_retries
from agent.k8s.watch import ListWatch, WatchOptions
from agent.logs import get_logger
from agent.model import FaultClass

#: How long one read of the holds or the brake's count is retried (503, 429, unreachable) within a pass: short,
#: so an outage never holds up the pass for long; the last holds read stand meanwhile.
READ_DEADLINE_SECONDS = 2.0
#: The longest this agent honours one hold from its own first sight of it, whatever the object says (the
#: controller's default --max-hold): a hold whose expiry a writer keeps moving, or placed far ahead by a
#: skewed clock, cannot hold a node for ever.
HOLD_CAP_SECONDS = 6 * 3600.0


class FleetGate:
    """One GET of `gpu-health-fleet-holds` at most every `cache_seconds` (a version seen before keeps its
    placement, so re-reading never moves an expiry); one metadata-only list at most every `count_seconds`,
    only when a new quarantine asks the brake: of the labelled (quarantined) GPU nodes where a live
    controller's census for this selector gives the count, else of every GPU node. A quarantine the count
    allows then claims its place (`claim`: agent.fleetapi.brake_claims)."""

    def __init__(self, raw: RawApi, *, namespace: str, gpu_node_selector: str, brake: BrakePolicy | None,
                 holds: bool = True, cache_seconds: float = 10.0, count_seconds: float = 10.0,
                 settle_seconds: float = 0.0, settle_max_seconds: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 claims: BrakeClaims | None = None, claim_retry_seconds: float = 30.0, node: str = "",
                 rule_class: Callable[[str], FaultClass | None] = lambda rule_id: None,
                 fabric_domain: Callable[[], str] = str,
                 on_unread: Callable[[str], None] = lambda what: None,
                 own: Callable[[], NodeSummary | None] = lambda: None) -> None:
        self.raw = raw
        self.brake = brake
        self.holds = holds
        self.selector = gpu_node_selector
        self.cache_seconds = cache_seconds
        #: How long a node not yet quarantined waits for the controller's word on a holdable fault (node_side).
        self.settle_seconds = settle_seconds
        #: How long past the first sight a settling node waits at most for the controller to hear of its fault.
        self.settle_max_seconds = settle_max_seconds
        self.count_seconds = count_seconds
        self.clock = clock
        self.wall = wall
        #: This node, its own rules' fault class of a rule (None: a rule it does not know) and its own NVLink
        #: fabric domain: what a published unit is checked against before this agent counts by it.
        self.node = node
        self.rule_class = rule_class
        self.fabric_domain = fabric_domain
        #: This node's summary as it last published it: a scoped hold covers it by its own keys.
        self.own = own
        #: Called once for each entry (or key) of the shared object this agent set aside ("holds", "census",
        #: "heard", "unit"): the daemon counts them in a metric.
        self.on_unread = on_unread
        self.path = api_path("", "v1", "configmaps", namespace=namespace, name=HOLDS_CONFIGMAP)
        self.source = f"configmap {namespace}/{HOLDS_CONFIGMAP}"
        self._holds: tuple[float, str, tuple[Hold, ...]] | None = None
        #: The controller's word in the version read: {rule: nodes heard}, alive-until by its wall clock.
        self._heard: tuple[dict[str, frozenset[str]], float] = ({}, 0.0)
        #: Until when (this reader's monotonic clock) the controller's promise to write again stands: from when
        #: this reader first saw the version, for as long as the writer promised (its alive-until less its
        #: written, both on its own clock). None: no promise. No wall clock of two machines is compared.
        self._promise: float | None = None
        #: The controller's census in the version read (None: none, or unreadable).
        self._census: Census | None = None
        self._count: tuple[float, int, dict[str, float]] | None = None
        #: Why the last count could not be listed ("" when it was).
        self._count_error = ""
        #: Why the last read of the holds failed, while the failures go on ("" once one succeeds).
        self._stale = ""
        #: When (this reader's clock) that read last failed.
        self._failed_at = 0.0
        #: When this agent first saw each hold (by id, on its clock): a hold stands at most HOLD_CAP_SECONDS.
        self._first_sight: dict[str, float] = {}
        #: The reasons already logged of what was set aside, so each is one line, once.
        self._told: set[str] = set()
        #: This node's claims on the brake's places (None: the brake is off, or counts without claims).
        self.claims = claims
        #: A refused claim stands this long (the daemon: two retry times, so that the pass after a refusal,
        #: due one retry time later, waits on it with no request): the taint does not claim every pass.
        self.claim_retry_seconds = claim_retry_seconds
        self._refused: tuple[float, str] | None = None
        self.reads = 0
        #: Lists of every GPU node's summary, and of the labelled nodes only.
        self.lists = 0
        self.label_lists = 0
        self._log = get_logger("agent.fleet_gate")

    def read(self, *, count: bool, fresh_after: float | None = None, fresh_count: bool = False) -> FleetReading:
        now = self.clock()
        holds = self._holds_or_stale(now, fresh_after) if self.holds else ()
        gpu_nodes: int | None = None
        quarantined: dict[str, float] = {}
        cached = False
        if count:
            try:
                gpu_nodes, quarantined, cached = self._count_quarantined(now, fresh=fresh_count)
                self._count_error = ""
            except (K8sError, InputError) as exc:
                self._count_error = f"{type(exc).__name__}: {exc}"
                self._log.warning("brake_count_unreadable", error=self._count_error)
        refused = self._refused[1] if count and self._refused is not None and \
            now - self._refused[0] < self.claim_retry_seconds else ""
        published = self.holds and self._holds is not None and bool(self._holds[1])
        heard = self._heard[0] if self.holds else {}
        promise = self._promise if self.holds else None
        return FleetReading(holds, now, gpu_nodes, quarantined, published=published, heard=heard,
                            controller_alive=promise is not None and now < promise,
                            controller_gone=promise is not None and promise <= now, count_cached=cached,
                            refused=refused, own=self.own() if any(h.scope for h in holds) else None,
                            holds_error=self._stale, count_error=self._count_error if count else "")

    def claim(self, node: str) -> str:
        """This node's place among the new quarantines (agent.fleetapi.brake_claims): "" when its claim ranks within
        the bound, else why the taint waits (the claim withdrawn; the refusal stands `claim_retry_seconds`).
        Without claims, or where the claim cannot be made or the claims listed (one warning), the count is
        listed afresh instead: not exact, as before claims. A ranking made always decides."""
        brake = self.brake
        if brake is None:
            return ""
        counted = self._count
        if self.claims is not None and (counted is not None or self._count_error):
            now = self.clock()
            live = [h for h in self._holds[2] if h.unit] if self.holds and self._holds is not None else []
            units = by_unit(live_units(live, now=now))
            domains = {h.id: h.key for h in live}  # a claim joins a unit only stating its domain
            if self._count_error or counted is None:
                # Nothing counted: the brake's floor of places, and only by the claims, which are exact.
                gpu_nodes, bound, unclaimed = None, brake_bound(0, brake), []
            else:
                gpu_nodes, bound = counted[1], brake_bound(counted[1], brake)
                # The count's quarantines within the window: those with no claim (an older agent's, a confirmed
                # one, a claim given back) take their places too.
                unclaimed = quarantined_within(counted[2], now=now, policy=brake)
            try:
                admitted, ahead = self.claims.rank(bound=bound, units=units, unclaimed=unclaimed, domains=domains)
            except K8sError as exc:
                self._log.warning("brake_claim_failed", error=str(exc))
                if gpu_nodes is None:
                    why = ("quarantine brake: neither the quarantined nodes nor the claims can be read "
                           f"({self._count_error or exc}); the taint waits")
                    self._refused = (now, why)
                    return why
            else:
                if admitted:
                    self._refused = None
                    return ""
                of = f"{gpu_nodes} GPU nodes" if gpu_nodes is not None else "the GPU nodes (uncounted: the floor)"
                why = (f"quarantine brake: {ahead} of {of} newly quarantined or claimed first "
                       f"within {brake.window_seconds:.0f} s (bound {bound}); the taint waits")
                self._refused = (now, why)
                return why
        recount = self.read(count=True, fresh_count=True)
        if recount.count_error:
            return f"quarantine brake: the quarantined nodes cannot be counted ({recount.count_error}); the taint waits"
        return brake_refusal(recount, node=node, policy=brake)

    def tidy(self) -> None:
        """This node's claim deleted once it has held it for the brake's window (and at the process's first
        pass, the one an earlier process may have left)."""
        if self.claims is None:
            return
        try:
            self.claims.expire()
        except K8sError as exc:
            self._log.warning("brake_claim_not_deleted", error=str(exc))

    def units(self) -> dict[str, frozenset[str]]:
        """The published units standing now (agent.fleet.unit) that this agent trusts, for the disruption
        budget's count; {} when the holds are off (every slot then counts as its own node). An unreadable
        object leaves the last units read standing until their own expiry."""
        if not self.holds:
            return {}
        now = self.clock()
        return live_units(self._holds_or_stale(now), now=now)

    def census_gpu_nodes(self, selector: str) -> int | None:
        """The GPU nodes a live controller counted for `selector` (the disruption budget's limit), from the
        holds as read (cached); None without one: no holds read, none published, its controller's promise
        lapsed, or another selector."""
        if not self.holds or selector != self.selector:
            return None
        self._holds_or_stale(self.clock())
        census = self._live_census()
        return census.gpu_nodes if census is not None else None

    def _holds_or_stale(self, now: float, fresh_after: float | None = None) -> tuple[Hold, ...]:
        """The holds read now, or where they cannot be read (after retries) the last ones read, each standing
        until its own expiry: a 503 or a damaged object never ends a hold early. A failed read is tried again
        once a cache period (or for a settle that ended since), not by every pass: during an outage a pass
        does not spend the read's whole retry deadline on it."""
        standing = self._holds[2] if self._holds is not None else ()
        if self._stale and now - self._failed_at < self.cache_seconds and \
                (fresh_after is None or self._failed_at >= fresh_after):
            return standing
        try:
            holds = self._read_holds(now, fresh_after)
        except (K8sError, InputError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            if not self._stale:
                self._log.warning("fleet_view_unreadable", error=error, standing=len(standing))
            self._stale, self._failed_at = error, now
            return standing
        if self._stale:
            self._log.info("fleet_view_readable", was=self._stale)
            self._stale = ""
        return holds

    def _read_holds(self, now: float, fresh_after: float | None = None) -> tuple[Hold, ...]:
        """The holds, cached for `cache_seconds` unless read before `fresh_after` (a settle that ended since)."""
        cached = self._holds
        if cached is not None and now - cached[0] < self.cache_seconds and \
                (fresh_after is None or cached[0] >= fresh_after):
            return cached[2]
        self.reads += 1
        try:
            obj = with_retries(lambda: self.raw.get(self.path), deadline_seconds=READ_DEADLINE_SECONDS,
                               throttled=True)
        except NotFound:
            self._holds, self._heard, self._census, self._promise = (now, "", ()), ({}, 0.0), None, None
            return ()
        version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if cached is not None and cached[1] == version and version:
            holds = cached[2]
        else:
            # Placed as written when first seen (no correction by this reader's wall clock against the writer's:
            # a controller minutes behind would hide every hold); each lasts its own remaining time from here.
            placed, unread = decode_all(obj.get("data"), observed_at=now, source=self.source)
            self._set_aside("holds", (u.reason for u in unread))
            holds = tuple(self._trusted(placed, now))
            try:
                self._heard = decode_heard(obj.get("data"), source=self.source)
            except InputError as exc:  # the holds stand; without the word the node waits the base settle only
                self._set_aside("heard", [exc.line()])
                self._heard = ({}, 0.0)
            self._promise = promised_until(obj.get("data"), self._heard[1], now)
            try:
                self._census = decode_census(obj.get("data"), source=self.source)
            except InputError as exc:  # the brake then lists every GPU node, as without a controller
                self._log.warning("fleet_census_unreadable", error=exc.line())
                self.on_unread("census")
                self._census = None
        self._holds = (now, version, holds)
        return holds

    def _trusted(self, holds: list[Hold], now: float) -> list[Hold]:
        """What this agent takes of the published holds: each at most HOLD_CAP_SECONDS from its own first
        sight of it, and a unit only where its own rules back it (`_unit_trusted`). The rest is set aside, one
        line each."""
        live = {h.id for h in holds}
        self._first_sight = {key: at for key, at in self._first_sight.items() if key in live}
        trusted = []
        for published in holds:
            first = self._first_sight.setdefault(published.id, now)
            hold = replace(published, expires_at=min(published.expires_at, first + HOLD_CAP_SECONDS))
            kept = self._unit_trusted(hold) if hold.unit else hold
            if kept is not None:
                trusted.append(kept)
        return trusted

    def _unit_trusted(self, unit: Hold) -> Hold | None:
        """A unit only for a rule this agent's own rules call a fabric fault, of one fabric domain (None: it
        counts as no unit); where it names this node, only for the domain this node itself reports (else the
        node is its own in the count)."""
        if self.rule_class(unit.rule_id) not in UNIT_CLASSES or unit.dimension is not Dimension.FABRIC_DOMAIN \
                or unit.key == FABRIC_WIDE_KEY:
            self._set_aside("unit", [f"unit {unit.id}: {unit.rule_id} is not a fabric fault of one domain by this "
                                     "agent's rules; not counted as one"])
            return None
        if self.node in unit.nodes and self.fabric_domain() != unit.key:
            self._set_aside("unit", [f"unit {unit.id} names this node, whose fabric domain is "
                                     f"{self.fabric_domain() or 'none'}; this node counts as its own"])
            return replace(unit, nodes=unit.nodes - {self.node})
        return unit

    def _set_aside(self, what: str, reasons: Iterable[str]) -> None:
        """What this agent could not read or does not trust in the shared object: logged once, counted."""
        for reason in reasons:
            self.on_unread(what)
            if reason not in self._told and len(self._told) < 256:
                self._told.add(reason)
                self._log.warning("fleet_entry_set_aside", what=what, reason=reason, object=self.source)

    def _count_quarantined(self, now: float, *, fresh: bool = False) -> tuple[int, dict[str, float], bool]:
        """The GPU nodes, and when each one the agents quarantined was (placed on this clock from the age its
        own wall clock published: a clock ahead makes it look newer and counted longer, one behind older);
        the cached count unless `fresh`, and whether it is the cached one."""
        cached = self._count
        if cached is not None and now - cached[0] < self.count_seconds and not fresh:
            return cached[1], cached[2], True
        census = self._live_census()
        wall = self.wall()
        quarantined: dict[str, float] = {}
        if census is not None:
            self.label_lists += 1
            selector = ",".join(t for t in (self.selector, QUARANTINE_LABEL) if t)
            items = self._list(selector)
            for item in items:
                metadata = item.get("metadata") or {}
                since = quarantined_since((metadata.get("labels") or {}).get(QUARANTINE_LABEL))
                if since > 0:
                    quarantined[str(metadata.get("name"))] = now - max(0.0, wall - since)
            if census.unlabelled:
                # An older agent's quarantine, as the census names it: counted only for a GPU node that exists
                # and whose own summary says so (a census naming nodes that are not there blocks no one).
                self.lists += 1
                named = self._summaries_quarantined(self._list(self.selector), now, wall)
                for node in census.unlabelled:
                    if node in named:
                        quarantined.setdefault(node, named[node])
            gpu_nodes = census.gpu_nodes
        else:
            self.lists += 1
            items = self._list(self.selector)
            quarantined = self._summaries_quarantined(items, now, wall)
            gpu_nodes = len(items)
        self._count = (now, gpu_nodes, quarantined)
        return gpu_nodes, quarantined, False

    @staticmethod
    def _summaries_quarantined(items: list[JsonDocument], now: float, wall: float) -> dict[str, float]:
        """The listed nodes whose own summary says quarantined, and since when (on this clock)."""
        quarantined: dict[str, float] = {}
        for item in items:
            metadata = item.get("metadata") or {}
            text = (metadata.get("annotations") or {}).get(SUMMARY_ANNOTATION)
            if not text:
                continue
            try:
                summary = NodeSummary.from_json(str(text), source=f"node {metadata.get('name')}")
            except InputError:
                continue  # the controller counts an unreadable summary; here it quarantines nothing
            if summary.quarantined_since > 0:
                age = max(0.0, wall - summary.quarantined_since)
                quarantined[str(metadata.get("name") or summary.node)] = now - age
        return quarantined

    def _live_census(self) -> Census | None:
        """The census to count by: the holds are read, its controller is alive by its promise, and it
        counted this agent's GPU node selector."""
        census = self._census if self.holds else None
        if census is None or census.selector != self.selector or self._promise is None or \
                not self.clock() < self._promise:
            return None
        return census

    def _list(self, selector: str) -> list[JsonDocument]:
        listing = ListWatch(self.raw.api_client, api_path("", "v1", "nodes"),
                            WatchOptions(label_selector=selector, metadata_only=True))
        items, _ = with_retries(listing.list_all, deadline_seconds=READ_DEADLINE_SECONDS, throttled=True)
        return items


def promised_until(data: JsonDocument | None, alive_until: float, now: float) -> float | None:
    """The controller's promise on the reader's clock `now` (when it first saw this version): for as long as
    the writer promised, its alive-until less its written (both its own wall clock); None without one."""
    if alive_until <= 0:
        return None
    try:
        written = float((data or {}).get(WRITTEN_KEY, ""))
    except ValueError:
        return None
    return now + max(0.0, alive_until - written)

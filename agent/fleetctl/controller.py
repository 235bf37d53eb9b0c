"""The fleet controller: while it leads, it correlates the nodes' summaries on every change (and at a
bounded tick), publishes the holds that follow with the faults it heard of, and announces each new
correlation with one Event."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

from agent.errors import AgentError
from agent.fleet import Correlation, Dimension, Hold, correlate, holdable, next_holds
from agent.fleet.published import HOLDS_CONFIGMAP, encode_census, encode_seen, word_of_pass
from agent.fleet.unit import settling, unit_ids
from agent.fleetapi.holds_store import Deposed, HoldsStore
from agent.fleetapi.leader import LeaderElector
from agent.fleetctl.metrics import FleetMetrics
from agent.fleetctl.settings import FleetSettings
from agent.fleetctl.view import SummaryView
from agent.k8s.errors import K8sError
from agent.k8s.events import EventRecorder
from agent.k8s.raw import RawApi
from agent.k8s.watch import ListWatch
from agent.logs import get_logger

log = get_logger("agent.fleetctl")

#: The API group and version of the workload kinds an Event can be put on (the owner keys of
#: agent.workloads name the kind only); an owner of another kind gets its Event on the holds object.
WORKLOAD_API_VERSIONS = {
    "Job": "batch/v1", "CronJob": "batch/v1", "Deployment": "apps/v1", "StatefulSet": "apps/v1",
    "DaemonSet": "apps/v1", "ReplicaSet": "apps/v1", "JobSet": "jobset.x-k8s.io/v1alpha2",
    "PyTorchJob": "kubeflow.org/v1", "TFJob": "kubeflow.org/v1", "MPIJob": "kubeflow.org/v2beta1",
    "RayJob": "ray.io/v1", "RayCluster": "ray.io/v1", "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1",
}
REASON = "FleetCorrelation"
#: The Event's reason when a hold ends, or is spent while its cause stands.
ENDED_REASON = "FleetHoldEnded"


class FleetController:
    """One pass is `reconcile`; `run` watches, elects and reconciles until stopped."""

    def __init__(self, raw: RawApi, settings: FleetSettings, *, identity: str, events: EventRecorder,
                 metrics: FleetMetrics | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, fence: Callable[[], bool] = lambda: True) -> None:
        self.raw = raw
        self.settings = settings
        self.identity = identity
        self.events = events
        self.metrics = metrics or FleetMetrics()
        self.clock = clock
        self.view = SummaryView(settings.labels)
        #: Whether this controller still leads (its elector's Lease renewed within the deadline): every write
        #: of the holds object is fenced by it.
        self.store = HoldsStore(raw, settings.namespace, writer=identity, clock=clock, wall=wall, fence=fence)
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self._standing: set[str] = set()
        self.holds: list[Hold] = []
        self.correlations: list[Correlation] = []
        #: When a unit settling now may be named (the controller's clock): the pass to run then.
        self.recheck_at: float | None = None
        #: The unreadable entries already logged (each reason once).
        self._told: set[str] = set()

    # ---- the watch's side ----
    def on_sync(self, objects: list[dict[str, Any]]) -> None:
        with self.lock:
            if self.view.resync(objects, self.clock()):
                self.changed.set()

    def on_event(self, kind: str, obj: dict[str, Any]) -> None:
        with self.lock:
            now = self.clock()
            changed = self.view.forget(_name(obj)) if kind == "DELETED" else self.view.observe(obj, now)
        if changed:
            self.changed.set()

    # ---- one pass ----
    def reconcile(self) -> list[Correlation]:
        """Correlate, announce what is new, publish the holds; returns the new correlations."""
        now = self.clock()
        s = self.settings
        read = self.store.read()
        with self.lock:  # a copy of the view, and nothing else: the watch is never kept waiting on a pass
            # A new leader takes its predecessor's first sightings: a fault it first hears of now may be old.
            self.view.adopt_first_seen(self.store.seen)
            sightings = self.view.sightings()
            summaries = dict(self.view.summaries)
            booted = {name: at for name, (_, at) in self.view.boots.items()}
            counts = {"valid": len(summaries), "invalid": len(self.view.invalid),
                      "none": len(self.view.nodes - set(summaries) - set(self.view.invalid))}
            census = encode_census(s.labels.gpu_nodes, len(self.view.gpu_nodes), self.view.unlabelled)
        for state, count in counts.items():
            self.metrics.nodes.labels(state).set(count)
        correlations = correlate(summaries, sightings, now=now, policy=s.policy, booted=booted)
        units = unit_ids(correlations, sightings, now=now, policy=s.policy)
        young = settling(correlations, now=now, settle_seconds=s.unit_settle_seconds)
        # A fabric domain's cause still settling is neither named, held nor heard: its nodes wait on, and the
        # pass at its end names it (a unit, or a hold), or the fabric-wide cause it turned out to be.
        withheld = {(c.rule_id, node) for c in correlations if c.id in young for node in c.nodes}
        correlations = [c for c in correlations if c.id not in young]
        heard, first = word_of_pass(correlations, sightings, units=units, withheld=withheld,
                                    spent={h.id for h in read[0] if h.spent}, now=now,
                                    window_seconds=s.policy.window_seconds)
        for entry in self.store.unread:  # a newer writer's entries: kept as written, never a reason to stop
            if entry.reason not in self._told:
                self._told.add(entry.reason)
                self.metrics.errors.labels("holds-entry").inc()
                log.warning("fleet_holds_entry_unread", reason=entry.reason)
        known = self._standing | {h.id for h in read[0]}
        fresh = [c for c in correlations if c.id not in known]
        for correlation in fresh:  # before the hold is written: a crash in between sends it once more, by name
            if not self.store.fence():  # deposed during the pass: its successor announces what it finds
                raise Deposed(f"{self.identity} no longer holds the fleet controller's Lease: nothing announced")
            self._announce(correlation, unit=correlation.id in units)
        before, after = self.store.update(lambda held: list(next_holds(
            {h.id: h for h in held}, correlations, now=now, hold_seconds=s.hold_seconds,
            max_hold_seconds=s.max_hold_seconds, units=units).values()), read=read, heard=heard,
            alive_seconds=3 * s.tick_seconds, census=census,
            seen=lambda mono, wall: encode_seen(first, now=mono, wall=wall))
        self._tell_ended(before, after)
        self._standing = {c.id for c in correlations}
        self.holds, self.correlations = after, correlations
        self.recheck_at = min(young.values(), default=None)
        self.metrics.passes.inc()
        self.metrics.show(correlations, after, now=now)
        return fresh

    def _announce(self, correlation: Correlation, *, unit: bool = False) -> None:
        self.metrics.correlations.labels(correlation.rule_id, str(correlation.dimension)).inc()
        held = holdable(correlation.fault_class)
        note = (f"{correlation.cause}. "
                + (f"The fault is confined to this fabric domain: its {len(correlation.group)} nodes are taken "
                   f"out as one unit (unit {correlation.id}): each node showing it is tainted and drained, the "
                   "disruption budget and the quarantine brake count the domain as one node; "
                   "`gpu-health-agent fleet release` ends it." if unit else
                   f"The rule is held on these {len(correlation.group)} nodes for up to "
                   f"{self.settings.hold_seconds:.0f}s while the cause stands (hold {correlation.id}): "
                   "conditions and Events as ever, no taint, eviction, reset or reboot for it; "
                   "`gpu-health-agent fleet release` ends it." if held else
                   "A hardware fault is never held: each node acts on it as its own evidence."))
        log.warning("fleet_correlation", hold=correlation.id, cause=correlation.cause, unit=unit)
        digest = hashlib.sha256(f"{correlation.id}/{int(time.time() // 3600)}".encode()).hexdigest()[:16]
        try:
            self.events.record(regarding=self._regarding(correlation), reason=REASON,
                               action="TakeOut" if unit else "Hold" if held else "Correlate", note=note,
                               event_id=digest)
        except K8sError as exc:
            self.metrics.errors.labels("event").inc()
            log.warning("fleet_event_failed", hold=correlation.id, error=str(exc))

    def _tell_ended(self, before: list[Hold], after: list[Hold]) -> None:
        """One Event (on the holds object) for each hold that ended, and for each that is spent while its cause
        still stands (its nodes act from now on): whoever watched it start sees it go."""
        now_held = {h.id: h for h in after}
        for hold in before:
            later = now_held.get(hold.id)
            if later is None:
                what, note = "ended", (f"The fleet hold {hold.id} ended: its cause ({hold.cause}) no longer "
                                       "stands, or it expired or was released. Its nodes act on their own "
                                       "evidence again.")
            elif later.spent and not hold.spent:
                what, note = "spent", (f"The fleet hold {hold.id} reached its longest life while its cause "
                                       f"still stands ({hold.cause}); it is kept spent, covering nothing: its "
                                       "nodes act on the rule from now on.")
            else:
                continue
            log.info("fleet_hold_ended", hold=hold.id, result=what)
            digest = hashlib.sha256(f"{hold.id}/{what}/{hold.started_at:.0f}".encode()).hexdigest()[:16]
            try:
                self.events.record(regarding={"apiVersion": "v1", "kind": "ConfigMap",
                                              "namespace": self.settings.namespace, "name": HOLDS_CONFIGMAP},
                                   reason=ENDED_REASON, action="Release", note=note, type_="Normal",
                                   event_id=digest)
            except K8sError as exc:
                self.metrics.errors.labels("event").inc()
                log.warning("fleet_event_failed", hold=hold.id, error=str(exc))

    def _regarding(self, correlation: Correlation) -> dict[str, str]:
        if correlation.dimension is Dimension.WORKLOAD:
            namespace, _, rest = correlation.key.partition("/")
            kind, _, name = rest.partition("/")
            if kind in WORKLOAD_API_VERSIONS and name and "/" not in name:
                return {"apiVersion": WORKLOAD_API_VERSIONS[kind], "kind": kind, "namespace": namespace,
                        "name": name}
        return {"apiVersion": "v1", "kind": "ConfigMap", "namespace": self.settings.namespace,
                "name": HOLDS_CONFIGMAP}

    # ---- the long run ----
    def run(self, stop: threading.Event, *, nodes: ListWatch, elector: LeaderElector) -> None:
        """Watch the Nodes, stand for election, and reconcile while leading: on a change (after
        `settle_seconds`, so one burst of annotations is one pass) and every `tick_seconds`."""
        watcher = threading.Thread(target=nodes.run, name="fleet-watch", daemon=True, kwargs={
            "stop": stop, "on_sync": self.on_sync, "on_event": self.on_event,
            "on_error": lambda exc: self._failed("watch", exc)})
        election = threading.Thread(target=elector.run, name="fleet-election", daemon=True, kwargs={
            "stop": stop, "on_change": self._leading, "on_error": lambda exc: self._failed("lease", exc)})
        watcher.start()
        election.start()
        due = time.monotonic() + self.settings.tick_seconds
        try:
            while not stop.is_set():
                self.changed.wait(min(0.5, self.settings.tick_seconds))  # and see `stop` twice a second
                if stop.is_set():
                    break
                if not self.changed.is_set() and time.monotonic() < due:
                    continue
                if self.changed.is_set():
                    stop.wait(self.settings.settle_seconds)
                self.changed.clear()
                due = time.monotonic() + self.settings.tick_seconds
                if not elector.leading or not nodes.resource_version:
                    continue  # a standby keeps its view warm; the first pass waits for the first list
                try:
                    self.reconcile()
                    if self.recheck_at is not None:  # a settling unit is named at its end, not a tick later
                        due = min(due, time.monotonic() + max(0.0, self.recheck_at - self.clock()))
                except AgentError as exc:  # the API, or a holds object someone broke: kept, tried again
                    self._failed("holds", exc)
                    self.changed.set()
                    stop.wait(self.settings.settle_seconds)
        finally:
            nodes.close()
            election.join(timeout=5.0)
            watcher.join(timeout=5.0)

    def _leading(self, leading: bool) -> None:
        self.metrics.leader.set(1 if leading else 0)
        log.warning("fleet_leader", identity=self.identity, leading=leading)
        if leading:
            self.changed.set()  # adopt the published holds at once

    def _failed(self, what: str, exc: AgentError) -> None:
        self.metrics.errors.labels(what).inc()
        log.warning("fleet_api_failed", what=what, error=str(exc))


def _name(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")

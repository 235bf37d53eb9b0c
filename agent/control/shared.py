"""What the classifier, the feedback step and the reconciler share: rules, inventory, engine state, record, lock."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from agent.control.record_store import RecordStore
from agent.engine import EngineState, RuleSet
from agent.fleet.node_side import FleetSource, FleetView
from agent.logs import BoundLogger
from agent.metrics import Metrics, worse_status
from agent.model import NODE_KEY, GpuRef, NodeInventory, Severity
from agent.remediation import ActiveFault, PlanOptions
from agent.remediation.guard import held_back
from agent.remediation.planner import awaiting_reset
from agent.remediation.record import NodeRecord


class Shared:
    """One node's state under one lock: the source thread classifies into it, the reconciler thread acts on it."""

    def __init__(self, *, rules: RuleSet, inventory: NodeInventory, options: PlanOptions, store: RecordStore,
                 metrics: Metrics | None, clock: Callable[[], float], log: BoundLogger,
                 fleet: FleetSource | None = None) -> None:
        self.rules = rules
        self.inventory = inventory
        #: What the planner is told (the reconciler replaces `devices` with each read of the Node).
        self.options = options
        self.store = store
        self.metrics = metrics
        self.clock = clock
        self.log = log
        self.engine = EngineState()
        self.lock = threading.RLock()
        #: Set whenever the record changed: the reconciler thread wakes on it.
        self.wake = threading.Event()
        #: Set, under the lock, with every verdict recorded: a pass under way drops what is left of a plan made
        #: before it, taints first where the verdict calls for it, and plans again (Reconciler._carry_out_plan).
        self.new_verdict = threading.Event()
        self.metrics_primed = False
        #: Each MIG GPU's MIG devices as its last poll outside a reset counted them: what a reset records as the
        #: geometry to restore before it runs (NodeState.mig_expected).
        self.mig_seen: dict[str, int] = {}
        #: The fleet view (holds, quarantine brake; agent.fleetapi.fleet_gate), read when a pass or a verdict needs it.
        self.fleet, self.fleet_view = fleet, FleetView()

    @property
    def record(self) -> NodeRecord:
        return self.store.record

    def save(self) -> None:
        """The record, with the inventory it knows, to the journal."""
        self.store.save(self.inventory.gpus)

    def merge_gpus(self, gpus: tuple[GpuRef, ...]) -> None:
        known = {g.uuid for g in self.inventory.gpus}
        extra = tuple(g for g in gpus if g.uuid and g.uuid not in known)
        if extra:
            merged = sorted((*self.inventory.gpus, *extra), key=lambda g: (g.index is None, g.index or 0))
            self.inventory = dataclasses.replace(self.inventory, gpus=tuple(merged))

    def resolved_faults(self) -> dict[tuple[str, str], ActiveFault]:
        """Faults raised before the GPU's UUID was known get it from the inventory now, if it knows it; a fault the
        fleet holds, or a quarantine the brake holds back, is planned as notify-only."""
        resolved = {}
        for key, fault in self.record.faults.items():
            unresolved = fault.gpu is not None and not fault.gpu.uuid
            resolved[key] = dataclasses.replace(fault, gpu=self.inventory.resolve(fault.gpu)) \
                if unresolved and fault.gpu is not None else fault
        return held_back(resolved, self.fleet_view.held, braked=bool(self.fleet_view.brake),
                         judged=self.fleet_view.judged)

    def gpu_statuses(self) -> dict[str, str]:
        """healthy | degraded | fatal | unknown for every GPU of the inventory and every faulty key."""
        statuses = {gpu.key: "healthy" for gpu in self.inventory.gpus}
        for fault in list(self.record.faults.values()):
            status = _status_of(fault.severity)
            keys = list(statuses) if fault.gpu_key == NODE_KEY else [fault.gpu_key]
            for key in keys:
                statuses[key] = worse_status(status, statuses.get(key, "healthy"))
        return statuses

    def status_gpus(self) -> dict[str, GpuRef]:
        """The GPU each key of gpu_statuses names: the inventory's, else the fault's own identity as the inventory
        completes it (a fault raised before its UUID was known names the inventory's GPU)."""
        gpus = {gpu.key: gpu for gpu in self.inventory.gpus}
        for fault in list(self.record.faults.values()):
            if fault.gpu is not None and fault.gpu_key not in gpus:
                gpus[fault.gpu_key] = self.inventory.resolve(fault.gpu)
        return gpus

    def update_metrics(self, changed: bool) -> None:
        if self.metrics and (changed or not self.metrics_primed):
            self.metrics_primed = True
            self.metrics.set_gpu_status(self.gpu_statuses(), self.status_gpus(), hostname=self.inventory.name)
            faults = list(self.record.faults.values())
            self.metrics.set_active([f.severity for f in faults])
            gpus = self.status_gpus()
            waiting = awaiting_reset(faults, self.options)
            self.metrics.set_reset_required((gpus.get(f.gpu_key) or f.gpu or GpuRef(uuid=f.gpu_key) for f in waiting),
                                            hostname=self.inventory.name)


def _status_of(severity: Severity) -> str:
    if severity is Severity.FATAL:
        return "fatal"
    if severity is Severity.DEGRADED:
        return "degraded"
    if severity is Severity.UNKNOWN:
        return "unknown"
    return "healthy"

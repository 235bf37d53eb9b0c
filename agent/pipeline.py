"""One node's data flow, composed: observation -> classifier -> durable record; record -> reconciler -> guard -> act.

A thin facade over agent/control (docs/control-map.md): the classifier and its feedback step write the record
under one lock and acknowledge the input with it (local, fast, never an API call); the reconciler reads the real
Node, computes what the record calls for and converges. The daemon runs `reconcile` on its own thread, so a slow
or hung API server never stops detection; `simulate` and the tests run it inline after each change, so what a
scenario shows is what the agent does.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from agent.control.classifier import Classifier
from agent.control.feedback import DRIVER_RECOVERED
from agent.control.reconciler import Reconciler
from agent.control.record_store import BOOT_CURSOR, NODE_STATE_CURSOR, RecordStore
from agent.control.seams import Actuator, ClusterGate, LocalActuator, LocalGate, Outcome
from agent.control.shared import Shared
from agent.control.steps import STARTED, StepRunner
from agent.engine import EngineState, RuleSet
from agent.fleet.node_side import FleetSource
from agent.journal import Journal
from agent.logs import get_logger
from agent.metrics import Metrics
from agent.model import NodeInventory, Observation, PodRef, Verdict
from agent.remediation import ActiveFault, GuardPolicy, Mode, NodeState, PlanOptions
from agent.remediation.planner import incident_settled
from agent.remediation.record import NodeRecord
from agent.sources.checkpoint import InputCheckpoint
from agent.sources.kmsg import KernelLogCheckpoint

__all__ = ["BOOT_CURSOR", "DRIVER_RECOVERED", "NODE_STATE_CURSOR", "STARTED", "Actuator", "ClusterGate",
           "LocalActuator", "LocalGate", "Outcome", "Pipeline"]


class Pipeline:
    """Holds the engine state and the durable record of one node, and reconciles the node to the record."""

    def __init__(
        self,
        *,
        rules: RuleSet,
        inventory: NodeInventory,
        policy: GuardPolicy,
        actuator: Actuator | None = None,
        gate: ClusterGate | None = None,
        journal: Journal | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        retry_seconds: float = 30.0,
        sync_seconds: float = 30.0,
        slot_renew_seconds: float = 600.0,
        own_pod: str = "",
        pods: Callable[[], tuple[PodRef, ...]] | None = None,
        offered: Callable[[], frozenset[str] | None] | None = None,
        max_faulty_gpus: int = 2,
        replace_after_recoveries: int = 2,
        reset_settle_seconds: float = 10.0,
        incident_settle_seconds: float = 0.0,
        reset_verify_seconds: float = 300.0,
        recovery_window_days: float = 30.0,
        diagnose: bool = False,
        repair_condition: bool = False,
        diagnostic_available: bool | None = None,
        inline: bool = True,
        rng: random.Random | None = None,
        on_released: Callable[[Verdict], None] | None = None,
        checkpoints: Sequence[InputCheckpoint] | None = None,
        fleet: FleetSource | None = None,
    ) -> None:
        log = get_logger("agent.pipeline").bind(node=inventory.name)
        #: The sources' input checkpoints (default: the kernel log's), each opaque: an observation that moves
        #: one is acknowledged in the journal transaction that records what it changed.
        self.checkpoints: tuple[InputCheckpoint, ...] = (tuple(checkpoints) if checkpoints is not None
                                                         else (KernelLogCheckpoint(),))
        self.store = RecordStore(journal=journal, node_name=inventory.name, checkpoints=self.checkpoints,
                                 metrics=metrics, log=log)
        options = PlanOptions(node_name=inventory.name, own_pod=own_pod, max_faulty_gpus=max_faulty_gpus,
                              reset_settle_seconds=reset_settle_seconds,
                              incident_settle_seconds=incident_settle_seconds, pods_live=pods is not None,
                              diagnose=diagnose, repair_condition=repair_condition,
                              resets=policy.mode is Mode.REMEDIATE)
        self.shared = Shared(rules=rules, inventory=inventory, options=options, store=self.store, metrics=metrics,
                             clock=clock, log=log, fleet=fleet)
        self.classifier = Classifier(
            self.shared, checkpoints=self.checkpoints, replace_after_recoveries=replace_after_recoveries,
            recovery_window_seconds=recovery_window_days * 86400.0, reset_verify_seconds=reset_verify_seconds,
            diagnostic_available=diagnose if diagnostic_available is None else diagnostic_available,
            on_released=on_released)
        self.runner = StepRunner(self.shared, policy=policy, actuator=actuator or LocalActuator(),
                                 gate=gate or LocalGate(), rng=rng or random.Random(),  # noqa: S311 - jitter
                                 retry_seconds=retry_seconds, slot_renew_seconds=slot_renew_seconds)
        self.reconciler = Reconciler(self.shared, classifier=self.classifier, runner=self.runner,
                                     sync_seconds=sync_seconds, pods=pods, offered=offered)
        self.journal = journal
        self.metrics = metrics
        self.clock = clock
        self.pods = pods
        self.inline = inline
        self.store.load(self.classifier.fault_of)
        self.classifier.restore_engine(list(self.record.faults.values()))
        self.shared.merge_gpus(self.record.gpus)

    # ---- what callers read ----
    @property
    def rules(self) -> RuleSet:
        return self.shared.rules

    @property
    def inventory(self) -> NodeInventory:
        return self.shared.inventory

    @property
    def engine(self) -> EngineState:
        return self.shared.engine

    @property
    def record(self) -> NodeRecord:
        return self.store.record

    @property
    def fresh(self) -> bool:
        """No record in the journal, and none adopted from the Node yet."""
        return self.store.fresh

    @property
    def journal_failing(self) -> Mapping[str, str]:
        return self.store.journal_failing

    @property
    def active(self) -> dict[tuple[str, str], ActiveFault]:
        return self.record.faults

    @property
    def node(self) -> NodeState:
        return self.record.node

    @property
    def policy(self) -> GuardPolicy:
        return self.runner.policy

    @property
    def actuator(self) -> Actuator:
        return self.runner.actuator

    @actuator.setter
    def actuator(self, actuator: Actuator) -> None:
        self.runner.actuator = actuator

    @property
    def gate(self) -> ClusterGate:
        return self.runner.gate

    @property
    def wake(self) -> threading.Event:
        """Set whenever the record changed: the reconciler thread wakes on it."""
        return self.shared.wake

    @property
    def due_at(self) -> float:
        """When the next reconciliation pass is due (the reconciler also wakes on every change)."""
        return self.reconciler.due_at

    def occurrences(self, gpu_key: str, rule_id: str) -> int:
        return self.classifier.occurrences(gpu_key, rule_id)

    def incident_settled(self, now: float) -> float | None:
        """When the earliest eviction waiting for its incident to settle is due (None when none waits)."""
        with self.shared.lock:
            return incident_settled(list(self.shared.record.faults.values()), self.shared.options, now)

    def gpu_statuses(self) -> dict[str, str]:
        """healthy | degraded | fatal | unknown for every GPU of the inventory and every faulty key."""
        return self.shared.gpu_statuses()

    # ---- classification (never touches the API) ----
    def handle(self, observation: Observation, now: float | None = None) -> Outcome:
        """Classify one observation, record what it changes, acknowledge it; reconcile inline if configured."""
        now = self.clock() if now is None else now
        return self._after(self.classifier.handle(observation, now), now)

    def tick(self, now: float | None = None) -> Outcome:
        """Let time pass: quiet windows may clear faults; a reconciliation pass runs when one is due."""
        now = self.clock() if now is None else now
        return self._after(self.classifier.tick(now), now)

    def _after(self, verdicts: list[Verdict], now: float) -> Outcome:
        if verdicts:
            self.shared.wake.set()
        self.shared.update_metrics(bool(verdicts))
        outcome = Outcome(verdicts, [])
        if self.inline and (verdicts or now >= self.reconciler.due_at):
            outcome.extend(self.reconcile(now))
        return outcome

    def replace_rules(self, rules: RuleSet) -> None:
        with self.shared.lock:
            self.shared.rules = rules
        if self.metrics:
            self.metrics.rules_loaded.set(len(rules.rules))

    # ---- reconciliation (the only half that talks to the API) ----
    def start(self) -> bool:
        """Read the Node once and adopt its record where it is newer (or the journal had none)."""
        return self.reconciler.observe_and_adopt(self.clock()) is not None

    def reconcile(self, now: float | None = None) -> Outcome:
        """One level-triggered pass (Reconciler.reconcile)."""
        return self.reconciler.reconcile(now)

    def refresh_pods(self) -> None:
        self.reconciler.refresh_pods()

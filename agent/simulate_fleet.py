"""`simulate` of a fleet: one agent per node, wired as the daemon wires it, and the fleet controller, on one
in-process fake API server and one virtual clock; reports what each node took and what the fleet saw."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from agent.cluster_side import ClusterSide, NodeHooks, build_cluster_side
from agent.config import Config
from agent.engine import RuleSet
from agent.fleet import Correlation, Hold
from agent.fleet.summariser import NodeFacts
from agent.fleet.summary import RACK_LABEL
from agent.fleetctl.controller import FleetController
from agent.fleetctl.settings import FleetSettings
from agent.k8s.client import client_for
from agent.k8s.events import EventRecorder
from agent.k8s.raw import RawApi
from agent.k8s.watch import ListWatch, WatchOptions
from agent.model import ActionRecord, NodeInventory, StepKind, StepResult
from agent.pipeline import Outcome, Pipeline
from agent.remediation import GuardPolicy
from agent.simulate import UPTIME_AT_START, no_operator_reset
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster, populate
from agent.simulation.host_isolation import simulated_node_config
from agent.sources.scenario import Scenario, ScenarioFleet, fleet_timeline, inventory
from agent.wiring import pipeline_of


@dataclass(slots=True)
class NodeRun:
    """One node of the fleet: its agent and every action it recorded."""

    inventory: NodeInventory
    pipeline: Pipeline
    side: ClusterSide
    actions: list[ActionRecord] = field(default_factory=list)
    first_fault_at: float | None = None

    def took(self, outcome: Outcome, at: float) -> None:
        self.actions += outcome.actions
        if outcome.verdicts and self.first_fault_at is None:
            self.first_fault_at = at

    def applied(self, kind: StepKind) -> list[ActionRecord]:
        return [a for a in self.actions if a.step.kind is kind and a.result is StepResult.APPLIED]


@dataclass(slots=True)
class Sighted:
    """A correlation as the controller first announced it, on the virtual clock."""

    at: float
    correlation: Correlation


@dataclass(slots=True)
class FleetReport:
    scenario: Scenario
    nodes: list[NodeRun]
    cluster: FakeCluster
    correlations: list[Sighted] = field(default_factory=list)
    holds: list[Hold] = field(default_factory=list)

    def node_rows(self) -> list[dict[str, Any]]:
        rows = []
        for run in self.nodes:
            name = run.inventory.name
            taints = [t for t in self.cluster.node(name)["spec"].get("taints", [])
                      if t["key"] == run.side.writer.taint_key]
            rows.append({
                "node": name,
                "tainted_ever": bool(run.applied(StepKind.TAINT)),
                "tainted_at_end": bool(taints),
                "evicted": len(run.applied(StepKind.EVICT)),
                "reset": len(run.applied(StepKind.RESET_GPU)),
                "reboot_requested": bool(run.applied(StepKind.REBOOT_REQUEST)),
                "blocked": sum(1 for a in run.actions if a.result is StepResult.BLOCKED),
                "first_fault_at": run.first_fault_at,
            })
        return rows

    def totals(self) -> dict[str, int]:
        rows = self.node_rows()
        return {
            "nodes": len(rows),
            "nodes_faulted": sum(1 for r in rows if r["first_fault_at"] is not None),
            "nodes_tainted_ever": sum(1 for r in rows if r["tainted_ever"]),
            "nodes_tainted_at_end": sum(1 for r in rows if r["tainted_at_end"]),
            "pods_evicted": sum(r["evicted"] for r in rows),
            "gpus_reset": sum(r["reset"] for r in rows),
            "nodes_reboot_requested": sum(1 for r in rows if r["reboot_requested"]),
        }

    def to_json(self) -> dict[str, Any]:
        first = min((r.first_fault_at for r in self.nodes if r.first_fault_at is not None), default=None)
        return {
            "scenario": self.scenario.name,
            "description": self.scenario.description.strip(),
            "fleet": msgspec.to_builtins(self.scenario.fleet) if self.scenario.fleet else None,
            "totals": self.totals(),
            "correlations": [{
                "id": s.correlation.id, "cause": s.correlation.cause, "rule_id": s.correlation.rule_id,
                "dimension": str(s.correlation.dimension), "key": s.correlation.key,
                "nodes": len(s.correlation.nodes), "group": len(s.correlation.group), "at": s.at,
                "after_first_fault_seconds": None if first is None else round(s.at - first, 3),
            } for s in self.correlations],
            "holds_at_end": [h.to_json() for h in self.holds],
            "events": dict(sorted(Counter(e["reason"] for e in self.cluster.events()).items())),
            "nodes": self.node_rows(),
        }


def simulate_fleet(scenario: Scenario, *, rules: RuleSet, policy: GuardPolicy,
                   config: Config | None = None) -> FleetReport:
    """Every node's agent built by `build_cluster_side` from `config` (default: the shipped defaults) with
    the virtual clock injected, the fleet controller passing once a virtual second while it runs (a real one
    passes half a second after a change); each second, the observations due, the controller, then every
    agent's tick. A GPU reset is simulated: there is no GPU."""
    fleet = scenario.fleet or ScenarioFleet(nodes=2)
    clock = _FleetClock()
    started = time.time()

    def wall() -> float:
        return started + clock()

    cluster = FakeCluster(clock=wall)
    server = FakeApiServer(cluster).start()
    try:
        api_client = client_for(server.url)
        base = config or Config()
        runs = [_node(scenario, fleet, n, cluster, api_client, base, rules, policy, clock, wall)
                for n in range(fleet.nodes)]
        controller = _controller(api_client, clock, wall) if fleet.controller else None
        report = FleetReport(scenario, runs, cluster)
        _replay(scenario, report, controller, clock)
        if controller is not None:
            report.holds = list(controller.holds)
    finally:
        server.stop()
    return report


def _node(scenario: Scenario, fleet: ScenarioFleet, number: int, cluster: FakeCluster, api_client: Any,
          base: Config, rules: RuleSet, policy: GuardPolicy, clock: _FleetClock,
          wall: Callable[[], float]) -> NodeRun:
    node = inventory(scenario, number)
    labels = {RACK_LABEL: f"rack-{number // fleet.rack_size}"} if fleet.rack_size else {}
    populate(cluster, node, labels=labels)
    facts = NodeFacts(driver_version=fleet.driver_versions[number % len(fleet.driver_versions)],
                      fabric_domain=f"fabric-{number // fleet.fabric_domain_size}" if fleet.fabric_domain_size
                      else "", rack=labels.get(RACK_LABEL, ""))
    config = simulated_node_config(base, node_name=node.name, policy=policy)
    hooks = NodeHooks(pods=lambda: node.pods, facts=lambda: facts, reset_of=no_operator_reset,
                      uptime=lambda: UPTIME_AT_START + clock(), rule_class=rules.fault_class_of)
    own_pod = next((p.key for p in node.pods if p.daemonset), "")
    side = build_cluster_side(api_client, config, hooks, on_stuck=lambda pod: None, clock=wall, monotonic=clock,
                              own_pod=own_pod)
    pipeline = pipeline_of(config, rules=rules, inventory=node, cluster=side, clock=clock, live_pods=False)
    return NodeRun(node, pipeline, side)


def _controller(api_client: Any, clock: _FleetClock, wall: Callable[[], float]) -> FleetController:
    raw = RawApi(api_client)
    settings = FleetSettings()
    return FleetController(raw, settings, identity="fleet-simulate", clock=clock, wall=wall,
                           events=EventRecorder(raw, instance="fleet-simulate", namespace=settings.namespace,
                                                clock=clock))


def _replay(scenario: Scenario, report: FleetReport, controller: FleetController | None,
            clock: _FleetClock) -> None:
    due = fleet_timeline(scenario)
    position, second = 0, 0.0
    while second <= scenario.end:
        while position < len(due) and due[position][1].observation.at <= second:
            number, timed = due[position]
            clock.now = timed.observation.at
            run = report.nodes[number]
            run.took(run.pipeline.handle(timed.observation, clock.now), clock.now)
            position += 1
        clock.now = second
        if controller is not None:
            _controller_pass(controller, report, second)
        for run in report.nodes:
            run.took(run.pipeline.tick(second), second)
        second += scenario.tick_seconds


def _controller_pass(controller: FleetController, report: FleetReport, at: float) -> None:
    """What the controller's watch and pass do: the Nodes' metadata, then one correlation pass."""
    nodes = ListWatch(controller.raw.api_client, "/api/v1/nodes", WatchOptions(metadata_only=True))
    controller.on_sync(nodes.list_all()[0])
    report.correlations += [Sighted(at, c) for c in controller.reconcile()]


class _FleetClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

"""Replays a scenario through the real pipeline on a virtual clock and reports what happened."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.cluster_side import NodeHooks, build_cluster_side
from agent.config import Config
from agent.engine import RuleSet
from agent.gpu.reset import IN_USE, ResetOutcome, ResetProcedure, ResetRunner, without_persistence
from agent.journal import Journal
from agent.k8s.client import client_for
from agent.k8s.operands import OperandPauser
from agent.model import NodeInventory, Observation, Signal
from agent.model_json import action_to_dict, gpu_to_dict, verdict_to_dict
from agent.pipeline import Outcome, Pipeline
from agent.remediation import GuardPolicy
from agent.simulation.device_plugin import SimulatedDevicePlugin
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster, populate
from agent.simulation.gpu_operator import DRA_OPERANDS, OPERANDS, HostHolder, SimulatedGpuOperator
from agent.simulation.host_isolation import simulated_node_config
from agent.sources.scenario import Scenario, expand, inventory
from agent.wiring import pipeline_of

#: The node's uptime when a scenario starts: past the fleet summary's boot window, unless a scenario boots it.
UPTIME_AT_START = 86400.0
#: The agent's own pod where a scenario lists none (a DaemonSet's pod: never evicted, never waited for).
OWN_POD = "gpu-health/gpu-health-agent-x7k2p"


@dataclass(slots=True)
class TimelineLine:
    """One scenario entry (all its repeats) or one clock tick, and what it led to."""

    at: float
    observation: Observation | None
    repeats: int = 1
    outcome: Outcome = field(default_factory=Outcome)


@dataclass(slots=True)
class SimulationReport:
    scenario: Scenario
    lines: list[TimelineLine]
    pipeline: Pipeline
    cluster: FakeCluster | None = None

    def to_json(self) -> dict[str, Any]:
        verdicts = [verdict_to_dict(v) for line in self.lines for v in line.outcome.verdicts]
        actions = [action_to_dict(a) for line in self.lines for a in line.outcome.actions]
        active = [
            {"gpu_key": key, "rule_id": rule_id, "severity": str(f.severity), "action": str(f.action),
             "occurrences": self.pipeline.occurrences(key, rule_id)}
            for (key, rule_id), f in sorted(self.pipeline.active.items())
        ]
        node = self.pipeline.inventory
        return {
            "scenario": self.scenario.name,
            "description": self.scenario.description.strip(),
            "node": {
                "name": node.name,
                "gpus": [gpu_to_dict(g) for g in node.gpus],
                "pods": [{"namespace": p.namespace, "name": p.name, "uid": p.uid, "gpus": list(p.gpu_uuids),
                          "daemonset": p.daemonset} for p in node.pods],
            },
            "mode": str(self.pipeline.policy.mode),
            "dry_run": self.pipeline.policy.dry_run,
            "verdicts": verdicts,
            "actions": actions,
            "active_faults": active,
            "gpu_status": self.pipeline.gpu_statuses(),
            "cluster": self._cluster_json(),
        }

    def _cluster_json(self) -> dict[str, Any] | None:
        """The fake cluster after the run: the node as the API shows it, the events, the pods left."""
        if self.cluster is None:
            return None
        node = self.cluster.node(self.pipeline.inventory.name)
        return {
            "node": {"taints": node["spec"].get("taints", []),
                     "unschedulable": node["spec"].get("unschedulable", False),
                     "labels": node["metadata"].get("labels", {}),
                     "annotations": node["metadata"].get("annotations", {}),
                     "conditions": [c for c in node["status"].get("conditions", []) if c["type"] != "Ready"]},
            "events": [{"reason": e["reason"], "type": e["type"], "regarding": e["regarding"], "note": e["note"],
                        "count": e.get("series", {}).get("count", 1)} for e in self.cluster.events()],
            "pods": sorted(f"{p['metadata']['namespace']}/{p['metadata']['name']}"
                           for p in self.cluster.pods_on(self.pipeline.inventory.name)),
            "device_taint_rules": [{"name": r["metadata"]["name"], "device": r["spec"]["deviceSelector"],
                                    "taint": r["spec"]["taint"]} for r in self.cluster.device_taint_rules()],
        }


def simulate_in_cluster(scenario: Scenario, *, rules: RuleSet, policy: GuardPolicy,
                        journal: Journal | None = None, config: Config | None = None) -> SimulationReport:
    """The scenario through the agent as `run` wires it (agent.cluster_side.build_cluster_side, agent.wiring:
    the same actuators, budget, rate bound, opt-out label and fleet view, from `config`, default the shipped
    one) against an in-process fake API server holding the scenario's node and pods (over real HTTP); a GPU
    reset is simulated, since there is no GPU. The fake cluster keeps the scenario's virtual time, so evicted
    pods finish terminating as the scenario runs."""
    clock = ScenarioClock()
    started = time.time()

    def wall() -> float:
        return started + clock()

    cluster = FakeCluster(clock=wall)
    node = inventory(scenario)
    populate(cluster, node, dra=scenario.node.dra)
    server = FakeApiServer(cluster).start()
    try:
        settings = simulated_node_config(config or Config(), node_name=node.name, policy=policy)
        # NVIDIA's device plugin hands the GPUs out where DRA does not: it withholds a GPU after a critical Xid.
        plugin = SimulatedDevicePlugin(cluster, node) if not scenario.node.dra else None
        hooks = _node_hooks(cluster, scenario, node, rules, clock)
        if plugin is not None:
            hooks = dataclasses.replace(hooks, allocatable=plugin.allocatable)
        side = build_cluster_side(client_for(server.url), settings, hooks, on_stuck=lambda pod: None, clock=wall,
                                  monotonic=clock, own_pod=own_pod_of(node))
        pipeline = pipeline_of(settings, rules=rules, inventory=node, cluster=side, journal=journal, clock=clock,
                               live_pods=False, diagnostic_available=scenario.node.diagnostic)
        report = simulate(scenario, pipeline=pipeline, clock=clock,
                          observe=plugin.observe if plugin is not None else None)
    finally:
        server.stop()
    report.cluster = cluster
    return report


def own_pod_of(node: NodeInventory) -> str:
    """The agent's own pod among the scenario's (a DaemonSet's), else the name the agent's pod would have."""
    return next((p.key for p in node.pods if p.daemonset), OWN_POD)


def _node_hooks(cluster: FakeCluster, scenario: Scenario, node: NodeInventory, rules: RuleSet,
                clock: ScenarioClock) -> NodeHooks:
    """What the cluster side reads from the simulated node: its pods, uptime and rules, and its reset (through
    the operands' pause on a GPU Operator node, whose waits let the simulated DaemonSet controller act, on a
    clock of their own: no scenario time passes)."""
    hooks = NodeHooks(pods=lambda: node.pods, uptime=lambda: UPTIME_AT_START + clock(),
                      rule_class=rules.fault_class_of, reset_of=no_operator_reset)
    if not scenario.node.gpu_operator:
        return hooks
    holders = tuple(HostHolder(node.gpus[h.gpu].uuid, h.name, h.until) for h in scenario.node.host_holders)
    operator = SimulatedGpuOperator(cluster, node, host_holders=holders, clock=clock,
                                    persistent={g.uuid for g in node.gpus} if scenario.node.persistence_mode else set(),
                                    operands=dict(DRA_OPERANDS if scenario.node.dra else OPERANDS))
    operator.install()
    waited = [0.0]

    def wait(seconds: float) -> None:
        waited[0] += seconds
        operator.reconcile()

    return dataclasses.replace(hooks, reset_of=lambda operands: _operator_node_reset(operator, operands),
                               operand_clock=lambda: waited[0], operand_sleep=wait)


def no_operator_reset(operands: OperandPauser) -> ResetRunner:
    """The reset of a simulated node without the GPU Operator (nothing to pause): simulated, there is no GPU."""
    del operands

    def reset(uuid: str) -> tuple[bool | None, str]:
        return True, f"simulated reset of {uuid} (no GPU here)"

    return reset


def _operator_node_reset(operator: SimulatedGpuOperator, operands: OperandPauser) -> ResetRunner:
    """The real reset procedure on a simulated GPU Operator node: its operands paused through the fake API
    server (their pods go as the DaemonSet controller removes them), the agent's NVML released, and a simulated
    nvidia-smi that refuses while anything still holds the GPU."""

    def nvidia_smi(uuid: str) -> ResetOutcome:
        """The privileged part as DeviceReset runs it: persistence mode off, the reset, persistence back on; a
        refusal because the GPU is in use is the GPU still held (not idle yet), as DeviceReset says."""
        def reset() -> ResetOutcome:
            ok, message = operator.nvidia_smi(uuid)
            return ResetOutcome(ok, message, held=not ok and bool(IN_USE.search(message)))
        return without_persistence(lambda args: operator.persistence(uuid, args), reset)

    procedure = ResetProcedure(nvidia_smi, operands=operands, nvml=operator.nvml)

    def reset(uuid: str) -> tuple[bool | None, str]:
        try:
            return procedure(uuid)
        finally:
            operator.reconcile()  # the restored operands' pods come back

    return reset


def simulate(
    scenario: Scenario,
    *,
    rules: RuleSet | None = None,
    policy: GuardPolicy | None = None,
    journal: Journal | None = None,
    pipeline: Pipeline | None = None,
    clock: ScenarioClock | None = None,
    observe: Callable[[Observation], None] | None = None,
) -> SimulationReport:
    """Run every observation of the scenario through `pipeline` (simulate_in_cluster's), else a fresh local
    one (no cluster: steps are only planned) from `rules` and `policy`, ticking the virtual clock; `observe` sees
    each observation first (the simulated node's own parts, such as its device plugin)."""
    clock = clock or ScenarioClock()
    if pipeline is None:
        if rules is None or policy is None:
            raise ValueError("simulate: rules and policy, or a pipeline")
        config = Config(mode=policy.mode, dry_run=policy.dry_run)
        node = inventory(scenario)
        pipeline = pipeline_of(config, rules=rules, inventory=node, cluster=None, journal=journal, clock=clock,
                               diagnostic_available=scenario.node.diagnostic, own_pod=own_pod_of(node))
    node = pipeline.inventory
    lines: list[TimelineLine] = []
    current: dict[int, TimelineLine] = {}
    next_tick = scenario.tick_seconds
    for timed in expand(scenario, node):
        at = timed.observation.at
        while next_tick <= at:
            _settle(pipeline, clock, next_tick, lines)
            _tick(pipeline, clock, next_tick, lines)
            next_tick += scenario.tick_seconds
        _settle(pipeline, clock, at, lines)
        clock.now = at
        if observe is not None:
            observe(timed.observation)
        outcome = pipeline.handle(timed.observation, at)
        line = current.get(timed.entry)
        if line is None or timed.observation.signal is Signal.BOOT:
            line = TimelineLine(at, timed.observation)
            current[timed.entry] = line
            lines.append(line)
        else:
            line.repeats += 1
        line.outcome.extend(outcome)
    while next_tick <= scenario.end:
        _settle(pipeline, clock, next_tick, lines)
        _tick(pipeline, clock, next_tick, lines)
        next_tick += scenario.tick_seconds
    return SimulationReport(scenario, [line for line in lines if _worth_showing(line)], pipeline)


def _tick(pipeline: Pipeline, clock: ScenarioClock, at: float, lines: list[TimelineLine]) -> None:
    clock.now = at
    outcome = pipeline.tick(at)
    if outcome.verdicts or outcome.actions:
        lines.append(TimelineLine(at, None, outcome=outcome))


def _settle(pipeline: Pipeline, clock: ScenarioClock, before: float, lines: list[TimelineLine]) -> None:
    """A pass where an incident's settle window ends before `before`: the agent's reconciler wakes for it
    (remediation.incident_settle_seconds, 1 s), whatever the scenario's ticks."""
    while (due := pipeline.incident_settled(clock.now)) is not None and due < before:
        _tick(pipeline, clock, due, lines)


def _worth_showing(line: TimelineLine) -> bool:
    if line.observation is not None and line.observation.signal is Signal.BOOT:  # the replayed first boot: quiet
        return bool(line.outcome.verdicts or line.outcome.actions) or line.observation.at > 0
    return True


class ScenarioClock:
    """The scenario's virtual time in seconds: `simulate` moves it to each observation and tick."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

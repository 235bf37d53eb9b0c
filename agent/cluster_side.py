"""Assembles the cluster side of the agent from its configuration: actuator, budget gate, pods."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from agent.config import Config
from agent.diagnostics import command_runner
from agent.errors import InputError
from agent.fleet import BrakePolicy, NodeSummary
from agent.fleet.published import SUMMARY_ANNOTATION
from agent.fleet.summariser import NodeFacts, Summariser
from agent.fleetapi.brake_claims import BrakeClaims
from agent.fleetapi.budget import LeaseBudget
from agent.fleetapi.claims_watch import REOPEN_FACTOR, ClaimsWatch
from agent.fleetapi.fleet_gate import FleetGate
from agent.k8s.actuator import K8sActuator, ResetRunner, unwired_reset
from agent.k8s.errors import K8sError
from agent.k8s.events import EventRecorder
from agent.k8s.evictions import Evictor
from agent.k8s.isolation import DeviceIsolator
from agent.k8s.node import RELEASE_ANNOTATION, NodeWriter
from agent.k8s.node_cache import NodeCache
from agent.k8s.node_watch import NodeWatch
from agent.k8s.operands import OperandPauser
from agent.k8s.pods import PodFinder
from agent.k8s.raw import RawApi
from agent.model import FaultClass, PodRef
from agent.timefmt import rfc3339


@dataclass(frozen=True, slots=True)
class NodeHooks:
    """What the cluster side reads from the node side, handed over when it is built (each read when called)."""

    #: pod UID -> GPU UUIDs of the processes NVML lists (host PIDs charged through the host's /proc).
    gpus_by_pod_uid: Callable[[], dict[str, list[str]]] | None = None
    #: MIG device UUID -> its parent GPU's UUID.
    mig_parents: Callable[[], dict[str, str]] | None = None
    #: The kubelet's allocatable devices by resource (None: asked on the PodResources socket; a replay: its
    #: simulated device plugin's).
    allocatable: Callable[[], dict[str, list[str]]] | None = None
    #: The node's pods as the agent last listed them (the fleet summary names their workloads).
    pods: Callable[[], Iterable[PodRef]] = tuple
    #: The node's facts for the fleet summary (driver version, NVLink fabric domain).
    facts: Callable[[], NodeFacts] = NodeFacts
    #: The GPU edge's reset, given the operand pauser this side builds (agent.gpu composes it above).
    reset_of: Callable[[OperandPauser], ResetRunner] | None = None
    #: Seconds since the node booted (the fleet summary's boot window).
    uptime: Callable[[], float] = lambda: time.clock_gettime(time.CLOCK_BOOTTIME)
    #: The fault class this node's rules give a rule (None: no such rule): what a published unit is checked by.
    rule_class: Callable[[str], FaultClass | None] = lambda rule_id: None
    #: Called for each entry of the fleet's shared objects the fleet view set aside (the daemon's metric).
    on_fleet_set_aside: Callable[[str], None] = lambda what: None
    #: How the operand pauser waits for the paused operands' pods to go (a replay: a clock of its own).
    operand_clock: Callable[[], float] = time.monotonic
    operand_sleep: Callable[[float], None] = time.sleep


@dataclass(slots=True)
class ClusterSide:
    """What the daemon needs from the cluster, built once at start."""

    actuator: K8sActuator
    gate: LeaseBudget
    pods: PodFinder
    writer: NodeWriter
    own_pod: str
    #: Pauses the GPU Operator's operands for a reset (the GPU edge's procedure is handed it by the daemon).
    operands: OperandPauser | None = None
    #: The fleet view's reader (holds, quarantine brake) and the summary the mirror publishes; None: off.
    fleet: FleetGate | None = None
    summariser: Summariser | None = None
    #: Keeps the writer's Node current between passes (the daemon runs it on a thread); None: a GET a pass.
    node_watch: NodeWatch | None = None
    #: Keeps the brake's claims current, so a ranking needs no list (the daemon runs it on a thread); None: off.
    claims_watch: ClaimsWatch | None = None


def build_cluster_side(api_client: Any, config: Config, node: NodeHooks | None = None, *,
                       on_stuck: Callable[[str], None],
                       on_budget: Callable[[int, int], None] = lambda in_use, limit: None,
                       clock: Callable[[], float] = time.time,
                       monotonic: Callable[[], float] = time.monotonic, own_pod: str | None = None) -> ClusterSide:
    """Every part built once, in order, with what it reads from the node side: nothing is wired in later.
    `clock` is the wall clock (stamps people read), `monotonic` the one every interval is measured on;
    `own_pod` is the agent's pod, `namespace/name` (default: POD_NAMESPACE and POD_NAME, the downward API)."""
    settings = config.remediation
    hooks = node or NodeHooks()
    raw = RawApi(api_client)
    seen = NodeCache()
    writer = NodeWriter(raw, config.node_name, taint_key=settings.taint_key,
                        taint_effect=settings.taint_effect, cordon=settings.cordon, seen=seen)
    watch = NodeWatch(api_client, config.node_name, seen, watch_seconds=settings.node_watch_seconds) \
        if settings.node_watch_seconds > 0 else None
    devices = DeviceIsolator(
        raw, node_name=config.node_name, taint_key=settings.taint_key, setting=settings.isolation,
        effect=settings.device_taint_effect, mark_degraded=settings.device_taint_degraded)
    if own_pod is None:
        own_pod = f"{os.environ.get('POD_NAMESPACE', settings.namespace)}/{os.environ.get('POD_NAME', '')}"
    operands = OperandPauser(writer, raw, labels=tuple(settings.reset_operand_labels),
                             wait_seconds=settings.reset_operand_wait_seconds, clock=hooks.operand_clock,
                             sleep=hooks.operand_sleep)
    fleet, summariser, claims_watch = fleet_side(raw, config, clock=clock, monotonic=monotonic, hooks=hooks)
    actuator = K8sActuator(
        writer=writer,
        events=EventRecorder(raw, instance=f"{config.node_name}/{os.environ.get('POD_NAME', 'agent')}",
                             clock=monotonic),
        evictor=Evictor(raw, deadline_seconds=settings.eviction_deadline_seconds, clock=monotonic),
        reset=hooks.reset_of(operands) if hooks.reset_of is not None else unwired_reset,
        reboot_sentinel=settings.reboot_sentinel_path,
        on_stuck=on_stuck,
        opt_out_label=settings.opt_out_label,
        diagnose=command_runner(settings.diagnostic_command, timeout_seconds=settings.diagnostic_timeout_seconds,
                                hostengine=config.sources.dcgm.hostengine) if settings.diagnostic_command else None,
        devices=devices,
        summarise=summariser,
    )
    budget = LeaseBudget(raw, node_name=config.node_name, namespace=settings.namespace,
                         max_nodes=settings.budget_max_nodes, max_percent=settings.budget_max_percent,
                         max_per_hour=settings.budget_max_nodes_per_hour,
                         gpu_node_selector=settings.gpu_node_selector, clock=clock, monotonic=monotonic,
                         on_usage=on_budget, units=fleet.units if fleet is not None else None,
                         census=fleet.census_gpu_nodes if fleet is not None else None, node=writer)
    pods = PodFinder(raw, config.node_name, socket_path=settings.pod_resources_socket,
                     gpus_by_pod_uid=hooks.gpus_by_pod_uid, mig_parents=hooks.mig_parents,
                     dra_gpus=devices.gpus_by_pod, allocatable=hooks.allocatable)
    if fleet is not None and summariser is not None:
        fleet.own = own_summary(summariser, writer)
    return ClusterSide(actuator, budget, pods, writer, own_pod, operands, fleet, summariser, watch, claims_watch)


def own_summary(summariser: Summariser, writer: NodeWriter) -> Callable[[], NodeSummary | None]:
    """This node's summary as the summariser last made it, or before its first (a restarted agent's first
    pass) as its Node shows it: what a scoped hold covers the node by (agent.fleet.scope)."""
    return lambda: summariser.last or published_summary(writer)


def published_summary(writer: NodeWriter) -> NodeSummary | None:
    """The summary this node's agent last published on its Node (a restarted agent's, before it makes its
    own); None where there is none or it cannot be read."""
    try:
        text = writer.read().annotations.get(SUMMARY_ANNOTATION, "")
        return NodeSummary.from_json(text, source="own Node's summary") if text else None
    except (K8sError, InputError):
        return None


def fleet_side(raw: RawApi, config: Config, *, clock: Callable[[], float] = time.time,
               monotonic: Callable[[], float] = time.monotonic,
               hooks: NodeHooks | None = None) -> tuple[FleetGate | None, Summariser | None, ClaimsWatch | None]:
    """The fleet view's reader and the summariser, when `fleet_holds` or the brake is on; the brake's claims
    watch with the brake, where watches are on (`node_watch_seconds` > 0)."""
    settings = config.remediation
    hooks = hooks or NodeHooks()
    brake = BrakePolicy(max_share=settings.brake_max_share, min_nodes=settings.brake_min_nodes,
                        max_nodes=settings.brake_max_nodes, window_seconds=settings.brake_window_seconds) \
        if settings.brake_window_seconds > 0 else None
    if not settings.fleet_holds and brake is None:
        return None, None, None
    watch = ClaimsWatch(raw.api_client, settings.namespace,
                        watch_seconds=REOPEN_FACTOR * settings.node_watch_seconds) \
        if brake is not None and settings.node_watch_seconds > 0 else None
    claims = BrakeClaims(raw, node_name=config.node_name, namespace=settings.namespace,
                         window_seconds=brake.window_seconds, monotonic=monotonic,
                         fabric_domain=lambda: hooks.facts().fabric_domain,
                         delivered=watch.through if watch is not None else None) if brake is not None else None
    gate = FleetGate(raw, namespace=settings.namespace, gpu_node_selector=settings.gpu_node_selector, brake=brake,
                     holds=settings.fleet_holds, clock=monotonic, wall=clock, claims=claims,
                     claim_retry_seconds=2 * settings.retry_seconds,
                     settle_seconds=settings.fleet_settle_seconds if settings.fleet_holds else 0.0,
                     settle_max_seconds=settings.fleet_settle_max_seconds if settings.fleet_holds else 0.0,
                     node=config.node_name, rule_class=hooks.rule_class,
                     fabric_domain=lambda: hooks.facts().fabric_domain, on_unread=hooks.on_fleet_set_aside)
    return gate, Summariser(config.node_name, wall=clock, uptime=hooks.uptime, pods=hooks.pods,
                            facts=hooks.facts), watch


def request_release(api_client: Any, node_name: str, gpu: str = "all") -> None:
    """What `gpu-health-agent release` does: annotate the Node; its agent consumes the annotation."""
    writer = NodeWriter(RawApi(api_client), node_name, taint_key="")
    writer.set_metadata(annotations={RELEASE_ANNOTATION: f"{gpu}@{rfc3339()}"})

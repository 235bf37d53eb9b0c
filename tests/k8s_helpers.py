"""Builds agents that act on a FakeCluster through the real client, for the remediation tests."""

from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.cluster_side import ClusterSide, own_summary
from agent.engine import builtin_rules_dir, load_rules
from agent.fleet import BrakePolicy
from agent.fleet.summariser import NodeFacts, Summariser
from agent.fleetapi.brake_claims import BrakeClaims
from agent.fleetapi.budget import LeaseBudget
from agent.fleetapi.claims_watch import ClaimsWatch
from agent.fleetapi.fleet_gate import FleetGate
from agent.journal import Journal
from agent.k8s.actuator import K8sActuator
from agent.k8s.client import client_for
from agent.k8s.events import EventRecorder
from agent.k8s.evictions import Evictor
from agent.k8s.node import NodeWriter
from agent.k8s.node_cache import NodeCache
from agent.k8s.node_watch import NodeWatch
from agent.k8s.pods import PodFinder
from agent.k8s.raw import RawApi
from agent.model import GpuRef, NodeInventory, Observation, PodRef, Signal, frozen_attrs
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy, Mode
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster, populate
from agent.simulation.fake_apiserver.evictions import DEFAULT_GRACE_SECONDS

RULES = load_rules(builtin_rules_dir())
TAINT = "gpu-health-agent.io/unhealthy"
_names = itertools.count()


def gpu_node(name: str, gpus: int = 8) -> NodeInventory:
    refs = tuple(GpuRef(i, f"GPU-{name}-{i:04d}", f"0000:{0x18 + i:02x}:00.0", "NVIDIA H100 80GB HBM3")
                 for i in range(gpus))
    pods = tuple(PodRef("ml", f"{name}-trainer-{i}", f"uid-{name}-{i}", (refs[i].uuid,)) for i in range(gpus))
    agent = PodRef("gpu-health", f"gpu-health-agent-{name}", f"uid-agent-{name}", (), daemonset=True)
    return NodeInventory(name, refs, (*pods, agent))


@dataclass
class Agent:
    inventory: NodeInventory
    pipeline: Pipeline
    actuator: K8sActuator
    side: ClusterSide
    evictor: Evictor
    journal: Journal | None = None
    cluster: FakeCluster | None = None
    server: FakeApiServer | None = None
    options: dict[str, Any] | None = None
    #: The watch of its Node (make_agent(node_watch=True)) on its own thread, and what stops it.
    watch: NodeWatch | None = None
    watch_stop: threading.Event | None = None
    #: The watch of the brake's claims (node_watch=True with a brake), on its own thread, stopped with it.
    claims_watch: ClaimsWatch | None = None

    def fault(self, gpu: int, xid: int = 79, at: float = 1.0):
        return self.pipeline.handle(Observation(Signal.XID, xid, at, "kmsg", self.inventory.gpus[gpu]), at)

    def poll(self, gpu: int, at: float, **readings: float):
        """One complete NVML poll of the GPU: clean unless a reading says otherwise (what verifies a reset)."""
        attrs = {"recovery_action": 0, "remap_pending": 0, "retirement_pending": 0, "volatile_dbe": 0,
                 "links_down": 0, **readings}
        return self.pipeline.handle(Observation(Signal.GPU_POLLED, 1, at, "nvml", self.inventory.gpus[gpu],
                                                frozen_attrs(attrs)), at)

    def settle(self, now: float):
        """Time passes to `now`: a reconciliation pass runs if one is due, as the agent's reconciler makes it."""
        return self.pipeline.tick(now)

    def close(self) -> None:
        if self.watch is not None and self.watch_stop is not None:
            self.watch_stop.set()
            self.watch.close()
        if self.claims_watch is not None:
            self.claims_watch.close()
        if self.journal is not None:
            self.journal.close()


class ClusterClock:
    """The fake cluster's own clock, moved by the test: a terminating pod is gone once it passes the deadline."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def start_cluster() -> tuple[FakeCluster, FakeApiServer]:
    cluster = FakeCluster(clock=ClusterClock())
    return cluster, FakeApiServer(cluster).start()


def grace_period_passes(cluster: Any, seconds: float = DEFAULT_GRACE_SECONDS) -> None:
    """Evicted pods finish terminating, as the kubelet ends them after their grace period: on the fake by
    moving its clock; on the real control plane kwok ends them, so wait until none is left terminating."""
    if isinstance(cluster, FakeCluster):
        cluster.clock.now += seconds  # type: ignore[attr-defined]
        cluster.finish_terminations()
        return
    cluster.wait_terminations_finished()


def running_pods(cluster: Any, node: str) -> set[str]:
    """Names of the node's pods that are not Terminating: what a "nobody was evicted" check counts, since an
    evicted pod stays listed, with a deletionTimestamp, for its grace period (on the fake and a real server)."""
    return {p["metadata"]["name"] for p in cluster.pods_on(node) if not p["metadata"].get("deletionTimestamp")}


def eviction_requests(cluster: Any, since: int = 0) -> list[str]:
    """The pods the agents asked the Eviction API to evict, from the request log's entry `since` on (the
    fake's log, or the real server's audit log of the agent's identity)."""
    return [path.rsplit("/", 2)[-2] for _, path, _ in cluster.log[since:] if path.endswith("/eviction")]


def populate_any(cluster: Any, inventory: NodeInventory) -> None:
    """The node and its pods, in a FakeCluster or on the real control plane (tests/realcluster/backend.py)."""
    if isinstance(cluster, FakeCluster):
        populate(cluster, inventory)
    else:
        cluster.populate(inventory)


def agent_client(server: Any, node_name: str) -> Any:
    """The agent's ApiClient: anonymous on the fake; its own ServiceAccount token on the real server."""
    return client_for(server.url) if isinstance(server, FakeApiServer) else server.agent_client(node_name)


def operator_client(server: Any) -> Any:
    """A cluster operator's ApiClient (what `gpu-health-agent release` runs with)."""
    return client_for(server.url) if isinstance(server, FakeApiServer) else server.operator_client()


def operator_kubeconfig(server: Any, directory: Path) -> str:
    """A kubeconfig file with the operator's credentials, for the CLI (`--kubeconfig`)."""
    if not isinstance(server, FakeApiServer):
        return str(server.plane.admin_kubeconfig)
    import yaml

    path = directory / "operator-kubeconfig"
    path.write_text(yaml.safe_dump(server.kubeconfig()))
    return str(path)


def make_agent(cluster: Any, server: Any, inventory: NodeInventory, *,
               mode: Mode = Mode.REMEDIATE, populate_node: bool = True, max_nodes: int = 1,
               max_percent: float = 10, max_per_hour: int = 0, deadline: float = 600.0, clock=None, reset=None,
               restore: bool = False, retry_seconds: float = 30.0, max_faulty_gpus: int = 2,
               journal: Path | None = None, dry_run: bool = False, budget_clock: Any = None,
                api_client: Any = None, diagnose: Any = None, fleet: bool = False, brake: BrakePolicy | None = None,
                fleet_clock: Any = None, driver: str = "570.86.15", seed: int | None = None,
                fabric_domain: str = "", settle_seconds: float = 0.0, settle_max_seconds: float = 0.0,
                metrics: Any = None, node_watch: bool = False, fresh_seconds: float = 150.0) -> Agent:
    options = {k: v for k, v in locals().items() if k not in {"cluster", "server", "inventory", "populate_node",
                                                               "restore", "api_client"}}
    if populate_node:
        populate_any(cluster, inventory)
    apis = RawApi(api_client if api_client is not None else agent_client(server, inventory.name))
    seen = NodeCache(fresh_seconds=fresh_seconds)
    writer = NodeWriter(apis, inventory.name, taint_key=TAINT, seen=seen)
    evictor = Evictor(apis, deadline_seconds=deadline, **({"clock": clock} if clock else {}))
    budget = LeaseBudget(apis, node_name=inventory.name, namespace="gpu-health", max_nodes=max_nodes,
                         max_percent=max_percent, max_per_hour=max_per_hour,
                         rng=None if seed is None else random.Random(seed), node=writer,
                         **({"clock": budget_clock, "monotonic": budget_clock} if budget_clock else {}))
    stuck: list[str] = []
    actuator = K8sActuator(writer=writer, events=EventRecorder(apis, instance=f"{inventory.name}/test"),
                           evictor=evictor, reset=reset or (lambda uuid: (True, "fake reset")),
                           on_stuck=stuck.append, opt_out_label="gpu-health-agent.io/opt-out", diagnose=diagnose)
    # The GPUs each pod's processes run on, as NVML's process accounting tells the daemon's pod finder,
    # keyed by the UID the API server gave each pod (the real server assigns its own).
    by_key = {p.key: list(p.gpu_uuids) for p in inventory.pods}

    def held() -> dict[str, list[str]]:
        listed = [p["metadata"] for p in cluster.pods_on(inventory.name)]
        pods = {f"{m['namespace']}/{m['name']}": m["uid"] for m in listed}
        return {uid: by_key[key] for key, uid in pods.items() if key in by_key}

    side = ClusterSide(actuator, budget, PodFinder(apis, inventory.name, gpus_by_pod_uid=held), writer,
                       f"gpu-health/gpu-health-agent-{inventory.name}")
    claims_watch: ClaimsWatch | None = None
    if fleet or brake is not None:
        # Wall clocks behind every writer's: a hold is placed as just written; a quarantine's age on `wall`.
        wall = fleet_clock or (lambda: 1.0)
        monotonic = fleet_clock or time.monotonic
        claims_watch = ClaimsWatch(apis.api_client, "gpu-health", watch_seconds=60.0) \
            if brake is not None and node_watch else None
        claims = BrakeClaims(apis, node_name=inventory.name, namespace="gpu-health",
                             window_seconds=brake.window_seconds, monotonic=monotonic,
                             fabric_domain=lambda: fabric_domain,
                             delivered=claims_watch.through if claims_watch is not None else None) \
            if brake is not None else None
        side.fleet = FleetGate(apis, namespace="gpu-health", gpu_node_selector="nvidia.com/gpu.present=true",
                               brake=brake, holds=fleet, cache_seconds=0.0, count_seconds=0.0,
                               clock=monotonic, wall=wall, settle_seconds=settle_seconds,
                               settle_max_seconds=settle_max_seconds, claims=claims,
                               claim_retry_seconds=2 * retry_seconds, node=inventory.name,
                               rule_class=RULES.fault_class_of, fabric_domain=lambda: fabric_domain)
        side.summariser = actuator.summarise = Summariser(
            inventory.name, wall=wall, uptime=lambda: 86400.0, pods=lambda: inventory.pods,
            facts=lambda: NodeFacts(driver_version=driver, fabric_domain=fabric_domain))
        side.fleet.own = own_summary(side.summariser, writer)
        budget.units.read = side.fleet.units
        budget.census = side.fleet.census_gpu_nodes
    opened = Journal(journal) if journal is not None else None
    pipeline = Pipeline(rules=RULES, inventory=inventory, policy=GuardPolicy(mode=mode, dry_run=dry_run),
                        actuator=actuator, journal=opened, pods=side.pods.pods,
                        gate=budget, own_pod=side.own_pod, clock=lambda: 0.0,
                        retry_seconds=retry_seconds, max_faulty_gpus=max_faulty_gpus, diagnose=diagnose is not None,
                        fleet=side.fleet, rng=None if seed is None else random.Random(seed + 1), metrics=metrics)
    if restore:
        pipeline.start()
    agent = Agent(inventory, pipeline, actuator, side, evictor, opened, cluster, server, options)
    agent.stuck = stuck  # type: ignore[attr-defined]
    if node_watch:  # as the daemon runs it: its own thread, a change to the Node's inputs wakes a pass
        agent.watch, agent.watch_stop = NodeWatch(apis.api_client, inventory.name, seen), threading.Event()
        threading.Thread(target=agent.watch.run, args=(agent.watch_stop, pipeline.wake.set), daemon=True,
                         name=f"node-watch-{inventory.name}").start()
        if claims_watch is not None:
            agent.claims_watch = claims_watch
            threading.Thread(target=claims_watch.run, args=(agent.watch_stop,), daemon=True,
                             name=f"claims-watch-{inventory.name}").start()
    return agent


def restart(agent: Agent | None, *, cluster: FakeCluster | None = None, server: FakeApiServer | None = None,
            inventory: NodeInventory | None = None) -> Agent:
    """A new agent process on the same node: same journal file (if any), same Node, a fresh memory."""
    options = dict(agent.options or {}) if agent is not None else {}
    if agent is not None:
        agent.close()
        cluster, server = cluster or agent.cluster, server or agent.server
        inventory = inventory or agent.inventory
    assert cluster is not None and server is not None and inventory is not None
    return make_agent(cluster, server, inventory, populate_node=False, restore=True, **options)

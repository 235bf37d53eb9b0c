"""Builds agents that act on a FakeCluster through the real client, for the remediation tests."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from agent.engine import builtin_rules_dir, load_rules
from agent.fakecluster import FakeApiServer, FakeCluster, populate
from agent.k8s.actuator import K8sActuator
from agent.k8s.budget import LeaseBudget
from agent.k8s.client import Apis, client_for
from agent.k8s.cluster import ClusterSide
from agent.k8s.events import EventRecorder
from agent.k8s.evictions import Evictor
from agent.k8s.node import NodeWriter
from agent.k8s.pods import PodFinder
from agent.model import GpuRef, NodeInventory, Observation, PodRef, Signal
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy, Mode

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

    def fault(self, gpu: int, xid: int = 79, at: float = 1.0):
        return self.pipeline.handle(Observation(Signal.XID, xid, at, "kmsg", self.inventory.gpus[gpu]), at)


def start_cluster() -> tuple[FakeCluster, FakeApiServer]:
    cluster = FakeCluster()
    return cluster, FakeApiServer(cluster).start()


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


def make_agent(cluster: Any, server: Any, inventory: NodeInventory, *,
               mode: Mode = Mode.REMEDIATE, populate_node: bool = True, max_nodes: int = 1,
               max_percent: float = 10, deadline: float = 600.0, clock=None, reset=None,
               restore: bool = False, retry_seconds: float = 30.0, max_faulty_gpus: int = 2) -> Agent:
    if populate_node:
        populate_any(cluster, inventory)
    apis = Apis.of(agent_client(server, inventory.name))
    writer = NodeWriter(apis.core, inventory.name, taint_key=TAINT)
    evictor = Evictor(apis.core, deadline_seconds=deadline, **({"clock": clock} if clock else {}))
    budget = LeaseBudget(apis, node_name=inventory.name, namespace="gpu-health", max_nodes=max_nodes,
                         max_percent=max_percent, opt_out_label="gpu-health-agent.io/opt-out")
    stuck: list[str] = []
    actuator = K8sActuator(writer=writer, events=EventRecorder(apis.events, instance=f"{inventory.name}/test"),
                           evictor=evictor, budget=budget, reset=reset or (lambda uuid: (True, "fake reset")),
                           on_stuck=stuck.append)
    side = ClusterSide(actuator, budget, PodFinder(apis.core, inventory.name), writer,
                       f"gpu-health/gpu-health-agent-{inventory.name}")
    node_state, saved = side.restored(TAINT) if restore else (None, [])
    pipeline = Pipeline(rules=RULES, inventory=inventory, policy=GuardPolicy(mode=mode), actuator=actuator,
                        gate=budget, node_state=node_state, own_pod=side.own_pod, clock=lambda: 0.0,
                        retry_seconds=retry_seconds, max_faulty_gpus=max_faulty_gpus)
    if restore:
        pipeline.restore_from_node(saved)
    agent = Agent(inventory, pipeline, actuator, side, evictor)
    agent.stuck = stuck  # type: ignore[attr-defined]
    return agent

"""Assembles the cluster side of the agent from its configuration: actuator, budget gate, pods, node sync."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.config import Config
from agent.k8s.actuator import K8sActuator, command_reset_runner, saved_verdicts
from agent.k8s.budget import LeaseBudget
from agent.k8s.client import Apis
from agent.k8s.events import EventRecorder
from agent.k8s.evictions import Evictor
from agent.k8s.node import RELEASE_ANNOTATION, NodeWriter, saved_faults
from agent.k8s.pods import PodFinder
from agent.model import NODE_KEY, GpuRef, Observation, Signal, Verdict, frozen_attrs
from agent.remediation.planner import NodeState


@dataclass(slots=True)
class ClusterSide:
    """What the daemon needs from the cluster, built once at start."""

    actuator: K8sActuator
    gate: LeaseBudget
    pods: PodFinder
    writer: NodeWriter
    own_pod: str

    def restored(self, taint_key: str) -> tuple[NodeState, list[Verdict]]:
        """The node's own record of the agent's marks and active faults (the truth across restarts)."""
        view = self.writer.read()
        return view.node_state(taint_key), saved_verdicts(saved_faults(view))

    def sync(self, now: float) -> list[Observation]:
        """Reads the node: an operator's release annotation becomes an observation, and is consumed."""
        view = self.writer.read()
        release = view.annotations.get(RELEASE_ANNOTATION)
        if not release:
            return []
        target = release.split("@", 1)[0].strip() or "all"
        self.writer.set_metadata(annotations={RELEASE_ANNOTATION: None})
        gpu = None if target in {"all", NODE_KEY} else GpuRef(uuid=target)
        return [Observation(Signal.OPERATOR_RELEASE, 1, now, "operator", gpu,
                            frozen_attrs({"by": f"annotation {RELEASE_ANNOTATION}"}))]


def build_cluster_side(api_client: Any, config: Config, *, on_stuck: Callable[[str], None],
                       on_budget: Callable[[int, int], None] = lambda in_use, limit: None,
                       clock: Callable[[], float] = time.time) -> ClusterSide:
    settings = config.remediation
    apis = Apis.of(api_client)
    writer = NodeWriter(apis.core, config.node_name, taint_key=settings.taint_key,
                        taint_effect=settings.taint_effect, cordon=settings.cordon)
    own_pod = f"{os.environ.get('POD_NAMESPACE', settings.namespace)}/{os.environ.get('POD_NAME', '')}"
    actuator = K8sActuator(
        writer=writer,
        events=EventRecorder(apis.events, instance=f"{config.node_name}/{os.environ.get('POD_NAME', 'agent')}"),
        evictor=Evictor(apis.core, deadline_seconds=settings.eviction_deadline_seconds),
        budget=LeaseBudget(apis, node_name=config.node_name, namespace=settings.namespace,
                           max_nodes=settings.budget_max_nodes, max_percent=settings.budget_max_percent,
                           gpu_node_selector=settings.gpu_node_selector, opt_out_label=settings.opt_out_label,
                           clock=clock, on_usage=on_budget),
        reset=command_reset_runner(settings.reset_command, timeout_seconds=settings.reset_timeout_seconds),
        reboot_sentinel=settings.reboot_sentinel_path,
        on_stuck=on_stuck,
    )
    pods = PodFinder(apis.core, config.node_name, socket_path=settings.pod_resources_socket)
    return ClusterSide(actuator, actuator.budget, pods, writer, own_pod)


def request_release(api_client: Any, node_name: str, gpu: str = "all") -> None:
    """What `gpu-health-agent release` does: annotate the Node; its agent consumes the annotation."""
    writer = NodeWriter(Apis.of(api_client).core, node_name, taint_key="")
    writer.set_metadata(annotations={RELEASE_ANNOTATION: f"{gpu}@{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"})

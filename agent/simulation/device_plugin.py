"""The simulation wing's NVIDIA device plugin health check: a GPU that logs a critical Xid is marked Unhealthy,
and the kubelet then offers it no more (PodResources' allocatable devices leave it out; the Node's allocatable
drops below its capacity), as the k8s-device-plugin's NVML event watch does (every Xid but the application ones
it skips). The agent reads which GPUs are still offered to know one is withheld without a node taint
(docs/remediation.md, quarantine mode)."""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.model import NodeInventory, Observation, Signal
from agent.simulation.fake_apiserver.resources import RESOURCES
from agent.simulation.fake_apiserver.store import FakeCluster

#: The Xids the device plugin does not mark a GPU Unhealthy for (application errors: its skipped list).
SKIPPED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
RESOURCE = "nvidia.com/gpu"
_NODES = next(r for r in RESOURCES if r.plural == "nodes")


@dataclass(slots=True)
class SimulatedDevicePlugin:
    cluster: FakeCluster
    node: NodeInventory
    unhealthy: set[str] = field(default_factory=set)

    def observe(self, observation: Observation) -> None:
        """A critical Xid on one of the node's GPUs: that GPU Unhealthy, the Node's allocatable one fewer; a new
        boot starts the plugin afresh, every GPU healthy (it re-checks a GPU only when its pod restarts)."""
        if observation.signal is Signal.BOOT and self.unhealthy:
            self.unhealthy.clear()
            self._offer()
            return
        gpu = observation.gpu
        if observation.signal is not Signal.XID or int(observation.value) in SKIPPED_XIDS or gpu is None \
                or not gpu.uuid or gpu.uuid in self.unhealthy:
            return
        self.unhealthy.add(gpu.uuid)
        self._offer()

    def allocatable(self) -> dict[str, list[str]]:
        """The kubelet's allocatable devices, as PodResources' GetAllocatableResources lists them: the healthy GPUs
        by UUID (the plugin's default device IDs)."""
        return {RESOURCE: [g.uuid for g in self.node.gpus if g.uuid not in self.unhealthy]}

    def _offer(self) -> None:
        self.cluster.patch(_NODES, "", self.node.name, "application/merge-patch+json",
                           {"status": {"allocatable": {RESOURCE: str(len(self.node.gpus) - len(self.unhealthy))}}},
                           subresource="status")

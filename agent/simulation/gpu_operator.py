"""The simulation wing's GPU Operator node: the operands' DaemonSet pods come and go with their per-node
`nvidia.com/gpu.deploy.<operand>` labels (as the DaemonSet controller makes them), and a GPU's holders are what
nvidia-smi would find: the running operands (they hold every GPU), the pods the GPU is allocated to, and the
agent's own NVML session unless released, and the host's processes the procedure cannot stop (nv-hostengine, a
host dcgm-exporter: `host_holders`). The simulated nvidia-smi refuses to reset a GPU anyone holds, and one whose
persistence mode is on (nvidia-persistenced's attachment, on where the node says `persistence_mode`), in the
driver's words ("In use by another client", as NVSentinel #1690 shows it); `-pm 0|1` and the persistence-mode
query answer as nvidia-smi does."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.model import NodeInventory
from agent.simulation.fake_apiserver.resources import RESOURCES
from agent.simulation.fake_apiserver.store import FakeCluster

NAMESPACE = "gpu-operator"
#: Operand label -> its DaemonSet (GPU Operator names); all four hold every GPU of the node open.
OPERANDS = {
    "nvidia.com/gpu.deploy.device-plugin": "nvidia-device-plugin-daemonset",
    "nvidia.com/gpu.deploy.gpu-feature-discovery": "gpu-feature-discovery",
    "nvidia.com/gpu.deploy.dcgm-exporter": "nvidia-dcgm-exporter",
    "nvidia.com/gpu.deploy.dcgm": "nvidia-dcgm",
}
#: The operands of a node in the GPU Operator's DRA mode (26.x: GPUCluster, or ClusterPolicy.spec.draDriver): the
#: DRA driver's kubelet plugin, selecting nvidia.com/gpu.deploy.dra-driver, in the device plugin's place.
DRA_OPERANDS = {**{k: v for k, v in OPERANDS.items() if k != "nvidia.com/gpu.deploy.device-plugin"},
                "nvidia.com/gpu.deploy.dra-driver": "nvidia-dra-driver-gpu-kubelet-plugin"}
_PODS = next(r for r in RESOURCES if r.plural == "pods")


@dataclass(slots=True)
class SimulatedNvml:
    """The agent's NVML session in a simulation: it holds every GPU unless released for a reset."""

    held: bool = True

    def processes_on(self, uuid: str) -> list[int]:
        return []  # the simulated nvidia-smi names the pods that hold the GPU itself

    def release_for_reset(self) -> None:
        self.held = False

    def reacquire_after_reset(self, reset_uuid: str = "") -> None:
        self.held = True


@dataclass(frozen=True, slots=True)
class HostHolder:
    """A host process holding one GPU open that no operand label stops, until a virtual time (None: for ever)."""

    uuid: str
    name: str
    until: float | None = None


@dataclass(slots=True)
class SimulatedGpuOperator:
    cluster: FakeCluster
    node: NodeInventory
    nvml: SimulatedNvml = field(default_factory=SimulatedNvml)
    resets: list[str] = field(default_factory=list)
    #: The GPUs whose persistence mode is on (nvidia-persistenced in the driver pod keeps it on for all).
    persistent: set[str] = field(default_factory=set)
    host_holders: tuple[HostHolder, ...] = ()
    clock: Callable[[], float] = lambda: 0.0
    #: Operand label -> DaemonSet of the operands running on the node (DRA_OPERANDS in the DRA mode).
    operands: Mapping[str, str] = field(default_factory=lambda: dict(OPERANDS))

    def install(self) -> None:
        """The operator's labels on the node (all `true`) and its operands' pods running there."""
        self.cluster.add("namespaces", {"metadata": {"name": NAMESPACE}})
        node = self.cluster.node(self.node.name)
        labels = {**node["metadata"].get("labels", {}), **dict.fromkeys(self.operands, "true")}
        self.cluster.patch(next(r for r in RESOURCES if r.plural == "nodes"), "", self.node.name,
                           "application/merge-patch+json", {"metadata": {"labels": labels}})
        self.reconcile()

    def reconcile(self) -> None:
        """The DaemonSet controller: an operand's pod where its label is `true`, none where it is not."""
        labels = self.cluster.node(self.node.name)["metadata"].get("labels", {})
        running = {p["metadata"]["name"] for p in self.cluster.pods_on(self.node.name)
                   if p["metadata"]["namespace"] == NAMESPACE}
        for label, daemonset in self.operands.items():
            name = f"{daemonset}-{self.node.name}"
            if labels.get(label) == "true" and name not in running:
                self.cluster.add("pods", _operand_pod(self.node.name, name, daemonset, label), namespace=NAMESPACE)
            elif labels.get(label) != "true" and name in running:
                self.cluster.delete(_PODS, NAMESPACE, name)
                self.cluster.finish_termination(NAMESPACE, name)

    def holders(self, uuid: str) -> list[str]:
        pods = {f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in self.cluster.pods_on(self.node.name)}
        held = sorted(p for p in pods if p.startswith(f"{NAMESPACE}/"))
        held += sorted(p.key for p in self.node.pods if p.holds(uuid) and p.key in pods)
        now = self.clock()
        host = [f"host {h.name}" for h in self.host_holders if h.uuid == uuid and (h.until is None or now < h.until)]
        return [*held, *host, *(["the agent's NVML session"] if self.nvml.held else [])]

    def nvidia_smi(self, uuid: str) -> tuple[bool, str]:
        """`nvidia-smi --gpu-reset -i UUID` on this node: refused while anything holds the GPU or its persistence
        mode is on, as the real one words it."""
        self.reconcile()
        holders = [*(["nvidia-persistenced (persistence mode on)"] if uuid in self.persistent else []),
                   *self.holders(uuid)]
        if holders:
            return False, (f"nvidia-smi exit 255: The following GPUs could not be reset: {self._bus(uuid)}: In use by "
                           f"another client (simulated holders: {', '.join(holders)})")
        self.resets.append(uuid)
        return True, f"nvidia-smi exit 0: {self._bus(uuid)} was successfully reset (simulated)"

    def persistence(self, uuid: str, args: Sequence[str]) -> tuple[int, str]:
        """nvidia-smi's persistence-mode query, `-pm 0` and `-pm 1` for one GPU (agent/gpu/reset.py PERSISTENCE_*)."""
        if args and args[0].startswith("--query-gpu=persistence_mode"):
            return 0, "Enabled" if uuid in self.persistent else "Disabled"
        if len(args) >= 2 and args[0] == "-pm":
            if args[1] == "1":
                self.persistent.add(uuid)
            else:
                self.persistent.discard(uuid)
            return 0, f"{'Enabled' if args[1] == '1' else 'Disabled'} persistence mode for GPU {self._bus(uuid)}.\n" \
                      "All done."
        return 2, f"unsupported arguments {list(args)}"

    def _bus(self, uuid: str) -> str:
        return next((f"GPU {g.pci_bus_id}" for g in self.node.gpus if g.uuid == uuid), uuid)


def _operand_pod(node: str, name: str, daemonset: str, label: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": daemonset},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": daemonset,
                                          "uid": f"owner-{daemonset}", "controller": True}]},
        "spec": {"nodeName": node, "nodeSelector": {label: "true"},
                 "containers": [{"name": "main", "image": f"nvcr.io/nvidia/{daemonset}:simulated"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }

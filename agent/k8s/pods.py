"""Which pods of this node hold which GPU: the kubelet's PodResources first, else every GPU pod."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from agent.k8s.bodies import OwnerReference, PodSpec, as_pod_list
from agent.k8s.podresources import PodDevices, allocatable_devices, list_pod_devices, offered_gpus
from agent.k8s.raw import RawApi, api_path
from agent.k8s.retry import with_retries
from agent.logs import get_logger
from agent.model import ANY_GPU, PodRef
from agent.workloads import owner_key

MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
T = TypeVar("T")
log = get_logger("agent.k8s.pods")
DraGpus = Callable[[set[str], dict[tuple[str, str], list[tuple[str, str, str]]]], dict[tuple[str, str], set[str]]]


class PodFinder:
    """Lists the node's pods through the API and asks the kubelet which GPU each one holds."""

    def __init__(self, raw: RawApi, node_name: str, *, socket_path: str = "",
                 pod_devices: Callable[[str], list[PodDevices]] = list_pod_devices,
                 gpus_by_pod_uid: Callable[[], dict[str, list[str]]] | None = None,
                 mig_parents: Callable[[], dict[str, str]] | None = None,
                 dra_gpus: DraGpus | None = None,
                 allocatable: Callable[[], dict[str, list[str]]] | None = None) -> None:
        self.raw = raw
        self.node = node_name
        self.socket_path = socket_path
        self.pod_devices = pod_devices
        self.gpus_by_pod_uid = gpus_by_pod_uid
        self.mig_parents = mig_parents
        #: GPUs held through DRA (allocated ResourceClaims, PodResources' dynamic resources), by pod.
        self.dra_gpus = dra_gpus
        #: The kubelet's allocatable devices by resource (None: PodResources' GetAllocatableResources on the socket).
        self.allocatable = allocatable
        self._claimed: dict[tuple[str, str], list[tuple[str, str, str]]] = {}
        #: pod UID -> its workload (attribution.owner_key), as of the last listing; read by the kernel-log
        #: source to charge an Xid to a workload rather than to one pod or PID.
        self.owners: dict[str, str] = {}

    def pods(self) -> tuple[PodRef, ...]:
        listed = as_pod_list(with_retries(lambda: self.raw.get(
            api_path("", "v1", "pods"), query={"fieldSelector": f"spec.nodeName={self.node}"})))
        items = listed.get("items") or []
        devices = self._devices()
        by_process = self.gpus_by_pod_uid() if devices is None and self.gpus_by_pod_uid else {}
        namespaces = {str(i.get("metadata", {}).get("namespace", "")) for i in items}
        through_dra = self.dra_gpus(namespaces, self._claimed) if self.dra_gpus else {}
        pods = []
        owners: dict[str, str] = {}
        for item in items:
            meta, spec = item.get("metadata", {}), item.get("spec", {})
            if item.get("status", {}).get("phase") in {"Succeeded", "Failed"}:
                continue
            if MIRROR_ANNOTATION in (meta.get("annotations") or {}):
                continue  # static pods cannot be evicted through the API
            key = (meta.get("namespace", ""), meta.get("name", ""))
            gpus: tuple[str, ...] = ()
            if devices is not None and key in devices:
                gpus = self._with_parents(devices[key])
            elif _requests_gpu(spec):
                # Without the kubelet: the GPUs its processes run on, else it may hold any GPU.
                gpus = tuple(by_process.get(meta.get("uid", ""), ())) or (ANY_GPU,)
            if key in through_dra:
                gpus = tuple(sorted({*gpus, *through_dra[key]} - {ANY_GPU}))
            references = meta.get("ownerReferences") or []
            daemonset = any(o.get("kind") == "DaemonSet" and o.get("controller") for o in references)
            owner = _owner_of(key[0], references, spec)
            owners[meta.get("uid", "")] = owner
            pods.append(PodRef(key[0], key[1], meta.get("uid", ""), gpus, daemonset, owner=owner,
                               terminating=bool(meta.get("deletionTimestamp"))))
        self.owners = owners
        return tuple(pods)

    def offered(self) -> frozenset[str] | None:
        """The GPUs the kubelet may still give a new pod (its device plugins' healthy devices: NVIDIA's holds a
        GPU back after an Xid critical error); None where that cannot be told (no kubelet socket, no answer,
        device IDs that name no GPU)."""
        devices = self.allocatable() if self.allocatable is not None else self._ask_kubelet(allocatable_devices)
        return None if devices is None else offered_gpus(devices, self.mig_parents() if self.mig_parents else {})

    def _ask_kubelet(self, ask: Callable[[str], T]) -> T | None:
        """`ask` of the kubelet's PodResources socket; None where there is none, or no answer (said as a warning)."""
        if not self.socket_path or not os.path.exists(self.socket_path):
            return None
        try:
            return ask(self.socket_path)
        except OSError as exc:
            log.warning("pod_resources_unavailable", error=str(exc))
            return None

    def _with_parents(self, ids: list[str]) -> tuple[str, ...]:
        """A MIG device also names the GPU it is a slice of, so a fault on that GPU finds the pod."""
        parents = self.mig_parents() if self.mig_parents else {}
        return tuple(sorted({*ids, *(parents[i] for i in ids if i in parents)}))

    def _devices(self) -> dict[tuple[str, str], list[str]] | None:
        listed = self._ask_kubelet(self.pod_devices)
        if listed is None:
            return None
        self._claimed = {(p.namespace, p.name): p.claimed for p in listed if p.claimed}
        return {(p.namespace, p.name): p.gpu_ids() for p in listed if p.gpu_ids()}


def _owner_of(namespace: str, references: list[OwnerReference], spec: PodSpec) -> str:
    """The pod's workload: its controller (a ReplicaSet is its Deployment), else its first image."""
    controller = next((o for o in references if o.get("controller")), OwnerReference())
    containers = spec.get("containers") or []
    image = str(containers[0].get("image") or "") if containers else ""
    return owner_key(namespace, owner_kind=str(controller.get("kind") or ""),
                     owner_name=str(controller.get("name") or ""), image=image)


def _requests_gpu(spec: PodSpec) -> bool:
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.get("resources") or {}
        for names in (resources.get("limits") or {}, resources.get("requests") or {}):
            if any(name.startswith("nvidia.com/") for name in names):
                return True
    return False

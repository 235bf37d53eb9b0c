"""Puts a GPU node and the pods holding its GPUs into a FakeCluster, as a kubelet and scheduler would."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.model import NodeInventory
from agent.simulation.fake_apiserver.resources import RESOURCES, now_rfc3339
from agent.simulation.fake_apiserver.store import FakeCluster

DRA_DRIVER = "gpu.nvidia.com"
_NAMESPACES = next(r for r in RESOURCES if r.plural == "namespaces")


def populate(cluster: FakeCluster, node: NodeInventory, *, gpu_label: str = "nvidia.com/gpu.present",
             dra: bool = False, labels: Mapping[str, str] | None = None) -> None:
    """The node (Ready, with its GPUs as capacity, and `labels`) and every pod of the inventory, Running and
    Ready. With `dra` the GPUs are published in a ResourceSlice as NVIDIA's DRA driver does, and each pod
    holds its GPUs through a ResourceClaim allocated and reserved for it, as the scheduler leaves it."""
    cluster.add("nodes", {
        "metadata": {"name": node.name, "labels": {gpu_label: "true", "kubernetes.io/hostname": node.name,
                                                   **(labels or {})}},
        "spec": {},
        "status": {
            "capacity": {"nvidia.com/gpu": str(len(node.gpus)), "cpu": "192", "memory": "2Ti"},
            "allocatable": {"nvidia.com/gpu": str(len(node.gpus)), "cpu": "190", "memory": "2000Gi"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status", "lastHeartbeatTime": now_rfc3339(),
                            "lastTransitionTime": now_rfc3339()}],
        },
    })
    existing = {n["metadata"]["name"] for n in cluster.list_objects(_NAMESPACES, None)}
    for namespace in sorted({p.namespace for p in node.pods} - existing):
        cluster.add("namespaces", {"metadata": {"name": namespace}})
    daemonsets = next(r for r in RESOURCES if r.plural == "daemonsets")
    existing_ds = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in cluster.list_objects(daemonsets, None)}
    for owner in sorted({(p.namespace, p.name.rsplit("-", 1)[0]) for p in node.pods if p.daemonset} - existing_ds):
        cluster.add("daemonsets", {"metadata": {"name": owner[1], "namespace": owner[0]},
                                   "spec": {"selector": {"matchLabels": {"app": owner[1]}}}},
                    group="apps", namespace=owner[0])
    if dra:
        _publish(cluster, node)
    for pod in node.pods:
        manifest = _pod(node.name, pod.namespace, pod.name, pod.uid, () if dra else pod.gpu_uuids, pod.daemonset)
        if dra and pod.gpu_uuids:
            _claim(cluster, node, pod.namespace, pod.name, pod.uid, pod.gpu_uuids)
            manifest["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": f"{pod.name}-gpu"}]
            manifest["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
        cluster.add("pods", manifest, namespace=pod.namespace)


def _publish(cluster: FakeCluster, node: NodeInventory) -> None:
    devices = [{"name": f"gpu-{g.index}", "attributes": {
        "type": {"string": "gpu"}, "uuid": {"string": g.uuid}, "index": {"int": g.index},
        "productName": {"string": g.model}, "pcieBusID": {"string": g.pci_bus_id}}} for g in node.gpus]
    cluster.add("resourceslices", {
        "metadata": {"name": f"{node.name}-{DRA_DRIVER}"},
        "spec": {"driver": DRA_DRIVER, "nodeName": node.name,
                 "pool": {"name": node.name, "generation": 1, "resourceSliceCount": 1}, "devices": devices},
    }, group="resource.k8s.io")


def _claim(cluster: FakeCluster, node: NodeInventory, namespace: str, pod: str, uid: str,
           gpus: tuple[str, ...]) -> None:
    results = [{"request": "gpu", "driver": DRA_DRIVER, "pool": node.name, "device": f"gpu-{g.index}"}
               for g in node.gpus if g.uuid in gpus]
    cluster.add("resourceclaims", {
        "metadata": {"name": f"{pod}-gpu", "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRA_DRIVER,
                                                                      "count": len(results)}}]}},
        "status": {"allocation": {"devices": {"results": results}},
                   "reservedFor": [{"resource": "pods", "name": pod, "uid": uid}]},
    }, group="resource.k8s.io", namespace=namespace)


def _pod(node: str, namespace: str, name: str, uid: str, gpus: tuple[str, ...], daemonset: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid, "labels": {"app": name.rsplit("-", 1)[0]}}
    owner = ("apps/v1", "DaemonSet") if daemonset else ("batch/v1", "Job")
    meta["ownerReferences"] = [{"apiVersion": owner[0], "kind": owner[1], "name": name.rsplit("-", 1)[0],
                                "uid": f"owner-{name.rsplit('-', 1)[0]}", "controller": True}]
    resources = {"limits": {"nvidia.com/gpu": str(len(gpus))}} if gpus else {}
    return {
        "metadata": meta,
        "spec": {"nodeName": node,
                 "containers": [{"name": "main", "image": "example/trainer:1", "resources": resources}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }

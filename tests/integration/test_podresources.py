"""The kubelet PodResources client over a real gRPC unix socket, against a fake kubelet."""

from pathlib import Path

import pytest

from agent.k8s.podresources import (
    ALLOCATABLE_METHOD,
    LIST_METHOD,
    PodDevices,
    allocatable_devices,
    decode_allocatable_response,
    decode_list_response,
    encode_allocatable_response,
    encode_list_response,
    list_pod_devices,
)
from agent.k8s.pods import PodFinder
from agent.model import ANY_GPU
from tests.fake_kubelet import serving_kubelet

KUBELET_PODS = [
    PodDevices("ml", "trainer-0", {"nvidia.com/gpu": ["GPU-aaaa", "GPU-bbbb"]}),
    PodDevices("ml", "shared-0", {"nvidia.com/gpu": ["GPU-cccc::0", "GPU-cccc::3"]}),
    PodDevices("ml", "mig-0", {"nvidia.com/mig-1g.10gb": ["MIG-dddd"]}),
    PodDevices("kube-system", "cni", {}),
]
#: What the kubelet may still hand out: GPU-bbbb is gone (its device plugin reports it Unhealthy).
KUBELET_ALLOCATABLE = {"nvidia.com/gpu": ["GPU-aaaa", "GPU-cccc::0", "GPU-cccc::1"],
                       "nvidia.com/mig-1g.10gb": ["MIG-dddd"], "example.com/nic": ["nic-0"]}


@pytest.fixture
def kubelet(tmp_path: Path):
    socket = tmp_path / "kubelet.sock"
    with serving_kubelet(socket, KUBELET_PODS, KUBELET_ALLOCATABLE):
        yield socket


def test_the_wire_format_round_trips():
    decoded = decode_list_response(encode_list_response(KUBELET_PODS))
    assert [(p.namespace, p.name, p.devices) for p in decoded] == [
        (p.namespace, p.name, p.devices) for p in KUBELET_PODS]
    assert LIST_METHOD == "/v1.PodResourcesLister/List"


def test_the_kubelet_says_which_pod_holds_which_gpu(kubelet):
    pods = {(p.namespace, p.name): p.gpu_ids() for p in list_pod_devices(str(kubelet))}
    assert pods[("ml", "trainer-0")] == ["GPU-aaaa", "GPU-bbbb"]
    assert pods[("ml", "shared-0")] == ["GPU-cccc"]  # time-sliced replicas belong to their GPU
    assert pods[("ml", "mig-0")] == ["MIG-dddd"]
    assert pods[("kube-system", "cni")] == []


def test_the_allocatable_wire_format_round_trips():
    """An AllocatableResourcesResponse's devices decode as they were encoded, by resource."""
    assert decode_allocatable_response(encode_allocatable_response(KUBELET_ALLOCATABLE)) == KUBELET_ALLOCATABLE
    assert ALLOCATABLE_METHOD == "/v1.PodResourcesLister/GetAllocatableResources"


def test_the_kubelet_says_which_gpus_it_may_still_hand_out(kubelet):
    """GetAllocatableResources over the socket: its devices by resource, the unhealthy one left out."""
    assert allocatable_devices(str(kubelet)) == KUBELET_ALLOCATABLE


def test_the_offered_gpus_are_the_kubelets_allocatable_ones_by_gpu(kubelet):
    """PodFinder.offered: each allocatable nvidia.com/ device's GPU (a replica as its GPU, a MIG device as itself
    and its parent); the unhealthy GPU-bbbb not among them; other vendors' devices ignored."""
    finder = PodFinder(_Core([]), "n1", socket_path=str(kubelet), mig_parents=lambda: {"MIG-dddd": "GPU-eeee"})
    assert finder.offered() == {"GPU-aaaa", "GPU-cccc", "MIG-dddd", "GPU-eeee"}


def test_without_the_kubelet_which_gpus_are_offered_is_not_known(tmp_path: Path):
    """No socket: None (the planner then keeps the node taint rather than guess)."""
    assert PodFinder(_Core([]), "n1", socket_path=str(tmp_path / "none.sock")).offered() is None


def test_an_absent_kubelet_is_an_os_error(tmp_path: Path):
    with pytest.raises(OSError):
        list_pod_devices(str(tmp_path / "none.sock"), timeout_seconds=0.5)


class _Core:
    """The API's pod list for node n1, as RawApi.get returns it."""

    def __init__(self, items):
        self.items = items

    def get(self, path, *, query=None):
        assert path == "/api/v1/pods" and query == {"fieldSelector": "spec.nodeName=n1"}
        return {"items": self.items}


IMAGE = "nvcr.io/nvidia/pytorch:24.05-py3"


def _pod(ns, name, gpus=0, **meta):
    resources = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
    return {"metadata": {"namespace": ns, "name": name, "uid": f"u-{name}", **meta},
            "spec": {"containers": [{"name": "c", "image": IMAGE, "resources": resources}]},
            "status": {"phase": "Running"}}


def test_pods_take_their_gpus_from_the_kubelet(kubelet):
    core = _Core([_pod("ml", "trainer-0", 2), _pod("kube-system", "cni")])
    pods = {p.key: p for p in PodFinder(core, "n1", socket_path=str(kubelet)).pods()}
    assert pods["ml/trainer-0"].gpu_uuids == ("GPU-aaaa", "GPU-bbbb")
    assert pods["kube-system/cni"].gpu_uuids == ()


def test_without_the_kubelet_every_gpu_pod_may_hold_any_gpu(tmp_path: Path):
    core = _Core([_pod("ml", "trainer-0", 2), _pod("ml", "cpu-only"),
                  _pod("kube-system", "static", annotations={"kubernetes.io/config.mirror": "x"}),
                  _pod("gpu-health", "agent-x", ownerReferences=[{"kind": "DaemonSet", "controller": True}])])
    pods = {p.key: p for p in PodFinder(core, "n1", socket_path=str(tmp_path / "none.sock")).pods()}
    assert pods["ml/trainer-0"].gpu_uuids == (ANY_GPU,)
    assert pods["ml/cpu-only"].gpu_uuids == ()
    assert "kube-system/static" not in pods
    assert pods["gpu-health/agent-x"].daemonset


def test_each_pod_is_charged_to_its_workload_for_the_kernel_log(tmp_path: Path):
    """A Deployment's pod is its Deployment (not its ReplicaSet); a bare pod is its image without the tag."""
    core = _Core([_pod("ml", "trainer-7d4b9c6f5-x2x9z", 1,
                       ownerReferences=[{"kind": "ReplicaSet", "name": "trainer-7d4b9c6f5", "controller": True}]),
                  _pod("ml", "notebook", 1)])
    finder = PodFinder(core, "n1", socket_path=str(tmp_path / "none.sock"))
    pods = {p.key: p for p in finder.pods()}
    assert pods["ml/trainer-7d4b9c6f5-x2x9z"].owner == "ml/Deployment/trainer"
    assert pods["ml/notebook"].owner == "image/nvcr.io/nvidia/pytorch"
    assert finder.owners == {"u-trainer-7d4b9c6f5-x2x9z": "ml/Deployment/trainer",
                             "u-notebook": "image/nvcr.io/nvidia/pytorch"}


def test_without_the_kubelet_nvml_processes_name_the_gpu(tmp_path: Path):
    core = _Core([_pod("ml", "trainer-0", 2), _pod("ml", "idle", 1)])
    finder = PodFinder(core, "n1", socket_path=str(tmp_path / "none.sock"),
                       gpus_by_pod_uid=lambda: {"u-trainer-0": ["GPU-aaaa"]})
    pods = {p.key: p for p in finder.pods()}
    assert pods["ml/trainer-0"].gpu_uuids == ("GPU-aaaa",)
    assert pods["ml/idle"].gpu_uuids == (ANY_GPU,)


def test_a_pod_on_a_mig_slice_is_found_on_its_gpu(kubelet):
    core = _Core([_pod("ml", "mig-0", 1)])
    finder = PodFinder(core, "n1", socket_path=str(kubelet), mig_parents=lambda: {"MIG-dddd": "GPU-parent"})
    [pod] = finder.pods()
    assert pod.gpu_uuids == ("GPU-parent", "MIG-dddd")
    assert pod.holds("GPU-parent")

"""The kubelet's PodResources API (gRPC on a unix socket, agent.k8s.grpc_unary): which container holds which GPU.

The messages are decoded by hand from their protobuf wire format (k8s.io/kubelet podresources/v1:
ListPodResourcesResponse{pod_resources=1}, PodResources{name=1, namespace=2, containers=3},
ContainerResources{name=1, devices=2, dynamic_resources=5}, ContainerDevices{resource_name=1, device_ids=2},
DynamicResource{claim_name=2, claim_namespace=3, claim_resources=4},
ClaimResource{driver_name=2, pool_name=3, device_name=4}; AllocatableResourcesResponse{devices=1}, the devices
the kubelet may still hand out: its device plugins' healthy ones), so no code generator is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from agent.protowire import ProtobufError
from agent.protowire import fields as _fields
from agent.protowire import length_field as _field
from agent.protowire import text as _text

T = TypeVar("T")
LIST_METHOD = "/v1.PodResourcesLister/List"
ALLOCATABLE_METHOD = "/v1.PodResourcesLister/GetAllocatableResources"
#: Device IDs NVIDIA's device plugin gives with its default `uuid` strategy (a MIG device's own UUID under the
#: mixed strategy); its `index` strategy's IDs ("0", "1") say no GPU's identity.
GPU_ID_PREFIXES = ("GPU-", "MIG-")
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
#: The kubelet's own PodResources client allows answers up to 16 MiB (a node with many pods).
MAX_ANSWER_BYTES = 16 * 1024 * 1024
GPU_RESOURCE_PREFIXES = ("nvidia.com/gpu", "nvidia.com/mig-")


@dataclass(slots=True)
class PodDevices:
    namespace: str
    name: str
    devices: dict[str, list[str]] = field(default_factory=dict)
    # Devices held through DRA ResourceClaims, as (driver, pool, device): a GPU allocated by a claim is
    # not listed under `devices`, only here.
    claimed: list[tuple[str, str, str]] = field(default_factory=list)

    def gpu_ids(self) -> list[str]:
        """GPU UUIDs (and MIG device UUIDs) of every container; time-sliced replicas `UUID::N` give `UUID`."""
        ids: list[str] = []
        for resource, device_ids in self.devices.items():
            if resource.startswith(GPU_RESOURCE_PREFIXES) or resource.startswith("nvidia.com/"):
                ids.extend(device_id.split("::", 1)[0] for device_id in device_ids)
        return sorted(set(ids))


def decode_list_response(data: bytes) -> list[PodDevices]:
    pods: list[PodDevices] = []
    for number, wire, value in _fields(data):
        if number != 1 or wire != 2 or not isinstance(value, bytes):
            continue
        pod = PodDevices("", "")
        for p_number, _, p_value in _fields(value):
            if p_number == 1:
                pod.name = _text(p_value)
            elif p_number == 2:
                pod.namespace = _text(p_value)
            elif p_number == 3 and isinstance(p_value, bytes):
                for c_number, _, c_value in _fields(p_value):
                    if c_number == 2 and isinstance(c_value, bytes):
                        resource, ids = _container_devices(c_value)
                        pod.devices.setdefault(resource, []).extend(ids)
                    elif c_number == 5 and isinstance(c_value, bytes):
                        pod.claimed.extend(_claimed_devices(c_value))
        pods.append(pod)
    return pods


def _claimed_devices(dynamic_resource: bytes) -> list[tuple[str, str, str]]:
    """The (driver, pool, device) triples of one DynamicResource's ClaimResources."""
    claimed = []
    for number, _, value in _fields(dynamic_resource):
        if number == 4 and isinstance(value, bytes):
            parts = {n: _text(v) for n, _, v in _fields(value) if n in (2, 3, 4)}
            if all(parts.get(n) for n in (2, 3, 4)):
                claimed.append((parts[2], parts[3], parts[4]))
    return claimed


def encode_list_response(pods: list[PodDevices]) -> bytes:
    """The wire form of a ListPodResourcesResponse (for the fake kubelet in tests)."""
    out = b""
    for pod in pods:
        containers = b""
        for resource, ids in pod.devices.items():
            device = _field(1, resource.encode()) + b"".join(_field(2, i.encode()) for i in ids)
            containers += _field(3, _field(1, b"main") + _field(2, device))
        for driver, pool, name in pod.claimed:
            claim = _field(4, _field(2, driver.encode()) + _field(3, pool.encode()) + _field(4, name.encode()))
            dynamic = _field(2, b"claim") + _field(3, pod.namespace.encode()) + claim
            containers += _field(3, _field(1, b"main") + _field(5, dynamic))
        out += _field(1, _field(1, pod.name.encode()) + _field(2, pod.namespace.encode()) + containers)
    return out


def decode_allocatable_response(data: bytes) -> dict[str, list[str]]:
    """An AllocatableResourcesResponse's devices: resource name -> device IDs (its CPUs and memory skipped)."""
    devices: dict[str, list[str]] = {}
    for number, wire, value in _fields(data):
        if number != 1 or wire != 2 or not isinstance(value, bytes):
            continue
        resource, ids = _container_devices(value)
        devices.setdefault(resource, []).extend(ids)
    return devices


def _container_devices(message: bytes) -> tuple[str, list[str]]:
    """One ContainerDevices: its resource name and device IDs (its topology skipped)."""
    resource, ids = "", []
    for number, _, value in _fields(message):
        if number == 1:
            resource = _text(value)
        elif number == 2:
            ids.append(_text(value))
    return resource, ids


def encode_allocatable_response(devices: dict[str, list[str]]) -> bytes:
    """The wire form of an AllocatableResourcesResponse (for the fake kubelet in tests)."""
    return b"".join(_field(1, _field(1, resource.encode()) + b"".join(_field(2, i.encode()) for i in ids))
                    for resource, ids in devices.items())


def offered_gpus(devices: dict[str, list[str]], mig_parents: dict[str, str]) -> frozenset[str] | None:
    """The GPUs the kubelet may still give a new pod: the UUID of every `nvidia.com/` device it lists as
    allocatable (a time-sliced replica `UUID::N` as its GPU, a MIG device as itself and its parent GPU). None
    where an ID names no GPU (the plugin's `index` strategy): which GPU is held back cannot be told."""
    offered: set[str] = set()
    for resource, ids in devices.items():
        if not resource.startswith("nvidia.com/"):
            continue
        for device_id in ids:
            uuid = device_id.split("::", 1)[0]
            if not uuid.startswith(GPU_ID_PREFIXES):
                return None
            offered.add(uuid)
            if uuid in mig_parents:
                offered.add(mig_parents[uuid])
    return frozenset(offered)


def allocatable_devices(socket_path: str = DEFAULT_SOCKET, *, timeout_seconds: float = 5.0) -> dict[str, list[str]]:
    """Ask the kubelet which devices it may still hand out (raises OSError, one line, when it cannot be asked)."""
    return _ask(socket_path, ALLOCATABLE_METHOD, timeout_seconds, decode_allocatable_response)


def list_pod_devices(socket_path: str = DEFAULT_SOCKET, *, timeout_seconds: float = 5.0) -> list[PodDevices]:
    """Ask the kubelet which pod holds which device (raises OSError, one line, when it cannot be asked)."""
    return _ask(socket_path, LIST_METHOD, timeout_seconds, decode_list_response)


def _ask(socket_path: str, method: str, timeout_seconds: float, decode: Callable[[bytes], T]) -> T:
    """One PodResources call's answer, decoded; OSError naming the socket for no answer or one that does not
    decode."""
    # h2 (~1.1 MiB) is loaded by the first call: only where the kubelet's socket is there to ask.
    from agent.k8s.grpc_unary import unary_call  # noqa: PLC0415

    try:
        return decode(unary_call(socket_path, method, b"", timeout_seconds=timeout_seconds,
                                 max_response_bytes=MAX_ANSWER_BYTES))
    except ProtobufError as exc:
        raise OSError(f"kubelet PodResources at {socket_path}: undecodable answer ({exc})") from None
    except OSError as exc:
        raise OSError(f"kubelet PodResources at {socket_path}: {exc}") from None

"""The kubelet's PodResources API (gRPC on a unix socket, agent.k8s.grpc_unary): which container holds which GPU.

The messages are decoded by hand from their protobuf wire format (k8s.io/kubelet podresources/v1:
ListPodResourcesResponse{pod_resources=1}, PodResources{name=1, namespace=2, containers=3},
ContainerResources{name=1, devices=2, dynamic_resources=5}, ContainerDevices{resource_name=1, device_ids=2},
DynamicResource{claim_name=2, claim_namespace=3, claim_resources=4},
ClaimResource{driver_name=2, pool_name=3, device_name=4}), so no code generator is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.protowire import ProtobufError
from agent.protowire import fields as _fields
from agent.protowire import length_field as _field
from agent.protowire import text as _text

LIST_METHOD = "/v1.PodResourcesLister/List"
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
                        resource, ids = "", []
                        for d_number, _, d_value in _fields(c_value):
                            if d_number == 1:
                                resource = _text(d_value)
                            elif d_number == 2:
                                ids.append(_text(d_value))
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


def list_pod_devices(socket_path: str = DEFAULT_SOCKET, *, timeout_seconds: float = 5.0) -> list[PodDevices]:
    """Ask the kubelet which pod holds which device (raises OSError, one line, when it cannot be asked)."""
    # h2 (~1.1 MiB) is loaded by the first call: only where the kubelet's socket is there to ask.
    from agent.k8s.grpc_unary import unary_call  # noqa: PLC0415

    try:
        answer = unary_call(socket_path, LIST_METHOD, b"", timeout_seconds=timeout_seconds,
                            max_response_bytes=MAX_ANSWER_BYTES)
        return decode_list_response(answer)
    except ProtobufError as exc:
        raise OSError(f"kubelet PodResources at {socket_path}: undecodable answer ({exc})") from None
    except OSError as exc:
        raise OSError(f"kubelet PodResources at {socket_path}: {exc}") from None

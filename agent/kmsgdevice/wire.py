"""The device-plugin API's messages (k8s.io/kubelet deviceplugin/v1beta1) in protobuf's wire format, by hand.

Field numbers as the API documents its messages: RegisterRequest{version=1, endpoint=2, resource_name=3,
options=4}; DevicePluginOptions{pre_start_required=1, get_preferred_allocation_available=2};
ListAndWatchResponse{devices=1}; Device{ID=1, health=2}; AllocateRequest{container_requests=1};
ContainerAllocateRequest{devices_ids=1}; AllocateResponse{container_responses=1};
ContainerAllocateResponse{envs=1, mounts=2, devices=3, annotations=4}; DeviceSpec{container_path=1,
host_path=2, permissions=3}; PreferredAllocationRequest{container_requests=1};
ContainerPreferredAllocationRequest{available_deviceIDs=1, must_include_deviceIDs=2, allocation_size=3};
PreferredAllocationResponse{container_responses=1}; ContainerPreferredAllocationResponse{deviceIDs=1}.
Empty and PreStartContainerResponse have no fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.protowire import fields, length_field, text, varint_field

API_VERSION = "v1beta1"
REGISTER_METHOD = "/v1beta1.Registration/Register"
PLUGIN_SERVICE = "v1beta1.DevicePlugin"
HEALTHY = "Healthy"


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A device node the runtime makes in the container, and allows in its device cgroup."""

    container_path: str
    host_path: str
    permissions: str


@dataclass(frozen=True, slots=True)
class Registration:
    """What a plugin tells the kubelet: its API version, its socket's name in the directory, its resource."""

    version: str
    endpoint: str
    resource_name: str
    pre_start_required: bool = False
    preferred_allocation: bool = False


@dataclass(frozen=True, slots=True)
class PreferredRequest:
    """One container's GetPreferredAllocation question."""

    available: list[str] = field(default_factory=list)
    must_include: list[str] = field(default_factory=list)
    size: int = 0


def _strings(data: bytes, number: int) -> list[str]:
    return [text(value) for n, wire, value in fields(data) if n == number and wire == 2]


def _messages(data: bytes, number: int) -> list[bytes]:
    return [value for n, wire, value in fields(data) if n == number and wire == 2 and isinstance(value, bytes)]


def encode_options(pre_start_required: bool = False, preferred_allocation: bool = False) -> bytes:
    return varint_field(1, int(pre_start_required)) + varint_field(2, int(preferred_allocation))


def decode_options(data: bytes) -> tuple[bool, bool]:
    values = {n: bool(v) for n, wire, v in fields(data) if wire == 0}
    return values.get(1, False), values.get(2, False)


def encode_registration(registration: Registration) -> bytes:
    options = encode_options(registration.pre_start_required, registration.preferred_allocation)
    return (length_field(1, registration.version.encode()) + length_field(2, registration.endpoint.encode())
            + length_field(3, registration.resource_name.encode()) + length_field(4, options))


def decode_registration(data: bytes) -> Registration:
    """A RegisterRequest (what the fake kubelet in the tests reads)."""
    values = {n: v for n, _, v in fields(data)}
    options = values.get(4, b"")
    pre_start, preferred = decode_options(options if isinstance(options, bytes) else b"")
    return Registration(text(values.get(1, b"")), text(values.get(2, b"")), text(values.get(3, b"")),
                        pre_start, preferred)


def encode_devices(ids: list[str], health: str = HEALTHY) -> bytes:
    """A ListAndWatchResponse: every device with the same health."""
    return b"".join(length_field(1, length_field(1, i.encode()) + length_field(2, health.encode())) for i in ids)


def decode_devices(data: bytes) -> dict[str, str]:
    """A ListAndWatchResponse as device ID -> health."""
    devices = {}
    for device in _messages(data, 1):
        values = {n: text(v) for n, _, v in fields(device) if n in (1, 2)}
        devices[values.get(1, "")] = values.get(2, "")
    return devices


def encode_id_lists(containers: list[list[str]]) -> bytes:
    """An AllocateRequest, or a PreferredAllocationResponse: field 1 per container, holding its IDs as field 1."""
    return b"".join(length_field(1, b"".join(length_field(1, i.encode()) for i in ids)) for ids in containers)


def decode_allocate_request(data: bytes) -> list[list[str]]:
    """An AllocateRequest as the device IDs of each container that asks."""
    return [_strings(container, 1) for container in _messages(data, 1)]


def encode_allocate_response(containers: list[list[DeviceSpec]]) -> bytes:
    """An AllocateResponse: for each container, in the request's order, the device nodes it gets."""
    out = b""
    for specs in containers:
        devices = b"".join(length_field(3, length_field(1, s.container_path.encode())
                                        + length_field(2, s.host_path.encode())
                                        + length_field(3, s.permissions.encode())) for s in specs)
        out += length_field(1, devices)
    return out


def decode_allocate_response(data: bytes) -> list[list[DeviceSpec]]:
    containers = []
    for container in _messages(data, 1):
        specs = []
        for spec in _messages(container, 3):
            values = {n: text(v) for n, _, v in fields(spec) if n in (1, 2, 3)}
            specs.append(DeviceSpec(values.get(1, ""), values.get(2, ""), values.get(3, "")))
        containers.append(specs)
    return containers


def decode_preferred_request(data: bytes) -> list[PreferredRequest]:
    """A PreferredAllocationRequest: each container's available and required devices and how many it needs."""
    requests = []
    for container in _messages(data, 1):
        size = next((int(v) for n, wire, v in fields(container) if n == 3 and wire == 0), 0)
        requests.append(PreferredRequest(_strings(container, 1), _strings(container, 2), size))
    return requests

"""The /dev/kmsg device plugin against a fake kubelet: real gRPC on unix sockets in a temporary directory.

The fake kubelet serves only v1beta1.Registration/Register and records what it was told; the test then
talks to the plugin's socket as the kubelet would (ListAndWatch, Allocate, GetDevicePluginOptions)."""

from __future__ import annotations

import queue
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.kmsgdevice import wire
from agent.kmsgdevice.plugin import KmsgDevicePlugin, PluginSettings


def _raw(data: bytes) -> bytes:
    return data


class FakeKubelet:
    """The kubelet's registration socket: each RegisterRequest lands in `registrations`."""

    def __init__(self, directory: Path) -> None:
        self.socket = directory / "kubelet.sock"
        self.registrations: queue.Queue[wire.Registration] = queue.Queue()
        self.server: Any = None

    def start(self) -> None:
        self.socket.unlink(missing_ok=True)

        def register(request: bytes, _context: Any) -> bytes:
            self.registrations.put(wire.decode_registration(request))
            return b""

        handler = grpc.method_handlers_generic_handler("v1beta1.Registration", {
            "Register": grpc.unary_unary_rpc_method_handler(register, _raw, _raw)})
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=0).wait()


@pytest.fixture
def directory() -> Iterator[Path]:
    """A short path: a unix socket's path is limited to 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="kmsgdp-") as name:
        yield Path(name)


@pytest.fixture
def kubelet(directory: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(directory)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def plugin(directory: Path, kubelet: FakeKubelet) -> Iterator[KmsgDevicePlugin]:
    plugin = KmsgDevicePlugin(PluginSettings(directory=directory, devices=2, poll_seconds=0.05))
    stop = threading.Event()
    thread = threading.Thread(target=plugin.run, args=(stop,), daemon=True)
    thread.start()
    yield plugin
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()


def call(plugin: KmsgDevicePlugin, method: str, request: bytes) -> bytes:
    with grpc.insecure_channel(f"unix://{plugin.socket}") as channel:
        answer: bytes = channel.unary_unary(f"/v1beta1.DevicePlugin/{method}", request_serializer=_raw,
                                            response_deserializer=_raw)(request, timeout=5)
        return answer


def test_the_plugin_registers_its_socket_and_resource_with_the_kubelet(plugin: KmsgDevicePlugin,
                                                                      kubelet: FakeKubelet):
    """RegisterRequest: API v1beta1, the plugin's socket name in the directory, gpu-health-agent.io/kmsg."""
    registration = kubelet.registrations.get(timeout=10)
    assert registration == wire.Registration("v1beta1", plugin.socket.name, "gpu-health-agent.io/kmsg",
                                             preferred_allocation=True)
    assert plugin.socket.parent == kubelet.socket.parent


def test_list_and_watch_sends_the_healthy_devices_and_keeps_the_stream_open(plugin: KmsgDevicePlugin,
                                                                            kubelet: FakeKubelet):
    """The kubelet's ListAndWatch stream: the devices, all Healthy, then no end while the plugin runs."""
    kubelet.registrations.get(timeout=10)
    with grpc.insecure_channel(f"unix://{plugin.socket}") as channel:
        stream = channel.unary_stream("/v1beta1.DevicePlugin/ListAndWatch", request_serializer=_raw,
                                      response_deserializer=_raw)(b"", timeout=3)
        assert wire.decode_devices(next(stream)) == {"kmsg-0": "Healthy", "kmsg-1": "Healthy"}
        with pytest.raises(grpc.RpcError) as raised:
            next(stream)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # still open when the client gave up


def test_allocate_over_grpc_answers_the_kmsg_device_node(plugin: KmsgDevicePlugin, kubelet: FakeKubelet):
    """Allocate, as the kubelet calls it before it starts the container: /dev/kmsg, rw, for the one container."""
    kubelet.registrations.get(timeout=10)
    answer = call(plugin, "Allocate", wire.encode_id_lists([["kmsg-1"]]))
    assert wire.decode_allocate_response(answer) == [[wire.DeviceSpec("/dev/kmsg", "/dev/kmsg", "rw")]]
    assert wire.decode_options(call(plugin, "GetDevicePluginOptions", b"")) == (False, True)
    assert call(plugin, "PreStartContainer", b"") == b""


def test_the_plugin_registers_again_when_the_kubelet_restarts(plugin: KmsgDevicePlugin, kubelet: FakeKubelet):
    """A restarting kubelet deletes the directory's sockets and makes its own anew: the plugin serves and
    registers again, and the kubelet can allocate from the new socket."""
    kubelet.registrations.get(timeout=10)
    kubelet.stop()
    plugin.socket.unlink()
    kubelet.start()
    assert kubelet.registrations.get(timeout=10).resource_name == "gpu-health-agent.io/kmsg"
    # The plugin may have seen the kubelet's socket go and served anew before the test removed its socket:
    # then it sees its own socket gone at its next poll and serves and registers once more (as with a real
    # kubelet that deletes the directory's sockets while it starts).
    deadline = time.monotonic() + 10
    while True:
        try:
            answer = call(plugin, "Allocate", wire.encode_id_lists([["kmsg-0"]]))
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the plugin never served its socket again"
            time.sleep(0.1)
    assert wire.decode_allocate_response(answer)[0][0].host_path == "/dev/kmsg"


def test_the_nvidia_resource_hands_out_the_hosts_gpu_device_nodes_as_they_are_at_allocation(directory: Path):
    """The NVIDIA resource: each character device the patterns match under the host's /dev at Allocate time, by its
    host path (a regular file is not a device node); a GPU node added later is in the next allocation."""
    from agent.kmsgdevice.plugin import NVIDIA_DEVICES, NVIDIA_ENDPOINT, NVIDIA_RESOURCE

    host = directory / "host"
    (host / "dev" / "nvidia-caps").mkdir(parents=True)
    (host / "dev" / "nvidiactl").symlink_to("/dev/null")  # character devices a test can make without root
    (host / "dev" / "nvidia0").symlink_to("/dev/zero")
    (host / "dev" / "nvidia-caps" / "nvidia-cap1").symlink_to("/dev/null")
    (host / "dev" / "nvidia1").write_text("not a device node")
    plugin = KmsgDevicePlugin(PluginSettings(directory=directory, resource=NVIDIA_RESOURCE, endpoint=NVIDIA_ENDPOINT,
                                             device_paths=NVIDIA_DEVICES, host_root=host))
    server = plugin.serve()
    try:
        [specs] = wire.decode_allocate_response(call(plugin, "Allocate", wire.encode_id_lists([["kmsg-0"]])))
        assert [s.host_path for s in specs] == ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap1"]
        assert all(s.container_path == s.host_path and s.permissions == "rw" for s in specs)
        (host / "dev" / "nvidia7").symlink_to("/dev/zero")
        [again] = wire.decode_allocate_response(call(plugin, "Allocate", wire.encode_id_lists([["kmsg-1"]])))
        assert "/dev/nvidia7" in [s.host_path for s in again]
    finally:
        server.stop(grace=0).wait()


def test_a_device_node_missing_on_the_host_is_not_handed_out(directory: Path):
    """A node whose driver is not loaded (no /dev/nvidiactl, no /dev/nvidiaN): the NVIDIA resource hands out no
    path, so the agent's container still starts (the runtime refuses a device path that does not exist)."""
    from agent.kmsgdevice.plugin import NVIDIA_DEVICES, NVIDIA_ENDPOINT, NVIDIA_RESOURCE

    host = directory / "host"
    (host / "dev").mkdir(parents=True)
    plugin = KmsgDevicePlugin(PluginSettings(directory=directory, resource=NVIDIA_RESOURCE, endpoint=NVIDIA_ENDPOINT,
                                             device_paths=NVIDIA_DEVICES, host_root=host))
    assert plugin.device_nodes() == []

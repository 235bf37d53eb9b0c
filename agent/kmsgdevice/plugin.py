"""The device plugin's gRPC service on a unix socket in the kubelet's directory, its registration, and its
re-registration when the kubelet restarts (the kubelet deletes every socket in the directory as it starts).

It hands out device nodes an unprivileged container's device cgroup would refuse: /dev/kmsg for the kernel-log
source, and (a second resource) the host's NVIDIA device nodes for NVML and the reset helper, so the agent's pod
never depends on the NVIDIA container runtime's injection, which fails for a GPU in some states that need a reset
(NVSentinel PR #1243)."""

from __future__ import annotations

import contextlib
import glob
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.kmsgdevice import wire
from agent.logs import get_logger

log = get_logger("agent.kmsgdevice")

DEFAULT_DIRECTORY = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = "kubelet.sock"
RESOURCE = "gpu-health-agent.io/kmsg"
ENDPOINT = "gpu-health-agent-kmsg.sock"
#: The NVIDIA device nodes NVML and nvidia-smi open: the control node, one per GPU, and the MIG capabilities.
NVIDIA_RESOURCE = "gpu-health-agent.io/nvidia-devices"
NVIDIA_ENDPOINT = "gpu-health-agent-nvidia.sock"
NVIDIA_DEVICES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/nvidia-caps/nvidia-cap[0-9]*")
#: Read is what the kernel-log source needs; write is what `gpu-health-agent drill` in the pod needs.
PERMISSIONS = ("r", "rw")


@dataclass(frozen=True, slots=True)
class PluginSettings:
    """What the plugin advertises and hands out."""

    directory: Path = DEFAULT_DIRECTORY
    resource: str = RESOURCE
    devices: int = 4
    #: The device nodes handed out: a plain path as it is, a glob pattern as the nodes it matches at allocation.
    device_paths: tuple[str, ...] = ("/dev/kmsg",)
    permissions: str = "rw"
    endpoint: str = ENDPOINT
    poll_seconds: float = 1.0
    #: Where the host's filesystem is seen, for the patterns (the host's /dev mounted at <host_root>/dev).
    host_root: Path = Path("/")


class KmsgDevicePlugin:
    """`devices` identical, always-healthy devices; each allocation is every node of `device_paths`."""

    def __init__(self, settings: PluginSettings) -> None:
        if settings.permissions not in PERMISSIONS:
            raise ValueError(f"permissions {settings.permissions!r}: one of {', '.join(PERMISSIONS)}")
        self.settings = settings
        self.socket = settings.directory / settings.endpoint
        self.kubelet_socket = settings.directory / KUBELET_SOCKET
        self._closing = threading.Event()

    # ---- the answers ----
    def device_ids(self) -> list[str]:
        return [f"kmsg-{n}" for n in range(self.settings.devices)]

    def allocate(self, request: bytes) -> bytes:
        """Every container asking gets the device nodes (one ID is enough, however many it holds), as they are
        on the host now: a GPU lost or needing a reset keeps its node, so the container starts regardless."""
        specs = [wire.DeviceSpec(path, path, self.settings.permissions) for path in self.device_nodes()]
        return wire.encode_allocate_response([specs for _ in wire.decode_allocate_request(request)])

    def device_nodes(self) -> list[str]:
        """The host paths handed out: each pattern's character devices under `host_root`, and each plain path,
        where a host root is given only if it is a character device there now (a node whose driver is not
        loaded has no /dev/nvidiactl: a container handed a missing path never starts). Without a host root
        (the kmsg resource: /dev/kmsg, which the plugin's own container does not see) a plain path as it is."""
        paths: list[str] = []
        root = str(self.settings.host_root).rstrip("/")
        for pattern in self.settings.device_paths:
            if not glob.has_magic(pattern) and not root:
                paths.append(pattern)
                continue
            for found in sorted(glob.glob(root + pattern)):
                with contextlib.suppress(OSError):
                    if stat.S_ISCHR(os.stat(found).st_mode):
                        paths.append(found[len(root):])
        return list(dict.fromkeys(paths))

    def preferred(self, request: bytes) -> bytes:
        """The required devices first, then the available ones, up to the size asked (any will do)."""
        answers = []
        for container in wire.decode_preferred_request(request):
            chosen = list(dict.fromkeys([*container.must_include, *container.available]))
            answers.append(chosen[:container.size])
        return wire.encode_id_lists(answers)

    def list_and_watch(self, _request: bytes, context: Any) -> Iterator[bytes]:
        """The devices once; the stream then stays open (nothing changes) until the kubelet or we close it."""
        yield wire.encode_devices(self.device_ids())
        while context.is_active() and not self._closing.wait(0.5):
            pass

    # ---- serving and registering ----
    def serve(self) -> Any:
        """The gRPC server listening on the plugin's socket (a stale one removed first)."""
        import grpc  # noqa: PLC0415 - grpc loads a large native module; only this command needs it

        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        self._closing.clear()
        empty = b""
        handlers = {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                lambda _r, _c: wire.encode_options(preferred_allocation=True), _raw, _raw),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(self.list_and_watch, _raw, _raw),
            "Allocate": grpc.unary_unary_rpc_method_handler(lambda r, _c: self.allocate(r), _raw, _raw),
            "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(lambda r, _c: self.preferred(r), _raw, _raw),
            "PreStartContainer": grpc.unary_unary_rpc_method_handler(lambda _r, _c: empty, _raw, _raw),
        }
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="kmsg-plugin"))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.PLUGIN_SERVICE, handlers),))
        if not server.add_insecure_port(f"unix://{self.socket}"):
            raise OSError(f"cannot listen on {self.socket}")
        server.start()
        return server

    def register(self, timeout_seconds: float = 5.0) -> None:
        """Register with the kubelet (raises OSError when it cannot be reached or refuses)."""
        import grpc  # noqa: PLC0415

        request = wire.Registration(wire.API_VERSION, self.settings.endpoint, self.settings.resource,
                                    preferred_allocation=True)
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            call = channel.unary_unary(wire.REGISTER_METHOD, request_serializer=wire.encode_registration,
                                       response_deserializer=_raw)
            try:
                call(request, timeout=timeout_seconds)
            except grpc.RpcError as exc:
                raise OSError(f"kubelet registration at {self.kubelet_socket}: {exc.code().name} "
                              f"{exc.details() or ''}".rstrip()) from None

    def run(self, stop: threading.Event) -> None:
        """Serve and register; again whenever the kubelet restarts (our socket gone or its socket new)."""
        while not stop.is_set():
            server = self.serve()
            try:
                kubelet = self._register_until_done(stop)
                if kubelet is not None:
                    log.info("kmsg_plugin_registered", resource=self.settings.resource, socket=str(self.socket),
                             devices=self.settings.devices, permissions=self.settings.permissions)
                    while not stop.wait(self.settings.poll_seconds) and self._unchanged(kubelet):
                        pass
                    if not stop.is_set():
                        log.info("kmsg_plugin_reregistering", reason="the kubelet restarted")
            finally:
                self._closing.set()
                server.stop(grace=1).wait()
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def _register_until_done(self, stop: threading.Event) -> tuple[int, int] | None:
        """Registered: the kubelet socket's identity then (None when stopped first). Retries, logging once."""
        logged = False
        while not stop.is_set():
            identity = _identity(self.kubelet_socket)
            try:
                self.register()
            except OSError as exc:
                if not logged:
                    log.warning("kmsg_plugin_register_failed", reason=str(exc), retrying=True)
                    logged = True
                stop.wait(self.settings.poll_seconds)
                continue
            return identity
        return None

    def _unchanged(self, kubelet: tuple[int, int] | None) -> bool:
        return self.socket.exists() and _identity(self.kubelet_socket) == kubelet


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _raw(data: bytes) -> bytes:
    return data

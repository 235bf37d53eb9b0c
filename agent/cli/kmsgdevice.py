"""`kmsg-device-plugin`: hand /dev/kmsg (or the NVIDIA device nodes) to the agent's unprivileged containers
through the kubelet."""

from __future__ import annotations

from pathlib import Path

import click

from agent.cli.common import fail
from agent.gpu.driver_files import copy_driver_files
from agent.kmsgdevice.plugin import DEFAULT_DIRECTORY, ENDPOINT, PERMISSIONS, RESOURCE, KmsgDevicePlugin, PluginSettings
from agent.logs import configure_logging
from agent.shutdown import stop_event


@click.command(name="kmsg-device-plugin")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_DIRECTORY,
              show_default=True, help="The kubelet's device-plugin directory (its kubelet.sock, our socket).")
@click.option("--resource", default=RESOURCE, show_default=True, help="The extended resource to advertise.")
@click.option("--devices", type=click.IntRange(min=1, max=64), default=4, show_default=True,
              help="How many pods may hold the device at once (the agent's, a rolling update's, a debug pod's).")
@click.option("--device", "device_paths", multiple=True, default=("/dev/kmsg",), show_default=True,
              help="A device node handed out, or a glob pattern of them (/dev/nvidia[0-9]*, matched at each "
                   "allocation under --host-root); repeat for more.")
@click.option("--host-root", type=click.Path(file_okay=False, path_type=Path), default=Path("/"), show_default=True,
              help="Where the host's /dev is seen (its /dev mounted at HOST_ROOT/dev), for the patterns.")
@click.option("--endpoint", default=ENDPOINT, show_default=True, help="This plugin's socket name in --dir.")
@click.option("--permissions", type=click.Choice(PERMISSIONS), default="rw", show_default=True,
              help="r: the kernel-log source only; rw: also `gpu-health-agent drill` from inside the pod.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def kmsg_device_plugin(directory: Path, resource: str, devices: int, device_paths: tuple[str, ...], host_root: Path,
                       endpoint: str, permissions: str, log_level: str) -> None:
    """Advertise DEVICES healthy `gpu-health-agent.io/kmsg` devices to the kubelet; a container requesting one
    gets /dev/kmsg allowed in its device cgroup, so the agent needs no privileged mode. Re-registers when the
    kubelet restarts; stops on SIGTERM."""
    try:
        import grpc  # noqa: F401, PLC0415 - an optional extra: only this command needs it
    except ImportError:
        fail(["kmsg-device-plugin: grpcio is not installed (it is the `deviceplugin` extra: "
              "pip install 'gpu-health-agent[deviceplugin]'; the agent's image has it)"], code=1)
    if not directory.is_dir():
        fail([f"kmsg-device-plugin: {directory}: no such directory (mount the kubelet's device-plugins "
              "directory)"], code=1)
    configure_logging(log_level, "auto")
    plugin = KmsgDevicePlugin(PluginSettings(directory=directory, resource=resource, devices=devices,
                                             device_paths=tuple(device_paths), permissions=permissions,
                                             endpoint=endpoint, host_root=host_root))
    click.echo(f"kmsg-device-plugin: {devices} x {resource} ({', '.join(device_paths)}, {permissions}) on "
               f"{plugin.socket}, registering with {plugin.kubelet_socket}", err=True)
    plugin.run(stop_event())


@click.command(name="driver-files")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path("/driver-root"),
              show_default=True, help="The host's driver root as mounted (the host's /, read-only).")
@click.option("--to", "target", type=click.Path(file_okay=False, path_type=Path), default=Path("/nvidia"),
              show_default=True, help="Where to copy them (an emptyDir the agent's containers share).")
@click.option("--wait-seconds", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="How long to wait for a driver not there yet (a GPU Operator driver pod still installing).")
def driver_files(root: Path, target: Path, wait_seconds: float) -> None:
    """Copy the host driver's libnvidia-ml and nvidia-smi into TARGET (the pod's init container): the agent's
    containers then need no NVIDIA runtime injection, which fails for some GPUs that need a reset. Exit 0 also
    when no driver is found (the agent then reads the GPUs Unknown), 1 when the copy fails."""
    try:
        click.echo(f"driver-files: {copy_driver_files(root, target, wait_seconds=wait_seconds)}", err=True)
    except OSError as exc:
        fail([f"driver-files: {exc}"], code=1)

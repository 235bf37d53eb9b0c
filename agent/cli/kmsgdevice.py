"""`kmsg-device-plugin`: hand /dev/kmsg to the agent's unprivileged container through the kubelet."""

from __future__ import annotations

from pathlib import Path

import click

from agent.cli.common import fail
from agent.kmsgdevice.plugin import DEFAULT_DIRECTORY, ENDPOINT, PERMISSIONS, RESOURCE, KmsgDevicePlugin, PluginSettings
from agent.logs import configure_logging
from agent.shutdown import stop_event


@click.command(name="kmsg-device-plugin")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_DIRECTORY,
              show_default=True, help="The kubelet's device-plugin directory (its kubelet.sock, our socket).")
@click.option("--resource", default=RESOURCE, show_default=True, help="The extended resource to advertise.")
@click.option("--devices", type=click.IntRange(min=1, max=64), default=4, show_default=True,
              help="How many pods may hold the device at once (the agent's, a rolling update's, a debug pod's).")
@click.option("--device", "device_path", default="/dev/kmsg", show_default=True, help="The device node handed out.")
@click.option("--permissions", type=click.Choice(PERMISSIONS), default="rw", show_default=True,
              help="r: the kernel-log source only; rw: also `gpu-health-agent drill` from inside the pod.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def kmsg_device_plugin(directory: Path, resource: str, devices: int, device_path: str, permissions: str,
                       log_level: str) -> None:
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
                                             device_path=device_path, permissions=permissions, endpoint=ENDPOINT))
    click.echo(f"kmsg-device-plugin: {devices} x {resource} ({device_path}, {permissions}) on "
               f"{plugin.socket}, registering with {plugin.kubelet_socket}", err=True)
    plugin.run(stop_event())

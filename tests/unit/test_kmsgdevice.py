"""The /dev/kmsg device plugin's messages in protobuf's wire format, and what it answers the kubelet."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from agent.kmsgdevice import wire
from agent.kmsgdevice.plugin import KmsgDevicePlugin, PluginSettings


def test_a_device_is_written_with_the_apis_field_numbers():
    """ListAndWatchResponse{devices=1: Device{ID=1, health=2}}, byte for byte."""
    assert wire.encode_devices(["kmsg-0"]) == b"\x0a\x11\x0a\x06kmsg-0\x12\x07Healthy"


def test_a_registration_is_written_with_the_apis_field_numbers_and_reads_back():
    """RegisterRequest{version=1, endpoint=2, resource_name=3, options=4{get_preferred_allocation_available=2}}."""
    registration = wire.Registration("v1beta1", "k.sock", "x.io/kmsg", preferred_allocation=True)
    encoded = wire.encode_registration(registration)
    assert encoded == b"\x0a\x07v1beta1\x12\x06k.sock\x1a\x09x.io/kmsg\x22\x02\x10\x01"
    assert wire.decode_registration(encoded) == registration


def test_an_allocate_request_is_read_per_container():
    """AllocateRequest{container_requests=1: {devices_ids=1}}: each container's device IDs, in order."""
    request = b"\x0a\x08\x0a\x06kmsg-0" + b"\x0a\x10\x0a\x06kmsg-1\x0a\x06kmsg-2"
    assert wire.decode_allocate_request(request) == [["kmsg-0"], ["kmsg-1", "kmsg-2"]]


def test_allocate_gives_every_container_the_kmsg_device_node_with_the_configured_permissions():
    """Each container asking gets DeviceSpec{container_path=1, host_path=2, permissions=3}: /dev/kmsg once."""
    plugin = KmsgDevicePlugin(PluginSettings(permissions="r"))
    answer = plugin.allocate(wire.encode_id_lists([["kmsg-0"], ["kmsg-1", "kmsg-2"]]))
    spec = wire.DeviceSpec("/dev/kmsg", "/dev/kmsg", "r")
    assert wire.decode_allocate_response(answer) == [[spec], [spec]]
    assert answer.startswith(b"\x0a\x1b\x1a\x19\x0a\x09/dev/kmsg\x12\x09/dev/kmsg\x1a\x01r")


def test_the_preferred_allocation_takes_the_required_devices_first_up_to_the_size_asked():
    """GetPreferredAllocation: must_include first, then the available ones, allocation_size of them."""
    # ContainerPreferredAllocationRequest{available_deviceIDs=1, must_include_deviceIDs=2, allocation_size=3}
    container = (b"".join(b"\x0a\x06" + i.encode() for i in ("kmsg-0", "kmsg-1", "kmsg-2"))
                 + b"\x12\x06kmsg-2" + b"\x18\x02")
    request = b"\x0a" + bytes([len(container)]) + container
    answer = KmsgDevicePlugin(PluginSettings()).preferred(request)
    assert wire.decode_allocate_request(answer) == [["kmsg-2", "kmsg-0"]]


def test_the_plugin_advertises_the_configured_number_of_devices():
    """--devices N: N devices kmsg-0..kmsg-N-1."""
    assert KmsgDevicePlugin(PluginSettings(devices=3)).device_ids() == ["kmsg-0", "kmsg-1", "kmsg-2"]


def test_a_permission_other_than_r_or_rw_is_refused():
    """mknod ("m") is never handed out."""
    with pytest.raises(ValueError, match="permissions"):
        KmsgDevicePlugin(PluginSettings(permissions="rwm"))


def test_a_kmsg_the_device_cgroup_refuses_names_the_device_plugin_resource(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    """EPERM on open (what an unprivileged container's device cgroup answers): the reason names the resource."""
    from agent.config import load_config
    from agent.discovery import SourceContext, discover_sources
    from agent.journal import Journal

    def refused(path: object, *_: object) -> int:
        raise OSError(errno.EPERM, os.strerror(errno.EPERM), str(path))

    config = load_config(None, env={"NODE_NAME": "n", "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db"),
                                    "GPU_HEALTH_SOURCES__NVML__ENABLED": "off",
                                    "GPU_HEALTH_SOURCES__DCGM__ENABLED": "off"})
    journal = Journal(config.journal_path)
    monkeypatch.setattr("agent.discovery.os.open", refused)
    [probe] = [p for p in discover_sources(SourceContext(config, journal, lambda *a: None)) if p.name == "kmsg"]
    journal.close()
    assert probe.source is None
    assert "Operation not permitted" in probe.why_not and "gpu-health-agent.io/kmsg" in probe.why_not

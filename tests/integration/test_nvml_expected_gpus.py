"""A first boot with fewer GPUs than the node has (no remembered inventory): the PCI bus and GFD's label say so,
on the real pynvml over the fake libnvidia-ml.so.1 and a sysfs tree in the kernel's own format."""

from pathlib import Path

from agent.logs import capture_logs
from agent.model import Signal
from agent.sources.nvml import NvmlSource, load_pynvml
from tests.conftest import eight_gpus
from tests.integration.test_nvml import judge

GPU5_PCI = "00000000:68:00.0"


def sysfs(root: Path, devices: dict[str, tuple[str, str, str]]) -> Path:
    """/sys/bus/pci/devices as the kernel lays it out: per address `vendor`, `class` and a `driver` link."""
    drivers = root / "drivers"
    for address, (vendor, klass, driver) in devices.items():
        device = root / "devices" / address
        device.mkdir(parents=True)
        (device / "vendor").write_text(vendor + "\n")
        (device / "class").write_text(klass + "\n")
        if driver:
            (drivers / driver).mkdir(parents=True, exist_ok=True)
            (device / "driver").symlink_to(drivers / driver)
    return root / "devices"


def baseboard(root: Path, **changes: tuple[str, str, str]) -> Path:
    """An HGX baseboard's bus: the eight GPUs of eight_gpus() bound to nvidia, an NVSwitch, a NIC."""
    devices = {f"0000:{0x18 + i * 0x10:02x}:00.0": ("0x10de", "0x030200", "nvidia") for i in range(8)}
    devices["0000:05:00.0"] = ("0x10de", "0x068000", "nvidia-nvswitch")
    devices["0000:0c:00.0"] = ("0x15b3", "0x020700", "mlx5_core")
    devices.update(changes)
    return sysfs(root, devices)


def seven_of_eight(fake_nvml) -> None:
    state = eight_gpus()
    state["gpus"] = [g for g in state["gpus"] if g["pci"] != GPU5_PCI]
    fake_nvml.write(state)


def started(**options) -> NvmlSource:
    nvml = NvmlSource(load_pynvml(), poll_seconds=0.05, call_timeout_seconds=2.0, event_wait_ms=50, **options)
    nvml.start()
    return nvml


def missing_at_first_poll(**options) -> list:
    """The gpu_missing readings above 0 of the first poll of a source started with `options`."""
    nvml = started(**options)
    try:
        return [o for o in nvml.poll() if o.signal is Signal.GPU_MISSING and o.value]
    finally:
        nvml.stop()


def test_a_gpu_on_the_pci_bus_that_nvml_does_not_enumerate_at_a_first_boot_is_a_fault(fake_nvml, tmp_path):
    """7 of 8 GPUs at a first boot (nothing remembered): the eighth, on the bus at 0000:68:00, is named and fatal."""
    seven_of_eight(fake_nvml)
    nvml = started(pci_devices=baseboard(tmp_path))
    try:
        observations = nvml.poll()
        [missing] = [o for o in observations if o.signal is Signal.GPU_MISSING and o.value == 1]
        assert (missing.gpu.pci_bus_id, missing.attrs["expected_from"]) == ("0000:68:00", "pci")
        verdicts, pipeline = judge(observations)
        assert [(v.rule_id, v.severity, v.action) for v in verdicts] == [("gpu-not-enumerated", "fatal", "notify")]
        assert pipeline.gpu_statuses()[missing.gpu.key] == "fatal"
    finally:
        nvml.stop()


def test_a_gpu_passed_through_to_a_vm_or_an_nvswitch_is_not_a_missing_gpu(fake_nvml, tmp_path):
    """Bound to vfio-pci the GPU is a VM's, not this NVML's; a bridge-class NVSwitch is no GPU."""
    seven_of_eight(fake_nvml)
    assert missing_at_first_poll(pci_devices=baseboard(tmp_path, **{"0000:68:00.0": ("0x10de", "0x030200",
                                                                                     "vfio-pci")})) == []


def test_a_gpu_whose_driver_probe_failed_is_missing_too(fake_nvml, tmp_path):
    """No driver bound (nvidia's probe of it failed): on the bus, not enumerated, a fault."""
    seven_of_eight(fake_nvml)
    missing = missing_at_first_poll(pci_devices=baseboard(tmp_path, **{"0000:68:00.0": ("0x10de", "0x030200", "")}))
    assert [o.gpu.pci_bus_id for o in missing] == ["0000:68:00"]


def test_fewer_gpus_than_gfds_gpu_count_label_is_a_fault_of_the_node(fake_nvml):
    """No bus to read, GFD's nvidia.com/gpu.count says 8, NVML enumerates 7: one GPU missing, not healthy."""
    seven_of_eight(fake_nvml)
    labels = {"nvidia.com/gpu.count": "8"}
    nvml = started(node_labels=lambda: labels)
    try:
        observations = nvml.poll()
        [node] = [o for o in observations if o.signal is Signal.GPU_MISSING and o.gpu is None]
        assert (node.value, node.attrs["expected"], node.attrs["enumerated"]) == (1, 8, 7)
        verdicts, _ = judge(observations)
        assert [(v.rule_id, v.gpu_key, v.severity) for v in verdicts] == [("gpus-fewer-than-labelled", "node", "fatal")]
        labels["nvidia.com/gpu.count"] = "7"  # GFD relabels with what it found on this boot: no GPU came back
        [again] = [o for o in nvml.poll() if o.signal is Signal.GPU_MISSING and o.gpu is None]
        assert again.value == 1
    finally:
        nvml.stop()


def test_every_gpu_accounted_for_is_no_fault(fake_nvml, tmp_path):
    """Eight enumerated, eight on the bus, a label of 8: nothing missing."""
    fake_nvml.write(eight_gpus())
    labels = {"nvidia.com/gpu.count": "8"}
    assert missing_at_first_poll(pci_devices=baseboard(tmp_path), node_labels=lambda: labels) == []


def test_a_gpu_on_the_bus_counts_once_against_the_label(fake_nvml, tmp_path):
    """The bus names the eighth GPU; the label's 8 then lacks none: one fault, the named one."""
    seven_of_eight(fake_nvml)
    missing = missing_at_first_poll(pci_devices=baseboard(tmp_path), node_labels=lambda: {"nvidia.com/gpu.count": "8"})
    assert [(o.attrs["expected_from"], o.gpu is None) for o in missing] == [("pci", False)]


def test_an_unreadable_bus_is_one_warning_and_no_fault(fake_nvml, tmp_path):
    fake_nvml.write(eight_gpus())
    with capture_logs() as logs:
        assert missing_at_first_poll(pci_devices=tmp_path / "absent") == []
    assert [e["event"] for e in logs if e["event"] == "pci_devices_unreadable"] == ["pci_devices_unreadable"]


def test_a_released_gpu_on_the_bus_is_not_raised_again(fake_nvml, tmp_path):
    seven_of_eight(fake_nvml)
    nvml = started(pci_devices=baseboard(tmp_path))
    try:
        nvml.forget_gpu("", pci_bus_id="0000:68:00.0")
        assert [o for o in nvml.poll() if o.signal is Signal.GPU_MISSING and o.value] == []
    finally:
        nvml.stop()


def test_the_daemon_hands_the_nvml_source_the_labels_of_its_node_as_last_read(tmp_path):
    """GFD's nvidia.com/gpu.count reaches the NVML source through the daemon: the Node as its cluster side saw it
    (fake API server over real HTTP)."""
    from prometheus_client import CollectorRegistry

    from agent.cluster_side import build_cluster_side
    from agent.config import load_config
    from agent.daemon import Daemon
    from agent.k8s.client import client_for
    from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster, populate
    from tests.integration.test_node_watch import Idle
    from tests.k8s_helpers import RULES, gpu_node

    cluster = FakeCluster()
    populate(cluster, gpu_node("n1"), labels={"nvidia.com/gpu.count": "8"})
    server = FakeApiServer(cluster).start()
    try:
        config = load_config(None, env={"NODE_NAME": "n1", "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db")})
        side = build_cluster_side(client_for(server.url), config, on_stuck=lambda pod: None)
        daemon = Daemon(config, rules=RULES, sources=[Idle()], registry=CollectorRegistry(), cluster=side)
        side.writer.read()
        assert daemon._node_labels()["nvidia.com/gpu.count"] == "8"
    finally:
        server.stop()

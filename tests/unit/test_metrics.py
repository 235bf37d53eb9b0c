"""The agent's metrics: per-GPU series labelled as dcgm-exporter labels its own, so the two join."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from agent.metrics import Metrics, dcgm_pci_bus_id
from agent.model import GpuRef

# Two GPUs as the NVML source knows them (it keeps NVML's bus id lower-cased).
GPU0 = ("GPU-6f5e2a3c-0000-4d6b-9a1e-000000000000", "00000000:1a:00.0")
GPU1 = ("GPU-6f5e2a3c-0000-4d6b-9a1e-000000000001", "00000000:2b:00.0")
MODEL = "NVIDIA H100 80GB HBM3"


def gpus() -> dict[str, GpuRef]:
    return {uuid: GpuRef(index=i, uuid=uuid, pci_bus_id=pci, model=MODEL) for i, (uuid, pci) in enumerate((GPU0, GPU1))}


def status_samples(registry: CollectorRegistry) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for m in registry.collect() if m.name == "gpu_health_gpu_status" for s in m.samples]


def test_a_gpus_status_carries_dcgm_exporters_labels():
    """gpu is the index; UUID, pci_bus_id (as NVML prints it), modelName and Hostname are their own labels."""
    registry = CollectorRegistry()
    Metrics(registry).set_gpu_status({GPU1[0]: "fatal"}, gpus(), hostname="node-a")
    assert registry.get_sample_value("gpu_health_gpu_status", {
        "gpu": "1", "UUID": GPU1[0], "pci_bus_id": "00000000:2B:00.0", "modelName": MODEL, "Hostname": "node-a",
        "status": "fatal"}) == 1
    assert {labels["status"]: value for labels, value in status_samples(registry)} == {
        "healthy": 0, "unknown": 0, "degraded": 0, "fatal": 1}


def test_a_mig_device_is_labelled_as_its_parent_gpu():
    """dcgm-exporter's UUID of a MIG device's series is the parent GPU's."""
    registry = CollectorRegistry()
    mig = GpuRef(index=0, uuid="MIG-1234", pci_bus_id=GPU0[1], model=MODEL, mig_parent_uuid=GPU0[0],
                 mig_gpu_instance=3)
    Metrics(registry).set_gpu_status({GPU0[0]: "degraded"}, {GPU0[0]: mig}, hostname="node-a")
    assert {labels["UUID"] for labels, _ in status_samples(registry)} == {GPU0[0]}


def test_a_gpu_no_longer_reported_leaves_no_series():
    """Statuses replace the last ones whole: a key gone from them (a fault cleared on a GPU the inventory never
    listed) is gone from the exposition, not left at its last value."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.set_gpu_status({GPU0[0]: "healthy", "index:7": "fatal"}, gpus(), hostname="node-a")
    metrics.set_gpu_status({GPU0[0]: "healthy"}, gpus(), hostname="node-a")
    assert {labels["UUID"] for labels, _ in status_samples(registry)} == {GPU0[0]}


def test_keys_naming_one_gpu_are_one_series_with_the_worse_status():
    """A fault keyed by the GPU's index before its UUID was known, and the GPU's own healthy entry: one GPU."""
    registry = CollectorRegistry()
    Metrics(registry).set_gpu_status({"index:0": "degraded", GPU0[0]: "healthy"},
                                     {**gpus(), "index:0": gpus()[GPU0[0]]}, hostname="node-a")
    assert [labels["status"] for labels, value in status_samples(registry) if value == 1] == ["degraded"]


@pytest.mark.parametrize(("given", "printed"), [
    ("00000000:1a:00.0", "00000000:1A:00.0"),  # NVML's, lower-cased by the NVML source
    ("0000:1a:00.0", "00000000:1A:00.0"),  # a 4-digit domain (sysfs, the kernel log)
    ("0000:1a:00", "00000000:1A:00.0"),  # no function
    ("1a:00", "00000000:1A:00.0"),  # no domain
    ("pci:0000:c1:00.1", "00000000:C1:00.1"),
    ("not a bus id", "not a bus id"),  # passed on as it came rather than dropped
])
def test_a_pci_bus_id_is_printed_as_nvml_and_dcgm_exporter_print_it(given, printed):
    """pci_bus_id joins dcgm-exporter's only if it is byte for byte NVML's `%08X:%02X:%02X.%X`."""
    assert dcgm_pci_bus_id(given) == printed


def _series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _dcgm_exporter(name: str, index: int, uuid: str, pci: str, value: float) -> dict[str, str]:
    """One series as dcgm-exporter renders it (its gpuMetricsFormat) and the GPU Operator's scrape labels it."""
    labels = {"job": "nvidia-dcgm-exporter", "instance": "10.0.0.9:9400", "namespace": "gpu-operator",
              "pod": "nvidia-dcgm-exporter-q7", "gpu": str(index), "UUID": uuid, "pci_bus_id": pci,
              "device": f"nvidia{index}", "modelName": MODEL, "Hostname": "node-a",
              "DCGM_FI_DRIVER_VERSION": "580.95.05"}
    return {"series": _series(name, labels), "values": f"{value}x5"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus) not installed")
@pytest.mark.parametrize("on", ["UUID", "Hostname, gpu", "Hostname, pci_bus_id"])
def test_the_agents_exposition_joins_dcgm_exporters_series(tmp_path: Path, on: str):
    """Our real exposition, scraped as the ServiceMonitor scrapes it, joins dcgm-exporter's series in PromQL
    (promtool): the fatal GPU's dcgm-exporter temperature comes back with our status."""
    registry = CollectorRegistry()
    Metrics(registry).set_gpu_status({GPU0[0]: "healthy", GPU1[0]: "fatal"}, gpus(), hostname="node-a")
    scrape = {"job": "gpu-health-agent", "instance": "10.0.0.9:9402", "pod": "gpu-health-agent-x2", "node": "node-a"}
    ours = [{"series": _series("gpu_health_gpu_status", scrape | labels), "values": f"{value:g}x5"}
            for labels, value in status_samples(registry)]
    theirs = [_dcgm_exporter("DCGM_FI_DEV_GPU_TEMP", 0, GPU0[0], "00000000:1A:00.0", 41),
              _dcgm_exporter("DCGM_FI_DEV_GPU_TEMP", 1, GPU1[0], "00000000:2B:00.0", 88)]
    expr = (f"max by (UUID) (DCGM_FI_DEV_GPU_TEMP * on ({on}) group_left (status) "
            f'max by ({on}, status) (gpu_health_gpu_status{{status!="healthy"}} == 1))')
    test = {"tests": [{"interval": "1m", "input_series": ours + theirs, "promql_expr_test": [
        {"expr": expr, "eval_time": "3m", "exp_samples": [{"labels": f'{{UUID="{GPU1[0]}"}}', "value": 88}]}]}]}
    (tmp_path / "join.yaml").write_text(yaml.safe_dump(test))
    result = subprocess.run(["promtool", "test", "rules", "join.yaml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr

"""NVML discovery of one GPU: its name, UUID and PCI address, MIG devices and temperature thresholds."""

from __future__ import annotations

from typing import Any

from agent.logs import get_logger
from agent.model import GpuRef
from agent.sources.bounded import CallTimeout, TooManyHungCalls
from agent.sources.nvml_calls import ERROR_GPU_IS_LOST, GpuState, NvmlCalls, handle_key, text
from agent.sources.thresholds import plausible_threshold

log = get_logger("agent.sources.nvml")

THRESHOLDS = {"shutdown": 0, "slowdown": 1, "mem_max": 2}


def discover(calls: NvmlCalls, nvml: Any, index: int) -> GpuState:
    """The GPU at `index`; one that cannot even name itself is known by index, lost or Unknown."""
    key = f"gpu{index}"
    handle = calls.call("nvmlDeviceGetHandleByIndex", nvml.nvmlDeviceGetHandleByIndex, index, key=key)
    try:
        uuid = text(calls.call("nvmlDeviceGetUUID", nvml.nvmlDeviceGetUUID, handle, key=key))
        pci = text(calls.call("nvmlDeviceGetPciInfo", nvml.nvmlDeviceGetPciInfo, handle, key=key).busId)
        name = text(calls.call("nvmlDeviceGetName", nvml.nvmlDeviceGetName, handle, key=key))
    except (nvml.NVMLError, CallTimeout, TooManyHungCalls) as exc:
        # A GPU that cannot even name itself is still a GPU of this node: known by index, read as lost
        # (GPU_IS_LOST) or Unknown (another error, or a call that hung: the other GPUs are still found).
        gpu = GpuState(GpuRef(index=index), handle, handle_key(handle))
        gpu.readings["discovery_error"] = str(exc)
        gpu.lost = getattr(exc, "value", None) == ERROR_GPU_IS_LOST
        if isinstance(exc, CallTimeout):
            gpu.hung_call = exc.name
        return gpu
    gpu = GpuState(GpuRef(index, uuid, pci.lower(), name), handle, handle_key(handle))
    mig = calls.optional(gpu, "nvmlDeviceGetMigMode", nvml.nvmlDeviceGetMigMode, handle, aux=True)
    gpu.mig_mode = int(mig[0]) if mig else 0
    if gpu.mig_mode:
        gpu.mig_uuids = mig_devices(calls, nvml, gpu)
    gpu.shutdown_c = threshold(calls, nvml, gpu, "shutdown")
    gpu.slowdown_c = threshold(calls, nvml, gpu, "slowdown")
    gpu.mem_max_c = threshold(calls, nvml, gpu, "mem_max")
    return gpu


def threshold(calls: NvmlCalls, nvml: Any, gpu: GpuState, name: str) -> float | None:
    """A temperature threshold the GPU reports, or None (with a warning) when it cannot be a real one."""
    value = calls.optional(gpu, f"threshold.{name}", nvml.nvmlDeviceGetTemperatureThreshold,
                           gpu.handle, THRESHOLDS[name], aux=True)
    if value is None:
        return None
    if not plausible_threshold(float(value)):
        log.warning("nvml_threshold_ignored", gpu=gpu.ref.uuid or gpu.ref.index, threshold=name, value=value)
        gpu.readings.setdefault("ignored_thresholds", {})[name] = value
        return None
    return float(value)


def mig_devices(calls: NvmlCalls, nvml: Any, gpu: GpuState) -> list[str]:
    """The UUIDs of a MIG-enabled GPU's MIG devices, so pods holding them are known to be on this GPU."""
    count = calls.optional(gpu, "nvmlDeviceGetMaxMigDeviceCount", nvml.nvmlDeviceGetMaxMigDeviceCount,
                           gpu.handle, aux=True) or 0
    uuids = []
    for index in range(int(count)):
        handle = calls.optional(gpu, "nvmlDeviceGetMigDeviceHandleByIndex",
                                nvml.nvmlDeviceGetMigDeviceHandleByIndex, gpu.handle, index, aux=True)
        gpu.unsupported.discard("nvmlDeviceGetMigDeviceHandleByIndex")  # a free slot is not "unsupported"
        if handle is None:
            continue
        uuid = calls.optional(gpu, "mig.uuid", nvml.nvmlDeviceGetUUID, handle, aux=True)
        if uuid:
            uuids.append(text(uuid))
    return uuids

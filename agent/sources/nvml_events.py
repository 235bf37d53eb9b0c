"""NVML events as observations: Xid, double-bit ECC, GPU unavailable and recovery action, as they happen."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from agent.logs import get_logger
from agent.model import AttrValue, GpuRef, Observation, Signal, frozen_attrs
from agent.sources.base import Emit
from agent.sources.bounded import CallTimeout, TooManyHungCalls
from agent.sources.nvml_calls import ERROR_TIMEOUT, GpuLost, GpuState, NvmlCalls, handle_key

log = get_logger("agent.sources.nvml")

NO_MIG_INSTANCE = 0xFFFFFFFF
EVENT_DBE, EVENT_XID = 0x2, 0x8
EVENT_GPU_UNAVAILABLE, EVENT_RECOVERY_ACTION = 0x4000, 0x8000
WANTED_EVENTS = EVENT_DBE | EVENT_XID | EVENT_GPU_UNAVAILABLE | EVENT_RECOVERY_ACTION
XID_REMAP_FAILURE = 64
_SIGNALS = {EVENT_XID: Signal.XID, EVENT_DBE: Signal.ECC_DBE, EVENT_GPU_UNAVAILABLE: Signal.GPU_LOST,
            EVENT_RECOVERY_ACTION: Signal.RECOVERY_ACTION}


def watch_events(calls: NvmlCalls, gpus: list[GpuState], emit: Emit, stop: threading.Event, *, wait_ms: int,
                 clock: Callable[[], float], session: contextlib.AbstractContextManager[Any] | None = None,
                 current: Callable[[], bool] = lambda: True) -> bool:
    """Register every GPU for the events it supports, then emit each event until `stop` is set or NVML's session
    is no longer `current` (a GPU reset released it: True, the caller starts the next session); False when
    events cannot be had at all. Each wait runs under `session`, so a release waits for the wait under way."""
    nvml = calls.nvml
    try:
        event_set = calls.call("nvmlEventSetCreate", nvml.nvmlEventSetCreate)
    except Exception:  # noqa: BLE001 - isolation: one failure must not stop the rest
        return False
    held = session if session is not None else contextlib.nullcontext()
    by_handle = {gpu.handle_key: gpu for gpu in gpus}
    for gpu in gpus:
        try:
            supported = calls.optional(gpu, "nvmlDeviceGetSupportedEventTypes",
                                       nvml.nvmlDeviceGetSupportedEventTypes, gpu.handle)
            mask = int(supported or 0) & WANTED_EVENTS
            if mask:
                calls.optional(gpu, "nvmlDeviceRegisterEvents", nvml.nvmlDeviceRegisterEvents, gpu.handle, mask,
                               event_set)
        except (CallTimeout, TooManyHungCalls, GpuLost) as exc:  # that GPU's events only; the others still come
            log.warning("nvml_events_not_registered", gpu=gpu.ref.uuid or gpu.ref.index, error=str(exc))
    try:
        while not stop.is_set():
            try:
                with held:
                    if not current():
                        return True
                    data = nvml.nvmlEventSetWait_v2(event_set, wait_ms)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != ERROR_TIMEOUT:
                    stop.wait(wait_ms / 1000)
                continue
            source_gpu = by_handle.get(handle_key(data.device))
            if source_gpu is not None:
                observation = event_observation(source_gpu, data, clock())
                if observation is not None:
                    emit(observation)
    finally:
        with contextlib.suppress(Exception):  # freeing on a wedged driver is best effort
            nvml.nvmlEventSetFree(event_set)
    return True


def event_observation(gpu: GpuState, data: Any, now: float) -> Observation | None:
    """An NVML event as an observation: Xid, double-bit ECC, GPU unavailable, recovery action."""
    kind, payload = int(data.eventType), int(data.eventData)
    ref = gpu.ref
    attrs: dict[str, AttrValue] = {"event_type": kind}
    gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
    if gi != NO_MIG_INSTANCE:
        attrs.update(gpu_instance=gi, compute_instance=ci if ci != NO_MIG_INSTANCE else -1)
        ref = GpuRef(ref.index, ref.uuid, ref.pci_bus_id, ref.model, mig_parent_uuid=ref.uuid,
                     mig_gpu_instance=gi, mig_compute_instance=ci if ci != NO_MIG_INSTANCE else None)
    signal = _SIGNALS.get(kind)
    if signal is None:
        return None
    value = float(payload) if signal in {Signal.XID, Signal.RECOVERY_ACTION} else 1.0
    if signal is Signal.XID and payload == XID_REMAP_FAILURE:
        # Whether a remap failure can be ruled out: not while the remap state cannot be read.
        attrs["remap_state"] = str(gpu.readings.get("remap_state", "unreadable"))
    return Observation(signal, value, now, "nvml-event", ref, frozen_attrs(attrs))

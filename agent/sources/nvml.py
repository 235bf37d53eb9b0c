"""The NVML source: polls every GPU's health counters and waits on NVML events, each call under a deadline.

Counters become deltas between polls; NotSupported is remembered per GPU and call, and probed again when
the GPU's MIG mode changes and every `reprobe_seconds`; a hung call, or a GPU whose every call fails with an
unexpected error, makes that GPU Unknown (its own observation), never a hardware fault; GPU lost and
"reset required" are their own observations. The node's GPUs and the NVLinks seen up are remembered in a
NodeMemory, so a GPU missing after a reboot, or a link down since it, is seen.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.logs import get_logger
from agent.model import AttrValue, GpuRef, Observation, Signal, frozen_attrs
from agent.sources.attribution import pod_of_pid
from agent.sources.base import Emit
from agent.sources.bounded import BoundedCaller, CallTimeout, TooManyHungCalls
from agent.sources.node_memory import InMemory, NodeMemory
from agent.sources.thresholds import plausible_threshold

log = get_logger("agent.sources.nvml")

# NVML constants used here (public NVML API documentation).
ERROR_NOT_SUPPORTED = 3
ERROR_TIMEOUT = 10
ERROR_GPU_IS_LOST = 15
ERROR_RESET_REQUIRED = 16
ERROR_FUNCTION_NOT_FOUND = 13
NO_MIG_INSTANCE = 0xFFFFFFFF
TEMPERATURE_GPU = 0
THRESHOLD_SHUTDOWN, THRESHOLD_SLOWDOWN, THRESHOLD_MEM_MAX = 0, 1, 2
MEMORY_ERROR_CORRECTED, MEMORY_ERROR_UNCORRECTED = 0, 1
VOLATILE_ECC, AGGREGATE_ECC = 0, 1
RETIREMENT_SBE, RETIREMENT_DBE = 0, 1
FIELD_RECOVERY_ACTION = 230
FIELD_MEMORY_TEMP = 82
FIELD_PCIE_REPLAY = 94
NVLINK_FIELDS = {38: "crc_flit", 45: "crc_data", 52: "replay", 59: "recovery", 160: "ecc_data"}
POLL_FIELDS = [FIELD_RECOVERY_ACTION, FIELD_MEMORY_TEMP, FIELD_PCIE_REPLAY, *NVLINK_FIELDS]
EVENT_DBE, EVENT_XID = 0x2, 0x8
EVENT_GPU_UNAVAILABLE, EVENT_RECOVERY_ACTION = 0x4000, 0x8000
WANTED_EVENTS = EVENT_DBE | EVENT_XID | EVENT_GPU_UNAVAILABLE | EVENT_RECOVERY_ACTION
MAX_NVLINKS = 18
SRAM_STATUS_VERSION = 0x1000068  # nvmlEccSramErrorStatus_v1
REPROBE_SECONDS = 600.0
XID_REMAP_FAILURE = 64
INVENTORY_KEY = "nvml.inventory"
NVLINK_KEY = "nvml.nvlinks_seen_up"
WEEK_SECONDS = 7 * 24 * 3600
MEMORY_LOCATIONS = {"l1": 0, "l2": 1, "dram": 2, "register_file": 3, "sram": 7}
# DCGM's PCIe watch: replays per minute per lane allowed at each generation (a 1e-12 bit-error rate).
PCIE_REPLAYS_PER_LANE_PER_MIN = {1: 0.15, 2: 0.3, 3: 0.48, 4: 0.96, 5: 1.92, 6: 3.84}


@dataclass(slots=True)
class GpuState:
    """One GPU as the source knows it: identity, handle, static limits, counters of the last poll."""

    ref: GpuRef
    handle: Any
    handle_key: int
    mig_mode: int = 0
    slowdown_c: float | None = None
    shutdown_c: float | None = None
    mem_max_c: float | None = None
    unsupported: set[str] = field(default_factory=set)
    counters: dict[str, float] = field(default_factory=dict)
    links_seen_up: set[int] = field(default_factory=set)
    nvlinks: int | None = None
    replay_at: float | None = None
    readings: dict[str, Any] = field(default_factory=dict)
    lost: bool = False
    mig_uuids: list[str] = field(default_factory=list)
    probed_at: float = 0.0


class GpuLost(Exception):
    """The GPU answered NVML_ERROR_GPU_IS_LOST."""


class _Abandoned(Exception):
    """The poll that made this call has timed out and moved on."""


@dataclass(slots=True)
class _Reading:
    """One poll of one GPU on the worker thread: which call it is in, and whether it was abandoned."""

    abandoned: threading.Event = field(default_factory=threading.Event)
    current: str = ""
    succeeded: int = 0
    failed: int = 0
    reset_required: str = ""


class NvmlSource:
    """Polls GPUs every `poll_seconds`; a second thread turns NVML events into observations at once."""

    name = "nvml"

    def __init__(self, nvml: Any, *, poll_seconds: float = 10.0, call_timeout_seconds: float = 2.0,
                 clock: Callable[[], float] = time.time, event_wait_ms: int = 500,
                 memory: NodeMemory | None = None, reprobe_seconds: float = REPROBE_SECONDS) -> None:
        self.nvml = nvml
        self.memory: NodeMemory = memory if memory is not None else InMemory()
        self.reprobe_seconds = reprobe_seconds
        self.missing: list[GpuRef] = []
        self.poll_seconds = poll_seconds
        self.caller = BoundedCaller(timeout_seconds=call_timeout_seconds)
        self.clock = clock
        self.event_wait_ms = event_wait_ms
        self.gpus: list[GpuState] = []
        self._reading: contextvars.ContextVar[_Reading | None] = contextvars.ContextVar("nvml_reading", default=None)
        self.driver_version = ""
        self.ready = threading.Event()
        # The GPU reset's seam (release_for_reset below): while released, NVML is shut down and nothing reads it.
        self._session = threading.RLock()
        self._released = False
        self._session_generation = 0

    # ---- lifecycle ----
    def start(self) -> None:
        """nvmlInit and discover the GPUs (raises the NVML error when the driver or library is missing)."""
        self._call("nvmlInit", self.nvml.nvmlInit)
        self.driver_version = _text(self._call("nvmlSystemGetDriverVersion", self.nvml.nvmlSystemGetDriverVersion))
        count = int(self._call("nvmlDeviceGetCount", self.nvml.nvmlDeviceGetCount))
        self.gpus = [self._discover(index) for index in range(count)]
        self._remember_inventory()
        self._restore_nvlink_baselines()

    # ---- what the node had before ----
    def _remember_inventory(self) -> None:
        """Compare the GPUs found with those the node had before; remember every GPU ever seen here.

        A GPU that cannot even name itself is present but unreadable (reported lost), so while one is,
        nothing is called missing: it may be that very GPU.
        """
        known = [g for g in self.memory.load(INVENTORY_KEY) or [] if isinstance(g, dict) and g.get("uuid")]
        present = {gpu.ref.uuid for gpu in self.gpus if gpu.ref.uuid}
        unnamed = any(not gpu.ref.uuid for gpu in self.gpus)
        self.missing = [] if unnamed else [
            GpuRef(uuid=str(g["uuid"]), pci_bus_id=str(g.get("pci", "")), model=str(g.get("model", "")))
            for g in known if g["uuid"] not in present]
        for ref in self.missing:
            log.warning("gpu_missing", gpu=ref.uuid, pci=ref.pci_bus_id)
        inventory = {str(g["uuid"]): g for g in known}
        for gpu in self.gpus:
            if gpu.ref.uuid:
                inventory[gpu.ref.uuid] = {"uuid": gpu.ref.uuid, "pci": gpu.ref.pci_bus_id, "model": gpu.ref.model,
                                           "index": gpu.ref.index}
        self.memory.save(INVENTORY_KEY, sorted(inventory.values(), key=lambda g: str(g["uuid"])))

    def forget_gpu(self, uuid: str) -> None:
        """An operator released a missing GPU (removed or replaced on purpose): stop reporting it."""
        known = self.memory.load(INVENTORY_KEY) or []
        self.memory.save(INVENTORY_KEY, [g for g in known if isinstance(g, dict) and g.get("uuid") != uuid])
        self.missing = [ref for ref in self.missing if ref.uuid != uuid]

    def _restore_nvlink_baselines(self) -> None:
        saved = self.memory.load(NVLINK_KEY) or {}
        for gpu in self.gpus:
            links = saved.get(gpu.ref.uuid) if isinstance(saved, dict) else None
            if isinstance(links, list):
                gpu.links_seen_up.update(int(n) for n in links if isinstance(n, int))

    def _save_nvlink_baselines(self) -> None:
        self.memory.save(NVLINK_KEY, {gpu.ref.uuid: sorted(gpu.links_seen_up)
                                      for gpu in self.gpus if gpu.ref.uuid and gpu.links_seen_up})

    def stop(self) -> None:
        with contextlib.suppress(Exception):  # shutting down a wedged driver is best effort
            self._call("nvmlShutdown", self.nvml.nvmlShutdown)
        self.caller.close()

    def run(self, emit: Emit, stop: threading.Event) -> None:
        self.start()
        events = threading.Thread(target=self._events, args=(emit, stop), name="nvml-events", daemon=True)
        events.start()
        self.ready.set()
        try:
            while not stop.is_set():
                started = self.clock()
                for observation in self.poll():
                    emit(observation)
                stop.wait(max(0.0, self.poll_seconds - (self.clock() - started)))
        finally:
            events.join(timeout=2 * self.event_wait_ms / 1000 + 1)
            self.stop()

    def _discover(self, index: int) -> GpuState:
        handle = self._call("nvmlDeviceGetHandleByIndex", self.nvml.nvmlDeviceGetHandleByIndex, index)
        try:
            uuid = _text(self._call("nvmlDeviceGetUUID", self.nvml.nvmlDeviceGetUUID, handle))
            pci = _text(self._call("nvmlDeviceGetPciInfo", self.nvml.nvmlDeviceGetPciInfo, handle).busId)
            name = _text(self._call("nvmlDeviceGetName", self.nvml.nvmlDeviceGetName, handle))
        except self.nvml.NVMLError as exc:
            # A GPU that cannot even name itself is still a GPU of this node: known by index, read as lost.
            gpu = GpuState(GpuRef(index=index), handle, _handle_key(handle))
            gpu.readings["discovery_error"] = str(exc)
            gpu.lost = getattr(exc, "value", None) == ERROR_GPU_IS_LOST
            return gpu
        gpu = GpuState(GpuRef(index, uuid, pci.lower(), name), handle, _handle_key(handle))
        mig = self._optional(gpu, "nvmlDeviceGetMigMode", self.nvml.nvmlDeviceGetMigMode, handle)
        gpu.mig_mode = int(mig[0]) if mig else 0
        if gpu.mig_mode:
            gpu.mig_uuids = self._mig_devices(gpu)
        gpu.shutdown_c = self._threshold(gpu, "shutdown", THRESHOLD_SHUTDOWN)
        gpu.slowdown_c = self._threshold(gpu, "slowdown", THRESHOLD_SLOWDOWN)
        gpu.mem_max_c = self._threshold(gpu, "mem_max", THRESHOLD_MEM_MAX)
        return gpu

    def _threshold(self, gpu: GpuState, name: str, kind: int) -> float | None:
        """A temperature threshold the GPU reports, or None (with a warning) when it cannot be a real one."""
        value = self._optional(gpu, f"threshold.{name}", self.nvml.nvmlDeviceGetTemperatureThreshold,
                               gpu.handle, kind)
        if value is None:
            return None
        if not plausible_threshold(float(value)):
            log.warning("nvml_threshold_ignored", gpu=gpu.ref.uuid or gpu.ref.index, threshold=name, value=value)
            gpu.readings.setdefault("ignored_thresholds", {})[name] = value
            return None
        return float(value)

    def _mig_devices(self, gpu: GpuState) -> list[str]:
        """The UUIDs of a MIG-enabled GPU's MIG devices, so pods holding them are known to be on this GPU."""
        count = self._optional(gpu, "nvmlDeviceGetMaxMigDeviceCount", self.nvml.nvmlDeviceGetMaxMigDeviceCount,
                               gpu.handle) or 0
        uuids = []
        for index in range(int(count)):
            handle = self._optional(gpu, "nvmlDeviceGetMigDeviceHandleByIndex",
                                    self.nvml.nvmlDeviceGetMigDeviceHandleByIndex, gpu.handle, index)
            gpu.unsupported.discard("nvmlDeviceGetMigDeviceHandleByIndex")  # a free slot is not "unsupported"
            if handle is None:
                continue
            uuid = self._optional(gpu, "mig.uuid", self.nvml.nvmlDeviceGetUUID, handle)
            if uuid:
                uuids.append(_text(uuid))
        return uuids

    def mig_parents(self) -> dict[str, str]:
        """MIG device UUID -> the UUID of the GPU it is a slice of."""
        return {mig: gpu.ref.uuid for gpu in self.gpus for mig in gpu.mig_uuids}

    # ---- calls ----
    def _call(self, name: str, func: Callable[..., Any], *args: Any) -> Any:
        """A driver call: on the poll's worker thread it runs directly (the whole poll of a GPU is under
        one deadline); anywhere else it gets a deadline of its own."""
        reading = self._reading.get()
        if reading is None:
            return self.caller.call(name, func, *args)
        if reading.abandoned.is_set():
            raise _Abandoned
        reading.current = name
        try:
            result = func(*args)
        except self.nvml.NVMLError as exc:
            if getattr(exc, "value", None) not in {ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND}:
                reading.failed += 1  # an unexpected error: a GPU that answers nothing else is Unknown
            raise
        if reading.abandoned.is_set():
            raise _Abandoned  # the poll gave up on this call: touch no state with its late answer
        reading.succeeded += 1
        return result

    def _optional(self, gpu: GpuState, name: str, func: Callable[..., Any], *args: Any) -> Any:
        """A call whose NotSupported is remembered; GPU lost and timeouts propagate; other errors give None."""
        if name in gpu.unsupported:
            return None
        try:
            return self._call(name, func, *args)
        except self.nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == ERROR_GPU_IS_LOST:
                raise GpuLost(name) from None
            if code in {ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND}:
                gpu.unsupported.add(name)
            else:
                gpu.readings.setdefault("errors", {})[name] = str(exc)
                reading = self._reading.get()
                if code == ERROR_RESET_REQUIRED and reading is not None and not reading.reset_required:
                    reading.reset_required = name
            return None

    # ---- polling ----
    def poll(self) -> list[Observation]:
        """One reading of every GPU (also what `check` uses); none while NVML is released for a GPU reset."""
        with self._session:
            return [] if self._released else self._poll_all()

    def _poll_all(self) -> list[Observation]:
        observations: list[Observation] = []
        for gpu in self.gpus:
            observations.extend(self.poll_gpu(gpu))
        now = self.clock()
        for ref in self.missing:
            observations.append(Observation(Signal.GPU_MISSING, 1.0, now, self.name, ref, frozen_attrs(
                {"last_seen": f"PCI {ref.pci_bus_id or '?'} before the last restart",
                 "message": "no longer enumerated by NVML"})))
        return observations

    def poll_gpu(self, gpu: GpuState) -> list[Observation]:
        """Every reading of one GPU, all under one deadline: a hung call makes the GPU Unknown."""
        now = self.clock()
        out: list[Observation] = []
        gpu.readings.pop("errors", None)
        reading = _Reading()
        try:
            if gpu.lost:
                raise GpuLost("nvmlDeviceGetUUID")
            self.caller.call("poll", self._read_in_worker, reading, gpu, now, out)
        except CallTimeout:
            reading.abandoned.set()
            message = f"{reading.current or 'an NVML call'} timed out after {self.caller.timeout:g}s"
            # what was read before the hung call stands; the worker adds nothing once abandoned
            out = [*out, self._obs(gpu, Signal.SOURCE_UNREADABLE, 1, now, message=message)]
            gpu.readings["status_note"] = message
            return out
        except GpuLost as lost:
            out.append(self._obs(gpu, Signal.GPU_LOST, 1, now, message=f"{lost} returned GPU_IS_LOST"))
            gpu.readings["status_note"] = "GPU lost"
            return out
        except TooManyHungCalls as exc:
            out.append(self._obs(gpu, Signal.SOURCE_UNREADABLE, 1, now, message=str(exc)))
            gpu.readings["status_note"] = str(exc)
            return out
        if gpu.ref.uuid:
            out.append(self._obs(gpu, Signal.GPU_MISSING, 0, now))
        out.append(self._obs(gpu, Signal.RESET_REQUIRED, 1 if reading.reset_required else 0, now,
                             message=f"{reading.reset_required} returned NVML_ERROR_RESET_REQUIRED"
                             if reading.reset_required else None))
        if reading.reset_required:
            gpu.readings["status_note"] = "reset required"
            return out
        if reading.failed and not reading.succeeded:
            errors = gpu.readings.get("errors", {})
            first = next(iter(errors.items()), ("an NVML call", "failed"))
            message = f"every NVML call failed ({reading.failed}), e.g. {first[0]}: {first[1]}"
            out.append(self._obs(gpu, Signal.SOURCE_UNREADABLE, 1, now, message=message))
            gpu.readings["status_note"] = message
            return out
        out.append(self._obs(gpu, Signal.SOURCE_UNREADABLE, 0, now))
        out.append(self._polled(gpu, now))
        gpu.readings.pop("status_note", None)
        return out

    def _polled(self, gpu: GpuState, now: float) -> Observation:
        """The whole poll in one reading, what verifies a reset: None where the GPU cannot say."""
        r = gpu.readings
        down = r.get("nvlinks_down")
        return self._obs(gpu, Signal.GPU_POLLED, 1, now, extra={
            "recovery_action": r.get("recovery_action"), "remap_pending": r.get("remap_pending"),
            "retirement_pending": r.get("retired_pages_pending"), "volatile_dbe": r.get("ecc_dbe_volatile"),
            "links_down": len(down) if isinstance(down, list) else None})

    def _read_in_worker(self, reading: _Reading, gpu: GpuState, now: float, out: list[Observation]) -> None:
        self._reading.set(reading)
        try:
            self._read_all(gpu, now, out)
        finally:
            self._reading.set(None)

    def _reprobe(self, gpu: GpuState, now: float) -> None:
        """Forget what was NotSupported when the MIG mode changed (remapped rows come back when MIG goes
        off) and every `reprobe_seconds` (a driver update, a GPU reset)."""
        mig = self._optional(gpu, "nvmlDeviceGetMigMode", self.nvml.nvmlDeviceGetMigMode, gpu.handle)
        mode = int(mig[0]) if mig else gpu.mig_mode
        changed = mode != gpu.mig_mode
        if changed or now - gpu.probed_at >= self.reprobe_seconds:
            if changed:
                log.info("nvml_mig_mode_changed", gpu=gpu.ref.uuid, mig_mode=mode)
            gpu.unsupported.clear()
            gpu.nvlinks = None
            gpu.probed_at = now
            gpu.mig_mode = mode
            if changed:
                gpu.mig_uuids = self._mig_devices(gpu) if mode else []

    def _read_sram(self, gpu: GpuState, now: float, out: list[Observation]) -> None:
        """NVIDIA's WORKFLOW_XID_48: the SRAM uncorrectable-error threshold flag decides replacement."""
        factory = getattr(self.nvml, "c_nvmlEccSramErrorStatus_v1_t", None)
        if factory is None or "nvmlDeviceGetSramEccErrorStatus" in gpu.unsupported:
            return
        status = factory()
        done = self._optional(gpu, "nvmlDeviceGetSramEccErrorStatus", self.nvml.nvmlDeviceGetSramEccErrorStatus,
                              gpu.handle, ctypes.byref(status))
        if done is None:
            return
        exceeded = int(bool(status.bThresholdExceeded))
        gpu.readings["sram_threshold_exceeded"] = bool(exceeded)
        out.append(self._obs(gpu, Signal.SRAM_THRESHOLD_EXCEEDED, exceeded, now,
                             volatile_uncorrected=int(status.volatileUncParity + status.volatileUncSecDed),
                             aggregate_uncorrected=int(status.aggregateUncParity + status.aggregateUncSecDed)))

    def _read_all(self, gpu: GpuState, now: float, out: list[Observation]) -> None:
        nvml, h = self.nvml, gpu.handle
        self._reprobe(gpu, now)
        self._read_temperature(gpu, now, out)
        self._read_fields(gpu, now, out)
        usage = self._optional(gpu, "nvmlDeviceGetPowerUsage", nvml.nvmlDeviceGetPowerUsage, h)
        limit = self._optional(gpu, "nvmlDeviceGetEnforcedPowerLimit", nvml.nvmlDeviceGetEnforcedPowerLimit, h)
        if usage is not None:
            gpu.readings.update(power_w=usage / 1000, power_limit_w=limit / 1000 if limit else None)
            out.append(self._obs(gpu, Signal.POWER, usage / 1000, now, limit_w=limit / 1000 if limit else None))
        reasons = self._optional(gpu, "nvmlDeviceGetCurrentClocksEventReasons",
                                 nvml.nvmlDeviceGetCurrentClocksEventReasons, h)
        if reasons is not None:
            gpu.readings["clocks_event_reasons"] = int(reasons)
            out.append(self._obs(gpu, Signal.CLOCK_EVENTS, int(reasons), now))
        self._read_ecc(gpu, now, out)
        self._read_sram(gpu, now, out)
        self._read_retired_pages(gpu, now, out)
        self._read_remapped_rows(gpu, now, out)
        self._read_nvlink_state(gpu, now, out)
        self._read_pcie_link(gpu, now, out)
        utilization = self._optional(gpu, "nvmlDeviceGetUtilizationRates", nvml.nvmlDeviceGetUtilizationRates, h)
        if utilization is not None:
            gpu.readings.update(utilization_gpu=utilization.gpu, utilization_memory=utilization.memory)
        processes = self._optional(gpu, "nvmlDeviceGetComputeRunningProcesses",
                                   nvml.nvmlDeviceGetComputeRunningProcesses, h)
        if processes is not None:
            gpu.readings["pids"] = sorted(int(p.pid) for p in processes)

    def _read_temperature(self, gpu: GpuState, now: float, out: list[Observation]) -> None:
        nvml, h = self.nvml, gpu.handle
        temp = self._optional(gpu, "nvmlDeviceGetTemperatureV", nvml.nvmlDeviceGetTemperatureV, h, TEMPERATURE_GPU)
        if temp is None and "nvmlDeviceGetTemperatureV" in gpu.unsupported:
            temp = self._optional(gpu, "nvmlDeviceGetTemperature", nvml.nvmlDeviceGetTemperature, h, TEMPERATURE_GPU)
        if temp is None:
            return
        gpu.readings.update(temperature_c=temp, slowdown_c=gpu.slowdown_c, shutdown_c=gpu.shutdown_c)
        out.append(self._obs(gpu, Signal.TEMPERATURE, temp, now, slowdown_c=gpu.slowdown_c,
                             shutdown_c=gpu.shutdown_c))

    def _read_fields(self, gpu: GpuState, now: float, out: list[Observation]) -> None:
        values = self._optional(gpu, "nvmlDeviceGetFieldValues", self.nvml.nvmlDeviceGetFieldValues, gpu.handle,
                                POLL_FIELDS)
        if values is None:
            return
        readings: dict[int, float] = {}
        for value in values:
            if value.nvmlReturn == 0:
                readings[int(value.fieldId)] = float(value.value.ullVal)
            elif value.nvmlReturn == ERROR_GPU_IS_LOST:
                raise GpuLost("nvmlDeviceGetFieldValues")
        if FIELD_RECOVERY_ACTION in readings:
            gpu.readings["recovery_action"] = int(readings[FIELD_RECOVERY_ACTION])
            out.append(self._obs(gpu, Signal.RECOVERY_ACTION, readings[FIELD_RECOVERY_ACTION], now))
        if FIELD_MEMORY_TEMP in readings:
            gpu.readings["memory_temperature_c"] = readings[FIELD_MEMORY_TEMP]
            out.append(self._obs(gpu, Signal.MEMORY_TEMPERATURE, readings[FIELD_MEMORY_TEMP], now,
                                 mem_max_c=gpu.mem_max_c))
        for field_id, counter in NVLINK_FIELDS.items():
            if field_id in readings:
                delta = self._delta(gpu, f"nvlink.{counter}", readings[field_id])
                if delta:
                    out.append(self._obs(gpu, Signal.NVLINK_ERRORS, delta, now, count=int(delta), counter=counter,
                                         link="all"))
        if FIELD_PCIE_REPLAY in readings:
            self._pcie_replay_rate(gpu, readings[FIELD_PCIE_REPLAY], now, out)

    def _pcie_replay_rate(self, gpu: GpuState, total: float, now: float, out: list[Observation]) -> None:
        previous_at = gpu.replay_at
        delta = self._delta(gpu, "pcie.replay", total)
        gpu.replay_at = now
        gpu.readings["pcie_replays"] = total
        if previous_at is None or delta is None or now <= previous_at:
            return
        rate = delta / ((now - previous_at) / 60.0)
        gen = gpu.readings.get("pcie_max_gen") or 5
        width = gpu.readings.get("pcie_max_width") or 16
        limit = math.ceil(PCIE_REPLAYS_PER_LANE_PER_MIN.get(int(gen), 1.92) * int(width))
        out.append(self._obs(gpu, Signal.PCIE_REPLAYS, rate, now, limit_per_min=limit))

    def _read_ecc(self, gpu: GpuState, now: float, out: list[Observation]) -> None:
        nvml, h = self.nvml, gpu.handle
        dbe = self._optional(gpu, "ecc.dbe", nvml.nvmlDeviceGetTotalEccErrors, h, MEMORY_ERROR_UNCORRECTED,
                             VOLATILE_ECC)
        sbe = self._optional(gpu, "ecc.sbe", nvml.nvmlDeviceGetTotalEccErrors, h, MEMORY_ERROR_CORRECTED,
                             VOLATILE_ECC)
        if dbe is not None:
            first = "ecc.dbe" not in gpu.counters
            delta = self._delta(gpu, "ecc.dbe", float(dbe))
            gpu.readings["ecc_dbe_volatile"] = int(dbe)
            new = float(dbe) if first else (delta or 0.0)
            if new > 0:
                aggregate = self._optional(gpu, "ecc.dbe.aggregate", nvml.nvmlDeviceGetTotalEccErrors, h,
                                           MEMORY_ERROR_UNCORRECTED, AGGREGATE_ECC)
                out.append(self._obs(gpu, Signal.ECC_DBE, new, now, volatile_total=int(dbe),
                                     aggregate_total=int(aggregate) if aggregate is not None else None,
                                     extra=self._dbe_locations(gpu)))
        if sbe is not None:
            delta = self._delta(gpu, "ecc.sbe", float(sbe))
            gpu.readings["ecc_sbe_volatile"] = int(sbe)
            if delta:
                out.append(self._obs(gpu, Signal.ECC_SBE, delta, now, count=int(delta), volatile_total=int(sbe)))

    def _dbe_locations(self, gpu: GpuState) -> dict[str, AttrValue | None]:
        """Where the uncorrectable errors are (volatile counts per memory location), read when a DBE is new."""
        counts: dict[str, AttrValue | None] = {}
        for name, location in MEMORY_LOCATIONS.items():
            count = self._optional(gpu, f"ecc.location.{name}", self.nvml.nvmlDeviceGetMemoryErrorCounter,
                                   gpu.handle, MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC, location)
            if count:
                counts[f"dbe_{name}"] = int(count)
        return counts

    def _read_retired_pages(self, gpu: GpuState, now: float, out: list[Observation]) -> None:
        nvml, h = self.nvml, gpu.handle
        sbe = self._optional(gpu, "retired.sbe", nvml.nvmlDeviceGetRetiredPages, h, RETIREMENT_SBE)
        dbe_pages = self._optional(gpu, "retired.dbe.v2", nvml.nvmlDeviceGetRetiredPages_v2, h, RETIREMENT_DBE)
        dbe: int | None
        new_this_week: int | None
        if dbe_pages is not None:
            dbe, new_this_week = len(dbe_pages), sum(1 for p in dbe_pages if now - p["timestamp"] < WEEK_SECONDS)
        else:
            listed = self._optional(gpu, "retired.dbe", nvml.nvmlDeviceGetRetiredPages, h, RETIREMENT_DBE)
            dbe, new_this_week = (len(listed), None) if listed is not None else (None, None)
        if sbe is not None and dbe is not None:
            gpu.readings.update(retired_pages_sbe=len(sbe), retired_pages_dbe=dbe)
            out.append(self._obs(gpu, Signal.RETIRED_PAGES, len(sbe) + dbe, now, sbe=len(sbe), dbe=dbe,
                                 dbe_new_last_week=new_this_week))
        pending = self._optional(gpu, "retired.pending", nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
        if pending is not None:
            gpu.readings["retired_pages_pending"] = int(pending)
            out.append(self._obs(gpu, Signal.RETIRED_PAGES_PENDING, int(pending), now))

    def _read_remapped_rows(self, gpu: GpuState, now: float, out: list[Observation]) -> None:
        rows = self._optional(gpu, "nvmlDeviceGetRemappedRows", self.nvml.nvmlDeviceGetRemappedRows, gpu.handle)
        gpu.readings["remap_state"] = "unreadable" if rows is None else "readable"
        if rows is None:
            return
        corr, unc, pending, failure = (int(v) for v in rows)
        gpu.readings.update(remap_correctable=corr, remap_uncorrectable=unc, remap_pending=pending,
                            remap_failure=failure)
        out.append(self._obs(gpu, Signal.ROW_REMAP_PENDING, pending, now, correctable_rows=corr,
                             uncorrectable_rows=unc))
        out.append(self._obs(gpu, Signal.ROW_REMAP_FAILURE, failure, now))
        out.append(self._obs(gpu, Signal.ROW_REMAP_UNCORRECTABLE, unc, now))

    def _read_nvlink_state(self, gpu: GpuState, now: float, out: list[Observation]) -> None:
        if "nvlink.state" in gpu.unsupported:
            return
        down: list[int] = []
        learned = False
        links = gpu.nvlinks if gpu.nvlinks is not None else MAX_NVLINKS
        for link in range(links):
            try:
                active = self._call("nvmlDeviceGetNvLinkState", self.nvml.nvmlDeviceGetNvLinkState, gpu.handle, link)
            except self.nvml.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code == ERROR_GPU_IS_LOST:
                    raise GpuLost("nvmlDeviceGetNvLinkState") from None
                if gpu.nvlinks is None:
                    gpu.nvlinks = link
                    if link == 0:
                        gpu.unsupported.add("nvlink.state")
                break
            if active:
                if link not in gpu.links_seen_up:
                    gpu.links_seen_up.add(link)
                    learned = True
            elif link in gpu.links_seen_up:
                down.append(link)
        else:
            gpu.nvlinks = links
        if learned:
            self._save_nvlink_baselines()  # a link seen up is remembered across restarts and reboots
        # A link counts as down only against a baseline (seen up before, remembered across restarts); a link
        # with no baseline gives no reading, so "none down" is said only when every link has one.
        without_baseline = (gpu.nvlinks or 0) - len(gpu.links_seen_up)
        if gpu.links_seen_up:
            gpu.readings.update(nvlinks_up=len(gpu.links_seen_up) - len(down), nvlinks_down=down,
                                nvlinks_without_baseline=max(0, without_baseline))
        if down or (gpu.links_seen_up and without_baseline <= 0):
            out.append(self._obs(gpu, Signal.NVLINK_DOWN, len(down), now,
                                 links=",".join(str(n) for n in down) or "none"))

    def _read_pcie_link(self, gpu: GpuState, now: float, out: list[Observation]) -> None:
        nvml, h = self.nvml, gpu.handle
        width = self._optional(gpu, "nvmlDeviceGetCurrPcieLinkWidth", nvml.nvmlDeviceGetCurrPcieLinkWidth, h)
        if "pcie_max_width" not in gpu.readings:
            gpu.readings["pcie_max_width"] = self._optional(gpu, "nvmlDeviceGetMaxPcieLinkWidth",
                                                            nvml.nvmlDeviceGetMaxPcieLinkWidth, h)
            gpu.readings["pcie_max_gen"] = self._optional(gpu, "nvmlDeviceGetMaxPcieLinkGeneration",
                                                          nvml.nvmlDeviceGetMaxPcieLinkGeneration, h)
        gen = self._optional(gpu, "nvmlDeviceGetCurrPcieLinkGeneration", nvml.nvmlDeviceGetCurrPcieLinkGeneration, h)
        gpu.readings.update(pcie_width=width, pcie_gen=gen)
        max_width = gpu.readings.get("pcie_max_width")
        if width is not None and max_width:
            out.append(self._obs(gpu, Signal.PCIE_LINK, int(width), now, max_width=int(max_width),
                                 gen=int(gen or 0), max_gen=int(gpu.readings.get("pcie_max_gen") or 0)))

    def _delta(self, gpu: GpuState, name: str, value: float) -> float | None:
        """The increase since the last poll (None on the first); a counter that went back restarted (reset)."""
        previous = gpu.counters.get(name)
        gpu.counters[name] = value
        if previous is None:
            return None
        return value - previous if value >= previous else value

    def _obs(self, gpu: GpuState, signal: Signal, value: float, now: float, *, count: int = 1,
             extra: dict[str, AttrValue | None] | None = None, **attrs: AttrValue | None) -> Observation:
        clean = {k: v for k, v in {**attrs, **(extra or {})}.items() if v is not None}
        if gpu.mig_mode:
            clean["mig_mode"] = gpu.mig_mode
        return Observation(signal, float(value), now, self.name, gpu.ref, frozen_attrs(clean), max(1, count))

    def pids_by_gpu(self) -> dict[str, list[int]]:
        """The compute processes each GPU ran at the last poll (for finding the pods on a faulty GPU)."""
        return {gpu.ref.uuid: list(gpu.readings.get("pids", [])) for gpu in self.gpus if gpu.ref.uuid}

    def gpus_by_pod_uid(self, proc_root: Path = Path("/proc")) -> dict[str, list[str]]:
        """Those processes charged to their pods through /proc/<pid>/cgroup: pod UID -> GPU UUIDs."""
        mapping: dict[str, list[str]] = {}
        for uuid, pids in self.pids_by_gpu().items():
            for pid in pids:
                pod = pod_of_pid(pid, proc_root)
                if pod is not None and uuid not in mapping.setdefault(pod.pod_uid, []):
                    mapping[pod.pod_uid].append(uuid)
        return mapping

    # ---- events ----
    def _events(self, emit: Emit, stop: threading.Event) -> None:
        """Event sessions, one per NVML session: a GPU reset's release ends one, the reacquire starts the next."""
        while not stop.is_set():
            if self._released:
                stop.wait(self.event_wait_ms / 1000)
                continue
            if not self._event_session(emit, stop, self._session_generation):
                return

    def _event_session(self, emit: Emit, stop: threading.Event, generation: int) -> bool:
        """Wait for events until stopped or NVML's session changes; False when events cannot be had at all."""
        nvml = self.nvml
        try:
            event_set = self._call("nvmlEventSetCreate", nvml.nvmlEventSetCreate)
        except Exception:  # noqa: BLE001 - isolation: one failure must not stop the rest
            return False
        by_handle = {gpu.handle_key: gpu for gpu in self.gpus}
        for gpu in self.gpus:
            supported = self._optional(gpu, "nvmlDeviceGetSupportedEventTypes", nvml.nvmlDeviceGetSupportedEventTypes,
                                       gpu.handle)
            mask = int(supported or 0) & WANTED_EVENTS
            if mask:
                self._optional(gpu, "nvmlDeviceRegisterEvents", nvml.nvmlDeviceRegisterEvents, gpu.handle, mask,
                               event_set)
        try:
            while not stop.is_set():
                try:
                    with self._session:
                        if self._released or generation != self._session_generation:
                            return True
                        data = nvml.nvmlEventSetWait_v2(event_set, self.event_wait_ms)
                except nvml.NVMLError as exc:
                    if getattr(exc, "value", None) != ERROR_TIMEOUT:
                        stop.wait(self.event_wait_ms / 1000)
                    continue
                source_gpu = by_handle.get(_handle_key(data.device))
                if source_gpu is not None:
                    observation = self.event_observation(source_gpu, data)
                    if observation is not None:
                        emit(observation)
        finally:
            with contextlib.suppress(Exception):  # freeing on a wedged driver is best effort
                nvml.nvmlEventSetFree(event_set)
        return True

    # ---- the GPU reset's seam (agent/gpu/reset.py NvmlHandles) ----
    def release_for_reset(self) -> None:
        """nvmlShutdown, after the poll or event wait under way: NVML holds every /dev/nvidiaN open while it is
        initialised, and the driver resets no GPU that any process holds. Nothing is read until reacquired."""
        with self._session:
            if not self._released:
                self._released = True
                self._call("nvmlShutdown", self.nvml.nvmlShutdown)

    def reacquire_after_reset(self) -> None:
        """nvmlInit and each GPU's handle again; readings and event waits resume. Should nvmlInit fail, polls resume
        anyway, so the GPUs read as unreadable (Unknown) rather than silently not at all."""
        with self._session:
            if not self._released:
                return
            try:
                self._call("nvmlInit", self.nvml.nvmlInit)
                for gpu in self.gpus:  # by index, as discovered; a reset renumbers nothing
                    if gpu.ref.index is not None:
                        gpu.handle = self._call("nvmlDeviceGetHandleByIndex", self.nvml.nvmlDeviceGetHandleByIndex,
                                                gpu.ref.index)
                        gpu.handle_key = _handle_key(gpu.handle)
            finally:
                self._released = False
                self._session_generation += 1

    def event_observation(self, gpu: GpuState, data: Any) -> Observation | None:
        """An NVML event as an observation: Xid, double-bit ECC, GPU unavailable, recovery action."""
        now = self.clock()
        kind, payload = int(data.eventType), int(data.eventData)
        ref = gpu.ref
        attrs: dict[str, AttrValue] = {"event_type": kind}
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        if gi != NO_MIG_INSTANCE:
            attrs.update(gpu_instance=gi, compute_instance=ci if ci != NO_MIG_INSTANCE else -1)
            ref = GpuRef(ref.index, ref.uuid, ref.pci_bus_id, ref.model, mig_parent_uuid=ref.uuid,
                         mig_gpu_instance=gi, mig_compute_instance=ci if ci != NO_MIG_INSTANCE else None)
        signal = {EVENT_XID: Signal.XID, EVENT_DBE: Signal.ECC_DBE, EVENT_GPU_UNAVAILABLE: Signal.GPU_LOST,
                  EVENT_RECOVERY_ACTION: Signal.RECOVERY_ACTION}.get(kind)
        if signal is None:
            return None
        value = float(payload) if signal in {Signal.XID, Signal.RECOVERY_ACTION} else 1.0
        if signal is Signal.XID and payload == XID_REMAP_FAILURE:
            # Whether a remap failure can be ruled out: not while the remap state cannot be read.
            attrs["remap_state"] = str(gpu.readings.get("remap_state", "unreadable"))
        return Observation(signal, value, now, "nvml-event", ref, frozen_attrs(attrs))


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


def load_pynvml() -> Any:
    """The real pynvml module (nvidia-ml-py)."""
    import pynvml  # noqa: PLC0415 - only the NVML source touches the driver bindings

    return pynvml


def probe_calls(source: NvmlSource) -> list[tuple[int, str, str]]:
    """(GPU index, NVML call, supported | NotSupported | error: ...) for every read the agent makes."""
    nvml = source.nvml
    results: list[tuple[int, str, str]] = []
    for gpu in source.gpus:
        calls: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
            ("nvmlDeviceGetTemperatureV", nvml.nvmlDeviceGetTemperatureV, (TEMPERATURE_GPU,)),
            ("nvmlDeviceGetTemperatureThreshold(SHUTDOWN)", nvml.nvmlDeviceGetTemperatureThreshold,
             (THRESHOLD_SHUTDOWN,)),
            ("nvmlDeviceGetTemperatureThreshold(SLOWDOWN)", nvml.nvmlDeviceGetTemperatureThreshold,
             (THRESHOLD_SLOWDOWN,)),
            ("nvmlDeviceGetTemperatureThreshold(MEM_MAX)", nvml.nvmlDeviceGetTemperatureThreshold,
             (THRESHOLD_MEM_MAX,)),
            ("nvmlDeviceGetPowerUsage", nvml.nvmlDeviceGetPowerUsage, ()),
            ("nvmlDeviceGetEnforcedPowerLimit", nvml.nvmlDeviceGetEnforcedPowerLimit, ()),
            ("nvmlDeviceGetCurrentClocksEventReasons", nvml.nvmlDeviceGetCurrentClocksEventReasons, ()),
            ("nvmlDeviceGetTotalEccErrors(DBE, volatile)", nvml.nvmlDeviceGetTotalEccErrors,
             (MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC)),
            ("nvmlDeviceGetTotalEccErrors(SBE, volatile)", nvml.nvmlDeviceGetTotalEccErrors,
             (MEMORY_ERROR_CORRECTED, VOLATILE_ECC)),
            ("nvmlDeviceGetRetiredPages(DBE)", nvml.nvmlDeviceGetRetiredPages, (RETIREMENT_DBE,)),
            ("nvmlDeviceGetRetiredPagesPendingStatus", nvml.nvmlDeviceGetRetiredPagesPendingStatus, ()),
            ("nvmlDeviceGetRemappedRows", nvml.nvmlDeviceGetRemappedRows, ()),
            ("nvmlDeviceGetNvLinkState(0)", nvml.nvmlDeviceGetNvLinkState, (0,)),
            ("nvmlDeviceGetCurrPcieLinkWidth", nvml.nvmlDeviceGetCurrPcieLinkWidth, ()),
            ("nvmlDeviceGetMaxPcieLinkWidth", nvml.nvmlDeviceGetMaxPcieLinkWidth, ()),
            ("nvmlDeviceGetCurrPcieLinkGeneration", nvml.nvmlDeviceGetCurrPcieLinkGeneration, ()),
            ("nvmlDeviceGetMaxPcieLinkGeneration", nvml.nvmlDeviceGetMaxPcieLinkGeneration, ()),
            ("nvmlDeviceGetUtilizationRates", nvml.nvmlDeviceGetUtilizationRates, ()),
            ("nvmlDeviceGetSupportedEventTypes", nvml.nvmlDeviceGetSupportedEventTypes, ()),
            ("nvmlDeviceGetMigMode", nvml.nvmlDeviceGetMigMode, ()),
        ]
        calls.extend((f"nvmlDeviceGetFieldValues({f})", _field_status, (nvml, f)) for f in POLL_FIELDS)
        for name, func, args in calls:
            call_args = (args[0], gpu.handle, *args[1:]) if func is _field_status else (gpu.handle, *args)
            results.append((gpu.ref.index or 0, name, _probe(source, name, func, call_args)))
    return results


def _probe(source: NvmlSource, name: str, func: Callable[..., Any], args: tuple[Any, ...]) -> str:
    try:
        source.caller.call(name, func, *args)
    except source.nvml.NVMLError as exc:
        code = getattr(exc, "value", None)
        return "NotSupported" if code in {ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND} else f"error: {exc}"
    except Exception as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
        return f"error: {exc}"
    return "supported"


def _field_status(nvml: Any, handle: Any, field_id: int) -> None:
    [value] = nvml.nvmlDeviceGetFieldValues(handle, [field_id])
    if value.nvmlReturn != 0:
        raise nvml.NVMLError(value.nvmlReturn)

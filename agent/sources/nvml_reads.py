"""The NVML source's readings of one GPU's core and memory: temperature, power, clocks, field values, ECC
(mode and counters), SRAM, retired pages and remapped rows. Each appends its observations to `out`."""

from __future__ import annotations

import ctypes
import math
import re

from agent.model import AttrValue, Observation, Signal
from agent.sources.nvml_calls import GpuLost, GpuState, NvmlCalls, delta, observation

TEMPERATURE_GPU = 0
MEMORY_ERROR_CORRECTED, MEMORY_ERROR_UNCORRECTED = 0, 1
VOLATILE_ECC, AGGREGATE_ECC = 0, 1
RETIREMENT_SBE, RETIREMENT_DBE = 0, 1
FIELD_RECOVERY_ACTION = 230
FIELD_MEMORY_TEMP = 82
FIELD_PCIE_REPLAY = 94
NVLINK_FIELDS = {38: "crc_flit", 45: "crc_data", 52: "replay", 59: "recovery", 160: "ecc_data"}
POLL_FIELDS = [FIELD_RECOVERY_ACTION, FIELD_MEMORY_TEMP, FIELD_PCIE_REPLAY, *NVLINK_FIELDS]
WEEK_SECONDS = 7 * 24 * 3600
MEMORY_LOCATIONS = {"l1": 0, "l2": 1, "dram": 2, "register_file": 3, "sram": 7}
# DCGM's PCIe watch: replays per minute per lane allowed at each generation (a 1e-12 bit-error rate).
PCIE_REPLAYS_PER_LANE_PER_MIN = {1: 0.15, 2: 0.3, 3: 0.48, 4: 0.96, 5: 1.92, 6: 3.84}
#: One HBM stack has a 1024-bit interface; GDDR boards have at most 512 bits in all.
HBM_MIN_BUS_BITS = 1024
#: Data-center GPUs with HBM, by name, for drivers that do not report the memory bus width.
HBM_MODELS = re.compile(r"HBM|\b(?:P100|V100|A100|A30|A800|H100|H200|H800|H20|GH200|B100|B200|B300|GB200|GB300)\b")


def read_temperature(calls: NvmlCalls, gpu: GpuState, now: float, out: list[Observation]) -> None:
    nvml, h = calls.nvml, gpu.handle
    temp = calls.optional(gpu, "nvmlDeviceGetTemperatureV", nvml.nvmlDeviceGetTemperatureV, h, TEMPERATURE_GPU)
    if temp is None and "nvmlDeviceGetTemperatureV" in gpu.unsupported:
        temp = calls.optional(gpu, "nvmlDeviceGetTemperature", nvml.nvmlDeviceGetTemperature, h, TEMPERATURE_GPU)
    if temp is None:
        return
    gpu.readings.update(temperature_c=temp, slowdown_c=gpu.slowdown_c, shutdown_c=gpu.shutdown_c)
    out.append(observation(gpu, Signal.TEMPERATURE, temp, now, slowdown_c=gpu.slowdown_c,
                           shutdown_c=gpu.shutdown_c))


def read_power_and_clocks(calls: NvmlCalls, gpu: GpuState, now: float, out: list[Observation]) -> None:
    nvml, h = calls.nvml, gpu.handle
    usage = calls.optional(gpu, "nvmlDeviceGetPowerUsage", nvml.nvmlDeviceGetPowerUsage, h)
    limit = calls.optional(gpu, "nvmlDeviceGetEnforcedPowerLimit", nvml.nvmlDeviceGetEnforcedPowerLimit, h)
    if usage is not None:
        gpu.readings.update(power_w=usage / 1000, power_limit_w=limit / 1000 if limit else None)
        out.append(observation(gpu, Signal.POWER, usage / 1000, now, limit_w=limit / 1000 if limit else None))
    reasons = calls.optional(gpu, "nvmlDeviceGetCurrentClocksEventReasons",
                             nvml.nvmlDeviceGetCurrentClocksEventReasons, h)
    if reasons is not None:
        gpu.readings["clocks_event_reasons"] = int(reasons)
        out.append(observation(gpu, Signal.CLOCK_EVENTS, int(reasons), now))


def read_fields(calls: NvmlCalls, gpu: GpuState, now: float, out: list[Observation]) -> None:
    values = calls.optional(gpu, "nvmlDeviceGetFieldValues", calls.nvml.nvmlDeviceGetFieldValues, gpu.handle,
                            POLL_FIELDS, aux=True)
    if values is None:
        return
    readings: dict[int, float] = {}
    for value in values:
        if value.nvmlReturn == 0:
            readings[int(value.fieldId)] = float(value.value.ullVal)
        elif value.nvmlReturn == 15:  # NVML_ERROR_GPU_IS_LOST
            raise GpuLost("nvmlDeviceGetFieldValues")
    calls.fields_answered(gpu, "nvmlDeviceGetFieldValues", values)  # the call answers; its fields may not
    if FIELD_RECOVERY_ACTION in readings:
        gpu.readings["recovery_action"] = int(readings[FIELD_RECOVERY_ACTION])
        out.append(observation(gpu, Signal.RECOVERY_ACTION, readings[FIELD_RECOVERY_ACTION], now))
    if FIELD_MEMORY_TEMP in readings:
        gpu.readings["memory_temperature_c"] = readings[FIELD_MEMORY_TEMP]
        out.append(observation(gpu, Signal.MEMORY_TEMPERATURE, readings[FIELD_MEMORY_TEMP], now,
                               mem_max_c=gpu.mem_max_c))
    for field_id, counter in NVLINK_FIELDS.items():
        if field_id in readings:
            increase = delta(gpu, f"nvlink.{counter}", readings[field_id])
            if increase:
                out.append(observation(gpu, Signal.NVLINK_ERRORS, increase, now, count=int(increase),
                                       counter=counter, link="all"))
    if FIELD_PCIE_REPLAY in readings:
        _pcie_replay_rate(gpu, readings[FIELD_PCIE_REPLAY], now, out)


def _pcie_replay_rate(gpu: GpuState, total: float, now: float, out: list[Observation]) -> None:
    previous_at = gpu.replay_at
    increase = delta(gpu, "pcie.replay", total)
    gpu.replay_at = now
    gpu.readings["pcie_replays"] = total
    if previous_at is None or increase is None or now <= previous_at:
        return
    rate = increase / ((now - previous_at) / 60.0)
    gen = gpu.readings.get("pcie_max_gen") or 5
    width = gpu.readings.get("pcie_max_width") or 16
    limit = math.ceil(PCIE_REPLAYS_PER_LANE_PER_MIN.get(int(gen), 1.92) * int(width))
    out.append(observation(gpu, Signal.PCIE_REPLAYS, rate, now, limit_per_min=limit))


def read_ecc(calls: NvmlCalls, gpu: GpuState, now: float, out: list[Observation]) -> None:
    nvml, h = calls.nvml, gpu.handle
    dbe = calls.optional(gpu, "ecc.dbe", nvml.nvmlDeviceGetTotalEccErrors, h, MEMORY_ERROR_UNCORRECTED,
                         VOLATILE_ECC)
    sbe = calls.optional(gpu, "ecc.sbe", nvml.nvmlDeviceGetTotalEccErrors, h, MEMORY_ERROR_CORRECTED,
                         VOLATILE_ECC)
    if dbe is not None:
        first = "ecc.dbe" not in gpu.counters
        increase = delta(gpu, "ecc.dbe", float(dbe))
        gpu.readings["ecc_dbe_volatile"] = int(dbe)
        new = float(dbe) if first else (increase or 0.0)
        if new > 0:
            aggregate = calls.optional(gpu, "ecc.dbe.aggregate", nvml.nvmlDeviceGetTotalEccErrors, h,
                                       MEMORY_ERROR_UNCORRECTED, AGGREGATE_ECC)
            out.append(observation(gpu, Signal.ECC_DBE, new, now, volatile_total=int(dbe),
                                   aggregate_total=int(aggregate) if aggregate is not None else None,
                                   extra=_dbe_locations(calls, gpu)))
    if sbe is not None:
        increase = delta(gpu, "ecc.sbe", float(sbe))
        gpu.readings["ecc_sbe_volatile"] = int(sbe)
        if increase:
            out.append(observation(gpu, Signal.ECC_SBE, increase, now, count=int(increase), volatile_total=int(sbe)))


def _dbe_locations(calls: NvmlCalls, gpu: GpuState) -> dict[str, AttrValue | None]:
    """Where the uncorrectable errors are (volatile counts per memory location), read when a DBE is new."""
    counts: dict[str, AttrValue | None] = {}
    for name, location in MEMORY_LOCATIONS.items():
        count = calls.optional(gpu, f"ecc.location.{name}", calls.nvml.nvmlDeviceGetMemoryErrorCounter,
                               gpu.handle, MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC, location)
        if count:
            counts[f"dbe_{name}"] = int(count)
    return counts


def read_ecc_mode(calls: NvmlCalls, gpu: GpuState, now: float, out: list[Observation]) -> None:
    """ECC mode, current and pending: off on an HBM GPU leaves its memory unprotected (and its ECC
    counters, remapped rows and retired pages then read NotSupported, which says nothing)."""
    mode = calls.optional(gpu, "nvmlDeviceGetEccMode", calls.nvml.nvmlDeviceGetEccMode, gpu.handle)
    if mode is None:
        return
    current, pending = (int(v) for v in mode)
    hbm = is_hbm(calls, gpu)
    gpu.readings.update(ecc_mode="on" if current else "off", ecc_mode_pending="on" if pending else "off")
    out.append(observation(gpu, Signal.ECC_MODE, current, now, current=current, pending=pending, hbm=int(hbm),
                           mode="on" if current else "off", pending_mode="on" if pending else "off",
                           memory_bus_bits=gpu.readings.get("memory_bus_bits")))


def is_hbm(calls: NvmlCalls, gpu: GpuState) -> bool:
    """Whether the GPU's memory is HBM: its bus is 1024 bits or wider, else (bus width unknown) its name."""
    if "memory_bus_bits" not in gpu.readings:
        bits = calls.optional(gpu, "nvmlDeviceGetMemoryBusWidth", calls.nvml.nvmlDeviceGetMemoryBusWidth,
                              gpu.handle, aux=True)
        gpu.readings["memory_bus_bits"] = int(bits) if bits else None
    bits = gpu.readings.get("memory_bus_bits")
    if bits:
        return int(bits) >= HBM_MIN_BUS_BITS
    return bool(HBM_MODELS.search(gpu.ref.model))


def read_sram(calls: NvmlCalls, gpu: GpuState, now: float, out: list[Observation]) -> None:
    """NVIDIA's WORKFLOW_XID_48: the SRAM uncorrectable-error threshold flag decides replacement."""
    factory = getattr(calls.nvml, "c_nvmlEccSramErrorStatus_v1_t", None)
    if factory is None or "nvmlDeviceGetSramEccErrorStatus" in gpu.unsupported:
        return
    status = factory()
    done = calls.optional(gpu, "nvmlDeviceGetSramEccErrorStatus", calls.nvml.nvmlDeviceGetSramEccErrorStatus,
                          gpu.handle, ctypes.byref(status))
    if done is None:
        return
    exceeded = int(bool(status.bThresholdExceeded))
    gpu.readings["sram_threshold_exceeded"] = bool(exceeded)
    out.append(observation(gpu, Signal.SRAM_THRESHOLD_EXCEEDED, exceeded, now,
                           volatile_uncorrected=int(status.volatileUncParity + status.volatileUncSecDed),
                           aggregate_uncorrected=int(status.aggregateUncParity + status.aggregateUncSecDed)))


def read_retired_pages(calls: NvmlCalls, gpu: GpuState, now: float, out: list[Observation]) -> None:
    nvml, h = calls.nvml, gpu.handle
    sbe = calls.optional(gpu, "retired.sbe", nvml.nvmlDeviceGetRetiredPages, h, RETIREMENT_SBE)
    dbe_pages = calls.optional(gpu, "retired.dbe.v2", nvml.nvmlDeviceGetRetiredPages_v2, h, RETIREMENT_DBE)
    dbe: int | None
    new_this_week: int | None
    if dbe_pages is not None:
        dbe, new_this_week = len(dbe_pages), sum(1 for p in dbe_pages if now - p["timestamp"] < WEEK_SECONDS)
    else:
        listed = calls.optional(gpu, "retired.dbe", nvml.nvmlDeviceGetRetiredPages, h, RETIREMENT_DBE)
        dbe, new_this_week = (len(listed), None) if listed is not None else (None, None)
    if sbe is not None and dbe is not None:
        gpu.readings.update(retired_pages_sbe=len(sbe), retired_pages_dbe=dbe)
        out.append(observation(gpu, Signal.RETIRED_PAGES, len(sbe) + dbe, now, sbe=len(sbe), dbe=dbe,
                               dbe_new_last_week=new_this_week))
    pending = calls.optional(gpu, "retired.pending", nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
    if pending is not None:
        gpu.readings["retired_pages_pending"] = int(pending)
        out.append(observation(gpu, Signal.RETIRED_PAGES_PENDING, int(pending), now))


def read_remapped_rows(calls: NvmlCalls, gpu: GpuState, now: float, out: list[Observation]) -> None:
    rows = calls.optional(gpu, "nvmlDeviceGetRemappedRows", calls.nvml.nvmlDeviceGetRemappedRows, gpu.handle)
    gpu.readings["remap_state"] = "unreadable" if rows is None else "readable"
    if rows is None:
        return
    corr, unc, pending, failure = (int(v) for v in rows)
    gpu.readings.update(remap_correctable=corr, remap_uncorrectable=unc, remap_pending=pending,
                        remap_failure=failure)
    out.append(observation(gpu, Signal.ROW_REMAP_PENDING, pending, now, correctable_rows=corr,
                           uncorrectable_rows=unc))
    out.append(observation(gpu, Signal.ROW_REMAP_FAILURE, failure, now))
    out.append(observation(gpu, Signal.ROW_REMAP_UNCORRECTABLE, unc, now))

"""`check --probe`: which of the NVML calls the agent makes each GPU supports, each under a deadline."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from agent.sources.bounded import BoundedCaller
from agent.sources.nvml_calls import NOT_SUPPORTED_CODES, GpuState
from agent.sources.nvml_reads import (
    MEMORY_ERROR_CORRECTED,
    MEMORY_ERROR_UNCORRECTED,
    POLL_FIELDS,
    RETIREMENT_DBE,
    TEMPERATURE_GPU,
    VOLATILE_ECC,
)

THRESHOLD_SHUTDOWN, THRESHOLD_SLOWDOWN, THRESHOLD_MEM_MAX = 0, 1, 2


def probe_calls(nvml: Any, caller: BoundedCaller, gpus: list[GpuState]) -> list[tuple[int, str, str]]:
    """(GPU index, NVML call, supported | NotSupported | error: ...) for every read the agent makes."""
    results: list[tuple[int, str, str]] = []
    for gpu in gpus:
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
            ("nvmlDeviceGetEccMode", nvml.nvmlDeviceGetEccMode, ()),
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
            ("nvmlDeviceGetGpuFabricInfoV", _fabric_status, (nvml,)),
            ("nvmlDeviceGetSupportedEventTypes", nvml.nvmlDeviceGetSupportedEventTypes, ()),
            ("nvmlDeviceGetMigMode", nvml.nvmlDeviceGetMigMode, ()),
        ]
        calls.extend((f"nvmlDeviceGetFieldValues({f})", _field_status, (nvml, f)) for f in POLL_FIELDS)
        for name, func, args in calls:
            wrapped = func in {_field_status, _fabric_status}
            call_args = (args[0], gpu.handle, *args[1:]) if wrapped else (gpu.handle, *args)
            results.append((gpu.ref.index or 0, name, _probe(nvml, caller, gpu, name, func, call_args)))
    return results


def _probe(nvml: Any, caller: BoundedCaller, gpu: GpuState, name: str, func: Callable[..., Any],
           args: tuple[Any, ...]) -> str:
    try:
        caller.call(name, func, *args, key=gpu.caller_key)
    except nvml.NVMLError as exc:
        return "NotSupported" if getattr(exc, "value", None) in NOT_SUPPORTED_CODES else f"error: {exc}"
    except Exception as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
        return f"error: {exc}"
    return "supported"


def _field_status(nvml: Any, handle: Any, field_id: int) -> None:
    [value] = nvml.nvmlDeviceGetFieldValues(handle, [field_id])
    if value.nvmlReturn != 0:
        raise nvml.NVMLError(value.nvmlReturn)


def _fabric_status(nvml: Any, handle: Any) -> None:
    info = nvml.c_nvmlGpuFabricInfo_v2_t()
    nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))

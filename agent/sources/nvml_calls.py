"""How the NVML source calls the driver: one GPU's state, its calls under a deadline, and its observations.

A poll of one GPU runs on the bounded caller's worker under one deadline; each call there is counted as a
reading (a health value) or an auxiliary call (identity, MIG layout, limits, processes), so a GPU none of
whose readings succeed is Unknown even while its auxiliary calls still answer. A field-values call counts by
its fields: NVML answers it with success and says in each field whether that field could be read.
"""

from __future__ import annotations

import contextvars
import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.model import AttrValue, GpuRef, Observation, Signal, frozen_attrs
from agent.sources.bounded import BoundedCaller

# NVML return codes used here (public NVML API documentation).
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_TIMEOUT = 10
ERROR_FUNCTION_NOT_FOUND = 13
ERROR_GPU_IS_LOST = 15
ERROR_RESET_REQUIRED = 16
ERROR_ARGUMENT_VERSION_MISMATCH = 25
NOT_SUPPORTED_CODES = frozenset({ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND})
SOURCE_NAME = "nvml"


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
    #: The call of this GPU that is still hung in the driver (its poll was abandoned), or "".
    hung_call: str = ""
    #: The fabric-info struct version the driver takes (3 adds the health summary; older drivers take 2).
    fabric_version: int = 3

    @property
    def caller_key(self) -> str:
        """What the bounded caller charges this GPU's hung calls to."""
        return f"gpu{self.ref.index}" if self.ref.index is not None else self.ref.key


class GpuLost(Exception):
    """The GPU answered NVML_ERROR_GPU_IS_LOST."""


class Abandoned(Exception):
    """The poll that made this call has timed out and moved on."""


@dataclass(slots=True)
class Reading:
    """One poll of one GPU on the worker thread: which call it is in, and what succeeded and failed."""

    abandoned: threading.Event = field(default_factory=threading.Event)
    current: str = ""
    #: Readings (health values) that answered; auxiliary calls do not count.
    succeeded: int = 0
    failed: int = 0
    reset_required: str = ""


class NvmlCalls:
    """The driver calls of the NVML source: on a poll's worker thread directly, anywhere else bounded."""

    def __init__(self, nvml: Any, caller: BoundedCaller) -> None:
        self.nvml = nvml
        self.caller = caller
        self._reading: contextvars.ContextVar[Reading | None] = contextvars.ContextVar("nvml_reading", default=None)

    @property
    def reading(self) -> Reading | None:
        return self._reading.get()

    def run_reading(self, reading: Reading, func: Callable[[], None]) -> None:
        """func() on this (the worker's) thread, with its calls charged to `reading`."""
        self._reading.set(reading)
        try:
            func()
        finally:
            self._reading.set(None)

    def call(self, name: str, func: Callable[..., Any], *args: Any, aux: bool = False, key: str | None = None) -> Any:
        """A driver call: on the poll's worker thread it runs directly (the whole poll of a GPU is under
        one deadline); anywhere else it gets a deadline of its own, its hang charged to `key` (a GPU).
        `aux`: not a health reading."""
        reading = self._reading.get()
        if reading is None:
            return self.caller.call(name, func, *args, key=key)
        if reading.abandoned.is_set():
            raise Abandoned
        reading.current = name
        try:
            result = func(*args)
        except self.nvml.NVMLError as exc:
            if getattr(exc, "value", None) not in NOT_SUPPORTED_CODES:
                reading.failed += 1  # an unexpected error: a GPU none of whose readings answer is Unknown
            raise
        if reading.abandoned.is_set():
            raise Abandoned  # the poll gave up on this call: touch no state with its late answer
        if not aux:
            reading.succeeded += 1
        return result

    def optional(self, gpu: GpuState, name: str, func: Callable[..., Any], *args: Any, aux: bool = False) -> Any:
        """A call whose NotSupported is remembered; GPU lost and timeouts propagate; other errors give None."""
        if name in gpu.unsupported:
            return None
        try:
            return self.call(name, func, *args, aux=aux, key=gpu.caller_key)
        except self.nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == ERROR_GPU_IS_LOST:
                raise GpuLost(name) from None
            if code in NOT_SUPPORTED_CODES:
                gpu.unsupported.add(name)
            else:
                self.failed(gpu, name, exc)
            return None

    def fields_answered(self, gpu: GpuState, name: str, values: Any) -> None:
        """Charge a field-values call to the poll by its fields. NVML answers nvmlDeviceGetFieldValues with
        NVML_SUCCESS and puts each field's status in its nvmlReturn, so the call is a reading that succeeded
        only where a field did; where every field failed (not NotSupported) it failed, as any other call."""
        reading = self._reading.get()
        codes = [int(value.nvmlReturn) for value in values]
        if 0 in codes:
            if reading is not None:
                reading.succeeded += 1
            return
        errors = [code for code in codes if code not in NOT_SUPPORTED_CODES]
        if errors:
            if reading is not None:
                reading.failed += 1
            self.failed(gpu, name, self.nvml.NVMLError(errors[0]))

    def failed(self, gpu: GpuState, name: str, exc: Exception) -> None:
        """Note an unexpected error of one call (shown by `check`; reset required is its own reading)."""
        gpu.readings.setdefault("errors", {})[name] = str(exc)
        reading = self._reading.get()
        if getattr(exc, "value", None) == ERROR_RESET_REQUIRED and reading is not None and not reading.reset_required:
            reading.reset_required = name


def observation(gpu: GpuState, signal: Signal, value: float, now: float, *, count: int = 1,
                extra: dict[str, AttrValue | None] | None = None, **attrs: AttrValue | None) -> Observation:
    """An observation of one GPU by the NVML source (None attributes left out)."""
    clean = {k: v for k, v in {**attrs, **(extra or {})}.items() if v is not None}
    if gpu.mig_mode:
        clean["mig_mode"] = gpu.mig_mode
    return Observation(signal, float(value), now, SOURCE_NAME, gpu.ref, frozen_attrs(clean), max(1, count))


def delta(gpu: GpuState, name: str, value: float) -> float | None:
    """The increase since the last poll (None on the first); a counter that went back restarted (reset)."""
    previous = gpu.counters.get(name)
    gpu.counters[name] = value
    if previous is None:
        return None
    return value - previous if value >= previous else value


def text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def handle_key(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)

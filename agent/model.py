"""The domain values every layer shares: GPUs, observations, verdicts, remediation steps."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

AttrValue = str | int | float | bool
Attrs = Mapping[str, AttrValue]
NODE_KEY = "node"


def frozen_attrs(attrs: Mapping[str, AttrValue] | None = None) -> Attrs:
    """Return a read-only copy of `attrs`, so frozen values stay frozen."""
    return MappingProxyType(dict(attrs or {}))


class Severity(StrEnum):
    """How bad a verdict is; `rank` orders them from harmless to fatal."""

    OK = "ok"
    INFO = "info"
    WARNING = "warning"
    UNKNOWN = "unknown"
    DEGRADED = "degraded"
    FATAL = "fatal"

    @property
    def rank(self) -> int:
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {
    Severity.OK: 0,
    Severity.INFO: 1,
    Severity.WARNING: 2,
    Severity.UNKNOWN: 3,
    Severity.DEGRADED: 4,
    Severity.FATAL: 5,
}


class FaultClass(StrEnum):
    """Who is at fault: the application, the driver, the GPU, its links, or our ability to see it."""

    NONE = "none"
    APPLICATION = "application"
    DRIVER = "driver"
    HARDWARE = "hardware"
    INTERCONNECT = "interconnect"
    TELEMETRY = "telemetry"


class Action(StrEnum):
    """The recommended remedy, in escalating order; `rank` gives the order."""

    NONE = "none"
    NOTIFY = "notify"
    RESTART_APP = "restart_app"
    RESET_WHEN_IDLE = "reset_when_idle"
    QUARANTINE = "quarantine"
    #: New work stays off the node (NoSchedule), nobody running is evicted, the GPU is reset once idle.
    QUARANTINE_RESET_WHEN_IDLE = "quarantine_reset_when_idle"
    DRAIN = "drain"
    RESET_GPU = "reset_gpu"
    REBOOT_NODE = "reboot_node"
    REPLACE_GPU = "replace_gpu"

    @property
    def rank(self) -> int:
        return _ACTION_RANK[self]

    @property
    def quarantines(self) -> bool:
        """True when one verdict with this action keeps new work off the node."""
        return self.rank >= Action.QUARANTINE.rank

    @property
    def resets(self) -> bool:
        """True when this action resets the GPU (once no pod holds it)."""
        return self in _RESETTING

    @property
    def evicts(self) -> bool:
        """True when this action moves running work off the faulty GPU."""
        return self.rank >= Action.DRAIN.rank


_ACTION_RANK = {action: n for n, action in enumerate(Action)}  # once: `rank` is on the planner's hot path
_RESETTING = frozenset({Action.RESET_WHEN_IDLE, Action.QUARANTINE_RESET_WHEN_IDLE, Action.RESET_GPU})


class Signal(StrEnum):
    """What a source observed. Event signals are occurrences; the others are levels read by polling."""

    XID = "xid"
    SXID = "sxid"
    GPU_LOST = "gpu_lost"
    ECC_DBE = "ecc_dbe"
    ECC_SBE = "ecc_sbe"
    RETIRED_PAGES = "retired_pages"
    RETIRED_PAGES_PENDING = "retired_pages_pending"
    ROW_REMAP_PENDING = "row_remap_pending"
    ROW_REMAP_FAILURE = "row_remap_failure"
    ROW_REMAP_UNCORRECTABLE = "row_remap_uncorrectable"
    RECOVERY_ACTION = "recovery_action"
    TEMPERATURE = "temperature"
    MEMORY_TEMPERATURE = "memory_temperature"
    CLOCK_EVENTS = "clock_events"
    POWER = "power"
    NVLINK_ERRORS = "nvlink_errors"
    NVLINK_DOWN = "nvlink_down"
    PCIE_REPLAYS = "pcie_replays"
    PCIE_LINK = "pcie_link"
    #: The PCIe link generation, read only while the GPU is busy (an idle GPU lowers it to save power).
    PCIE_LINK_GEN = "pcie_link_gen"
    #: The GPU's fabric registration (NVSwitch systems, GB200 NVL72): state, status, health mask.
    GPU_FABRIC = "gpu_fabric"
    #: ECC mode, current (the value: 1 on, 0 off) and pending.
    ECC_MODE = "ecc_mode"
    SOURCE_UNREADABLE = "source_unreadable"
    DCGM_HEALTH = "dcgm_health"
    BOOT = "boot"
    GPU_RESET = "gpu_reset"
    OPERATOR_RELEASE = "operator_release"
    RESET_REQUIRED = "reset_required"
    GPU_MISSING = "gpu_missing"
    SRAM_THRESHOLD_EXCEEDED = "sram_threshold_exceeded"
    MEMORY_UNREPAIRABLE = "memory_unrepairable"
    #: One complete, successful poll of a GPU: its post-reset health in one reading (see remediation/resets.py).
    GPU_POLLED = "gpu_polled"
    #: A GPU reset that failed or was never verified by a clean poll: the node needs a reboot.
    RESET_FAILED = "reset_failed"
    #: The result of a GPU diagnostic (agent/diagnostics.py): 1 passed, 0 failed.
    DIAGNOSTIC = "diagnostic"

    @property
    def is_event(self) -> bool:
        return self in _EVENT_SIGNALS


_EVENT_SIGNALS = frozenset(
    {Signal.XID, Signal.SXID, Signal.GPU_LOST, Signal.ECC_DBE, Signal.ECC_SBE, Signal.NVLINK_ERRORS,
     Signal.PCIE_REPLAYS, Signal.BOOT, Signal.GPU_RESET, Signal.OPERATOR_RELEASE, Signal.RESET_FAILED,
     Signal.DIAGNOSTIC}
)

#: Signals that carry lifecycle facts (boot, reset, release) rather than faults.
LIFECYCLE_SIGNALS = frozenset({Signal.BOOT, Signal.GPU_RESET, Signal.OPERATOR_RELEASE})


@dataclass(frozen=True, slots=True)
class GpuRef:
    """One GPU (or MIG device) of the node, by every identity a source may know it by."""

    index: int | None = None
    uuid: str = ""
    pci_bus_id: str = ""
    model: str = ""
    mig_parent_uuid: str = ""
    mig_gpu_instance: int | None = None
    mig_compute_instance: int | None = None

    @property
    def key(self) -> str:
        """A stable key for per-GPU state: the (parent) UUID, else the PCI bus id, else the index."""
        if self.mig_parent_uuid:
            return self.mig_parent_uuid
        if self.uuid:
            return self.uuid
        if self.pci_bus_id:
            return f"pci:{self.pci_bus_id}"
        if self.index is not None:
            return f"index:{self.index}"
        return NODE_KEY

    def describe(self) -> str:
        parts = [f"GPU {self.index}" if self.index is not None else "GPU"]
        if self.uuid:
            parts.append(self.uuid)
        if self.pci_bus_id:
            parts.append(f"PCI {self.pci_bus_id}")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Observation:
    """What one source saw at one moment. `count` > 1 means deduplicated repeats."""

    signal: Signal
    value: float
    at: float
    source: str
    gpu: GpuRef | None = None
    attrs: Attrs = field(default_factory=frozen_attrs)
    count: int = 1

    @property
    def gpu_key(self) -> str:
        return self.gpu.key if self.gpu is not None else NODE_KEY


def _slot_setter(name: str) -> Callable[[Observation, object], None]:
    """The descriptor that writes one slot of an Observation, bypassing the frozen __setattr__."""
    setter: Callable[[Observation, object], None] = getattr(Observation, name).__set__
    return setter


_new_object = object.__new__
_set_signal, _set_value, _set_at, _set_source, _set_gpu, _set_attrs, _set_count = (
    _slot_setter(name) for name in ("signal", "value", "at", "source", "gpu", "attrs", "count"))


def new_observation(signal: Signal, value: float, at: float, source: str, gpu: GpuRef | None,
                    attrs: Attrs, count: int = 1) -> Observation:
    """The same Observation as `Observation(signal, value, at, source, gpu, attrs, count)`, at half the cost:
    the frozen dataclass's __init__ goes through object.__setattr__ once per field, this sets each slot
    directly (and a fifth of dataclasses.replace's). For the storm path, which builds one or two per line."""
    observation: Observation = _new_object(Observation)
    _set_signal(observation, signal)
    _set_value(observation, value)
    _set_at(observation, at)
    _set_source(observation, source)
    _set_gpu(observation, gpu)
    _set_attrs(observation, attrs)
    _set_count(observation, count)
    return observation


class VerdictKind(StrEnum):
    """A verdict either raises a fault or clears one."""

    FAULT = "fault"
    CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The engine's decision about one GPU under one rule, with the evidence for it."""

    kind: VerdictKind
    rule_id: str
    gpu_key: str
    severity: Severity
    action: Action
    fault_class: FaultClass
    at: float
    summary: str
    gpu: GpuRef | None = None
    evidence: Attrs = field(default_factory=frozen_attrs)

    @property
    def quarantines(self) -> bool:
        return self.kind is VerdictKind.FAULT and self.action.quarantines


class StepKind(StrEnum):
    """One concrete remediation step on the node or a pod."""

    EVENT = "event"
    SET_CONDITION = "set_condition"
    CLEAR_CONDITION = "clear_condition"
    TAINT = "taint"
    UNTAINT = "untaint"
    TAINT_DEVICE = "taint_device"
    UNTAINT_DEVICE = "untaint_device"
    EVICT = "evict"
    RESET_GPU = "reset_gpu"
    REBOOT_REQUEST = "reboot_request"
    CLEAR_REBOOT_REQUEST = "clear_reboot_request"
    MARK_REPLACEMENT = "mark_replacement"
    UNMARK_REPLACEMENT = "unmark_replacement"
    RUN_DIAGNOSTIC = "run_diagnostic"

    @property
    def disruptive(self) -> bool:
        """Disruptive steps spend the cluster-wide budget; all others never wait for it."""
        return self in {StepKind.EVICT, StepKind.RESET_GPU, StepKind.REBOOT_REQUEST, StepKind.RUN_DIAGNOSTIC}

    @property
    def clearing(self) -> bool:
        """Clearing steps undo what the agent set; nothing ever blocks them."""
        return self in {StepKind.CLEAR_CONDITION, StepKind.UNTAINT, StepKind.UNTAINT_DEVICE,
                        StepKind.CLEAR_REBOOT_REQUEST, StepKind.UNMARK_REPLACEMENT}


@dataclass(frozen=True, slots=True)
class Step:
    """A planned step: what to do, to what, and why."""

    kind: StepKind
    target: str
    reason: str
    rule_id: str = ""
    gpu_key: str = ""
    details: Attrs = field(default_factory=frozen_attrs)

    @property
    def disruptive(self) -> bool:
        """Its kind is disruptive, or it is a NoExecute device taint (which deletes the device's pods)."""
        return self.kind.disruptive or (self.kind is StepKind.TAINT_DEVICE and
                                        self.details.get("effect") == "NoExecute")


class StepResult(StrEnum):
    """What became of a step."""

    PLANNED = "planned"
    APPLIED = "applied"
    DRY_RUN = "dry_run"
    BLOCKED = "blocked"
    SKIPPED = "skipped"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """A step and its outcome, as journalled and reported."""

    step: Step
    result: StepResult
    at: float
    message: str = ""


ANY_GPU = "*"


@dataclass(frozen=True, slots=True, order=True)
class DeviceRef:
    """One device of a DRA driver's pool: what a DeviceTaintRule selects and a claim's allocation names."""

    driver: str
    pool: str
    device: str

    def __str__(self) -> str:
        return f"{self.driver}/{self.pool}/{self.device}"


@dataclass(frozen=True, slots=True)
class PodRef:
    """A pod on this node and the GPUs (UUIDs) it holds; ANY_GPU when it holds GPUs nobody could name."""

    namespace: str
    name: str
    uid: str = ""
    gpu_uuids: tuple[str, ...] = ()
    daemonset: bool = False
    owner: str = ""  # the workload: attribution.owner_key() of its top controller, else its image
    #: Deleted (an eviction was accepted) but not gone yet: it still holds its GPUs.
    terminating: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def holds(self, gpu_uuid: str) -> bool:
        return gpu_uuid in self.gpu_uuids or ANY_GPU in self.gpu_uuids


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """What is on the node: its GPUs and the pods holding them."""

    name: str
    gpus: tuple[GpuRef, ...] = ()
    pods: tuple[PodRef, ...] = ()

    def gpu_by_key(self, key: str) -> GpuRef | None:
        return next((g for g in self.gpus if g.key == key), None)

    def resolve(self, ref: GpuRef) -> GpuRef:
        """Fill in a partial identity (only a PCI bus id, only an index) from the inventory."""
        if ref.uuid:
            for gpu in self.gpus:
                if gpu.uuid == ref.uuid:
                    return ref if ref.mig_parent_uuid else gpu
        if ref.pci_bus_id:
            wanted = normalise_pci(ref.pci_bus_id)
            for gpu in self.gpus:
                if normalise_pci(gpu.pci_bus_id) == wanted:
                    return gpu
        if not ref.uuid and not ref.pci_bus_id and ref.index is not None:
            for gpu in self.gpus:
                if gpu.index == ref.index:
                    return gpu
        return ref

    def pods_holding(self, gpu_uuid: str) -> tuple[PodRef, ...]:
        return tuple(p for p in self.pods if p.holds(gpu_uuid))


@functools.lru_cache(maxsize=1024)
def normalise_pci(bus_id: str) -> str:
    """Compare PCI bus ids as `dddd:bb:dd` lower-case, whatever domain width or function a source printed.
    Cached: resolving a kernel-log GPU against the inventory normalises the same few addresses on every line."""
    text = bus_id.strip().lower().removeprefix("pci:")
    if "." in text.rsplit(":", 1)[-1]:
        text = text.rsplit(".", 1)[0]
    parts = text.split(":")
    if len(parts) == 3:
        domain = parts[0][-4:].rjust(4, "0")
        return f"{domain}:{parts[1]}:{parts[2]}"
    if len(parts) == 2:
        return f"0000:{parts[0]}:{parts[1]}"
    return text

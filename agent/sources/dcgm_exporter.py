"""Reads a dcgm-exporter /metrics page (URL or file) into observations; pure parsing plus a bounded fetch.

GPUs are identified by `UUID` and `pci_bus_id` (pod labels are ignored for identity); fields are read
under their classic names and the DCGM 4.6 names; DCGM's blank sentinels mean "no value"; counters
become deltas between scrapes; the last-Xid gauge becomes an Xid observation once per new Xid.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from agent.logs import get_logger
from agent.model import AttrValue, GpuRef, Observation, Signal, frozen_attrs
from agent.sources.thresholds import plausible_threshold

log = get_logger("agent.sources.dcgm")

# Field names: each key is what we call the reading; values are every name dcgm-exporter may use.
FIELDS: dict[str, tuple[str, ...]] = {
    "xid": ("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR"),
    "temp": ("DCGM_FI_DEV_GPU_TEMP",),
    "mem_temp": ("DCGM_FI_DEV_MEMORY_TEMP",),
    "slowdown_temp": ("DCGM_FI_DEV_SLOWDOWN_TEMP",),
    "shutdown_temp": ("DCGM_FI_DEV_SHUTDOWN_TEMP",),
    "mem_max_temp": ("DCGM_FI_DEV_MEM_MAX_OP_TEMP",),
    "power": ("DCGM_FI_DEV_POWER_USAGE",),
    "power_limit": ("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "DCGM_FI_DEV_POWER_MGMT_LIMIT"),
    "clock_reasons": ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"),
    "sbe_vol": ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",),
    "dbe_vol": ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",),
    "retired_sbe": ("DCGM_FI_DEV_RETIRED_SBE", "DCGM_FI_DEV_PAGE_RETIRED_SBE"),
    "retired_dbe": ("DCGM_FI_DEV_RETIRED_DBE", "DCGM_FI_DEV_PAGE_RETIRED_DBE"),
    "retired_pending": ("DCGM_FI_DEV_RETIRED_PENDING", "DCGM_FI_DEV_PAGE_RETIRED_PENDING"),
    "remap_unc": ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",),
    "remap_corr": ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",),
    "remap_failure": ("DCGM_FI_DEV_ROW_REMAP_FAILURE",),
    "remap_pending": ("DCGM_FI_DEV_ROW_REMAP_PENDING",),
    "recovery_action": ("DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION", "DCGM_FI_DEV_GPU_RECOVERY_ACTION"),
    "pcie_replay": ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_PCIE_REPLAY_TOTAL"),
    "nvlink_crc_flit": ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",),
    "nvlink_crc_data": ("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",),
    "nvlink_replay": ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",),
    "nvlink_recovery": ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",),
    "sram_exceeded": ("DCGM_FI_DEV_THRESHOLD_SRM", "DCGM_FI_DEV_SRAM_EXCEEDED"),
    "memory_unrepairable": ("DCGM_FI_DEV_MEMORY_UNREPAIRABLE",),
}
_NAME_TO_FIELD = {name: key for key, names in FIELDS.items() for name in names}
_NVLINK = {"nvlink_crc_flit": "crc_flit", "nvlink_crc_data": "crc_data", "nvlink_replay": "replay",
           "nvlink_recovery": "recovery"}
# DCGM's blank sentinels (dcgm_structs.h): int32 from 0x7ff00000, int64 from 0x7ff0000000000000, fp64 from 2**47.
_INT32_BLANK = 0x7FF00000
_INT64_BLANK = 0x7FF0000000000000
_FP64_BLANK = 2.0**47
PCIE_DEFAULT_LIMIT_PER_MIN = 31  # ceil(1.92 replays/min/lane x 16 lanes): Gen5 x16, DCGM's PCIe watch


def is_blank(value: float) -> bool:
    """True for NaN and DCGM's blank / not-found / not-supported sentinels."""
    if math.isnan(value) or math.isinf(value):
        return True
    if value >= _FP64_BLANK:
        return True
    return _INT32_BLANK <= value < _INT32_BLANK + 16 or value >= _INT64_BLANK


@dataclass(slots=True)
class ScrapedGpu:
    """One GPU (or MIG instance) of one scrape."""

    ref: GpuRef
    values: dict[str, float] = field(default_factory=dict)
    xid_labels: dict[str, str] = field(default_factory=dict)


class ExporterParseError(Exception):
    """The page is not Prometheus text, or holds no DCGM metric."""


def parse_exporter_text(text: str) -> list[ScrapedGpu]:
    """The GPUs of a dcgm-exporter page with their readings (blank values left out)."""
    gpus: dict[str, ScrapedGpu] = {}
    seen_dcgm = False
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # noqa: BLE001 - the parser raises several kinds on garbage
        raise ExporterParseError(f"not Prometheus text: {exc}") from None
    for family in families:
        for sample in family.samples:
            key = _NAME_TO_FIELD.get(sample.name)
            if key is None and sample.name == f"{family.name}_total":
                key = _NAME_TO_FIELD.get(family.name)  # the parser adds _total to counter samples
            if key is None:
                continue
            seen_dcgm = True
            ref = _identity(sample.labels)
            if ref is None:
                continue
            gpu = gpus.setdefault(_ref_key(ref), ScrapedGpu(ref))
            value = float(sample.value)
            if is_blank(value):
                continue
            gpu.values[key] = value
            if key == "xid":
                gpu.xid_labels = {k: v for k, v in sample.labels.items() if k in {"err_code", "err_msg"}}
    if not seen_dcgm and text.strip():
        raise ExporterParseError("no DCGM_FI_* metric on the page")
    return list(gpus.values())


def _identity(labels: dict[str, str]) -> GpuRef | None:
    uuid = labels.get("UUID") or labels.get("uuid") or ""
    pci = (labels.get("pci_bus_id") or "").lower()
    index_text = labels.get("gpu") or ""
    if not uuid and not pci and not index_text.isdigit():
        return None
    index = int(index_text) if index_text.isdigit() else None
    model = labels.get("modelName", "")
    gi = labels.get("GPU_I_ID", "")
    if gi.isdigit():
        return GpuRef(index, uuid, pci, model, mig_parent_uuid=uuid, mig_gpu_instance=int(gi))
    return GpuRef(index, uuid, pci, model)


def _ref_key(ref: GpuRef) -> str:
    return f"{ref.key}/{ref.mig_gpu_instance}" if ref.mig_gpu_instance is not None else ref.key


Fetch = Callable[[str, float], str]


def fetch(url_or_path: str, timeout: float) -> str:
    """The page at a URL (HTTP GET with a deadline) or the text of a file."""
    if url_or_path.startswith(("http://", "https://")):
        with urllib.request.urlopen(url_or_path, timeout=timeout) as response:  # noqa: S310 - operator's URL
            if response.status != 200:
                raise urllib.error.HTTPError(url_or_path, response.status, "not 200", response.headers, None)
            return str(response.read(16 * 1024 * 1024).decode("utf-8", errors="replace"))
    return Path(url_or_path).read_text(encoding="utf-8", errors="replace")


@dataclass(slots=True)
class _Memory:
    counters: dict[str, float] = field(default_factory=dict)
    xid: tuple[float, str] | None = None
    replay_at: float | None = None


class DcgmTranslator:
    """DCGM readings of one GPU -> observations, remembering counters and the last Xid between reads."""

    def __init__(self, *, baseline_xid: bool = True, source: str = "dcgm") -> None:
        self.baseline_xid = baseline_xid
        self.source = source
        self.known: dict[str, GpuRef] = {}
        self._memory: dict[str, _Memory] = {}
        self._warned: set[tuple[str, str]] = set()

    def unreadable(self, now: float, message: str) -> list[Observation]:
        """DCGM (or its exporter) cannot be read: Unknown for every GPU known so far, never a fault."""
        attrs = frozen_attrs({"message": message})
        if not self.known:
            return [Observation(Signal.SOURCE_UNREADABLE, 1, now, self.source, None, attrs)]
        return [Observation(Signal.SOURCE_UNREADABLE, 1, now, self.source, ref, attrs) for ref in self.known.values()]

    def observations(self, gpu: ScrapedGpu, now: float) -> list[Observation]:
        if gpu.ref.mig_gpu_instance is None:
            self.known[gpu.ref.key] = gpu.ref
        v = gpu.values
        memory = self._memory.setdefault(_ref_key(gpu.ref), _Memory())
        out: list[Observation] = []

        def emit(signal: Signal, value: float, count: int = 1, **attrs: AttrValue | None) -> None:
            clean = {k: a for k, a in attrs.items() if a is not None}
            out.append(Observation(signal, float(value), now, self.source, gpu.ref, frozen_attrs(clean), count))

        if gpu.ref.mig_gpu_instance is None:
            self._xid(gpu, memory, emit)
        if "temp" in v:
            emit(Signal.TEMPERATURE, v["temp"], slowdown_c=self._threshold(gpu, "slowdown_temp"),
                 shutdown_c=self._threshold(gpu, "shutdown_temp"))
        if "mem_temp" in v:
            emit(Signal.MEMORY_TEMPERATURE, v["mem_temp"], mem_max_c=self._threshold(gpu, "mem_max_temp"))
        if "sram_exceeded" in v:
            emit(Signal.SRAM_THRESHOLD_EXCEEDED, 1 if v["sram_exceeded"] else 0)
        if "memory_unrepairable" in v:
            emit(Signal.MEMORY_UNREPAIRABLE, 1 if v["memory_unrepairable"] else 0)
        if "power" in v:
            emit(Signal.POWER, v["power"], limit_w=v.get("power_limit"))
        if "clock_reasons" in v:
            emit(Signal.CLOCK_EVENTS, int(v["clock_reasons"]))
        self._counters(gpu, memory, now, emit)
        if "retired_sbe" in v and "retired_dbe" in v:
            emit(Signal.RETIRED_PAGES, v["retired_sbe"] + v["retired_dbe"], sbe=int(v["retired_sbe"]),
                 dbe=int(v["retired_dbe"]))
        if "retired_pending" in v:
            emit(Signal.RETIRED_PAGES_PENDING, v["retired_pending"])
        if "remap_pending" in v:
            emit(Signal.ROW_REMAP_PENDING, v["remap_pending"], uncorrectable_rows=v.get("remap_unc"),
                 correctable_rows=v.get("remap_corr"))
        if "remap_failure" in v:
            emit(Signal.ROW_REMAP_FAILURE, v["remap_failure"])
        if "remap_unc" in v:
            emit(Signal.ROW_REMAP_UNCORRECTABLE, v["remap_unc"])
        if "recovery_action" in v:
            emit(Signal.RECOVERY_ACTION, v["recovery_action"])
        if gpu.ref.mig_gpu_instance is None:
            emit(Signal.SOURCE_UNREADABLE, 0)
            # The scrape in one reading, what verifies a reset (no NVLink state from the exporter: not judged).
            emit(Signal.GPU_POLLED, 1, recovery_action=_int(v.get("recovery_action")),
                 remap_pending=_int(v.get("remap_pending")), retirement_pending=_int(v.get("retired_pending")),
                 volatile_dbe=_int(v.get("dbe_vol")))
        return out

    def _threshold(self, gpu: ScrapedGpu, key: str) -> float | None:
        """A threshold DCGM reports, or None (warned once per GPU and kind) when it cannot be a real one."""
        value = gpu.values.get(key)
        if value is None or plausible_threshold(value):
            return value
        warned = (_ref_key(gpu.ref), key)
        if warned not in self._warned:
            self._warned.add(warned)
            log.warning("dcgm_threshold_ignored", gpu=gpu.ref.uuid or gpu.ref.key, threshold=key, value=value)
        return None

    def _xid(self, gpu: ScrapedGpu, memory: _Memory, emit: Callable[..., None]) -> None:
        """The last-Xid value: an Xid when it (or its err_code/err_msg labels) changes; 0 means none yet."""
        if "xid" not in gpu.values:
            return
        current = (gpu.values["xid"], "|".join(f"{k}={v}" for k, v in sorted(gpu.xid_labels.items())))
        previous, memory.xid = memory.xid, current
        if current[0] == 0 or current == previous:
            return
        if previous is None and self.baseline_xid:
            return  # the first read only tells what happened some time before the agent started
        emit(Signal.XID, current[0], message=gpu.xid_labels.get("err_msg"), err_code=gpu.xid_labels.get("err_code"))

    def _counters(self, gpu: ScrapedGpu, memory: _Memory, now: float, emit: Callable[..., None]) -> None:
        v = gpu.values
        if "dbe_vol" in v:
            first = "dbe_vol" not in memory.counters
            delta = _delta(memory, "dbe_vol", v["dbe_vol"])
            new = v["dbe_vol"] if first else (delta or 0.0)
            if new > 0:
                emit(Signal.ECC_DBE, new, volatile_total=int(v["dbe_vol"]))
        if "sbe_vol" in v:
            delta = _delta(memory, "sbe_vol", v["sbe_vol"])
            if delta:
                emit(Signal.ECC_SBE, delta, count=int(delta), volatile_total=int(v["sbe_vol"]))
        for key, counter in _NVLINK.items():
            if key in v:
                delta = _delta(memory, key, v[key])
                if delta:
                    emit(Signal.NVLINK_ERRORS, delta, count=int(delta), counter=counter, link="all")
        if "pcie_replay" in v:
            previous_at = memory.replay_at
            delta = _delta(memory, "pcie_replay", v["pcie_replay"])
            memory.replay_at = now
            if previous_at is not None and delta is not None and now > previous_at:
                emit(Signal.PCIE_REPLAYS, delta / ((now - previous_at) / 60.0),
                     limit_per_min=PCIE_DEFAULT_LIMIT_PER_MIN)


class ExporterReader:
    """Scrapes a dcgm-exporter page (URL or file) into observations."""

    def __init__(self, target: str, *, timeout_seconds: float = 5.0, fetcher: Fetch = fetch,
                 baseline_xid: bool = True, source: str = "dcgm") -> None:
        self.target = target
        self.timeout = timeout_seconds
        self.fetcher = fetcher
        self.translator = DcgmTranslator(baseline_xid=baseline_xid, source=source)
        self.last: list[ScrapedGpu] = []

    def read(self, now: float) -> list[Observation]:
        """One scrape; an unreachable, slow or garbled exporter gives Unknown, never a GPU fault."""
        try:
            gpus = parse_exporter_text(self.fetcher(self.target, self.timeout))
        except (OSError, ExporterParseError, ValueError) as exc:
            return self.translator.unreadable(now, f"dcgm-exporter {self.target}: {_reason(exc)}")
        self.last = gpus
        return [o for gpu in gpus for o in self.translator.observations(gpu, now)]


def _delta(memory: _Memory, name: str, value: float) -> float | None:
    previous = memory.counters.get(name)
    memory.counters[name] = value
    if previous is None:
        return None
    return value - previous if value >= previous else value


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    if isinstance(exc, urllib.error.URLError):
        return f"unreachable ({exc.reason})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)

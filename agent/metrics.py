"""Prometheus metrics (`gpu_health_` prefix, base units, bounded labels) on a registry the caller owns."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.model import ActionRecord, GpuRef, Observation, Severity, Verdict, VerdictKind

#: A GPU's status, from best to worst.
GPU_STATUS = ("healthy", "unknown", "degraded", "fatal")
#: A GPU's labels as dcgm-exporter names them (its `gpu` is the index, `UUID` the (parent) GPU's UUID), so that
#: `on(UUID)` or `on(Hostname, gpu)` joins our series with DCGM_FI_* ones.
GPU_LABELS = ("gpu", "UUID", "pci_bus_id", "modelName", "Hostname")


class BacklogView(Protocol):
    """What the metrics read of the queue between sources and engine (agent.sources.backlog.Backlog)."""

    @property
    def depth(self) -> int: ...

    @property
    def coalesced_total(self) -> int: ...

    @property
    def dropped_total(self) -> int: ...


class _BacklogCollector(Collector):
    """Reads the backlog at scrape time, so the hot path never touches a metric."""

    def __init__(self, backlog: BacklogView) -> None:
        self.backlog = backlog

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("gpu_health_backlog_depth",
                                "Observations waiting between the sources and the engine.", value=self.backlog.depth)
        yield CounterMetricFamily("gpu_health_backlog_coalesced",
                                  "Observations folded into a waiting one of the same kind (storm back-pressure).",
                                  value=self.backlog.coalesced_total)
        yield CounterMetricFamily("gpu_health_backlog_dropped",
                                  "New kinds of observation refused at the backlog's hard limit.",
                                  value=self.backlog.dropped_total)


def dcgm_pci_bus_id(bus_id: str) -> str:
    """A PCI bus id as NVML and dcgm-exporter print it (`00000000:0D:00.0`), whatever form a source gave."""
    text = bus_id.strip().removeprefix("pci:")
    address, _, function = text.partition(".")
    parts = address.split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    try:
        domain, bus, device = (int(part, 16) for part in parts)
        return f"{domain:08X}:{bus:02X}:{device:02X}.{int(function or '0', 16):X}"
    except ValueError:
        return text


def gpu_labels(gpu: GpuRef, hostname: str) -> tuple[str, str, str, str, str]:
    """GPU_LABELS' values for one GPU; a MIG device is its parent GPU's, as dcgm-exporter labels it."""
    return ("" if gpu.index is None else str(gpu.index), gpu.mig_parent_uuid or gpu.uuid,
            dcgm_pci_bus_id(gpu.pci_bus_id) if gpu.pci_bus_id else "", gpu.model, hostname)


class _GpuStatusCollector(Collector):
    """gpu_health_gpu_status from the last statuses set, replaced whole: a GPU that went away leaves no series."""

    def __init__(self) -> None:
        self.rows: tuple[tuple[tuple[str, ...], str], ...] = ()

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("gpu_health_gpu_status",
                                   "1 for the status each GPU is in (healthy, degraded, fatal, unknown).",
                                   labels=(*GPU_LABELS, "status"))
        for labels, status in self.rows:
            for name in GPU_STATUS:
                family.add_metric((*labels, name), 1 if name == status else 0)
        yield family


class _ResetRequiredCollector(Collector):
    """gpu_health_gpu_reset_required: 1 per GPU waiting for a reset its mode never runs, replaced whole."""

    def __init__(self) -> None:
        self.rows: tuple[tuple[str, ...], ...] = ()

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("gpu_health_gpu_reset_required",
                                   "1 for each GPU whose faults only a reset clears, in a mode that runs none.",
                                   labels=GPU_LABELS)
        for labels in self.rows:
            family.add_metric(labels, 1)
        yield family


def worse_status(status: str, other: str) -> str:
    """The worse of two GPU statuses (GPU_STATUS)."""
    return max(status, other, key=GPU_STATUS.index)


class Metrics:
    """Every metric the agent exports; one instance per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.observations = Counter(
            "gpu_health_observations_total", "Observations received, by source and signal.",
            ["source", "signal"], registry=registry)
        self.verdicts = Counter(
            "gpu_health_verdicts_total", "Verdicts raised or cleared, by kind, severity, fault class and rule.",
            ["kind", "severity", "fault_class", "rule_id", "drill"], registry=registry)
        self.actions = Counter(
            "gpu_health_remediation_steps_total", "Remediation steps by kind and result.",
            ["kind", "result"], registry=registry)
        self.source_errors = Counter(
            "gpu_health_source_errors_total", "Runtime errors of a source (it keeps running).",
            ["source"], registry=registry)
        self.step_errors = Counter(
            "gpu_health_step_errors_total", "Remediation steps that failed with an error.",
            ["kind"], registry=registry)
        self.journal_recreated = Counter(
            "gpu_health_journal_recreated_total",
            "Journals found damaged at start, moved aside and recreated (the record is rebuilt from the Node).",
            registry=registry)
        self.rules_reload_failures = Counter(
            "gpu_health_rules_reload_failures_total", "Rule reloads rejected as invalid; the last good rules stay.",
            registry=registry)
        self.http_refused = Counter(
            "gpu_health_http_connections_refused_total",
            "HTTP connections answered 503 and closed because http.max_connections were being served.",
            registry=registry)
        self.journal_write_failures = Counter(
            "gpu_health_journal_write_failures_total",
            "Journal writes that failed (disk full, I/O error), by what was written; /readyz fails meanwhile.",
            ["kind"], registry=registry)
        self.rules_reload_refused = Counter(
            "gpu_health_rules_reload_refused_total",
            "Valid rule reloads refused because they lose rules or leave a catalog Xid uncovered (reason).",
            ["reason"], registry=registry)
        self.rules_loaded = Gauge("gpu_health_rules_loaded", "Rules in force.", registry=registry)
        self.active_faults = Gauge(
            "gpu_health_active_faults", "Active faults by severity.", ["severity"], registry=registry)
        self.gpu_status = _GpuStatusCollector()
        registry.register(self.gpu_status)
        self.reset_required = _ResetRequiredCollector()
        registry.register(self.reset_required)
        self.detection_latency = Histogram(
            "gpu_health_detection_latency_seconds", "From an observation's timestamp to its verdict.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=registry)
        self.source_up = Gauge(
            "gpu_health_source_up", "1 while a source is running.", ["source"], registry=registry)
        self.last_observation = Gauge(
            "gpu_health_source_last_observation_timestamp_seconds", "When a source last reported anything.",
            ["source"], registry=registry)
        self.faults = Counter(
            "gpu_health_faults_total", "Faults raised, by fault class, severity and GPU model (the fault rate).",
            ["fault_class", "severity", "modelName"], registry=registry)
        self.detection_to_quarantine = Histogram(
            "gpu_health_detection_to_quarantine_seconds", "From an observation to the taint it caused being applied.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=registry)
        self.budget_in_use = Gauge(
            "gpu_health_budget_in_use", "Nodes holding a slot of the cluster-wide disruption budget (last seen).",
            registry=registry)
        self.budget_limit = Gauge(
            "gpu_health_budget_limit", "Slots of the cluster-wide disruption budget (last seen).", registry=registry)
        self.quarantine_braked = Gauge(
            "gpu_health_quarantine_braked", "1 while the quarantine brake keeps a new taint of this node waiting.",
            registry=registry)
        self.brake_confirms = Counter(
            "gpu_health_brake_confirms_total",
            "Operators' confirms of a braked taint consumed: used (it let the taint through), unused, expired.",
            ["result"], registry=registry)
        self.fleet_set_aside = Counter(
            "gpu_health_fleet_entries_set_aside_total",
            "Entries of the fleet's shared objects this agent could not read or does not trust (a newer "
            "format, a damaged entry, a unit its rules do not back), by object; the rest is used.",
            ["what"], registry=registry)
        self.evictions_stuck = Counter(
            "gpu_health_evictions_stuck_total", "Evictions still refused (429) at their deadline; never forced.",
            registry=registry)
        self.time_to_recovery = Histogram(
            "gpu_health_time_to_recovery_seconds", "From a quarantining fault to its verified recovery.",
            buckets=(60, 300, 900, 1800, 3600, 7200, 14400, 43200, 86400, 259200, 604800), registry=registry)
        self.kmsg_records_lost = Counter(
            "gpu_health_kmsg_records_lost_total", "Kernel-log records overwritten before they were read.",
            registry=registry)
        self.kmsg_forged = Counter(
            "gpu_health_kmsg_forged_records_total", "User-space kernel-log records that looked like Xids, ignored.",
            registry=registry)
        self._observed: dict[tuple[str, str], tuple[Counter, Gauge]] = {}
        self.kmsg_unreadable = Counter(
            "gpu_health_kmsg_unreadable_records_total",
            "Kernel-log driver records that could not be handled; skipped, the source goes on.", registry=registry)

    def watch_backlog(self, backlog: BacklogView) -> None:
        """Export the backlog's depth and its coalesced and dropped counts, read at each scrape."""
        self.registry.register(_BacklogCollector(backlog))

    def observed(self, observation: Observation) -> None:
        """Count one observation; called per observation, so the labelled children are looked up once."""
        key = (observation.source, observation.signal)
        children = self._observed.get(key)
        if children is None:
            children = self._observed[key] = (self.observations.labels(observation.source, str(observation.signal)),
                                              self.last_observation.labels(observation.source))
        children[0].inc(observation.count)
        children[1].set(observation.at)

    def judged(self, verdict: Verdict, latency_seconds: float | None) -> None:
        drill = "true" if verdict.evidence.get("drill") else "false"  # marked by agent.drill
        self.verdicts.labels(str(verdict.kind), str(verdict.severity), str(verdict.fault_class),
                             verdict.rule_id, drill).inc()
        if verdict.kind is VerdictKind.FAULT and verdict.severity.rank >= Severity.WARNING.rank:
            model = verdict.gpu.model if verdict.gpu and verdict.gpu.model else "unknown"
            self.faults.labels(str(verdict.fault_class), str(verdict.severity), model).inc()
        if latency_seconds is not None and verdict.kind is VerdictKind.FAULT:
            self.detection_latency.observe(max(latency_seconds, 0.0))

    def acted(self, record: ActionRecord) -> None:
        self.actions.labels(str(record.step.kind), str(record.result)).inc()

    def set_budget(self, in_use: int, limit: int) -> None:
        self.budget_in_use.set(in_use)
        self.budget_limit.set(limit)

    def set_gpu_status(self, statuses: Mapping[str, str], gpus: Mapping[str, GpuRef], *, hostname: str) -> None:
        """Each GPU's status (by GPU key), labelled from `gpus` (the GPU each key names); keys naming the same GPU
        are one series with the worse status."""
        rows: dict[tuple[str, ...], str] = {}
        for key, status in statuses.items():
            labels = gpu_labels(gpus.get(key) or GpuRef(uuid=key), hostname)
            rows[labels] = worse_status(status, rows.get(labels, "healthy"))
        self.gpu_status.rows = tuple(rows.items())

    def set_reset_required(self, gpus: Iterable[GpuRef], *, hostname: str) -> None:
        """The GPUs waiting for a reset that the mode never runs (one series each)."""
        self.reset_required.rows = tuple(sorted({gpu_labels(gpu, hostname) for gpu in gpus}))

    def set_active(self, severities: list[Severity]) -> None:
        for severity in Severity:
            self.active_faults.labels(str(severity)).set(sum(1 for s in severities if s is severity))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

"""One look at the node: read every available source once and judge each GPU, for `gpu-health-agent check`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

import msgspec

from agent.engine import EngineState, RuleSet, evaluate
from agent.engine.schema import Rule
from agent.model import NODE_KEY, Action, GpuRef, Observation, Severity, Verdict, normalise_pci
from agent.model_json import gpu_to_dict, verdict_to_dict
from agent.sources.dcgm_exporter import ExporterReader
from agent.sources.kmsg import KernelLogProcessor
from agent.sources.kmsg_records import RecordReader
from agent.sources.nvml import NvmlSource


class CheckStatus(IntEnum):
    """The exit status of `check`, in the monitoring-plugin convention (Nagios, Icinga, Sensu, Zabbix agents)."""

    OK = 0
    WARNING = 1
    CRITICAL = 2
    UNKNOWN = 3


# Which status wins when several apply: a fatal GPU outranks an unreadable one, which outranks a degraded one.
_PRECEDENCE = (CheckStatus.CRITICAL, CheckStatus.UNKNOWN, CheckStatus.WARNING, CheckStatus.OK)

_STATUS = {Severity.FATAL: "fatal", Severity.DEGRADED: "degraded", Severity.UNKNOWN: "unknown"}
_RANK = {"healthy": 0, "unknown": 1, "degraded": 2, "fatal": 3}


@dataclass(slots=True)
class GpuReport:
    gpu: GpuRef
    status: str = "healthy"
    verdicts: list[Verdict] = field(default_factory=list)
    readings: dict[str, Any] = field(default_factory=dict)

    @property
    def why(self) -> str:
        serious = [v for v in self.verdicts if v.severity.rank >= Severity.WARNING.rank]
        return "; ".join(f"{v.rule_id}: {v.summary}" for v in serious) or "no fault"

    @property
    def short_why(self) -> str:
        """The reasons without this GPU's own name, UUID and PCI address (the table's columns say those)."""
        serious = [v for v in self.verdicts if v.severity.rank >= Severity.WARNING.rank]
        described = self.gpu.describe()
        return "; ".join(f"{v.rule_id}: {_without(v.summary, described)}" for v in serious) or "-"

    def to_json(self) -> dict[str, Any]:
        gpu = gpu_to_dict(self.gpu) or {}
        return {**gpu, "status": self.status, "why": self.why, "verdicts": [verdict_to_dict(v) for v in self.verdicts],
                "readings": self.readings}


@dataclass(slots=True)
class CheckReport:
    gpus: list[GpuReport]
    node_verdicts: list[Verdict]
    sources: dict[str, str]
    unreadable: list[str] = field(default_factory=list)

    def status(self) -> tuple[CheckStatus, str]:
        """The exit status and a one-line summary saying why (the first line a monitoring system shows)."""
        counts = {s: sum(1 for g in self.gpus if g.status == s) for s in ("fatal", "unknown", "degraded", "healthy")}
        reasons: dict[CheckStatus, list[str]] = {s: [] for s in CheckStatus}
        if counts["fatal"]:
            reasons[CheckStatus.CRITICAL].append(f"{counts['fatal']} fatal")
        if not self.gpus:
            reasons[CheckStatus.UNKNOWN].append("no GPU found")
        if counts["unknown"]:
            reasons[CheckStatus.UNKNOWN].append(f"{counts['unknown']} unreadable")
        reasons[CheckStatus.UNKNOWN].extend(f"source {name} unreadable" for name in self.unreadable)
        if any(v.severity is Severity.UNKNOWN for v in self.node_verdicts):
            reasons[CheckStatus.UNKNOWN].append("node-level source unreadable")
        if counts["degraded"] or any(v.severity.rank >= Severity.WARNING.rank and v.severity is not Severity.UNKNOWN
                                     for v in self.node_verdicts):
            reasons[CheckStatus.WARNING].append(f"{counts['degraded']} degraded" if counts["degraded"]
                                                else "node-level warning")
        status = next(s for s in _PRECEDENCE if reasons[s] or s is CheckStatus.OK)
        found = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        details = [r for s in _PRECEDENCE for r in reasons[s] if not r.endswith((" fatal", " degraded"))]
        summary = f"{len(self.gpus)} GPU{'s' if len(self.gpus) != 1 else ''}" + (f" ({found})" if found else "")
        return status, f"{status.name} - {summary}" + (f"; {'; '.join(details)}" if details else "")

    def to_json(self) -> dict[str, Any]:
        status, summary = self.status()
        return {"status": status.name, "exit_code": int(status), "summary": summary,
                "gpus": [g.to_json() for g in self.gpus],
                "node": {"verdicts": [verdict_to_dict(v) for v in self.node_verdicts]},
                "sources": self.sources, "unreadable_sources": self.unreadable}


def _without(summary: str, described: str) -> str:
    """A verdict summary with the GPU's own description taken out ("Xid 79 on GPU 3 ... : x" -> "Xid 79: x")."""
    text = summary.replace(f" on {described}", "").replace(f" ({described})", "").replace(described, "this GPU")
    return " ".join(text.split())


def instantaneous(rules: RuleSet) -> RuleSet:
    """The rules as one reading can judge them. A rule that asks for a condition held for a while (a reason that
    flaps many times a second, held 15 minutes without a break) cannot be judged from one sample: it reports what
    the reading shows, as a warning that does not change the GPU's status, and says what it cannot tell."""
    return RuleSet(rules=tuple(_one_reading(r) for r in rules.rules), files=rules.files)


def _one_reading(rule: Rule) -> Rule:
    if not rule.sustain_seconds and not any(o.sustain_seconds for o in rule.overrides):
        return rule
    held = _duration(max([rule.sustain_seconds, *(o.sustain_seconds or 0.0 for o in rule.overrides)]))
    summary = rule.summary.split(" for ")[0] if " for " in rule.summary else rule.summary
    severity = Severity.WARNING if rule.severity.rank > Severity.WARNING.rank else rule.severity
    overrides = [msgspec.structs.replace(o, sustain_seconds=None, severity=None, action=None)
                 for o in rule.overrides]
    return msgspec.structs.replace(
        rule, sustain_seconds=0.0, severity=severity, action=Action.NOTIFY if rule.action.quarantines
        else rule.action, overrides=overrides,
        summary=f"{summary}: seen in this reading (the rule asks for {held} without a break, which cannot be "
                "judged from one reading; the running agent judges it)")


def _duration(seconds: float) -> str:
    if seconds >= 60 and seconds % 60 == 0:
        minutes = int(seconds // 60)
        return f"{minutes} minute{'s' if minutes != 1 else ''}"
    return f"{seconds:g} s"


def kmsg_snapshot(path: Path, *, now: float) -> list[Observation]:
    """Every NVIDIA record still in the kernel ring buffer (this boot), read without waiting."""
    processor = KernelLogProcessor(dedup_seconds=float("inf"))
    observations: list[Observation] = []
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        for line in RecordReader(fd, lambda: None).available():
            observations.extend(processor.handle(line, now))
    finally:
        os.close(fd)
    observations.extend(processor.flush(now, force=True))
    return observations


def check_node(rules: RuleSet, *, gpus: list[tuple[GpuRef, dict[str, Any]]], observations: list[Observation],
               now: float, sources: dict[str, str], unreadable: list[str] | None = None) -> CheckReport:
    """Judge every GPU from one reading of each source (GPUs with their readings, and observations)."""
    reports: dict[str, GpuReport] = {ref.key: GpuReport(ref, readings=dict(readings)) for ref, readings in gpus}
    by_pci = {normalise_pci(r.gpu.pci_bus_id): r for r in reports.values() if r.gpu.pci_bus_id}
    engine = EngineState()
    judged = instantaneous(rules)
    node_verdicts: list[Verdict] = []
    for observation in sorted(observations, key=lambda o: o.at):
        for verdict in evaluate(observation, engine, now, rules=judged):
            report = _report_for(verdict, observation, reports, by_pci)
            if report is None:
                node_verdicts.append(verdict)
                continue
            report.verdicts.append(verdict)
            status = _STATUS.get(verdict.severity, "healthy")
            if _RANK[status] > _RANK[report.status]:
                report.status = status
    ordered = sorted(reports.values(), key=lambda r: (r.gpu.index is None, r.gpu.index or 0, r.gpu.pci_bus_id))
    return CheckReport(ordered, node_verdicts, sources, list(unreadable or []))


def nvml_reading(nvml: NvmlSource) -> tuple[list[tuple[GpuRef, dict[str, Any]]], list[Observation]]:
    """One poll of every GPU through NVML, with the readings shown in the table."""
    observations = nvml.poll()
    return [(state.ref, dict(state.readings)) for state in nvml.gpus], observations


def exporter_reading(reader: ExporterReader, now: float) -> tuple[list[tuple[GpuRef, dict[str, Any]]],
                                                                  list[Observation]]:
    """One scrape of a dcgm-exporter page, with the readings shown in the table."""
    observations = reader.read(now)
    gpus = []
    for scraped in reader.last:
        if scraped.ref.mig_gpu_instance is not None:
            continue
        v = scraped.values
        readings = {"temperature_c": v.get("temp"), "slowdown_c": v.get("slowdown_temp"),
                    "shutdown_c": v.get("shutdown_temp"), "power_w": v.get("power"),
                    "power_limit_w": v.get("power_limit"), "ecc_sbe_volatile": v.get("sbe_vol"),
                    "ecc_dbe_volatile": v.get("dbe_vol")}
        if "remap_pending" in v:
            readings.update(remap_pending=v["remap_pending"], remap_failure=v.get("remap_failure", 0))
        gpus.append((scraped.ref, {k: val for k, val in readings.items() if val is not None}))
    return gpus, observations


def _report_for(verdict: Verdict, observation: Observation, reports: dict[str, GpuReport],
                by_pci: dict[str, GpuReport]) -> GpuReport | None:
    if verdict.gpu_key == NODE_KEY or observation.gpu is None:
        return None
    if verdict.gpu_key in reports:
        return reports[verdict.gpu_key]
    pci = normalise_pci(observation.gpu.pci_bus_id) if observation.gpu.pci_bus_id else ""
    if pci in by_pci:
        return by_pci[pci]
    report = GpuReport(observation.gpu)
    reports[verdict.gpu_key] = report
    if pci:
        by_pci[pci] = report
    return report

"""The JSON forms of GPUs, verdicts and actions, as the journal, the record and `simulate --json` write them."""

from __future__ import annotations

from collections.abc import Mapping

from agent.model import (
    Action,
    ActionRecord,
    FaultClass,
    GpuRef,
    Severity,
    Verdict,
    VerdictKind,
    frozen_attrs,
)


def gpu_to_dict(gpu: GpuRef | None) -> dict[str, object] | None:
    if gpu is None:
        return None
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "pci_bus_id": gpu.pci_bus_id,
        "model": gpu.model,
        "mig_parent_uuid": gpu.mig_parent_uuid,
        "mig_gpu_instance": gpu.mig_gpu_instance,
        "mig_compute_instance": gpu.mig_compute_instance,
    }


def gpu_from_dict(data: Mapping[str, object] | None) -> GpuRef | None:
    if not data:
        return None

    def optional_int(value: object) -> int | None:
        return int(str(value)) if value is not None else None

    return GpuRef(
        index=optional_int(data.get("index")),
        uuid=str(data.get("uuid") or ""),
        pci_bus_id=str(data.get("pci_bus_id") or ""),
        model=str(data.get("model") or ""),
        mig_parent_uuid=str(data.get("mig_parent_uuid") or ""),
        mig_gpu_instance=optional_int(data.get("mig_gpu_instance")),
        mig_compute_instance=optional_int(data.get("mig_compute_instance")),
    )


def verdict_to_dict(verdict: Verdict) -> dict[str, object]:
    return {
        "kind": str(verdict.kind),
        "rule_id": verdict.rule_id,
        "gpu_key": verdict.gpu_key,
        "gpu": gpu_to_dict(verdict.gpu),
        "severity": str(verdict.severity),
        "action": str(verdict.action),
        "fault_class": str(verdict.fault_class),
        "quarantine": verdict.quarantines,
        "at": verdict.at,
        "summary": verdict.summary,
        "evidence": dict(verdict.evidence),
    }


def verdict_from_dict(data: Mapping[str, object]) -> Verdict:
    evidence = data.get("evidence")
    gpu = data.get("gpu")
    return Verdict(
        kind=VerdictKind(str(data["kind"])),
        rule_id=str(data["rule_id"]),
        gpu_key=str(data["gpu_key"]),
        severity=Severity(str(data["severity"])),
        action=Action(str(data["action"])),
        fault_class=FaultClass(str(data["fault_class"])),
        at=float(str(data["at"])),
        summary=str(data["summary"]),
        gpu=gpu_from_dict(gpu if isinstance(gpu, Mapping) else None),
        evidence=frozen_attrs(evidence if isinstance(evidence, Mapping) else {}),
    )


def action_to_dict(record: ActionRecord) -> dict[str, object]:
    return {
        "kind": str(record.step.kind),
        "target": record.step.target,
        "result": str(record.result),
        "reason": record.step.reason,
        "message": record.message,
        "rule_id": record.step.rule_id,
        "gpu_key": record.step.gpu_key,
        "at": record.at,
        "details": dict(record.step.details),
    }

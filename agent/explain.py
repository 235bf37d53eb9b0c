"""Explains what the rules decide for an Xid or a signal value, by running the engine on it."""

from __future__ import annotations

import csv
import string
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import msgspec

from agent.engine import EngineState, RuleSet, evaluate
from agent.engine.schema import Recovery, Rule
from agent.model import AttrValue, GpuRef, Observation, Signal, Verdict, frozen_attrs

CATALOG_XIDS = range(1, 173)


@dataclass(frozen=True, slots=True)
class CatalogRow:
    xid: int
    mnemonic: str
    description: str
    immediate_action: str
    investigatory_action: str


@cache
def xid_catalog() -> dict[int, CatalogRow]:
    """NVIDIA's Xid catalog as shipped with the package (agent/data/xid_catalog.csv)."""
    text = (resources.files("agent") / "data" / "xid_catalog.csv").read_text(encoding="utf-8")
    rows = {}
    for row in csv.DictReader(text.splitlines()):
        xid = int(row["xid"])
        rows[xid] = CatalogRow(xid, row["mnemonic"], row["description"], row["immediate_action"],
                               row["investigatory_action"])
    return rows


def first_verdict(rules: RuleSet, observation: Observation) -> Verdict | None:
    """The verdict one occurrence gets on a fresh GPU (None when one occurrence is not enough)."""
    verdicts = evaluate(observation, EngineState(), observation.at, rules=rules)
    return max(verdicts, key=lambda v: (v.severity.rank, v.action.rank)) if verdicts else None


def explain_xid(rules: RuleSet, xid: int, *, attrs: dict[str, AttrValue] | None = None,
                model: str = "") -> dict[str, Any]:
    """What one occurrence of Xid `xid` does, with NVIDIA's bucket and every rule that can match it."""
    gpu = GpuRef(index=0, uuid="GPU-explain", pci_bus_id="0000:00:00.0", model=model)
    observation = Observation(Signal.XID, xid, 0.0, "explain", gpu, frozen_attrs(attrs))
    verdict = first_verdict(rules, observation)
    row = xid_catalog().get(xid)
    variants = [
        {"rule_id": r.id, "severity": str(r.severity), "action": str(r.action), "fault_class": str(r.fault_class),
         "quarantine": r.action.quarantines, "when": [msgspec.to_builtins(c) for c in r.when],
         "fallback": r.fallback, "window": msgspec.to_builtins(r.window)}
        for r in rules.for_signal(Signal.XID) if xid in r.codes
    ]
    return {
        "xid": xid,
        "name": row.mnemonic if row else "UNKNOWN",
        "description": row.description if row else "not in NVIDIA's Xid catalog",
        "nvidia_action": row.immediate_action if row else None,
        "nvidia_investigatory_action": row.investigatory_action if row else None,
        **_verdict_fields(verdict),
        "clears": _clears(rules, verdict),
        "variants": variants,
    }


def explain_signal(rules: RuleSet, signal: Signal, value: float, *, attrs: dict[str, AttrValue] | None = None,
                   model: str = "") -> dict[str, Any]:
    """What one reading of a non-Xid signal does on a fresh GPU, and the rules that watch that signal."""
    gpu = GpuRef(index=0, uuid="GPU-explain", pci_bus_id="0000:00:00.0", model=model)
    observation = Observation(signal, value, 0.0, "explain", gpu, frozen_attrs(attrs))
    verdict = first_verdict(rules, observation)
    watching = [
        {"rule_id": r.id, "severity": str(r.severity), "action": str(r.action),
         "when": [msgspec.to_builtins(c) for c in r.when], "sustain_seconds": r.sustain_seconds,
         "window": msgspec.to_builtins(r.window), "recovery": msgspec.to_builtins(r.recovery), "source": r.source}
        for r in rules.for_signal(signal)
    ]
    needed = attributes_read(rules.for_signal(signal))
    missing = [name for name in needed if name not in (attrs or {})]
    needs = ", ".join(needed) or "none"
    if missing:
        needs += f" (not given: {', '.join(missing)}; pass --attr KEY=VALUE)"
    fields = _verdict_fields(verdict)
    description = fields["summary"].replace(gpu.describe(), "the GPU") if verdict is not None else None
    result = {"signal": str(signal), "value": value, "attrs": dict(attrs or {}), **fields,
              "description": description,
              "clears": _clears(rules, verdict), "attributes": needed, "needs": needs, "rules": watching,
              "nvidia_action": _nvidia_action(rules, verdict)}
    if verdict is None and any(r.sustain_seconds or r.window.count > 1 for r in rules.for_signal(signal)):
        result["note"] = "one reading is not enough: some rules need the condition sustained or repeated"
    return result


def _verdict_fields(verdict: Verdict | None) -> dict[str, Any]:
    if verdict is None:
        return {"severity": "ok", "action": "none", "fault_class": "none", "quarantine": False, "rule_id": None,
                "summary": "no rule fires on one occurrence"}
    return {
        "severity": str(verdict.severity),
        "action": str(verdict.action),
        "fault_class": str(verdict.fault_class),
        "quarantine": verdict.quarantines,
        "rule_id": verdict.rule_id,
        "summary": verdict.summary,
        "reason": verdict.evidence.get("reason"),
    }


def attributes_read(rules: list[Rule] | tuple[Rule, ...]) -> list[str]:
    """Every observation attribute these rules test, compare against, count or print, sorted."""
    names: set[str] = set()
    for rule in rules:
        for condition in rule.when:
            names.update(n for n in (condition.field, condition.ref) if n and n != "value")
        if rule.window.distinct:
            names.add(rule.window.distinct)
        names.update(field for _, field, _, _ in string.Formatter().parse(rule.summary) if field)
    return sorted(names - {"value", "code", "gpu", "source"})


def recovery_text(recovery: Recovery) -> str:
    """How a fault of this rule clears, in an operator's words."""
    return {
        "quiet": f"after {recovery.quiet_seconds:g}s without another occurrence (and, for a polled reading, "
                 "a healthy one since)",
        "reset": "after a verified GPU reset (or a new boot) followed by a clean poll",
        "boot": "after a reboot: a new boot with the GPU present and clean",
        "recovered": "when the driver reports the recovery done (Xid 154: the action changed to none) and a clean "
                     "poll follows, or after a verified reset or a new boot",
        "operator": "only when an operator releases it (gpu-health-agent release --node N --gpu UUID)",
        "diagnostic": "when the diagnostic run on the idle GPU passes at NVIDIA's EUD depth (remediation."
                      "diagnostic_command: level 3 or 4, the eud test passed; a shallower pass only lifts a "
                      "quarantine), or an operator releases it; never by a timer",
    }[recovery.kind]


def _nvidia_action(rules: RuleSet, verdict: Verdict | None) -> str | None:
    """NVIDIA's guidance as the matching rule quotes it, shown beside our action."""
    rule = rules.get(verdict.rule_id) if verdict is not None else None
    return rule.nvidia_action if rule is not None else None


def _clears(rules: RuleSet, verdict: Verdict | None) -> str | None:
    if verdict is None:
        return None
    rule = rules.get(verdict.rule_id)
    return recovery_text(rule.recovery) if rule is not None else None

#!/usr/bin/env python3
"""Writes rules/xid.yaml from NVIDIA's Xid catalog and our policy, so every Xid is mapped on purpose.

Usage: scripts/gen_xid_rules.py [CATALOG_CSV] > rules/xid.yaml
The policy (how each NVIDIA resolution bucket becomes our severity, action and fault class, and every
Xid where we depart from NVIDIA, with the reason) lives in this file; the generated YAML is committed
and checked against the catalog by tests/unit/test_xid_catalog.py.
"""

from __future__ import annotations

import csv
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CATALOG = Path(__file__).resolve().parent.parent / "agent" / "data" / "xid_catalog.csv"
SOURCE = "NVIDIA Xid catalog (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), row Xid {xid}"


@dataclass(frozen=True)
class Policy:
    severity: str
    action: str
    fault_class: str
    recovery: dict[str, Any]
    reason: str | None = None


QUIET_APP = {"kind": "quiet", "quiet_seconds": 300}
QUIET_INFO = {"kind": "quiet", "quiet_seconds": 60}
QUIET_WARN = {"kind": "quiet", "quiet_seconds": 3600}
RESET = {"kind": "reset"}
#: The driver asks someone else to recover (the IMEX domain): it clears when the driver reports none again.
RECOVERED = {"kind": "recovered"}
BOOT = {"kind": "boot"}

UNUSED_REASON = (
    "NVIDIA lists this code as unused on every current GPU generation; seeing it is unexpected, so it "
    "is reported for investigation (CONTACT_SUPPORT) but never quarantines a node on its own."
)

BUCKET_POLICY: dict[str, Policy] = {
    "RESTART_APP": Policy("warning", "restart_app", "application", QUIET_APP),
    "IGNORE": Policy("info", "none", "driver", QUIET_INFO),
    "RESET_GPU": Policy("fatal", "reset_gpu", "hardware", RESET),
    "RESTART_BM": Policy("fatal", "reboot_node", "hardware", BOOT),
    "RESTART_VM": Policy(
        "fatal", "reboot_node", "driver", BOOT,
        "On a Kubernetes node the VM that owns the GPU is the node itself: restarting it is a node reboot.",
    ),
    "WORKFLOW_XID_48": Policy(
        "fatal", "reset_gpu", "hardware", RESET,
        "NVIDIA's workflow: solo Xid 48 needs a GPU reset; with Xid 63/64 drain and reset. Both drain the GPU.",
    ),
    "CONTACT_SUPPORT": Policy(
        "warning", "notify", "driver", QUIET_WARN,
        "CONTACT_SUPPORT asks a human to investigate; an event and an alert do that without a quarantine.",
    ),
    "UPDATE_SWFW": Policy(
        "warning", "notify", "driver", QUIET_WARN,
        "Needs a driver or firmware update; the GPU itself is not faulty, so nothing is quarantined.",
    ),
    "CHECK_UVM": Policy(
        "warning", "notify", "driver", QUIET_WARN,
        "NVIDIA: reset only if UVM/vGPU is in use, else ignore. The agent cannot tell, so it reports.",
    ),
    "CHECK_MECHANICALS": Policy(
        "degraded", "quarantine", "hardware", {"kind": "operator"},
        "Auxiliary power missing needs hands on the machine: no new work until an operator has checked it.",
    ),
    "WORKFLOW_NVLINK_ERR": Policy(
        "degraded", "quarantine_reset_when_idle", "interconnect", RESET,
        "NVIDIA's workflow decodes the registers; many bits are benign or sympathetic. A reset or reboot "
        "clears the link, so new work stays off the node but running work is not evicted on one Xid 74: the "
        "GPU is reset once idle and a clean poll verifies it (a quarantine alone would never clear).",
    ),
}

# Xids where the fault class (or the whole policy) differs from the bucket's default.
FAULT_CLASS: dict[int, str] = {
    37: "driver", 38: "driver", 43: "application", 44: "driver", 46: "driver", 63: "hardware",
    66: "driver", 67: "driver", 92: "hardware", 93: "hardware", 94: "hardware", 95: "hardware",
    106: "driver", 107: "driver", 108: "interconnect", 109: "driver", 110: "driver", 119: "driver",
    120: "driver", 121: "interconnect", 136: "interconnect", 137: "interconnect", 141: "driver",
    155: "interconnect", 156: "hardware", 157: "hardware", 158: "driver", 159: "interconnect",
    160: "driver", 161: "driver",
}

NO_BUCKET: dict[int, Policy] = {
    162: Policy("info", "none", "hardware", QUIET_INFO, "No bucket in NVIDIA's catalog; power smoothing re-engaged is good news."),
    163: Policy("warning", "notify", "hardware", QUIET_WARN, "No bucket in NVIDIA's catalog; power smoothing disengaged is reported, not acted on."),
    164: Policy("warning", "notify", "hardware", QUIET_WARN, "No bucket in NVIDIA's catalog; low remaining lifetime of the power-smoothing circuit is a planning signal."),
    165: Policy("degraded", "notify", "hardware", {"kind": "operator"}, "No bucket in NVIDIA's catalog; power smoothing lifetime exhausted is worn hardware: degraded until an operator clears it."),
    166: Policy("warning", "notify", "interconnect", QUIET_WARN, "No bucket in NVIDIA's catalog; a confidential-computing link set-up problem, reported."),
    167: Policy("fatal", "reset_gpu", "hardware", RESET, "No bucket in NVIDIA's catalog; a fatal PCIe timeout leaves the GPU unusable until reset."),
    168: Policy("degraded", "notify", "hardware", BOOT, "No bucket in NVIDIA's catalog; per its trigger text, enable ECC or re-attempt boot: degraded until a new boot."),
    169: Policy("fatal", "reset_gpu", "hardware", RESET, "No bucket in NVIDIA's catalog; a micro-controller halt, treated like Xid 62 (PMU halt), whose bucket is RESET_GPU."),
    170: Policy("warning", "notify", "interconnect", QUIET_WARN, "No bucket in NVIDIA's catalog; an interrupt in confidential-computing mode, reported."),
    171: Policy("info", "none", "hardware", QUIET_INFO, "Adds detail to Xid 48, whose rule decides the action."),
    172: Policy("info", "none", "hardware", QUIET_INFO,
                "Adds detail to Xid 48 (an SRAM, not DRAM, error), whose rule decides the reset; NVIDIA's workflow "
                "then checks the SRAM threshold flag, which rule sram-threshold-exceeded reads and marks for replacement."),
}

# Xids where we depart from NVIDIA's bucket on purpose (docs/rules.md lists each departure).
DEPARTURES: dict[int, Policy] = {
    94: Policy(
        "degraded", "quarantine_reset_when_idle", "hardware", RESET,
        "NVIDIA: a contained error affects one application, which must restart; all other applications are "
        "unaffected and may keep running, and the GPU should be reset when convenient. So nobody else is "
        "evicted; new work stays off the node (NoSchedule) so that the GPU becomes idle, and it is reset once "
        "idle. An Xid 95 that follows, or a recovery action other than none or drain-and-reset, escalates on "
        "its own rule.",
    ),
    157: Policy(
        "degraded", "notify", "hardware", {"kind": "operator"},
        "NVIDIA's bucket is IGNORE, but the Xid says no repair is possible for lack of spare resources and the "
        "same error may recur: the GPU is worn. Work keeps running (NVIDIA: workloads may still run), the GPU is "
        "reported degraded for replacement planning until an operator clears it.",
    ),
}

RECOVERY_ACTIONS: list[tuple[int, str, str, str, str, dict[str, Any]]] = [
    # value, name, severity, action, fault class, recovery
    (0, "None", "info", "none", "hardware", QUIET_INFO),
    (1, "GPU Reset Required", "fatal", "reset_gpu", "hardware", RESET),
    (2, "Node Reboot Required", "fatal", "reboot_node", "hardware", BOOT),
    (3, "Drain P2P", "degraded", "drain", "interconnect", {"kind": "quiet", "quiet_seconds": 300}),
    (4, "Drain and Reset", "degraded", "quarantine_reset_when_idle", "hardware", RESET),
    (5, "Recover IMEX domain", "degraded", "quarantine", "interconnect", RECOVERED),
    (6, "Bus Reset", "fatal", "reset_gpu", "hardware", RESET),
    (7, "System Reboot", "fatal", "reboot_node", "hardware", BOOT),
]

NVLINK5_BUCKETS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("RESET_GPU", "fatal", "reset_gpu", RESET),
    ("IGNORE", "info", "none", QUIET_INFO),
    ("XID_154_EVAL", "info", "none", QUIET_INFO),
]


def xid_rules(rows: list[dict[str, str]]) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for row in rows:
        xid = int(row["xid"])
        bucket = row["immediate_action"]
        if xid == 45:
            rules.extend(_xid45(row))
        elif xid == 74:
            rules.extend(_xid74(row))
        elif xid == 154:
            rules.extend(_xid154(row))
        elif xid == 48:
            rules.extend(_governed_by_containment(row))
        elif xid == 64:
            rules.extend([*_governed_by_containment(row), _xid64_remap_unreadable(row)])
        elif bucket == "WORKFLOW_NVLINK5_ERR":
            rules.extend(_nvlink5(row))
        else:
            rules.append(_plain(row))
    rules.extend(_repeating_application_faults())
    rules.extend(_xid13_repeating_location())
    rules.append(_unknown_xid())
    return rules


def _base(row: dict[str, str], rule_id: str, policy: Policy, summary: str) -> dict[str, Any]:
    xid = int(row["xid"])
    rule: dict[str, Any] = {
        "id": rule_id,
        "signal": "xid",
        "code": xid,
        "severity": policy.severity,
        "action": policy.action,
        "fault_class": policy.fault_class,
        "nvidia_action": row["immediate_action"] or "(none in catalog)",
        "summary": summary,
        "source": SOURCE.format(xid=xid),
        "recovery": policy.recovery,
    }
    if policy.reason:
        rule["reason"] = policy.reason
    return rule


def _plain(row: dict[str, str]) -> dict[str, Any]:
    xid = int(row["xid"])
    bucket = row["immediate_action"]
    unused = row["description"].strip().lower() == "unused"
    if xid in DEPARTURES:
        policy = DEPARTURES[xid]
    elif xid in NO_BUCKET:
        policy = NO_BUCKET[xid]
    elif unused and bucket == "CONTACT_SUPPORT":
        policy = Policy("warning", "notify", "driver", QUIET_WARN, UNUSED_REASON)
    else:
        policy = BUCKET_POLICY[bucket]
    if xid in FAULT_CLASS:
        policy = Policy(policy.severity, policy.action, FAULT_CLASS[xid], policy.recovery, policy.reason)
    summary = f"Xid {xid} ({row['mnemonic'].split(' /')[0]}): {row['description'].split(' --')[0]} on {{gpu}}"
    rule = _base(row, f"xid-{xid}", policy, summary)
    if xid == CONTAINED_ERROR_XID:
        rule["contains"] = True
    return rule


def _xid45(row: dict[str, str]) -> list[dict[str, Any]]:
    follows = _base(
        row, "xid-45-follows",
        Policy("info", "none", "driver", QUIET_INFO,
               "NVIDIA: not solo, follow the guidance of the Xid that caused it; that Xid's rule decides."),
        "Xid 45: preemptive cleanup after Xid {caused_by} on {gpu}",
    )
    follows["when"] = [{"field": "caused_by", "op": "present"}]
    after = _base(
        row, "xid-45-after-xid",
        Policy("info", "none", "driver", QUIET_INFO,
               "NVIDIA: not solo, follow the guidance of the Xid that caused it. The line names no cause, but "
               "another Xid hit the same GPU seconds before (prior_xid): that Xid's rule decides."),
        "Xid 45: preemptive cleanup seconds after Xid {prior_xid} on {gpu}",
    )
    after["when"] = [{"field": "caused_by", "op": "absent"}, {"field": "prior_xid", "op": "present"}]
    solo = _base(
        row, "xid-45-solo",
        Policy("info", "notify", "driver", QUIET_WARN,
               "The driver prints a solo Xid 45 whenever it stops a GPU process's channels: a pod killed mid-kernel "
               "(OOM kill, eviction, preemption) gives one, so it is a Normal Event, no condition and no quarantine. "
               "On an NVSwitch system (HGX/DGX 8-GPU baseboards, where the Fabric Manager runs) NVIDIA's advice for a "
               "solo Xid 45 applies: check and restart the Fabric Manager (nvidia-fabricmanager); elsewhere there is "
               "no Fabric Manager to restart."),
        "Xid 45: preemptive cleanup with no causing Xid on {gpu} (a GPU process stopped mid-kernel)",
    )
    solo["when"] = [{"field": "caused_by", "op": "absent"}, {"field": "prior_xid", "op": "absent"}]
    return [follows, after, solo]


#: NVIDIA's WORKFLOW_NVLINK_ERR: "The first, third, fourth and fifth registers are valid for Hopper-based products."
HOPPER_MODELS = ["*H100*", "*H200*", "*H800*", "*H20*"]


def _hopper_only(rule: dict[str, Any]) -> dict[str, Any]:
    """A register-decode rule applies only to Hopper GPUs; elsewhere (or on an unknown model) the caution stays."""
    rule["enabled"] = False
    rule["overrides"] = [{"models": HOPPER_MODELS, "enabled": True}]
    rule["reason"] += " The register decode is valid only for Hopper-based products, so this rule applies to them only."
    return rule


#: Xid 74's rules by the class of its registers (agent/sources/xid_fields.nvlink_error_class), in order.
XID74_BY_CLASS: list[tuple[str, str, Policy, str]] = [
    ("xid-74-ignorable", "IGNORE",
     Policy("info", "none", "interconnect", QUIET_INFO,
            "NVIDIA's workflow: only bits that can be safely ignored (first register bits 0, 23, 30; fifth "
            "register ECC thresholds with no uncorrectable error) are set."),
     "Xid 74 on link {link} of {gpu}: only ignorable NVLink error bits"),
    ("xid-74-sympathetic", "SYMPATHETIC",
     Policy("info", "none", "interconnect", QUIET_INFO,
            "NVIDIA's workflow: only secondary (sympathetic) bits are set; the accompanying Xid or SXid decides."),
     "Xid 74 on link {link} of {gpu}: secondary NVLink error bits only"),
    ("xid-74-ecc-parity", "ECC_PARITY",
     Policy("warning", "notify", "interconnect", QUIET_WARN,
            "NVIDIA's workflow: ECC/parity bits only (first register bits 4, 5; third 0, 1, 2, 6; fifth 18, 19, "
            "21, 22, 24, 25, 27, 28) are a likely hardware issue with ECC/parity, to report \"if seen more than 2 "
            "times on the same link\". One is counted and reported, nobody is evicted and nothing is reset: "
            "xid-74-ecc-parity-repeated decides the third on the same link, and an Xid 154 the driver prints "
            "with it decides what the driver needs (its own rule)."),
     "Xid 74 on link {link} of {gpu}: an NVLink ECC/parity error (counted: a third on the same link within a "
     "day is a hardware issue)"),
    ("xid-74-ecc-parity-repeated", "ECC_PARITY",
     Policy("degraded", "quarantine_reset_when_idle", "interconnect", RESET,
            "NVIDIA's workflow: ECC/parity bits \"seen more than 2 times on the same link\" are a hardware "
            "issue to report. NVIDIA gives no window; we count a day, each link apart. New work stays off, "
            "nobody running is evicted, the GPU is reset once idle (a reset clears the link's error) and a clean "
            "poll verifies it; a return after verified resets leads to replacement."),
     "Xid 74 ECC/parity errors on link {link} of {gpu}: more than 2 on the same link within a day"),
    ("xid-74-fabric-reset", "FABRIC_RESET",
     Policy("degraded", "quarantine_reset_when_idle", "interconnect", RESET,
            "NVIDIA's workflow: fourth register bit 18 is \"generally sympathetic or secondary, though a reset "
            "of the fabric is required\"; other bits set or another Xid follow their own resolution (their own "
            "rules). Seen solo it is not ignored: new work stays off, nobody running is evicted, and the GPU is "
            "reset once idle (the reset retrains its links with the fabric) and verified by a clean poll."),
     "Xid 74 on link {link} of {gpu}: the NVLink fabric needs a reset (fourth register bit 18)"),
    ("xid-74-serious", "INVESTIGATE",
     Policy("degraded", "reset_gpu", "interconnect", RESET,
            "NVIDIA's workflow: bits other than the ignorable, sympathetic, ECC/parity and fabric-reset ones point "
            "to a possible link or mechanical issue (or are bits the workflow does not list: report a bug), and a "
            "GPU reset or node reboot clears the error. The pods using the GPU "
            "move (Eviction API) and the GPU is reset once idle; a return after verified resets leads to "
            "replacement."),
     "Xid 74 on link {link} of {gpu}: NVLink error bits of a likely hardware issue"),
]
#: "If seen more than 2 times on the same link": NVIDIA gives no window, we count a day per link.
XID74_WINDOWS = {"xid-74-ecc-parity-repeated": {"count": 3, "seconds": 86400, "per": "link"}}


def _xid74(row: dict[str, str]) -> list[dict[str, Any]]:
    """WORKFLOW_NVLINK_ERR: the registers decide; a line whose registers cannot be read keeps the caution."""
    decoded = []
    for rule_id, nvlink_class, policy, summary in XID74_BY_CLASS:
        rule = _base(row, rule_id, policy, summary)
        rule["when"] = [{"field": "nvlink_error_class", "op": "eq", "value": nvlink_class}]
        if rule_id in XID74_WINDOWS:
            rule["window"] = XID74_WINDOWS[rule_id]
        decoded.append(_hopper_only(rule))
    undecoded = _plain(row)
    undecoded["fallback"] = True
    return [*decoded, undecoded]


#: A contained incident (`contains: true`): Xid 94 and the recovery action drain-and-reset that follows it.
CONTAINED_ERROR_XID = 94
DRAIN_AND_RESET = 4
#: The Xids a contained incident (Xid 94, recovery action drain-and-reset) on the same GPU governs: the engine's
#: classifier names the incident in `contained_by` (in either order, within remediation.incident_settle_seconds).
CONTAINED_REASON = (
    "The driver prints Xid {xid} for the very error that it then contains (Xid 94, Xid 154 to drain and reset): "
    "NVIDIA's catalog says the other applications are unaffected and the GPU is reset when convenient, and that "
    "Xid 48 with 63/64 is drain-and-reset only when not contained. So, with a contained incident active on the "
    "GPU, nobody is evicted: new work stays off (NoSchedule) and the GPU is reset once idle; a clean poll "
    "verifies it. Without one, xid-{xid} (fatal, reset at once) decides."
)


def _governed_by_containment(row: dict[str, str]) -> list[dict[str, Any]]:
    """The Xid's own rule, for when no contained incident is active on its GPU, and the rule it defers to one."""
    xid = int(row["xid"])
    alone = _plain(row)
    alone["when"] = [{"field": "contained_by", "op": "absent"}]
    contained = _base(
        row, f"xid-{xid}-contained",
        Policy("degraded", "quarantine_reset_when_idle", "hardware", RESET, CONTAINED_REASON.format(xid=xid)),
        f"Xid {xid} ({row['mnemonic'].split(' /')[0]}) on {{gpu}}, contained ({{contained_by}}): reset once idle",
    )
    contained["when"] = [{"field": "contained_by", "op": "present"}]
    return [alone, contained]


def _xid64_remap_unreadable(row: dict[str, str]) -> dict[str, Any]:
    """Xid 64 while the remap state cannot be read (e.g. MIG on): the failure cannot be ruled out."""
    rule = _base(
        row, "xid-64-remap-state-unreadable",
        Policy("fatal", "replace_gpu", "hardware", {"kind": "operator"},
               "A remapping failure is an RMA candidate (DCGM: ROW_REMAP_FAILURE is FAIL). While NVML cannot read "
               "the remap state (remapped-row queries are not supported under MIG), the failure the Xid reports "
               "cannot be ruled out, so the GPU is a replacement candidate until an operator has checked it."),
        "Xid 64 (remapping failure) on {gpu} while its remap state cannot be read: replacement candidate",
    )
    rule["when"] = [{"field": "remap_state", "op": "eq", "value": "unreadable"}]
    return rule


def _xid154(row: dict[str, str]) -> list[dict[str, Any]]:
    rules = []
    for value, name, severity, action, fault_class, recovery in RECOVERY_ACTIONS:
        policy = Policy(severity, action, fault_class, recovery, "NVIDIA: follow the recovery action Xid 154 reports.")
        rule = _base(row, f"xid-154-action-{value}", policy, f"Xid 154: GPU recovery action is {name} on {{gpu}}")
        rule["when"] = [{"field": "recovery_action", "op": "eq", "value": value}]
        if value == DRAIN_AND_RESET:
            rule["contains"] = True  # it follows a contained error (Xid 94): that incident, as the driver sums it up
        rules.append(rule)
    other = _base(
        row, "xid-154-unrecognised",
        Policy("warning", "notify", "driver", QUIET_WARN,
               "The recovery action could not be read from the line; reported for investigation."),
        "Xid 154 with an unrecognised recovery action on {gpu}",
    )
    other["fallback"] = True
    rules.append(other)
    return rules


def _nvlink5(row: dict[str, str]) -> list[dict[str, Any]]:
    xid = int(row["xid"])
    rules = []
    for bucket, severity, action, recovery in NVLINK5_BUCKETS:
        reason = "NVIDIA's Xid 144-150 decode table gives this bucket for the logged IntrInfo and error status."
        if bucket == "XID_154_EVAL":
            reason += " XID_154_EVAL: the Xid 154 that follows carries the action."
        policy = Policy(severity, action, "interconnect", recovery, reason)
        rule = _base(row, f"xid-{xid}-{bucket.lower().replace('_', '-')}", policy,
                     f"Xid {xid} ({row['mnemonic']}) decoded as {bucket} on link {{link}} of {{gpu}}")
        rule["when"] = [{"field": "decoded_action", "op": "eq", "value": bucket}]
        rules.append(rule)
    undecoded = _base(
        row, f"xid-{xid}-undecoded",
        Policy("warning", "notify", "interconnect", QUIET_WARN,
               "The line could not be decoded with NVIDIA's table; reported, never quarantined blind."),
        f"Xid {xid} ({row['mnemonic']}) that could not be decoded on {{gpu}}",
    )
    undecoded["fallback"] = True
    rules.append(undecoded)
    return rules


UNDIAGNOSED_REASON = (
    " With no diagnostic configured (remediation.diagnostic_command) nothing could decide, and a quarantine "
    "would hold until an operator released it: the pattern is reported instead (degraded, an Event, the "
    "GpuDegraded condition; nobody evicted, no taint) and clears after an hour without an application Xid on "
    "the GPU. Configure a diagnostic (the GPU Operator's DCGM: docs/configuration.md) to let the agent decide."
)


def _undiagnosed(rule: dict[str, Any]) -> dict[str, Any]:
    """The rule where no diagnostic can decide: reported, never a quarantine without a way back."""
    other = dict(rule)
    other["id"] = f"{rule['id']}-undiagnosed"
    other["action"] = "notify"
    other["summary"] = rule["summary"].replace("a diagnostic must clear the GPU", "no diagnostic is configured to decide")
    other["reason"] = rule["reason"] + UNDIAGNOSED_REASON
    other["when"] = [*rule.get("when", [])[:-1], {"field": "no_diagnostic", "op": "present"}]
    other["recovery"] = {"kind": "quiet", "quiet_seconds": 3600}
    return other


def _repeating_application_faults() -> list[dict[str, Any]]:
    rule = {
        "id": "xid-app-faults-across-workloads",
        "signal": "xid",
        "code": [13, 31],
        "when": [{"field": "no_diagnostic", "op": "absent"}],
        "severity": "degraded",
        "action": "quarantine",
        "fault_class": "hardware",
        "nvidia_action": "WORKFLOW_XID_13 / WORKFLOW_XID_31: repeats on the same GPU (Xid 31) or the same GPC/TPC "
        "(Xid 13): RUN_DCGMEUD, if it passes RUN_FIELDDIAGS; otherwise CHECK_APP/CUDA",
        "summary": "application Xids from three different workloads (owners) on {gpu} within an hour: "
        "a diagnostic must clear the GPU",
        "source": SOURCE.format(xid="13 and 31") + " and its Resolution Buckets sheet (WORKFLOW_XID_13, WORKFLOW_XID_31)",
        "reason": "One workload is one owner (its controller or image), never one process: a crash-looping job is "
        "one workload, and it is the application's (CHECK_APP/CUDA). Three different owners faulting on one GPU "
        "within an hour is NVIDIA's repeat pattern: new work stays off the node without evicting anyone; once "
        "the GPU is idle the configured diagnostic (remediation.diagnostic_command, e.g. dcgmi diag -r 2) runs, "
        "bounded in time. A pass releases the GPU, a failure is gpu-diagnostic-failed; an operator may release "
        "it - never a quiet timer.",
        "window": {"count": 3, "seconds": 3600, "distinct": "workload"},
        "recovery": {"kind": "diagnostic"},
    }
    return [rule, _undiagnosed(rule)]


def _xid13_repeating_location() -> list[dict[str, Any]]:
    rule = {
        "id": "xid-app-13-repeat-gpc-tpc",
        "signal": "xid",
        "code": 13,
        "when": [{"field": "sm_location_workloads", "op": "ge", "value": 3},
                 {"field": "no_diagnostic", "op": "absent"}],
        "severity": "degraded",
        "action": "quarantine",
        "fault_class": "hardware",
        "nvidia_action": "WORKFLOW_XID_13: Repeat TPC and GPC: RUN_DCGMEUD (possible HW issue); if pass RUN_FIELDDIAGS",
        "summary": "Xid 13 on {sm_location} of {gpu} from {sm_location_workloads} different workloads (owners) "
        "within a day: a diagnostic must clear the GPU",
        "source": SOURCE.format(xid="13") + " and its Resolution Buckets sheet (WORKFLOW_XID_13)",
        "reason": "One crash prints a burst of Xid 13 lines, and a crash-looping job starts process after process: "
        "both are one workload (owner), and a process no pod could be found for counts for nothing. The same GPC "
        "and TPC faulting under three different owners within a day is NVIDIA's repeat pattern, a possible "
        "hardware issue. New work stays off without evicting anyone; once the GPU is idle the configured "
        "diagnostic runs and its result decides: a pass releases the GPU, a failure is gpu-diagnostic-failed "
        "(or an operator releases it).",
        "recovery": {"kind": "diagnostic"},
    }
    return [rule, _undiagnosed(rule)]


def _unknown_xid() -> dict[str, Any]:
    return {
        "id": "xid-unknown",
        "signal": "xid",
        "fallback": True,
        "severity": "warning",
        "action": "notify",
        "fault_class": "driver",
        "summary": "Xid {code} is not in NVIDIA's catalog (1-172) on {gpu}",
        "source": "policy: an unmapped code is a warning, never a quarantine (field reports of fleet-wide false quarantines)",
        "reason": "Unknown codes come from newer drivers; they are reported for a human, not acted on.",
        "recovery": QUIET_WARN,
    }


class _PlainDumper(yaml.SafeDumper):
    """Writes repeated mappings in full: no YAML anchors in a file people read."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def main() -> None:
    catalog = Path(sys.argv[1]) if len(sys.argv) > 1 else CATALOG
    with catalog.open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    header = (
        "# Generated by scripts/gen_xid_rules.py from NVIDIA's Xid catalog; edit the policy there, not here.\n"
        "# Every Xid 1-172 is mapped on purpose; nvidia_action is NVIDIA's bucket verbatim.\n"
    )
    body = yaml.dump(
        {"rules": xid_rules(rows)}, Dumper=_PlainDumper, sort_keys=False, width=120, allow_unicode=True
    )
    sys.stdout.write(header + body)


if __name__ == "__main__":
    main()

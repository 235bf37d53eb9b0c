"""What the record keeps and the planner compares: the active faults and what the agent has set on the node."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.model import (
    Action,
    DeviceRef,
    FaultClass,
    GpuRef,
    Severity,
    Step,
    StepKind,
    Verdict,
    VerdictKind,
    frozen_attrs,
)
from agent.model_json import gpu_from_dict, gpu_to_dict
from agent.remediation.recoveries import Recoveries


@dataclass(frozen=True, slots=True)
class ActiveFault:
    """A fault the engine holds active, as the planner needs it and as the durable record keeps it.

    `recovery` and `quiet_seconds` are copied from the rule when the fault is raised, so a fault whose
    rule a reload renamed or removed can still clear (release, new boot, verified reset, quiet window).
    """

    rule_id: str
    gpu_key: str
    severity: Severity
    action: Action
    summary: str
    since: float
    gpu: GpuRef | None = None
    recovery: str = ""
    quiet_seconds: float = 0.0
    fault_class: FaultClass = FaultClass.HARDWARE
    occurrences: int = 1
    #: When the source saw what raised it (detection-to-quarantine is measured from here).
    observed_at: float | None = None

    @classmethod
    def from_verdict(cls, verdict: Verdict, *, recovery: str = "", quiet_seconds: float = 0.0) -> ActiveFault:
        occurrences = verdict.evidence.get("occurrences", 1)
        observed = verdict.evidence.get("observed_at")
        return cls(verdict.rule_id, verdict.gpu_key, verdict.severity, verdict.action, verdict.summary,
                   verdict.at, verdict.gpu, recovery, quiet_seconds, verdict.fault_class,
                   occurrences if isinstance(occurrences, int) else 1,
                   float(observed) if isinstance(observed, int | float) else None)

    def to_verdict(self) -> Verdict:
        """The fault as the FAULT verdict that raised it (what the engine restores)."""
        return Verdict(VerdictKind.FAULT, self.rule_id, self.gpu_key, self.severity, self.action, self.fault_class,
                       self.since, self.summary, self.gpu, frozen_attrs({"occurrences": self.occurrences}))

    def to_dict(self) -> dict[str, object]:
        return {"rule_id": self.rule_id, "gpu_key": self.gpu_key, "severity": str(self.severity),
                "action": str(self.action), "summary": self.summary, "since": self.since, "gpu": gpu_to_dict(self.gpu),
                "recovery": self.recovery, "quiet_seconds": self.quiet_seconds,
                "fault_class": str(self.fault_class), "occurrences": self.occurrences,
                "observed_at": self.observed_at}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> ActiveFault:
        """Raises KeyError or ValueError on a malformed entry."""
        gpu = data.get("gpu")
        occurrences = data.get("occurrences", 1)
        observed = data.get("observed_at")
        return cls(str(data["rule_id"]), str(data["gpu_key"]), Severity(str(data["severity"])),
                   Action(str(data["action"])), str(data.get("summary", "")), float(str(data["since"])),
                   gpu_from_dict(gpu if isinstance(gpu, Mapping) else None), str(data.get("recovery") or ""),
                   float(str(data.get("quiet_seconds") or 0.0)), FaultClass(str(data.get("fault_class") or "hardware")),
                   occurrences if isinstance(occurrences, int) else 1,
                   float(observed) if isinstance(observed, int | float) else None)


@dataclass(frozen=True, slots=True)
class DeviceMark:
    """The agent's taint on one DRA device: which GPU it stands for and its effect (NoSchedule, None, NoExecute)."""

    gpu_uuid: str
    effect: str


@dataclass(frozen=True, slots=True)
class DeviceIsolation:
    """Per-GPU isolation as the cluster allows it this pass: the devices each published GPU UUID (whole GPU or
    MIG device) is exposed as, or why the node must be tainted instead (`unavailable`)."""

    devices: Mapping[str, tuple[DeviceRef, ...]] = field(default_factory=dict)
    unavailable: str = ""
    #: NoSchedule, or NoExecute as an explicit opt-in (it deletes pods without a disruption budget).
    effect: str = "NoSchedule"
    #: A degraded-but-usable GPU gets a `None`-effect taint: visible on the device, nothing moves.
    mark_degraded: bool = False
    #: `auto` on a node without DRA: node isolation is the expected choice, not worth an Event.
    silent: bool = False


@dataclass(frozen=True, slots=True)
class ConditionState:
    status: bool
    message: str = ""


@dataclass(slots=True)
class NodeState:
    """What the agent has set on the node (read back from the node after a restart)."""

    conditions: dict[str, ConditionState] = field(default_factory=dict)
    tainted: bool = False
    evicted: dict[str, set[str]] = field(default_factory=dict)
    resets: set[str] = field(default_factory=set)
    reboot_requested: bool = False
    replacement: set[str] = field(default_factory=set)
    recoveries: Recoveries = field(default_factory=Recoveries)
    #: GPUs reset (by the agent, or by someone else as the driver's log says) and when: the reset counts as
    #: verified only after a clean poll of that GPU; none within the deadline escalates to a reboot request.
    verifying: dict[str, float] = field(default_factory=dict)
    #: Of those, the GPUs the driver reported recovered without a reset (Xid 154 5 -> 0: the IMEX domain), none of
    #: whose reset the agent ran: their clean poll verifies that recovery only, never a reset.
    recovering: set[str] = field(default_factory=set)
    #: GPUs whose diagnostic gave a verdict (pass or fail) for their current faults: not run again.
    diagnosed: set[str] = field(default_factory=set)
    #: The MIG geometry of each GPU being reset, recorded before the reset (its MIG devices, as the last poll
    #: counted them): a reset destroys the instances, and it is verified only once a poll counts as many again.
    mig_expected: dict[str, int] = field(default_factory=dict)
    device_taints: dict[DeviceRef, DeviceMark] = field(default_factory=dict)
    #: When the node was first quarantined (node taint, or a device taint that keeps work off), on the node's
    #: wall clock; 0 while it is not. Durable, so a restarted agent never re-stamps it (the quarantine brake
    #: counts the fleet's new quarantines by it).
    quarantined_since: float = 0.0

    @property
    def quarantined(self) -> bool:
        """Whether the node, or one of its devices, is tainted against new work."""
        return self.tainted or any(m.effect in {"NoSchedule", "NoExecute"} for m in self.device_taints.values())

    def mark_quarantine(self, wall: float) -> bool:
        """The quarantine's start kept while it lasts (stamped `wall` when it begins), 0 once it ended; whether
        that changed anything."""
        since = (self.quarantined_since or wall) if self.quarantined else 0.0
        changed, self.quarantined_since = since != self.quarantined_since, since
        return changed

    def apply(self, step: Step) -> None:
        """Record that a step took effect (or would have, in dry-run and local mode)."""
        if step.kind is StepKind.SET_CONDITION:
            self.conditions[step.target] = ConditionState(True, str(step.details.get("message", "")))
        elif step.kind is StepKind.CLEAR_CONDITION:
            self.conditions[step.target] = ConditionState(False, str(step.details.get("message", "")))
        elif step.kind is StepKind.TAINT:
            self.tainted = True
        elif step.kind is StepKind.UNTAINT:
            self.tainted = False
        elif step.kind is StepKind.TAINT_DEVICE:
            self.device_taints[device_of(step)] = DeviceMark(str(step.details.get("gpu_uuid", "")),
                                                             str(step.details.get("effect", "")))
        elif step.kind is StepKind.UNTAINT_DEVICE:
            self.device_taints.pop(device_of(step), None)
        elif step.kind is StepKind.EVICT:
            self.evicted.setdefault(step.gpu_key, set()).add(step.target)
        elif step.kind is StepKind.RESET_GPU:
            self.resets.add(step.gpu_key)
        elif step.kind is StepKind.REBOOT_REQUEST:
            self.reboot_requested = True
        elif step.kind is StepKind.CLEAR_REBOOT_REQUEST:
            self.reboot_requested = False
        elif step.kind is StepKind.MARK_REPLACEMENT:
            self.replacement.add(step.gpu_key)
        elif step.kind is StepKind.UNMARK_REPLACEMENT:
            self.replacement.discard(step.gpu_key)

    def forget_cleared(self, active_gpu_keys: set[str], *, still_held: set[str] | None = None) -> None:
        """Drop per-GPU eviction and reset memory once that GPU has no active fault left. With a fixed pod
        list, `still_held` names the pods on a GPU that is still faulty (pods_on_faulty_gpus): those stay
        remembered as evicted, since a pod evicted for one GPU is gone and must not be evicted for another
        once the first has recovered (see _evicted_for)."""
        for key in list(self.evicted):
            if key in active_gpu_keys:
                continue
            kept = self.evicted[key] & still_held if still_held else set()
            if kept:
                self.evicted[key] = kept
            else:
                del self.evicted[key]
        self.resets &= active_gpu_keys
        for key in set(self.verifying) - active_gpu_keys:
            del self.verifying[key]
        self.recovering &= set(self.verifying)
        self.diagnosed &= active_gpu_keys
        for key in set(self.mig_expected) - active_gpu_keys:
            del self.mig_expected[key]

    def to_json(self) -> dict[str, object]:
        since = {"quarantined_since": self.quarantined_since} if self.quarantined_since else {}
        conditions = {k: {"status": v.status, "message": v.message} for k, v in self.conditions.items()}
        return since | {"conditions": conditions,
                "tainted": self.tainted, "evicted": {k: sorted(v) for k, v in self.evicted.items()},
                "resets": sorted(self.resets), "reboot_requested": self.reboot_requested,
                "replacement": sorted(self.replacement), "recoveries": self.recoveries.to_json(),
                "verifying": dict(sorted(self.verifying.items())), "diagnosed": sorted(self.diagnosed),
                "device_taints": [{"driver": d.driver, "pool": d.pool, "device": d.device, "gpu": m.gpu_uuid,
                                   "effect": m.effect} for d, m in sorted(self.device_taints.items())],
                **({"recovering": sorted(self.recovering)} if self.recovering else {}),
                **({"mig_expected": dict(sorted(self.mig_expected.items()))} if self.mig_expected else {})}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> NodeState:
        state = cls()
        conditions = data.get("conditions")
        if isinstance(conditions, dict):
            for name, value in conditions.items():
                if isinstance(value, dict):
                    state.conditions[str(name)] = ConditionState(bool(value.get("status")),
                                                                 str(value.get("message", "")))
        state.tainted = bool(data.get("tainted"))
        evicted = data.get("evicted")
        if isinstance(evicted, dict):
            state.evicted = {str(k): {str(p) for p in v} for k, v in evicted.items() if isinstance(v, list)}
        resets, replacement = data.get("resets"), data.get("replacement")
        state.resets = {str(r) for r in resets} if isinstance(resets, list) else set()
        state.replacement = {str(r) for r in replacement} if isinstance(replacement, list) else set()
        state.reboot_requested = bool(data.get("reboot_requested"))
        state.recoveries = Recoveries.from_json(data.get("recoveries"))
        diagnosed = data.get("diagnosed")
        state.diagnosed = {str(d) for d in diagnosed} if isinstance(diagnosed, list) else set()
        verifying = data.get("verifying")
        if isinstance(verifying, dict):
            state.verifying = {str(k): float(v) for k, v in verifying.items() if isinstance(v, int | float)}
        since = data.get("quarantined_since")
        state.quarantined_since = float(since) if isinstance(since, int | float) and not isinstance(since, bool) \
            and since > 0 else 0.0
        recovering = data.get("recovering")
        state.recovering = {str(r) for r in recovering if str(r) in state.verifying} \
            if isinstance(recovering, list) else set()
        mig = data.get("mig_expected")
        if isinstance(mig, dict):
            state.mig_expected = {str(k): v for k, v in mig.items() if isinstance(v, int) and not isinstance(v, bool)
                                  and v > 0}
        taints = data.get("device_taints")
        for entry in taints if isinstance(taints, list) else []:
            if isinstance(entry, dict) and all(entry.get(k) for k in ("driver", "pool", "device")):
                device = DeviceRef(str(entry["driver"]), str(entry["pool"]), str(entry["device"]))
                state.device_taints[device] = DeviceMark(str(entry.get("gpu", "")), str(entry.get("effect", "")))
        return state


def device_of(step: Step) -> DeviceRef:
    """The DRA device a TAINT_DEVICE or UNTAINT_DEVICE step names in its details."""
    return DeviceRef(str(step.details.get("driver", "")), str(step.details.get("pool", "")),
                     str(step.details.get("device", "")))

"""Turns verdicts and the node's current state into the steps that bring the node to its desired state.

Pure: it compares what the active faults call for (conditions, taint, evictions, resets, reboot
request, replacement mark) with what the node already has, and plans only the difference, so
re-planning after a restart or on every tick repeats nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from agent.model import (
    NODE_KEY,
    Action,
    Attrs,
    DeviceRef,
    NodeInventory,
    PodRef,
    Severity,
    Step,
    StepKind,
    Verdict,
    VerdictKind,
    frozen_attrs,
)
from agent.remediation.repair_condition import repair_condition_steps
from agent.remediation.state import ActiveFault, DeviceIsolation, DeviceMark, NodeState

#: How long the agent lets one GPU's incident settle before evicting for it (docs/remediation.md: the driver prints
#: an incident's lines within 50 ms; the NVML event of it can wait behind a poll of every GPU).
INCIDENT_SETTLE_SECONDS = 1.0

CONDITION_FATAL = "GpuFatalFault"
CONDITION_DEGRADED = "GpuDegraded"
CONDITION_UNKNOWN = "GpuUnreadable"
#: A GPU waits for a reset that the mode never runs (quarantine mode): someone must reset it (docs/remediation.md).
CONDITION_RESET_REQUIRED = "GpuResetRequired"
CONDITION_FOR_SEVERITY = {
    Severity.FATAL: CONDITION_FATAL,
    Severity.DEGRADED: CONDITION_DEGRADED,
    Severity.UNKNOWN: CONDITION_UNKNOWN,
}
CONDITION_REASONS = {
    CONDITION_FATAL: "GpuFatalFault",
    CONDITION_DEGRADED: "GpuDegraded",
    CONDITION_UNKNOWN: "GpuUnreadable",
}


@dataclass(frozen=True, slots=True)
class PlanOptions:
    node_name: str
    own_pod: str = ""
    max_faulty_gpus: int = 2
    #: A reset waits this long after its fault was raised, so that the other signals of the same incident
    #: (the Xid, the ECC counter, the recovery action) arrive first and one reset clears them all.
    reset_settle_seconds: float = 10.0
    #: Nothing is evicted for a fault until this long after it was raised: the incident's other signals (the Xid
    #: 94 that contains the DBE before it) are judged with it first (remediation.incident_settle_seconds; the
    #: agent's default is INCIDENT_SETTLE_SECONDS, 0 here judges each fault alone).
    incident_settle_seconds: float = 0.0
    #: True when the pod list is read from the cluster: a pod stays "on the GPU" until it is really gone
    #: (an accepted eviction leaves it Terminating). Local mode has no live list and trusts its evictions.
    pods_live: bool = False
    #: A diagnostic command is configured: faults whose recovery is `diagnostic` run it once the GPU is idle.
    diagnose: bool = False
    #: None: isolate by node taint (the setting says `node`, or the cluster was not read yet).
    devices: DeviceIsolation | None = None
    #: The AcceleratedHardwareReady condition for node-repair tools (remediation.accelerated_hardware_condition).
    repair_condition: bool = False
    #: The mode runs GPU resets (remediate). Without, a GPU whose faults only a reset clears is kept off by itself
    #: (its device taint, or the device plugin withholding it) and the reset is asked for, not the node held.
    resets: bool = True
    #: The GPUs the kubelet may still give a new pod (PodResources' allocatable devices: NVIDIA's device plugin
    #: holds a GPU back on its own after an Xid critical error); None where that cannot be told.
    offered: frozenset[str] | None = None


def plan(
    verdicts: Iterable[Verdict],
    active: Mapping[tuple[str, str], ActiveFault],
    node: NodeState,
    inventory: NodeInventory,
    *,
    options: PlanOptions,
    now: float = float("inf"),
) -> list[Step]:
    """The steps that report the new verdicts and move the node to what the active faults call for."""
    steps: list[Step] = []
    why_node = node_isolation(active.values(), options)
    wants_taint = why_node is not None
    if wants_taint and not node.tainted:
        # First: keeping new work off a broken GPU is what protects the cluster; the reports follow.
        steps.append(Step(StepKind.TAINT, options.node_name, _worst_summary(active.values()),
                          rule_id=_worst(active.values()).rule_id))
        if why_node:
            steps.append(Step(StepKind.EVENT, options.node_name, f"node tainted instead of one device: {why_node}",
                              details=frozen_attrs({"type": "Warning", "reason": "DeviceIsolationUnavailable"})))
    steps.extend(_device_steps(active.values(), node, options))
    steps.extend(verdict_events(verdicts, inventory, options.node_name))
    steps.extend(_condition_steps(active.values(), node))
    steps.extend(_reset_required_steps(active.values(), node, options))
    if options.repair_condition:
        steps.extend(repair_condition_steps(active.values(), node.conditions, reboot_requested=node.reboot_requested))
    if not wants_taint and node.tainted:
        steps.append(Step(StepKind.UNTAINT, options.node_name, "no active fault calls for a quarantine"))
    for fault in sorted(_whole_node_if_too_many(active.values(), options),
                        key=lambda f: (-f.action.rank, f.gpu_key, f.rule_id)):
        steps.extend(_remedy_steps(fault, node, inventory, options, steps, now))
    if node.reboot_requested and not any(f.action is Action.REBOOT_NODE for f in active.values()):
        steps.append(Step(StepKind.CLEAR_REBOOT_REQUEST, options.node_name, "no active fault asks for a reboot"))
    still_replace = {f.gpu_key for f in active.values() if f.action is Action.REPLACE_GPU}
    for key in sorted(node.replacement - still_replace):
        steps.append(Step(StepKind.UNMARK_REPLACEMENT, key, "the GPU was released or recovered", gpu_key=key))
    return steps


def node_isolation(active: Iterable[ActiveFault], options: PlanOptions) -> str | None:
    """Whether the node must be tainted: None when not, "" when by setting or escalation, else why device
    isolation could not stand in (no DRA, the rule API off, the GPU not in the node's ResourceSlices)."""
    faults = [f for f in active if f.action.quarantines]
    if not faults:
        return None
    isolation = options.devices
    whole_node = any(f.gpu_key == NODE_KEY or f.action in {Action.REBOOT_NODE, Action.REPLACE_GPU} for f in faults)
    if isolation is None or whole_node or len({f.gpu_key for f in faults}) > options.max_faulty_gpus:
        return ""
    if isolation.unavailable:
        return _withheld_instead(faults, options, "" if isolation.silent else isolation.unavailable)
    missing = sorted({_gpu_text(f) for f in faults if not isolation.devices.get(f.gpu.uuid if f.gpu else "")})
    if missing:
        return f"{', '.join(missing)} not published in the node's ResourceSlices"
    return None


def awaiting_reset(active: Iterable[ActiveFault], options: PlanOptions) -> list[ActiveFault]:
    """The faults of single GPUs that only a reset clears (a quarantine, or a reset once idle such as a pending
    row remap), in a mode that never runs one: their GPU waits for someone to reset it (an operator's
    `nvidia-smi -r`, or remediate mode)."""
    if options.resets:
        return []
    return [f for f in active if f.gpu_key != NODE_KEY and f.recovery == "reset"
            and (f.action.quarantines or f.action.resets) and f.action not in {Action.REBOOT_NODE, Action.REPLACE_GPU}]


def _withheld_instead(faults: list[ActiveFault], options: PlanOptions, why: str) -> str | None:
    """Without device isolation: None where every quarantining fault waits for a reset the mode never runs and
    the kubelet offers none of those GPUs any more (the device plugin keeps new work off them itself), so the
    node stays schedulable; else the node taint (with why, where there is one to say). Matched by GPU, not
    counted: another GPU held back since earlier never stands in for one still offered."""
    waiting = awaiting_reset(faults, options)
    if len(waiting) < len(faults):
        return why
    # A GPU known by no UUID (only its index or bus) cannot be found among the kubelet's: still offered.
    still = sorted({_gpu_text(f) for f in waiting
                    if options.offered is None or not _gpu_uuid(f) or _gpu_uuid(f) in options.offered})
    if not still:
        return None
    if options.offered is None:
        return (f"which GPUs the kubelet still offers could not be read (PodResources): nothing shows "
                f"{', '.join(still)}, waiting for a reset (mode does not reset), kept off new work")
    return (f"the kubelet still offers {', '.join(still)}, waiting for a reset (mode does not reset): nothing "
            f"else keeps new work off it")


def _gpu_uuid(fault: ActiveFault) -> str:
    """The physical GPU a fault's reset resets (a MIG device's parent)."""
    gpu = fault.gpu
    return "" if gpu is None else gpu.mig_parent_uuid or gpu.uuid


def desired_device_taints(active: Iterable[ActiveFault], options: PlanOptions) -> dict[DeviceRef, DeviceMark]:
    """The devices the active faults take out: each quarantining GPU's devices with the configured effect, and
    (when asked for) each degraded-but-usable GPU's with `None`; a GPU with both keeps the stronger."""
    isolation = options.devices
    wanted: dict[DeviceRef, DeviceMark] = {}
    if isolation is None or isolation.unavailable:
        return wanted
    for fault in sorted(active, key=lambda f: (f.gpu_key, f.rule_id)):
        uuid = fault.gpu.uuid if fault.gpu else ""
        if fault.action.quarantines:
            effect = isolation.effect
        elif isolation.mark_degraded and fault.severity is Severity.DEGRADED:
            effect = "None"
        else:
            continue
        for device in isolation.devices.get(uuid, ()):
            if wanted.get(device, DeviceMark(uuid, "None")).effect == "None":
                wanted[device] = DeviceMark(uuid, effect)
    return wanted


def _device_steps(active: Iterable[ActiveFault], node: NodeState, options: PlanOptions) -> list[Step]:
    faults = list(active)
    wanted = desired_device_taints(faults, options)
    steps: list[Step] = []
    for device, mark in sorted(wanted.items()):
        have = node.device_taints.get(device)
        if have == mark:
            continue
        fault = next(f for f in faults if f.gpu and f.gpu.uuid == mark.gpu_uuid)
        marks = [mark]
        if mark.effect == "NoExecute" and (have is None or have.effect == "None"):
            # NoExecute is disruptive and may wait for the mode or the budget; NoSchedule keeps new work off now.
            marks.insert(0, DeviceMark(mark.gpu_uuid, "NoSchedule"))
        steps.extend(Step(StepKind.TAINT_DEVICE, str(device), fault.summary, rule_id=fault.rule_id,
                          gpu_key=fault.gpu_key, details=_device_details(device, m)) for m in marks)
    if options.devices is not None and not options.devices.unavailable:
        stale = [device for device in node.device_taints if device not in wanted]
    else:
        # Node isolation this pass (by setting, or DRA not readable): a rule made earlier stays while its GPU is
        # still faulty and goes once it is not, so a switch to `node` leaves no DeviceTaintRule behind.
        faulty = {f.gpu.uuid for f in faults if f.gpu and (f.action.quarantines or f.severity is Severity.DEGRADED)}
        stale = [device for device, mark in node.device_taints.items() if mark.gpu_uuid not in faulty]
    steps.extend(Step(StepKind.UNTAINT_DEVICE, str(device), "no active fault calls for it",
                      details=_device_details(device, node.device_taints[device])) for device in sorted(stale))
    return steps


def _device_details(device: DeviceRef, mark: DeviceMark) -> Attrs:
    return frozen_attrs({"driver": device.driver, "pool": device.pool, "device": device.device,
                         "gpu_uuid": mark.gpu_uuid, "effect": mark.effect})


def _whole_node_if_too_many(active: Iterable[ActiveFault], options: PlanOptions) -> list[ActiveFault]:
    """When more GPUs than allowed are faulty, the node as a whole is taken out: every GPU pod moves."""
    faults = list(active)
    faulty = {f.gpu_key for f in faults if f.action.evicts and f.gpu_key != NODE_KEY}
    if len(faulty) <= options.max_faulty_gpus:
        return faults
    worst = _worst([f for f in faults if f.action.evicts])
    summary = f"{len(faulty)} GPUs of the node are faulty (more than {options.max_faulty_gpus}): node taken out"
    return [*faults, ActiveFault("node-too-many-faulty-gpus", NODE_KEY, worst.severity, Action.DRAIN, summary,
                                 worst.since)]


def pods_on_faulty_gpus(active: Iterable[ActiveFault], inventory: NodeInventory, options: PlanOptions) -> set[str]:
    """The pods holding a GPU with an active fault (every GPU pod while the node as a whole is out)."""
    return {pod.key for fault in _whole_node_if_too_many(active, options)
            for pod in pods_on_gpu(fault, inventory, options.own_pod)}


def verdict_events(verdicts: Iterable[Verdict], inventory: NodeInventory, node_name: str) -> list[Step]:
    """The Events a batch of verdicts owes: one regarding the node per verdict, plus application faults
    charged to their pod."""
    verdicts = list(verdicts)
    return [*(_event(v, node_name) for v in verdicts), *_pod_events(verdicts, inventory)]


def _event(verdict: Verdict, node_name: str) -> Step:
    cleared = verdict.kind is VerdictKind.CLEARED
    reason = "GpuFaultCleared" if cleared else _event_reason(verdict)
    kind = "Normal" if cleared or verdict.severity.rank <= Severity.INFO.rank else "Warning"
    details = {"type": kind, "reason": reason, "severity": str(verdict.severity), "action": str(verdict.action)}
    return Step(StepKind.EVENT, node_name, verdict.summary, rule_id=verdict.rule_id, gpu_key=verdict.gpu_key,
                details=frozen_attrs(details))


def _event_reason(verdict: Verdict) -> str:
    return {
        Severity.FATAL: "GpuFatalFault",
        Severity.DEGRADED: "GpuDegraded",
        Severity.UNKNOWN: "GpuUnreadable",
        Severity.WARNING: "GpuWarning",
        Severity.INFO: "GpuInfo",
    }.get(verdict.severity, "GpuHealth")


def _pod_events(verdicts: Iterable[Verdict], inventory: NodeInventory) -> list[Step]:
    """Application faults are charged to the pod that caused them, when the source could tell which."""
    steps = []
    for verdict in verdicts:
        if verdict.kind is not VerdictKind.FAULT or verdict.action is not Action.RESTART_APP:
            continue
        pod_uid = str(verdict.evidence.get("pod_uid", ""))
        pod = next((p for p in inventory.pods if pod_uid and p.uid == pod_uid), None)
        if pod is None:
            continue
        details = frozen_attrs({"type": "Warning", "reason": "GpuApplicationFault", "severity": str(verdict.severity),
                                "action": str(verdict.action)})
        steps.append(Step(StepKind.EVENT, f"pod/{pod.key}", verdict.summary, rule_id=verdict.rule_id,
                          gpu_key=verdict.gpu_key, details=details))
    return steps


def _condition_steps(active: Iterable[ActiveFault], node: NodeState) -> list[Step]:
    by_condition: dict[str, list[ActiveFault]] = {name: [] for name in CONDITION_REASONS}
    for fault in active:
        name = CONDITION_FOR_SEVERITY.get(fault.severity)
        if name is not None:
            by_condition[name].append(fault)
    steps = []
    for name, faults in by_condition.items():
        current = node.conditions.get(name)
        if faults:
            message = condition_message(faults)
            if current is None or not current.status or current.message != message:
                steps.append(Step(StepKind.SET_CONDITION, name, message, rule_id=_worst(faults).rule_id,
                                  details=frozen_attrs({"reason": CONDITION_REASONS[name], "message": message})))
        elif current is not None and current.status:
            message = "no active fault of this kind"
            steps.append(Step(StepKind.CLEAR_CONDITION, name, message,
                              details=frozen_attrs({"reason": "GpuHealthy", "message": message})))
    return steps


def _reset_required_steps(active: Iterable[ActiveFault], node: NodeState, options: PlanOptions) -> list[Step]:
    """GpuResetRequired while a GPU waits for a reset the mode never runs, with one Event when it starts: the ask
    for the reset that clears its faults (the GPU itself is kept off by its device taint or the device plugin)."""
    waiting = awaiting_reset(active, options)
    current = node.conditions.get(CONDITION_RESET_REQUIRED)
    if not waiting:
        if current is None or not current.status:
            return []
        message = "no GPU waits for a reset"
        return [Step(StepKind.CLEAR_CONDITION, CONDITION_RESET_REQUIRED, message,
                     details=frozen_attrs({"reason": "GpuResetDone", "message": message}))]
    gpus = sorted({_gpu_text(f) for f in waiting})
    message = (f"reset needed (mode does not reset): {'; '.join(gpus)}. Reset each once idle (nvidia-smi -r -i UUID, "
               f"or mode remediate); until then only that GPU takes no new work. {condition_message(waiting)}")[:1024]
    if current is not None and current.status and current.message == message:
        return []
    worst = _worst(waiting)
    return [Step(StepKind.SET_CONDITION, CONDITION_RESET_REQUIRED, message, rule_id=worst.rule_id,
                 details=frozen_attrs({"reason": "GpuResetRequired", "message": message}))]


def reset_required_events(verdicts: Iterable[Verdict], active: Mapping[tuple[str, str], ActiveFault],
                           options: PlanOptions) -> list[Step]:
    """One Event per GPU when it starts waiting for a reset the mode never runs: with the verdict of its first
    such fault (a later fault of the same GPU, and every later pass, owe none; a dry run neither)."""
    waiting = awaiting_reset(active.values(), options)
    steps = []
    for verdict in verdicts:
        fault = active.get((verdict.gpu_key, verdict.rule_id))
        if verdict.kind is not VerdictKind.FAULT or fault is None or fault not in waiting:
            continue
        if any(f.gpu_key == fault.gpu_key and f is not fault and (f.since, f.rule_id) < (fault.since, fault.rule_id)
               for f in waiting):
            continue
        message = (f"{_gpu_text(fault)} needs a reset, which this mode does not run: {fault.summary}. "
                   "Reset it once idle (nvidia-smi -r -i UUID); until then only that GPU takes no new work")
        steps.append(Step(StepKind.EVENT, options.node_name, message, rule_id=fault.rule_id, gpu_key=fault.gpu_key,
                          details=frozen_attrs({"type": "Warning", "reason": "GpuResetRequired"})))
    return steps


def condition_message(faults: Iterable[ActiveFault]) -> str:
    """Names every affected GPU (UUID, PCI) and rule, at most 1 KiB."""
    parts = []
    for fault in sorted(faults, key=lambda f: (f.gpu_key, f.rule_id)):
        gpu = fault.gpu
        who = f"{gpu.uuid or fault.gpu_key} (PCI {gpu.pci_bus_id or '?'})" if gpu else "node"
        parts.append(f"{who}: {fault.rule_id}: {fault.summary}")
    message = "; ".join(parts)
    return message if len(message) <= 1024 else message[:1020] + " ..."


def _remedy_steps(
    fault: ActiveFault, node: NodeState, inventory: NodeInventory, options: PlanOptions, planned: list[Step],
    now: float,
) -> list[Step]:
    steps: list[Step] = []
    key = fault.gpu_key
    if fault.action.evicts and now - fault.since >= options.incident_settle_seconds:
        already = _evicted_for(fault, node, options) | {s.target for s in planned if s.kind is StepKind.EVICT}
        for pod in pods_on_gpu(fault, inventory, options.own_pod):
            if pod.key not in already and not pod.terminating:
                steps.append(Step(StepKind.EVICT, pod.key, f"holds faulty {_gpu_text(fault)}: {fault.summary}",
                                  rule_id=fault.rule_id, gpu_key=key,
                                  details=frozen_attrs({"pod_uid": pod.uid} if pod.uid else {})))
    # Never reset a GPU that still runs work: after the evictions took effect, the next pass resets it.
    uuid = fault.gpu.uuid if fault.gpu else ""
    wants_reset = (fault.action.resets and bool(uuid)
                   and not _busy(fault, inventory, node, options)
                   and now - fault.since >= options.reset_settle_seconds)
    if wants_reset and key != NODE_KEY and key not in node.resets and not _planned(planned, StepKind.RESET_GPU, key):
        steps.append(Step(StepKind.RESET_GPU, uuid, f"{fault.summary}", rule_id=fault.rule_id, gpu_key=key))
    if fault.recovery == "diagnostic" and options.diagnose and uuid and key not in node.diagnosed and \
            not _busy(fault, inventory, node, options) and not _planned(planned, StepKind.RUN_DIAGNOSTIC, key):
        steps.append(Step(StepKind.RUN_DIAGNOSTIC, uuid, f"diagnostic for: {fault.summary}", rule_id=fault.rule_id,
                          gpu_key=key))
    if fault.action is Action.REBOOT_NODE and not node.reboot_requested and not _planned(
        planned, StepKind.REBOOT_REQUEST, ""
    ):
        steps.append(Step(StepKind.REBOOT_REQUEST, options.node_name, fault.summary, rule_id=fault.rule_id,
                          gpu_key=""))
    if fault.action is Action.REPLACE_GPU and key not in node.replacement:
        steps.append(Step(StepKind.MARK_REPLACEMENT, fault.gpu.uuid if fault.gpu and fault.gpu.uuid else key,
                          fault.summary, rule_id=fault.rule_id, gpu_key=key))
    return steps


def pods_on_gpu(fault: ActiveFault, inventory: NodeInventory, own_pod: str = "") -> list[PodRef]:
    """The pods to move off a faulty GPU: those holding it. A fault on the node as a whole (or the explicit
    too-many-faulty-GPUs escalation) moves every GPU pod; a GPU whose UUID is unknown moves none."""
    candidates = [p for p in inventory.pods if not p.daemonset and p.key != own_pod and p.gpu_uuids]
    if fault.gpu_key == NODE_KEY:
        return candidates
    uuid = fault.gpu.uuid if fault.gpu else ""
    if not uuid:
        return []
    return [p for p in candidates if p.holds(uuid)]


def _busy(fault: ActiveFault, inventory: NodeInventory, node: NodeState, options: PlanOptions) -> bool:
    """A pod still listed on the GPU keeps it busy, evicted or not, until it is gone (live pod list)."""
    if options.pods_live:
        return bool(pods_on_gpu(fault, inventory))
    evicted = _evicted_for(fault, node, options)
    return any(p.key not in evicted for p in pods_on_gpu(fault, inventory))


def _evicted_for(fault: ActiveFault, node: NodeState, options: PlanOptions) -> set[str]:
    """The pods already moved off this fault's GPU. With a live pod list, those evicted for it: a pod of the
    same name evicted for another GPU may be a new incarnation here (a StatefulSet's), and the list shows an
    evicted one as terminating or gone. With a fixed list (local mode, `simulate`) nothing shows that, so a
    pod evicted for any GPU is gone: a pod on two faulty GPUs, or on one GPU and then the whole node (too
    many faulty GPUs), is evicted once."""
    if options.pods_live:
        return node.evicted.get(fault.gpu_key, set())
    return set().union(*node.evicted.values())


def _planned(steps: list[Step], kind: StepKind, gpu_key: str) -> bool:
    return any(s.kind is kind and s.gpu_key == gpu_key for s in steps)


def _gpu_text(fault: ActiveFault) -> str:
    return fault.gpu.describe() if fault.gpu else "GPU"


def _worst(faults: Iterable[ActiveFault]) -> ActiveFault:
    return max(faults, key=lambda f: (f.severity.rank, f.action.rank))


def _worst_summary(faults: Iterable[ActiveFault]) -> str:
    return _worst(faults).summary


def next_settled(active: Iterable[ActiveFault], node: NodeState, options: PlanOptions, now: float) -> float | None:
    """When the earliest reset or eviction still settling may be planned (None when none waits)."""
    faults = list(active)
    waiting = [f.since + options.reset_settle_seconds for f in faults
               if f.action.resets and f.gpu_key not in node.resets
               and f.since + options.reset_settle_seconds > now]
    incident = incident_settled(faults, options, now)
    return min([*waiting, *([incident] if incident is not None else [])], default=None)


def incident_settled(active: Iterable[ActiveFault], options: PlanOptions, now: float) -> float | None:
    """When the earliest eviction waiting for its incident to settle may be planned (None when none waits)."""
    return min((f.since + options.incident_settle_seconds for f in active
                if f.action.evicts and f.since + options.incident_settle_seconds > now), default=None)

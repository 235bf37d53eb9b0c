"""The planner's choice between a node taint and a device taint (DRA DeviceTaintRule) for one faulty GPU."""

import dataclasses

from agent.model import Action, DeviceRef, NodeInventory, PodRef, Severity, StepKind, StepResult, Verdict, VerdictKind
from agent.remediation import ActiveFault, NodeState, PlanOptions, plan
from agent.remediation.guard import AttemptHistory, ClusterView, GateReading, GuardPolicy, Mode, decide
from agent.remediation.record import NodeRecord
from agent.remediation.state import DeviceIsolation, DeviceMark
from tests.conftest import gpu

GPUS = tuple(gpu(i) for i in range(4))
PODS = (PodRef("ml", "on-gpu-1", "u1", (GPUS[1].uuid,)), PodRef("ml", "on-gpu-2", "u2", (GPUS[2].uuid,)))
NODE = NodeInventory("node-1", GPUS, PODS)
DEVICES = {g.uuid: (DeviceRef("gpu.nvidia.com", "node-1", f"gpu-{g.index}"),) for g in GPUS[:3]}
DEVICE = PlanOptions(node_name="node-1", devices=DeviceIsolation(DEVICES))

SPENT = ClusterView(gate=GateReading(in_use=1, limit=1))


def fault(index, action=Action.DRAIN, severity=Severity.FATAL, rule="xid-79"):
    g = GPUS[index]
    return Verdict(VerdictKind.FAULT, rule, g.key, severity, action, "hardware", 1.0, f"{rule} on {index}", g)


def active_of(*verdicts):
    return {(v.gpu_key, v.rule_id): ActiveFault.from_verdict(v) for v in verdicts}


def kinds(steps, *wanted):
    return [(s.kind, s.target) for s in steps if s.kind in wanted]


def test_one_faulty_published_gpu_taints_its_device_not_the_node():
    """Device isolation takes out gpu-1 alone and moves only the pod that holds it."""
    v = fault(1)
    steps = plan([v], active_of(v), NodeState(), NODE, options=DEVICE)
    assert kinds(steps, StepKind.TAINT, StepKind.TAINT_DEVICE, StepKind.EVICT) == [
        (StepKind.TAINT_DEVICE, "gpu.nvidia.com/node-1/gpu-1"), (StepKind.EVICT, "ml/on-gpu-1")]
    [taint] = [s for s in steps if s.kind is StepKind.TAINT_DEVICE]
    assert dict(taint.details) == {"driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-1",
                                   "gpu_uuid": GPUS[1].uuid, "effect": "NoSchedule"}


def test_node_isolation_taints_the_node_without_an_event_about_devices():
    """With `isolation: node` (no DeviceIsolation) the node is tainted as before and no device is touched."""
    v = fault(1)
    steps = plan([v], active_of(v), NodeState(), NODE, options=PlanOptions(node_name="node-1"))
    assert kinds(steps, StepKind.TAINT, StepKind.TAINT_DEVICE) == [(StepKind.TAINT, "node-1")]
    assert not [s for s in steps if s.details.get("reason") == "DeviceIsolationUnavailable"]


def test_a_gpu_missing_from_the_slices_falls_back_to_the_node_taint_with_one_event_saying_why():
    """gpu-3 is not published: the node is tainted, and one Event names the GPU and the reason."""
    v = fault(3)
    steps = plan([v], active_of(v), NodeState(), NODE, options=DEVICE)
    assert kinds(steps, StepKind.TAINT, StepKind.TAINT_DEVICE) == [(StepKind.TAINT, "node-1")]
    [why] = [s for s in steps if s.details.get("reason") == "DeviceIsolationUnavailable"]
    assert GPUS[3].uuid in why.reason and "ResourceSlices" in why.reason
    tainted = NodeState(tainted=True)
    again = plan([], active_of(v), tainted, NODE, options=DEVICE)
    assert not [s for s in again if s.details.get("reason") == "DeviceIsolationUnavailable"]


def test_no_rule_api_falls_back_to_the_node_taint_with_the_reason():
    """When the server serves no DeviceTaintRules the Event carries the isolator's reason."""
    options = dataclasses.replace(DEVICE, devices=DeviceIsolation(unavailable="no DeviceTaintRules served"))
    v = fault(1)
    steps = plan([v], active_of(v), NodeState(), NODE, options=options)
    assert kinds(steps, StepKind.TAINT, StepKind.TAINT_DEVICE) == [(StepKind.TAINT, "node-1")]
    assert [s.reason for s in steps if s.details.get("reason") == "DeviceIsolationUnavailable"] == [
        "node tainted instead of one device: no DeviceTaintRules served"]


def test_a_reboot_request_still_taints_the_whole_node():
    """A whole-node escalation (reboot) taints the node even though the GPU is published."""
    v = fault(1, action=Action.REBOOT_NODE)
    steps = plan([v], active_of(v), NodeState(), NODE, options=DEVICE)
    assert (StepKind.TAINT, "node-1") in kinds(steps, StepKind.TAINT)


def test_more_faulty_gpus_than_allowed_taint_the_whole_node():
    """Three faulty GPUs with max_faulty_gpus 2 take the node out."""
    vs = [fault(i) for i in range(3)]
    steps = plan(vs, active_of(*vs), NodeState(), NODE, options=DEVICE)
    assert kinds(steps, StepKind.TAINT) == [(StepKind.TAINT, "node-1")]


def test_recovery_removes_the_device_taint_exactly_when_the_fault_clears():
    """With no active fault left, the device's rule is planned away (and nothing else about the node)."""
    gpu1 = DeviceRef("gpu.nvidia.com", "node-1", "gpu-1")
    state = NodeState(device_taints={gpu1: DeviceMark(GPUS[1].uuid, "NoSchedule")})
    v = fault(1)
    assert not kinds(plan([], active_of(v), state, NODE, options=DEVICE), StepKind.UNTAINT_DEVICE)
    steps = plan([], {}, state, NODE, options=DEVICE)
    assert kinds(steps, StepKind.UNTAINT_DEVICE, StepKind.UNTAINT) == [
        (StepKind.UNTAINT_DEVICE, "gpu.nvidia.com/node-1/gpu-1")]


def test_an_existing_rule_is_not_planned_again():
    """After a restart the observed rule satisfies the plan: no second TAINT_DEVICE."""
    gpu1 = DeviceRef("gpu.nvidia.com", "node-1", "gpu-1")
    state = NodeState(device_taints={gpu1: DeviceMark(GPUS[1].uuid, "NoSchedule")})
    v = fault(1)
    assert not kinds(plan([], active_of(v), state, NODE, options=DEVICE), StepKind.TAINT_DEVICE)


def test_a_degraded_gpu_gets_a_none_effect_taint_only_when_asked():
    """Visibility only: a degraded, non-quarantining fault marks the device `None` when mark_degraded is on."""
    v = fault(2, action=Action.NOTIFY, severity=Severity.DEGRADED, rule="thermal")
    assert not kinds(plan([v], active_of(v), NodeState(), NODE, options=DEVICE), StepKind.TAINT_DEVICE)
    options = dataclasses.replace(DEVICE, devices=DeviceIsolation(DEVICES, mark_degraded=True))
    steps = plan([v], active_of(v), NodeState(), NODE, options=options)
    [taint] = [s for s in steps if s.kind is StepKind.TAINT_DEVICE]
    assert taint.details["effect"] == "None"
    assert not kinds(steps, StepKind.TAINT, StepKind.EVICT)


def test_no_execute_device_taint_needs_remediate_mode():
    """The NoExecute opt-in deletes pods: quarantine mode skips it, remediate mode lets it through; the
    NoSchedule planned before it keeps new work off the GPU whatever becomes of it."""
    options = dataclasses.replace(DEVICE, devices=DeviceIsolation(DEVICES, effect="NoExecute"))
    v = fault(1)
    first, taint = [s for s in plan([v], active_of(v), NodeState(), NODE, options=options)
                    if s.kind is StepKind.TAINT_DEVICE]
    assert (first.details["effect"], taint.details["effect"]) == ("NoSchedule", "NoExecute")
    assert decide(first, policy=GuardPolicy(mode=Mode.QUARANTINE), cluster=SPENT,
                  history=AttemptHistory(), now=0.0).proceed
    args = {"cluster": ClusterView(gate=GateReading()), "history": AttemptHistory(), "now": 0.0}
    assert decide(taint, policy=GuardPolicy(mode=Mode.QUARANTINE), **args).result is StepResult.SKIPPED
    assert decide(taint, policy=GuardPolicy(mode=Mode.REMEDIATE), **args).proceed
    assert not decide(taint, policy=GuardPolicy(mode=Mode.REMEDIATE), cluster=SPENT,
                      history=AttemptHistory(), now=0.0).proceed


def test_the_durable_record_says_which_device_was_tainted():
    """The record's JSON names driver, pool, device, GPU and effect, and reads back the same."""
    gpu1 = DeviceRef("gpu.nvidia.com", "node-1", "gpu-1")
    record = NodeRecord(node=NodeState(device_taints={gpu1: DeviceMark(GPUS[1].uuid, "NoSchedule")}))
    document = record.to_json()
    assert document["remediation"]["device_taints"] == [{"driver": "gpu.nvidia.com", "pool": "node-1",
                                                         "device": "gpu-1", "gpu": GPUS[1].uuid,
                                                         "effect": "NoSchedule"}]
    assert NodeRecord.from_json(document).node.device_taints == record.node.device_taints


def test_auto_without_dra_taints_the_node_without_an_event():
    """`auto` on a node without DRA (silent): the node taint, and no DeviceIsolationUnavailable Event."""
    options = dataclasses.replace(DEVICE, devices=DeviceIsolation(unavailable="no DRA", silent=True))
    v = fault(1)
    steps = plan([v], active_of(v), NodeState(), NODE, options=options)
    assert kinds(steps, StepKind.TAINT, StepKind.TAINT_DEVICE) == [(StepKind.TAINT, "node-1")]
    assert not [s for s in steps if s.details.get("reason") == "DeviceIsolationUnavailable"]


def test_a_rule_left_from_device_isolation_goes_once_its_gpu_recovers_under_node_isolation():
    """Switched to `node` (or DRA unreadable): a recorded rule stays while its GPU is faulty, goes once it is not."""
    gpu1 = DeviceRef("gpu.nvidia.com", "node-1", "gpu-1")
    state = NodeState(device_taints={gpu1: DeviceMark(GPUS[1].uuid, "NoSchedule")})
    for options in (PlanOptions(node_name="node-1"),
                    PlanOptions(node_name="node-1", devices=DeviceIsolation(unavailable="no rule API"))):
        assert not kinds(plan([], active_of(fault(1)), state, NODE, options=options), StepKind.UNTAINT_DEVICE)
        assert kinds(plan([], active_of(fault(2)), state, NODE, options=options), StepKind.UNTAINT_DEVICE) == [
            (StepKind.UNTAINT_DEVICE, "gpu.nvidia.com/node-1/gpu-1")]

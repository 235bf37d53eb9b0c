"""Quarantine mode runs no reset: a GPU whose faults only a reset clears is kept off by itself, never the node."""

import dataclasses

from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from agent.cli import main
from agent.k8s.podresources import offered_gpus
from agent.metrics import Metrics
from agent.model import Action, NodeInventory, PodRef, Severity, Signal, StepKind, StepResult, Verdict, VerdictKind
from agent.pipeline import LocalActuator, Pipeline
from agent.remediation import ActiveFault, GuardPolicy, Mode, NodeState, PlanOptions, plan
from agent.remediation.planner import CONDITION_RESET_REQUIRED, awaiting_reset, reset_required_events
from agent.remediation.record import NodeObservation
from agent.remediation.state import ConditionState, DeviceIsolation
from tests.conftest import gpu, obs

GPUS = tuple(gpu(i) for i in range(8))
NODE = NodeInventory("node-1", GPUS, (PodRef("ml", "on-gpu-2", "u2", (GPUS[2].uuid,)),))
#: `auto` on a cluster without DRA: GPUs are handed out by the device plugin.
NO_DRA = DeviceIsolation(unavailable="no DeviceTaintRules served", silent=True)
QUARANTINE = PlanOptions(node_name="node-1", devices=NO_DRA, resets=False)


def offered_but(*indices):
    """The GPUs the kubelet still offers: every GPU but those (the device plugin holds them back)."""
    return frozenset(g.uuid for i, g in enumerate(GPUS) if i not in indices)


def contained(index=2, rule="xid-94", action=Action.QUARANTINE_RESET_WHEN_IDLE, recovery="reset", at=1.0):
    g = GPUS[index]
    v = Verdict(VerdictKind.FAULT, rule, g.key, Severity.DEGRADED, action, "hardware", at, f"{rule} on {index}", g)
    return {(v.gpu_key, v.rule_id): ActiveFault.from_verdict(v, recovery=recovery)}


def kinds(steps, *wanted):
    return [(s.kind, s.target) for s in steps if s.kind in wanted]


def test_a_gpu_the_device_plugin_withholds_keeps_the_node_schedulable_in_quarantine_mode():
    """Xid 94 on GPU 2 of 8, the device plugin withholding it: no node taint, nobody evicted, no reset."""
    steps = plan([], contained(), NodeState(), NODE, options=dataclasses.replace(QUARANTINE, offered=offered_but(2)))
    assert kinds(steps, StepKind.TAINT, StepKind.EVICT, StepKind.RESET_GPU) == []


def test_a_gpu_the_device_plugin_still_offers_taints_the_node_and_says_why():
    """Where nothing keeps new work off the GPU (the kubelet offers every GPU), the node taint stands in."""
    steps = plan([], contained(), NodeState(), NODE, options=dataclasses.replace(QUARANTINE, offered=offered_but()))
    assert kinds(steps, StepKind.TAINT) == [(StepKind.TAINT, "node-1")]
    [why] = [s for s in steps if s.details.get("reason") == "DeviceIsolationUnavailable"]
    assert "the kubelet still offers GPU 2" in why.reason and GPUS[2].uuid in why.reason


def test_another_gpu_held_back_since_earlier_does_not_stand_in_for_one_still_offered():
    """GPU 5 held back by the device plugin (an old fault), GPU 2 waiting for a reset and still offered: the
    node is tainted, naming GPU 2 (one GPU withheld for one waiting is not enough: it must be that one)."""
    steps = plan([], contained(), NodeState(), NODE, options=dataclasses.replace(QUARANTINE, offered=offered_but(5)))
    assert kinds(steps, StepKind.TAINT) == [(StepKind.TAINT, "node-1")]
    [why] = [s for s in steps if s.details.get("reason") == "DeviceIsolationUnavailable"]
    assert "the kubelet still offers GPU 2" in why.reason


def test_without_the_kubelets_word_the_node_is_tainted_for_a_gpu_waiting_for_a_reset():
    """Which GPUs are offered unreadable (no PodResources answer): the node taint, saying why."""
    steps = plan([], contained(), NodeState(), NODE, options=QUARANTINE)
    assert kinds(steps, StepKind.TAINT) == [(StepKind.TAINT, "node-1")]
    [why] = [s for s in steps if s.details.get("reason") == "DeviceIsolationUnavailable"]
    assert "could not be read (PodResources)" in why.reason


def test_the_offered_gpus_are_read_from_the_kubelets_device_ids():
    """nvidia.com/ devices only; a time-sliced replica is its GPU; a MIG device is itself and its parent GPU."""
    devices = {"nvidia.com/gpu": ["GPU-a", "GPU-b::0", "GPU-b::1"], "nvidia.com/mig-1g.10gb": ["MIG-c"],
               "example.com/nic": ["eth9"]}
    assert offered_gpus(devices, {"MIG-c": "GPU-d"}) == {"GPU-a", "GPU-b", "MIG-c", "GPU-d"}
    assert offered_gpus({}, {}) == frozenset()


def test_device_ids_that_name_no_gpu_leave_the_offered_gpus_unknown():
    """The plugin's `index` strategy ("0", "1"): which GPU is held back cannot be told, so None (not empty)."""
    assert offered_gpus({"nvidia.com/gpu": ["0", "1"]}, {}) is None


def test_withheld_devices_lift_a_node_taint_set_before_the_device_plugin_reported():
    """The taint set in the seconds before the kubelet showed the GPU withheld is lifted once it does."""
    steps = plan([], contained(), NodeState(tainted=True), NODE,
                 options=dataclasses.replace(QUARANTINE, offered=offered_but(2)))
    assert kinds(steps, StepKind.UNTAINT) == [(StepKind.UNTAINT, "node-1")]


def test_remediate_mode_still_taints_the_node_until_the_reset():
    """The mode that resets keeps today's behaviour: the node is tainted until the GPU is idle and reset."""
    options = dataclasses.replace(QUARANTINE, resets=True, offered=offered_but(2))
    steps = plan([], contained(), NodeState(), NODE, options=options)
    assert kinds(steps, StepKind.TAINT) == [(StepKind.TAINT, "node-1")]
    assert not [s for s in steps if s.target == CONDITION_RESET_REQUIRED]


def test_a_fault_a_reset_does_not_clear_still_takes_the_node():
    """A quarantine cleared by a quiet window (not a reset) is not waiting for one: the node is tainted."""
    faults = {**contained(), **contained(index=3, rule="thermal", action=Action.QUARANTINE, recovery="quiet")}
    steps = plan([], faults, NodeState(), NODE, options=dataclasses.replace(QUARANTINE, offered=offered_but(2, 3)))
    assert kinds(steps, StepKind.TAINT) == [(StepKind.TAINT, "node-1")]


def test_a_reboot_fault_still_takes_the_whole_node():
    """A node-wide escalation (a reboot request) taints the node whatever the device plugin withholds."""
    faults = contained(action=Action.REBOOT_NODE, recovery="boot")
    steps = plan([], faults, NodeState(), NODE, options=dataclasses.replace(QUARANTINE, offered=offered_but(2)))
    assert kinds(steps, StepKind.TAINT) == [(StepKind.TAINT, "node-1")]


def test_the_reset_is_asked_for_with_a_condition_and_one_event():
    """GpuResetRequired names the GPU and the rule; its Event goes with the GPU's first such verdict, once."""
    faults = contained()
    [first] = [f.to_verdict() for f in faults.values()]
    options = dataclasses.replace(QUARANTINE, offered=offered_but(2))
    steps = plan([], faults, NodeState(), NODE, options=options)
    [condition] = [s for s in steps if s.kind is StepKind.SET_CONDITION and s.target == CONDITION_RESET_REQUIRED]
    assert GPUS[2].uuid in condition.reason and "xid-94" in condition.reason
    [event] = reset_required_events([first], faults, options)
    assert event.details["reason"] == "GpuResetRequired" and GPUS[2].uuid in event.reason
    later = {**faults, **contained(rule="xid-154-action-4", at=1.05)}
    second = later[(GPUS[2].key, "xid-154-action-4")].to_verdict()
    assert reset_required_events([second], later, options) == []
    assert reset_required_events([first], faults, dataclasses.replace(options, resets=True)) == []


def test_the_condition_clears_when_no_gpu_waits_for_a_reset():
    """Reset by hand (the faults cleared): GpuResetRequired goes False."""
    held = NodeState(conditions={CONDITION_RESET_REQUIRED: ConditionState(True, "reset needed")})
    steps = plan([], {}, held, NODE, options=QUARANTINE)
    assert kinds(steps, StepKind.CLEAR_CONDITION) == [(StepKind.CLEAR_CONDITION, CONDITION_RESET_REQUIRED)]


def test_a_gpu_waiting_for_a_reset_is_one_series_of_the_reset_metric():
    """gpu_health_gpu_reset_required carries dcgm-exporter's labels for the alert GpuHealthResetRequired."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    waiting = awaiting_reset(contained().values(), QUARANTINE)
    metrics.set_reset_required((f.gpu for f in waiting if f.gpu), hostname="node-1")
    labels = {"gpu": "2", "UUID": GPUS[2].uuid, "pci_bus_id": "00000000:1A:00.0", "modelName": GPUS[2].model,
              "Hostname": "node-1"}
    assert registry.get_sample_value("gpu_health_gpu_reset_required", labels) == 1


def test_rules_lint_in_quarantine_mode_flags_the_quarantines_only_a_reset_clears():
    """`rules lint --mode quarantine` names xid-94 (reset never run) and gpu-lost (reboot never requested)."""
    result = CliRunner().invoke(main, ["rules", "lint", "--mode", "quarantine"])
    assert result.exit_code == 0
    warnings = [line for line in result.output.splitlines() if ": warning: mode quarantine: " in line]
    assert any("rule xid-94: " in line and "verified reset, which this mode never runs" in line for line in warnings)
    assert any("rule gpu-lost: " in line and "never requests the reboot" in line for line in warnings)


def test_rules_lint_in_remediate_or_observe_mode_flags_nothing():
    """Remediate reaches every recovery itself; observe holds nothing for one."""
    for mode in ("remediate", "observe"):
        result = CliRunner().invoke(main, ["rules", "lint", "--mode", mode])
        assert result.exit_code == 0 and "warning" not in result.output


class _DevicePluginNode(LocalActuator):
    """A Node without DRA (NVIDIA's device plugin hands its GPUs out)."""

    def __init__(self):
        self.applied = []

    def observe(self, devices=True):
        return NodeObservation({}, False, False, frozenset(), devices=NO_DRA)

    def apply(self, step):
        self.applied.append(step.kind)
        return StepResult.APPLIED, "ok"


def _run(shipped_rules, *, mode, offered):
    node = _DevicePluginNode()
    asked = []
    inventory = NodeInventory("node-1", GPUS, ())
    p = Pipeline(rules=shipped_rules, inventory=inventory, policy=GuardPolicy(mode=mode), actuator=node,
                 clock=lambda: 100.0, offered=lambda: asked.append(1) or offered)
    p.handle(obs(Signal.XID, 94, 1.0, gpu_ref=GPUS[2]), 1.0)
    p.reconcile(40.0)
    return node.applied, len(asked)


def test_the_agent_in_quarantine_mode_leaves_the_node_untainted_for_a_withheld_gpu(shipped_rules):
    """Through the pipeline: mode quarantine and the kubelet no longer offering GPU 2, Xid 94 taints nothing."""
    applied, _ = _run(shipped_rules, mode=Mode.QUARANTINE, offered=offered_but(2))
    assert StepKind.TAINT not in applied and StepKind.SET_CONDITION in applied


def test_the_agent_in_quarantine_mode_taints_the_node_while_the_gpu_is_still_offered(shipped_rules):
    """The kubelet offering GPU 2 still (another GPU held back): the node is tainted."""
    applied, _ = _run(shipped_rules, mode=Mode.QUARANTINE, offered=offered_but(6))
    assert StepKind.TAINT in applied


def test_the_agent_in_remediate_mode_taints_the_node_for_the_same_gpu(shipped_rules):
    """The same Node in remediate mode: the node is tainted until the GPU is idle and reset, as before; the
    kubelet is not asked (the mode resets, so no GPU waits on someone else's reset)."""
    applied, asked = _run(shipped_rules, mode=Mode.REMEDIATE, offered=offered_but(2))
    assert StepKind.TAINT in applied and asked == 0


def test_a_pending_row_remap_asks_for_its_reset_without_holding_anything():
    """reset_when_idle in quarantine mode: no taint (it never quarantined), but GpuResetRequired asks for the reset."""
    faults = contained(rule="row-remap-pending", action=Action.RESET_WHEN_IDLE)
    steps = plan([], faults, NodeState(), NODE, options=QUARANTINE)
    assert kinds(steps, StepKind.TAINT, StepKind.SET_CONDITION) == [
        (StepKind.SET_CONDITION, "GpuDegraded"), (StepKind.SET_CONDITION, CONDITION_RESET_REQUIRED)]

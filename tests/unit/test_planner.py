from agent.model import (
    NODE_KEY,
    Action,
    NodeInventory,
    PodRef,
    Severity,
    StepKind,
    Verdict,
    VerdictKind,
    frozen_attrs,
)
from agent.remediation import ActiveFault, NodeState, PlanOptions, plan
from agent.remediation.planner import pods_on_faulty_gpus
from tests.conftest import gpu

GPUS = tuple(gpu(i) for i in range(4))
PODS = (
    PodRef("ml", "trainer-0", "u0", (GPUS[0].uuid,)),
    PodRef("ml", "trainer-1", "u1", (GPUS[1].uuid,)),
    PodRef("ml", "pair", "u2", (GPUS[2].uuid, GPUS[3].uuid)),
    PodRef("monitoring", "dcgm-exporter-x", "u3", (), daemonset=True),
    PodRef("gpu-health", "agent-abc", "u4", (GPUS[1].uuid,)),
)
NODE = NodeInventory("node-1", GPUS, PODS)
OPTIONS = PlanOptions(node_name="node-1", own_pod="gpu-health/agent-abc")


def fault(index, action=Action.REBOOT_NODE, severity=Severity.FATAL, rule="xid-79", kind=VerdictKind.FAULT, **ev):
    g = GPUS[index] if index is not None else None
    return Verdict(kind, rule, g.key if g else NODE_KEY, severity, action, "hardware", 1.0, f"{rule} on {index}", g,
                   frozen_attrs(ev))


def active_of(*verdicts):
    return {(v.gpu_key, v.rule_id): ActiveFault.from_verdict(v) for v in verdicts if v.kind is VerdictKind.FAULT}


def kinds(steps):
    return [(s.kind, s.target) for s in steps]


def test_a_fatal_fault_taints_first_then_reports_evicts_its_pods_and_requests_a_reboot():
    """The taint comes first (new work is kept off at once); the Event and condition follow."""
    v = fault(1)
    steps = plan([v], active_of(v), NodeState(), NODE, options=OPTIONS)
    assert kinds(steps) == [
        (StepKind.TAINT, "node-1"), (StepKind.EVENT, "node-1"), (StepKind.SET_CONDITION, "GpuFatalFault"),
        (StepKind.EVICT, "ml/trainer-1"), (StepKind.REBOOT_REQUEST, "node-1")]


def test_only_the_pods_holding_the_faulty_gpu_are_evicted():
    v = fault(3, action=Action.RESET_GPU, rule="xid-48")
    steps = plan([v], active_of(v), NodeState(), NODE, options=OPTIONS)
    assert [s.target for s in steps if s.kind is StepKind.EVICT] == ["ml/pair"]


def test_daemonset_pods_and_the_agent_itself_are_never_evicted():
    v = fault(None, rule="sxid-fatal")
    steps = plan([v], active_of(v), NodeState(), NODE, options=OPTIONS)
    assert sorted(s.target for s in steps if s.kind is StepKind.EVICT) == ["ml/pair", "ml/trainer-0", "ml/trainer-1"]


def test_the_condition_message_names_uuid_pci_and_rule():
    v = fault(2, action=Action.RESET_GPU, rule="xid-48")
    [cond] = [s for s in plan([v], active_of(v), NodeState(), NODE, options=OPTIONS)
              if s.kind is StepKind.SET_CONDITION]
    assert GPUS[2].uuid in cond.reason
    assert GPUS[2].pci_bus_id in cond.reason
    assert "xid-48" in cond.reason


def test_planning_again_after_applying_repeats_nothing():
    v = fault(1)
    node = NodeState()
    for step in plan([v], active_of(v), node, NODE, options=OPTIONS):
        node.apply(step)
    assert plan([], active_of(v), node, NODE, options=OPTIONS) == []


def test_clearing_the_last_fault_removes_taint_and_condition():
    v = fault(1)
    node = NodeState()
    for step in plan([v], active_of(v), node, NODE, options=OPTIONS):
        node.apply(step)
    cleared = fault(1, kind=VerdictKind.CLEARED, severity=Severity.OK)
    steps = plan([cleared], {}, node, NODE, options=OPTIONS)
    assert kinds(steps) == [(StepKind.EVENT, "node-1"), (StepKind.CLEAR_CONDITION, "GpuFatalFault"),
                            (StepKind.UNTAINT, "node-1"), (StepKind.CLEAR_REBOOT_REQUEST, "node-1")]


def test_an_application_fault_disrupts_nothing_and_is_charged_to_its_pod():
    v = fault(0, action=Action.RESTART_APP, severity=Severity.WARNING, rule="xid-13", pod_uid="u0")
    steps = plan([v], active_of(v), NodeState(), NODE, options=OPTIONS)
    assert kinds(steps) == [(StepKind.EVENT, "node-1"), (StepKind.EVENT, "pod/ml/trainer-0")]


def test_a_degraded_notify_fault_sets_a_condition_without_a_taint():
    v = fault(0, action=Action.NOTIFY, severity=Severity.DEGRADED, rule="hot")
    steps = plan([v], active_of(v), NodeState(), NODE, options=OPTIONS)
    assert kinds(steps) == [(StepKind.EVENT, "node-1"), (StepKind.SET_CONDITION, "GpuDegraded")]


def test_reset_when_idle_waits_for_the_gpu_to_be_free():
    busy = fault(0, action=Action.RESET_WHEN_IDLE, severity=Severity.DEGRADED, rule="row-remap-pending")
    assert StepKind.RESET_GPU not in [s.kind for s in plan([busy], active_of(busy), NodeState(), NODE,
                                                                 options=OPTIONS)]
    idle_node = NodeInventory("node-1", GPUS, ())
    steps = plan([busy], active_of(busy), NodeState(), idle_node, options=OPTIONS)
    assert (StepKind.RESET_GPU, GPUS[0].uuid) in kinds(steps)


def test_a_replacement_candidate_is_marked_once():
    v = fault(0, action=Action.REPLACE_GPU, rule="row-remap-failure")
    node = NodeState()
    steps = plan([v], active_of(v), node, NODE, options=OPTIONS)
    assert (StepKind.MARK_REPLACEMENT, GPUS[0].uuid) in kinds(steps)
    for step in steps:
        node.apply(step)
    assert plan([], active_of(v), node, NODE, options=OPTIONS) == []


def test_an_unknown_reading_sets_its_own_condition_and_never_taints():
    v = fault(0, action=Action.NOTIFY, severity=Severity.UNKNOWN, rule="source-unreadable")
    steps = plan([v], active_of(v), NodeState(), NODE, options=OPTIONS)
    assert kinds(steps) == [(StepKind.EVENT, "node-1"), (StepKind.SET_CONDITION, "GpuUnreadable")]


def test_a_released_replacement_is_unmarked():
    node = NodeState(replacement={GPUS[0].key})
    steps = plan([], {}, node, NODE, options=OPTIONS)
    assert kinds(steps) == [(StepKind.UNMARK_REPLACEMENT, GPUS[0].key)]


def test_too_many_faulty_gpus_take_the_whole_node_out():
    verdicts = [fault(i, action=Action.RESET_GPU, rule="xid-48") for i in range(3)]
    steps = plan(verdicts, active_of(*verdicts), NodeState(), NODE,
                 options=PlanOptions(node_name="node-1", own_pod="gpu-health/agent-abc", max_faulty_gpus=2))
    evicted = sorted(s.target for s in steps if s.kind is StepKind.EVICT)
    assert evicted == ["ml/pair", "ml/trainer-0", "ml/trainer-1"]


def _applied(verdicts, node, options=OPTIONS, inventory=NODE):
    """Plan for the verdicts (active with every earlier one applied to `node`) and apply the steps."""
    steps = plan(verdicts, active_of(*verdicts), node, inventory, options=options)
    for step in steps:
        node.apply(step)
    return steps


def evictions(steps):
    return sorted(s.target for s in steps if s.kind is StepKind.EVICT)


def test_with_a_fixed_pod_list_a_pod_on_two_faulty_gpus_is_evicted_once():
    """Local mode and simulate list pods once: a pod evicted for one GPU is gone, not evicted for its other."""
    node = NodeState()
    first = fault(2, action=Action.RESET_GPU, rule="xid-48")
    assert evictions(_applied([first], node)) == ["ml/pair"]
    assert evictions(_applied([first, fault(3, action=Action.RESET_GPU, rule="xid-48")], node)) == []


def _recovered(node, *still_active, options=OPTIONS, pods_live=False):
    """What the pipeline does when faults clear: forget what only the recovered GPUs needed."""
    active = active_of(*still_active)
    held = None if pods_live else pods_on_faulty_gpus(active.values(), NODE, options)
    node.forget_cleared({key for key, _ in active}, still_held=held)


def test_with_a_fixed_pod_list_a_pod_is_not_evicted_again_once_its_first_gpu_recovered():
    """The pod evicted for GPU 2 is still gone when GPU 2 recovers while GPU 3, which it also held, stays faulty."""
    node = NodeState()
    first, second = fault(2, action=Action.RESET_GPU, rule="xid-48"), fault(3, action=Action.RESET_GPU, rule="xid-48")
    _applied([first], node)
    _applied([first, second], node)
    _recovered(node, second)
    assert evictions(_applied([second], node)) == []


def test_with_a_fixed_pod_list_a_fault_elsewhere_does_not_keep_a_recovered_gpus_evictions():
    """Once GPU 0 recovered, a fault on GPU 1 (which trainer-0 never held) does not make trainer-0 count as
    gone: GPU 0's next fault evicts it again."""
    node = NodeState()
    elsewhere = fault(1, action=Action.NOTIFY, severity=Severity.DEGRADED, rule="hot")
    first = fault(0, action=Action.RESET_GPU, rule="xid-48")
    assert "ml/trainer-0" in evictions(_applied([elsewhere, first], node))
    _recovered(node, elsewhere)
    assert evictions(_applied([elsewhere, fault(0, action=Action.RESET_GPU, rule="xid-79")], node)) == [
        "ml/trainer-0"]


def test_with_a_fixed_pod_list_the_whole_nodes_evictions_are_kept_while_it_is_out():
    """Pods evicted because too many GPUs are faulty stay evicted while that lasts, on no GPU of their own."""
    node = NodeState()
    options = PlanOptions(node_name="node-1", own_pod="gpu-health/agent-abc", max_faulty_gpus=1)
    faults = [fault(i, action=Action.RESET_GPU, rule="xid-48") for i in (0, 2)]
    assert evictions(_applied(faults, node, options)) == ["ml/pair", "ml/trainer-0", "ml/trainer-1"]
    _recovered(node, *faults, options=options)
    assert evictions(_applied(faults, node, options)) == []


def test_with_a_live_pod_list_a_recovered_gpus_evictions_are_forgotten():
    """A live list shows what is on the node: the memory of a recovered GPU's evictions goes with its fault."""
    node = NodeState(evicted={GPUS[2].key: {"ml/pair"}, GPUS[3].key: set()})
    _recovered(node, fault(3, action=Action.RESET_GPU, rule="xid-48"), pods_live=True)
    assert GPUS[2].key not in node.evicted


def test_with_a_fixed_pod_list_a_gpu_whose_pods_were_evicted_for_another_is_reset():
    """The pod that held both GPUs was evicted for the first: the second is idle and is reset at once."""
    node = NodeState()
    first = fault(2, action=Action.RESET_GPU, rule="xid-48")
    _applied([first], node)
    steps = _applied([first, fault(3, action=Action.RESET_GPU, rule="xid-48")], node)
    assert (StepKind.RESET_GPU, GPUS[3].uuid) in kinds(steps)


def test_with_a_fixed_pod_list_the_whole_node_evicts_only_the_pods_not_evicted_yet():
    """Once too many GPUs are faulty every GPU pod goes, but those already evicted for their GPU only once."""
    node = NodeState()
    options = PlanOptions(node_name="node-1", own_pod="gpu-health/agent-abc", max_faulty_gpus=2)
    earlier = [fault(i, action=Action.RESET_GPU, rule="xid-48") for i in range(2)]
    assert evictions(_applied(earlier, node, options)) == ["ml/trainer-0", "ml/trainer-1"]
    assert evictions(_applied([*earlier, fault(2, action=Action.RESET_GPU, rule="xid-48")], node, options)) == [
        "ml/pair"]


def test_with_a_live_pod_list_a_pod_of_the_same_name_on_another_faulty_gpu_is_evicted():
    """A StatefulSet's pod comes back under its name: listed again on a faulty GPU, it is a new incarnation."""
    node = NodeState()
    live = PlanOptions(node_name="node-1", own_pod="gpu-health/agent-abc", pods_live=True)
    first = fault(0, action=Action.RESET_GPU, rule="xid-48")
    assert evictions(_applied([first], node, live)) == ["ml/trainer-0"]
    moved = NodeInventory("node-1", GPUS, (PodRef("ml", "trainer-0", "u9", (GPUS[1].uuid,)),))
    steps = _applied([first, fault(1, action=Action.RESET_GPU, rule="xid-48")], node, live, moved)
    assert evictions(steps) == ["ml/trainer-0"]


def test_node_state_survives_its_annotation():
    node = NodeState(tainted=True, evicted={"GPU-1": {"ml/a"}}, resets={"GPU-1"}, reboot_requested=True)
    node.apply(plan([fault(1)], active_of(fault(1)), NodeState(), NODE, options=OPTIONS)[1])
    import json
    assert NodeState.from_json(json.loads(json.dumps(node.to_json()))) == node

from agent.model import Step, StepKind, StepResult
from agent.remediation import AttemptHistory, ClusterView, GateReading, GuardPolicy, Mode, decide, needs_gate
from agent.remediation.guard import disrupted
from agent.remediation.state import DeviceMark, NodeState

EVICT = Step(StepKind.EVICT, "ml/trainer-3", "holds faulty GPU")
TAINT = Step(StepKind.TAINT, "node-1", "fatal")
UNTAINT = Step(StepKind.UNTAINT, "node-1", "healthy")
EVENT = Step(StepKind.EVENT, "node-1", "fatal")
RESET = Step(StepKind.RESET_GPU, "GPU-1", "fatal")
OPEN = ClusterView(gate=GateReading())
SPENT = GateReading(in_use=2, limit=2)


def _decide(step, *, mode=Mode.REMEDIATE, dry_run=False, cluster=OPEN, history=None, now=1000.0):
    return decide(step, policy=GuardPolicy(mode=mode, dry_run=dry_run), cluster=cluster,
                  history=history or AttemptHistory(), now=now)


def test_remediate_mode_lets_an_eviction_through():
    assert _decide(EVICT).proceed


def test_quarantine_mode_taints_but_does_not_evict():
    assert _decide(TAINT, mode=Mode.QUARANTINE).proceed
    assert _decide(EVICT, mode=Mode.QUARANTINE).result is StepResult.SKIPPED


def test_observe_mode_only_records_events():
    assert _decide(EVENT, mode=Mode.OBSERVE).proceed
    assert _decide(TAINT, mode=Mode.OBSERVE).result is StepResult.SKIPPED


def test_dry_run_records_every_step_instead_of_doing_it():
    for step in (EVENT, TAINT, EVICT, UNTAINT):
        assert _decide(step, dry_run=True).result is StepResult.DRY_RUN


def test_clearing_is_never_blocked():
    blocked = ClusterView(gate=GateReading(paused=True, in_use=2, limit=2), opted_out=True)
    assert _decide(UNTAINT, mode=Mode.OBSERVE, cluster=blocked).proceed


def test_an_exhausted_budget_blocks_disruptive_steps_only():
    empty = ClusterView(gate=SPENT)
    decision = _decide(EVICT, cluster=empty)
    assert decision.result is StepResult.BLOCKED
    assert "budget" in decision.reason
    assert _decide(TAINT, cluster=empty).proceed


def test_a_cluster_wide_pause_blocks_disruption():
    """The pause Lease, as the gate read it, blocks a disruptive step (and says why)."""
    decision = _decide(EVICT, cluster=ClusterView(gate=GateReading(paused=True)))
    assert (decision.result, decision.reason) == (StepResult.BLOCKED, "remediation paused cluster-wide")


def test_a_node_holding_its_slot_proceeds_although_every_slot_is_in_use():
    """A renewal needs no free slot: the node's own slot counts as the budget it has."""
    assert _decide(EVICT, cluster=ClusterView(gate=GateReading(held=True, in_use=2, limit=2))).proceed


def test_an_unreadable_gate_blocks_disruption_and_names_why():
    """A gate that could not be read is never taken as open."""
    decision = _decide(EVICT, cluster=ClusterView(gate=GateReading(error="Unavailable: 503")))
    assert decision.result is StepResult.BLOCKED
    assert decision.reason == "disruption budget unreadable: Unavailable: 503"
    assert decision.by_gate


def test_a_disruptive_step_without_a_gate_reading_is_blocked():
    """The guard never lets a disruptive step past a gate nobody read."""
    assert _decide(EVICT, cluster=ClusterView()).result is StepResult.BLOCKED


def test_only_a_disruptive_step_the_mode_allows_needs_the_gate():
    """The caller reads the cluster gate only for a step that gets as far as it."""
    policy = GuardPolicy(mode=Mode.REMEDIATE)
    assert needs_gate(EVICT, policy=policy, opted_out=False)
    assert not needs_gate(TAINT, policy=policy, opted_out=False)
    assert not needs_gate(EVICT, policy=GuardPolicy(mode=Mode.QUARANTINE), opted_out=False)
    assert not needs_gate(EVICT, policy=GuardPolicy(mode=Mode.REMEDIATE, dry_run=True), opted_out=False)
    assert not needs_gate(EVICT, policy=policy, opted_out=True)


def test_an_opted_out_node_gets_events_only():
    opted_out = ClusterView(opted_out=True)
    assert _decide(EVENT, cluster=opted_out).proceed
    assert _decide(TAINT, cluster=opted_out).result is StepResult.SKIPPED


def test_resets_are_capped_per_hour():
    history = AttemptHistory()
    for t in (0.0, 400.0, 800.0):
        history.record(RESET, t)
    decision = _decide(RESET, history=history, now=1300.0)
    assert decision.result is StepResult.BLOCKED
    assert "attempt cap" in decision.reason
    assert _decide(RESET, history=history, now=4000.0).proceed


def test_a_cooldown_spaces_resets():
    history = AttemptHistory()
    history.record(RESET, 900.0)
    assert "cooldown" in _decide(RESET, history=history, now=1000.0).reason


def test_evictions_are_retried_without_a_cap_their_deadline_governs_them():
    history = AttemptHistory()
    for t in (0.0, 30.0, 60.0, 90.0):
        history.record(EVICT, t)
    assert _decide(EVICT, history=history, now=120.0).proceed


def _node(**marks):
    node = NodeState()
    for name, value in marks.items():
        setattr(node, name, value)
    return node


def test_a_noexecute_device_taint_counts_as_disrupted():
    """It deletes the GPU's pods as an eviction would: the node holds its budget slot for it."""
    node = _node(device_taints={"gpu-0": DeviceMark("GPU-0", "NoExecute")})
    assert disrupted(node, set(), policy=GuardPolicy(mode=Mode.REMEDIATE), opted_out=False)
    quiet = _node(device_taints={"gpu-0": DeviceMark("GPU-0", "NoSchedule")})
    assert not disrupted(quiet, set(), policy=GuardPolicy(mode=Mode.REMEDIATE), opted_out=False)


def test_evictions_count_as_disrupted_only_while_their_fault_is_active():
    """Pods moved off a GPU hold the slot until that GPU's fault ends."""
    node = _node(evicted={"GPU-3": {"ml/trainer-3"}})
    policy = GuardPolicy(mode=Mode.REMEDIATE)
    assert disrupted(node, {"GPU-3"}, policy=policy, opted_out=False)
    assert not disrupted(node, {"GPU-4"}, policy=policy, opted_out=False)


def test_a_node_the_agent_does_not_act_on_is_never_disrupted():
    """Dry run, quarantine mode or the opt-out label: a reboot request on the record holds no slot."""
    node = _node(reboot_requested=True)
    assert disrupted(node, set(), policy=GuardPolicy(mode=Mode.REMEDIATE), opted_out=False)
    assert not disrupted(node, set(), policy=GuardPolicy(mode=Mode.REMEDIATE, dry_run=True), opted_out=False)
    assert not disrupted(node, set(), policy=GuardPolicy(mode=Mode.QUARANTINE), opted_out=False)
    assert not disrupted(node, set(), policy=GuardPolicy(mode=Mode.REMEDIATE), opted_out=True)

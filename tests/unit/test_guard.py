from agent.model import Step, StepKind, StepResult
from agent.remediation import AttemptHistory, ClusterView, GuardPolicy, Mode, decide

EVICT = Step(StepKind.EVICT, "ml/trainer-3", "holds faulty GPU")
TAINT = Step(StepKind.TAINT, "node-1", "fatal")
UNTAINT = Step(StepKind.UNTAINT, "node-1", "healthy")
EVENT = Step(StepKind.EVENT, "node-1", "fatal")
RESET = Step(StepKind.RESET_GPU, "GPU-1", "fatal")
OPEN = ClusterView()


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
    blocked = ClusterView(budget_available=False, paused=True, opted_out=True)
    assert _decide(UNTAINT, mode=Mode.OBSERVE, cluster=blocked).proceed


def test_an_exhausted_budget_blocks_disruptive_steps_only():
    empty = ClusterView(budget_available=False)
    decision = _decide(EVICT, cluster=empty)
    assert decision.result is StepResult.BLOCKED
    assert "budget" in decision.reason
    assert _decide(TAINT, cluster=empty).proceed


def test_a_cluster_wide_pause_blocks_disruption():
    assert _decide(EVICT, cluster=ClusterView(paused=True)).result is StepResult.BLOCKED


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

"""Contained ECC errors and the recovery actions that follow them: who is evicted, and when the GPU is reset."""

from agent.model import NodeInventory, PodRef, Signal, StepKind
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy, Mode
from tests.conftest import gpu, obs
from tests.unit.test_reset_verification import Resets

TENANT = PodRef("ml", "tenant", "u0", (gpu(0).uuid,))


def pipeline(rules, pods):
    return Pipeline(rules=rules, inventory=NodeInventory("node-1", (gpu(0), gpu(1)), tuple(pods)),
                    policy=GuardPolicy(mode=Mode.REMEDIATE), actuator=Resets(), clock=lambda: 100.0,
                    pods=lambda: tuple(pods))


def kinds(outcome):
    return [a.step.kind for a in outcome.actions]


def test_a_contained_ecc_error_keeps_new_work_off_and_evicts_no_tenant(shipped_rules):
    """Xid 94: NoSchedule taint at once; the GPU's running tenant is not evicted, and nothing is reset yet."""
    p = pipeline(shipped_rules, [TENANT])
    outcome = p.handle(obs(Signal.XID, 94, 1.0), 1.0)
    assert StepKind.TAINT in kinds(outcome)
    assert StepKind.EVICT not in kinds(outcome) + kinds(p.tick(50.0))
    assert StepKind.RESET_GPU not in kinds(p.tick(60.0))


def test_a_contained_ecc_error_resets_the_gpu_once_its_tenant_has_finished(shipped_rules):
    """When the tenant is gone (it finished, nobody evicted it), the GPU is reset."""
    pods = [TENANT]
    p = pipeline(shipped_rules, pods)
    p.handle(obs(Signal.XID, 94, 1.0), 1.0)
    p.tick(50.0)
    pods.clear()
    assert StepKind.RESET_GPU in kinds(p.tick(90.0))


def test_recovery_action_drain_p2p_evicts_the_gpu_s_pods_then_follows_the_next_action(shipped_rules):
    """Recovery action 3 moves the pods using the GPU; re-read as 4, the GPU is reset when idle; none clears."""
    pods = [TENANT]
    p = pipeline(shipped_rules, pods)
    drained = p.handle(obs(Signal.RECOVERY_ACTION, 3, 1.0), 1.0)
    assert [a.step.target for a in drained.actions if a.step.kind is StepKind.EVICT] == ["ml/tenant"]
    pods.clear()
    [then] = p.handle(obs(Signal.RECOVERY_ACTION, 4, 20.0), 20.0).verdicts
    assert (then.rule_id, str(then.action)) == ("recovery-action-drain-and-reset", "quarantine_reset_when_idle")
    assert StepKind.RESET_GPU in kinds(p.tick(40.0))
    for at in (41.0, 60.0, 80.0):
        p.handle(obs(Signal.RECOVERY_ACTION, 0, at), at)
    p.tick(90.0)  # 30 s of recovery action none: both faults are over
    assert p.gpu_statuses()[gpu(0).key] == "healthy" and not p.node.tainted

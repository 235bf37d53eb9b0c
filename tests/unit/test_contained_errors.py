"""Contained ECC errors and the recovery actions that follow them: who is evicted, and when the GPU is reset."""

import pytest

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


# ---- issue 41 row 1: one incident, one verdict, in any order within the settle window ----
SHARED = [PodRef("team-a", "notebook-a", "ua", (gpu(0).uuid,)), PodRef("team-b", "notebook-b", "ub", (gpu(0).uuid,)),
          PodRef("team-c", "inference-c", "uc", (gpu(0).uuid,))]
#: The incident as the driver and NVML report it, in its real order, 50 ms from first to last (seconds, observation).
REAL_ORDER = [
    (0.000, obs(Signal.ECC_DBE, 1, 10.000, source="nvml-event", event_type=2)),
    (0.010, obs(Signal.XID, 48, 10.010, source="kmsg", message="DBE (0x1) has been detected")),
    (0.020, obs(Signal.XID, 63, 10.020, source="kmsg", message="Row Remapper: New row marked for remapping")),
    (0.030, obs(Signal.XID, 94, 10.030, source="kmsg", message="Contained: SM (0x1). RST: No, D-RST: No")),
    (0.050, obs(Signal.XID, 154, 10.050, source="kmsg", recovery_action_from=0, recovery_action=4,
                message="GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)")),
]


def settling(rules, pods):
    return Pipeline(rules=rules, inventory=NodeInventory("node-1", (gpu(0), gpu(1)), tuple(pods)),
                    policy=GuardPolicy(mode=Mode.REMEDIATE), actuator=Resets(), clock=lambda: 100.0,
                    pods=lambda: tuple(pods), incident_settle_seconds=1.0)


def replay(p, sequence):
    outcomes = [p.handle(o, 10.0 + offset) for offset, o in sequence]
    return outcomes + [p.tick(at) for at in (11.5, 12.0, 15.0, 30.0)]


def active_rules(p):
    return sorted(rule_id for _, rule_id in p.shared.record.faults)


def test_a_contained_incident_in_its_real_order_evicts_no_tenant_and_waits_for_idle_to_reset(shipped_rules):
    """DBE event, Xid 48, 63, 94, 154 0->4 within 50 ms on a GPU shared by three pods: nobody evicted, no reset."""
    p = settling(shipped_rules, SHARED)
    done = [k for outcome in replay(p, REAL_ORDER) for k in kinds(outcome)]
    assert StepKind.EVICT not in done and StepKind.RESET_GPU not in done
    assert StepKind.TAINT in done
    assert active_rules(p) == ["ecc-dbe-contained", "xid-154-action-4", "xid-48-contained", "xid-63", "xid-94"]


def test_the_faults_a_contained_incident_governs_end_saying_why(shipped_rules):
    """The DBE and Xid 48 judged before Xid 94 end as judged with it, and their contained rules decide."""
    p = settling(shipped_rules, SHARED)
    verdicts = [v for outcome in replay(p, REAL_ORDER) for v in outcome.verdicts]
    ended = {v.rule_id: str(v.evidence["why"]) for v in verdicts if str(v.kind) == "cleared"}
    assert set(ended) == {"ecc-dbe", "xid-48"}
    assert all(why.startswith("judged with the contained incident xid-94") for why in ended.values())


@pytest.mark.parametrize("order", [[4, 3, 2, 1, 0], [1, 3, 0, 4, 2], [2, 0, 4, 1, 3]],
                         ids=["reversed", "xid48-first", "xid63-first"])
def test_a_contained_incident_governs_its_errors_in_any_order(shipped_rules, order):
    """Whatever the order of the five within 50 ms, the verdict is the same: contained, nobody evicted."""
    sequence = [(position * 0.0125, REAL_ORDER[n][1]) for position, n in enumerate(order)]
    p = settling(shipped_rules, SHARED)
    done = [k for outcome in replay(p, sequence) for k in kinds(outcome)]
    assert StepKind.EVICT not in done and StepKind.RESET_GPU not in done
    assert active_rules(p) == ["ecc-dbe-contained", "xid-154-action-4", "xid-48-contained", "xid-63", "xid-94"]


def test_the_contained_gpu_is_reset_once_its_tenants_are_done(shipped_rules):
    """The incident judged contained: once the three tenants have finished by themselves, the GPU is reset."""
    pods = list(SHARED)
    p = settling(shipped_rules, pods)
    replay(p, REAL_ORDER)
    pods.clear()
    assert StepKind.RESET_GPU in kinds(p.tick(60.0))


def test_a_solo_xid_48_still_evicts_and_resets_once_the_incident_settled(shipped_rules):
    """Xid 48 alone (no containment within the window): every tenant is evicted after the 1 s settle, then reset."""
    p = settling(shipped_rules, SHARED)
    first = p.handle(obs(Signal.XID, 48, 10.0, source="kmsg"), 10.0)
    assert StepKind.EVICT not in kinds(first)
    evicted = [a.step.target for a in p.tick(11.0).actions if a.step.kind is StepKind.EVICT]
    assert sorted(evicted) == ["team-a/notebook-a", "team-b/notebook-b", "team-c/inference-c"]
    assert active_rules(p) == ["xid-48"]


def test_a_containment_after_the_settle_window_is_another_incident(shipped_rules):
    """Xid 94 two seconds after a DBE governs nothing: the DBE's tenants were already evicted for it."""
    p = settling(shipped_rules, SHARED)
    p.handle(obs(Signal.ECC_DBE, 1, 10.0, source="nvml-event"), 10.0)
    p.tick(11.0)
    p.handle(obs(Signal.XID, 94, 12.0, source="kmsg"), 12.0)
    assert "ecc-dbe" in active_rules(p) and "ecc-dbe-contained" not in active_rules(p)


def test_an_xid_74_quarantine_contains_no_ecc_error(shipped_rules):
    """Only a contained incident (a `contains` rule) governs a DBE: an NVLink Xid 74 reset-when-idle does not."""
    p = settling(shipped_rules, SHARED)
    p.handle(obs(Signal.XID, 74, 10.0, source="kmsg"), 10.0)  # undecoded: xid-74, reset when idle
    p.handle(obs(Signal.ECC_DBE, 1, 10.01, source="nvml-event"), 10.01)
    assert "ecc-dbe" in active_rules(p)

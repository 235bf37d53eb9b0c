"""Verified recoveries count per GPU and fault family, within a window, toward a replacement."""

from agent.model import FaultClass, Observation, Signal
from agent.remediation.recoveries import Recoveries
from agent.remediation.state import NodeState
from tests.conftest import gpu, obs
from tests.unit.test_reset_verification import CLEAN, pipeline

DAY = 86400.0
KEY = gpu(0).key


def recovered_twice(p, start=0.0):
    """Xid 48 on GPU 0, reset and verified by a clean poll, twice."""
    for round_ in range(2):
        at = start + 1000.0 * round_
        p.handle(obs(Signal.XID, 48, at + 1), at + 1)
        p.tick(at + 20)
        p.handle(obs(Signal.GPU_POLLED, 1, at + 21, **CLEAN), at + 21)
    return p


def test_a_hardware_fault_back_after_two_verified_recoveries_needs_replacement(shipped_rules):
    """The third Xid 48 after two verified resets is escalated to replace_gpu."""
    p = recovered_twice(pipeline(shipped_rules))
    [verdict] = p.handle(obs(Signal.XID, 48, 3000.0), 3000.0).verdicts
    assert (verdict.action, verdict.evidence["recoveries"]) == ("replace_gpu", 2)


def test_recoveries_of_another_family_do_not_count(shipped_rules):
    """Two recoveries from memory (hardware) faults do not make an NVLink (interconnect) fault a replacement."""
    p = recovered_twice(pipeline(shipped_rules))
    [verdict] = p.handle(obs(Signal.XID, 74, 3000.0), 3000.0).verdicts
    assert verdict.fault_class == "interconnect" and verdict.action != "replace_gpu"


def test_recoveries_older_than_the_window_do_not_count(shipped_rules):
    """With a 7-day window, recoveries from 8 days ago are forgotten."""
    p = recovered_twice(pipeline(shipped_rules, recovery_window_days=7.0))
    later = 8 * DAY
    [verdict] = p.handle(obs(Signal.XID, 48, later), later).verdicts
    assert verdict.action == "reset_gpu"
    assert p.node.recoveries.to_json() == {}


def test_an_operator_release_starts_the_count_again(shipped_rules):
    """A released GPU's recovery history is gone: the next fault is judged afresh."""
    p = recovered_twice(pipeline(shipped_rules))
    p.handle(Observation(Signal.OPERATOR_RELEASE, 1, 2500.0, "operator", gpu(0)), 2500.0)
    assert p.node.recoveries.to_json() == {}
    [verdict] = p.handle(obs(Signal.XID, 48, 3000.0), 3000.0).verdicts
    assert verdict.action == "reset_gpu"


def test_application_and_driver_faults_never_count():
    """Recoveries from application, driver and telemetry faults are not recorded."""
    recoveries = Recoveries()
    for fault_class in (FaultClass.APPLICATION, FaultClass.DRIVER, FaultClass.TELEMETRY):
        recoveries.add(KEY, fault_class, 10.0)
    assert recoveries.to_json() == {}
    assert recoveries.count(KEY, FaultClass.DRIVER, now=11.0, window_seconds=DAY) == 0


def test_one_reset_that_clears_several_faults_is_one_recovery():
    """The Xid 48 and the ECC counter cleared by the same reset are one recovery of the GPU."""
    recoveries = Recoveries()
    recoveries.add(KEY, FaultClass.HARDWARE, 10.0)
    recoveries.add(KEY, FaultClass.HARDWARE, 10.0)
    assert recoveries.count(KEY, FaultClass.HARDWARE, now=11.0, window_seconds=DAY) == 1


def test_the_old_record_shape_is_read_as_undated_hardware_recoveries():
    """{gpu: count} from an older agent: kept, dated when first counted, then aged out by the window."""
    state = NodeState.from_json({"recoveries": {KEY: 2}})
    assert state.recoveries.count(KEY, FaultClass.HARDWARE, now=100.0, window_seconds=DAY) == 2
    assert state.to_json()["recoveries"] == {KEY: {"hardware": [100.0, 100.0]}}
    assert state.recoveries.count(KEY, FaultClass.HARDWARE, now=100.0 + 2 * DAY, window_seconds=DAY) == 0


def test_the_new_record_shape_round_trips():
    """What the record writes, it reads back."""
    state = NodeState()
    state.recoveries.add(KEY, FaultClass.INTERCONNECT, 5.0)
    state.verifying[KEY] = 7.0
    state.diagnosed.add(KEY)
    again = NodeState.from_json(state.to_json())
    assert again.recoveries.to_json() == {KEY: {"interconnect": [5.0]}}
    assert (again.verifying, again.diagnosed) == ({KEY: 7.0}, {KEY})

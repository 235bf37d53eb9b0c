"""A GPU reset counts only after a clean poll of the GPU; a failed or unverified reset asks for a reboot."""

import pytest

from agent.model import NodeInventory, Signal, StepKind, StepResult
from agent.pipeline import LocalActuator, Pipeline
from agent.remediation import GuardPolicy, Mode
from agent.remediation.resets import reset_by_driver_log, unclean
from agent.sources.kmsg import KernelLogProcessor
from tests.conftest import gpu, obs

NODE = NodeInventory("node-1", (gpu(0), gpu(1)), ())
CLEAN = {"recovery_action": 0, "remap_pending": 0, "retirement_pending": 0, "volatile_dbe": 0, "links_down": 0}
RESET_DONE_LINE = ("NVRM: Xid (PCI:0000:18:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) "
                   "to 0x0 (None)")


class Resets(LocalActuator):
    """Every step takes effect; the reset command succeeds or fails as told."""

    def __init__(self, *, reset_works: bool = True) -> None:
        self.reset_works = reset_works

    def apply(self, step):
        if step.kind is StepKind.RESET_GPU and not self.reset_works:
            return StepResult.FAILED, "nvidia-smi: GPU is busy"
        return StepResult.APPLIED, "ok"


def pipeline(rules, actuator=None, **options):
    return Pipeline(rules=rules, inventory=NODE, policy=GuardPolicy(mode=Mode.REMEDIATE),
                    actuator=actuator or Resets(), clock=lambda: 100.0, **options)


def reset_after_xid_48(p):
    """Xid 48 on an idle GPU 0: it settles and is reset at t=20."""
    p.handle(obs(Signal.XID, 48, 1.0), 1.0)
    return p.tick(20.0)


def resets(outcome):
    return [a for a in outcome.actions if a.step.kind is StepKind.RESET_GPU]


def test_a_clean_poll_is_clean_and_an_unsupported_reading_does_not_count_against_it():
    """Unsupported readings (absent) leave a poll clean; every named dirt is reported."""
    assert unclean(obs(Signal.GPU_POLLED, 1, **CLEAN)) == []
    assert unclean(obs(Signal.GPU_POLLED, 1, recovery_action=0)) == []
    dirty = unclean(obs(Signal.GPU_POLLED, 1, **{**CLEAN, "recovery_action": 1, "remap_pending": 1,
                                                 "volatile_dbe": 2, "links_down": 1}))
    assert dirty == ["recovery action 1", "row remap pending 1", "volatile DBE count 2", "NVLinks down 1"]


def test_the_driver_line_for_a_finished_reset_is_recognised():
    """Xid 154 from GPU Reset Required to None is a reset; a change toward a reset is not."""
    [done] = KernelLogProcessor().handle(RESET_DONE_LINE, 5.0)
    assert reset_by_driver_log(done)
    [asks] = KernelLogProcessor().handle(RESET_DONE_LINE.replace("0x1 (GPU Reset Required) to 0x0 (None)",
                                                                 "0x0 (None) to 0x1 (GPU Reset Required)"), 5.0)
    assert not reset_by_driver_log(asks)


def test_a_successful_reset_command_alone_does_not_clear_the_fault(shipped_rules):
    """The command's success is not the verification: the fault stays until a clean poll."""
    p = pipeline(shipped_rules)
    outcome = reset_after_xid_48(p)
    assert [a.result for a in resets(outcome)] == [StepResult.APPLIED]
    assert outcome.verdicts == []
    assert p.gpu_statuses()[gpu(0).key] == "fatal"
    assert p.node.verifying == {gpu(0).key: 20.0}


def test_a_clean_poll_after_the_reset_verifies_it(shipped_rules):
    """The first clean poll after the reset clears the reset-recovery faults and counts a recovery."""
    p = pipeline(shipped_rules)
    reset_after_xid_48(p)
    cleared = p.handle(obs(Signal.GPU_POLLED, 1, 21.0, **CLEAN), 21.0)
    assert [(v.rule_id, v.evidence["why"]) for v in cleared.verdicts] == [("xid-48", "verified GPU reset")]
    assert p.gpu_statuses()[gpu(0).key] == "healthy"
    assert p.node.recoveries.to_json() == {gpu(0).key: {"hardware": [21.0]}}


def test_a_poll_that_is_not_clean_keeps_the_reset_unverified(shipped_rules):
    """A pending row remap after the reset: the fault stays, the reset still awaits a clean poll."""
    p = pipeline(shipped_rules)
    reset_after_xid_48(p)
    assert p.handle(obs(Signal.GPU_POLLED, 1, 21.0, **{**CLEAN, "remap_pending": 1}), 21.0).verdicts == []
    assert p.gpu_statuses()[gpu(0).key] == "fatal"
    assert gpu(0).key in p.node.verifying


def test_a_poll_of_another_gpu_does_not_verify_the_reset(shipped_rules):
    """Only a poll of the GPU that was reset verifies it."""
    p = pipeline(shipped_rules)
    reset_after_xid_48(p)
    assert p.handle(obs(Signal.GPU_POLLED, 1, 21.0, gpu_ref=gpu(1), **CLEAN), 21.0).verdicts == []
    assert p.gpu_statuses()[gpu(0).key] == "fatal"


def test_a_failed_reset_command_requests_a_reboot(shipped_rules):
    """The reset command failed: gpu-reset-failed asks for a reboot, and the reset is not retried."""
    p = pipeline(shipped_rules, Resets(reset_works=False))
    outcome = reset_after_xid_48(p)
    assert [v.rule_id for v in outcome.verdicts] == ["gpu-reset-failed"]
    assert "GPU is busy" in outcome.verdicts[0].summary
    assert p.node.reboot_requested
    assert resets(p.tick(200.0)) == []


def test_a_reset_no_clean_poll_follows_in_time_requests_a_reboot(shipped_rules):
    """No clean poll within reset_verify_seconds: the reset failed, the node needs a reboot."""
    p = pipeline(shipped_rules, reset_verify_seconds=60.0)
    reset_after_xid_48(p)
    assert p.tick(79.0).verdicts == []
    [failed] = p.tick(80.0).verdicts
    assert (failed.rule_id, failed.action) == ("gpu-reset-failed", "reboot_node")
    assert p.node.reboot_requested and p.node.verifying == {}


def test_a_reset_by_someone_else_is_verified_by_the_next_clean_poll(shipped_rules):
    """The driver's line for a finished reset, then a clean poll, clears the fault without our reset."""
    p = pipeline(shipped_rules, actuator=LocalActuator())  # local mode: the agent's own reset only plans
    p.handle(obs(Signal.XID, 48, 1.0), 1.0)
    [line] = KernelLogProcessor().handle(RESET_DONE_LINE, 30.0)
    assert not line.gpu.uuid  # the kernel log names the GPU by PCI bus id only
    p.handle(line, 30.0)
    assert p.node.verifying == {gpu(0).key: 30.0}
    cleared = p.handle(obs(Signal.GPU_POLLED, 1, 31.0, **CLEAN), 31.0)
    assert "xid-48" in [v.rule_id for v in cleared.verdicts]
    assert p.gpu_statuses()[gpu(0).key] == "healthy"


def test_the_pending_verification_survives_a_restart(shipped_rules, tmp_path):
    """A reset awaiting its clean poll is in the durable record: a restarted agent still verifies it."""
    from agent.journal import Journal
    p = pipeline(shipped_rules, journal=Journal(tmp_path / "j.db"))
    reset_after_xid_48(p)
    again = pipeline(shipped_rules, journal=Journal(tmp_path / "j.db"))
    assert again.node.verifying == {gpu(0).key: 20.0}
    assert [v.rule_id for v in again.handle(obs(Signal.GPU_POLLED, 1, 21.0, **CLEAN), 21.0).verdicts] == ["xid-48"]


def test_a_failed_reset_of_a_gpu_with_only_a_pending_remap_keeps_it_out_without_a_reboot(shipped_rules):
    """Issue 26 item 4: a pending row remap whose reset failed taints the GPU and requests no reboot."""
    p = pipeline(shipped_rules, Resets(reset_works=False))
    p.handle(obs(Signal.ROW_REMAP_PENDING, 1, 1.0), 1.0)
    outcome = p.tick(20.0)
    assert [v.rule_id for v in outcome.verdicts] == ["gpu-reset-failed-when-idle"]
    assert "no reboot is requested" in outcome.verdicts[0].summary
    assert p.node.tainted and not p.node.reboot_requested
    assert not any(a.step.kind is StepKind.REBOOT_REQUEST for a in outcome.actions)


def test_a_failed_reset_of_a_gpu_with_a_fault_beyond_reset_when_idle_still_requests_a_reboot(shipped_rules):
    """A pending remap beside an Xid 48 (reset now): the failed reset asks for a reboot as before."""
    p = pipeline(shipped_rules, Resets(reset_works=False))
    p.handle(obs(Signal.ROW_REMAP_PENDING, 1, 1.0), 1.0)
    outcome = reset_after_xid_48(p)
    assert "gpu-reset-failed" in [v.rule_id for v in outcome.verdicts]
    assert p.node.reboot_requested


class DiesMidReset(Resets):
    """The agent is killed while the reset runs: the command never returns to the pipeline."""

    def apply(self, step):
        if step.kind is StepKind.RESET_GPU:
            raise SystemExit("killed mid-reset")
        return super().apply(step)


def test_a_reset_interrupted_by_a_restart_is_not_run_again(shipped_rules, tmp_path):
    """The reset's intent is journaled before the command runs: a restarted agent awaits its clean poll."""
    from agent.journal import Journal
    p = pipeline(shipped_rules, DiesMidReset(), journal=Journal(tmp_path / "j.db"))
    p.handle(obs(Signal.XID, 48, 1.0), 1.0)
    with pytest.raises(SystemExit):
        p.tick(20.0)
    again = pipeline(shipped_rules, journal=Journal(tmp_path / "j.db"))
    assert resets(again.tick(21.0)) == []
    assert again.node.verifying == {gpu(0).key: 20.0}
    assert [v.rule_id for v in again.handle(obs(Signal.GPU_POLLED, 1, 22.0, **CLEAN), 22.0).verdicts] == ["xid-48"]


def test_the_reset_attempt_is_in_the_journal_before_the_command_runs(shipped_rules, tmp_path):
    """An action row for the reset, result pending, is written before the actuator is called."""
    from agent.journal import Journal
    journal = Journal(tmp_path / "j.db")
    seen: list[list[str]] = []

    class Looks(Resets):
        def apply(self, step):
            if step.kind is StepKind.RESET_GPU:
                seen.append([e["message"] for e in journal.history(limit=1000)
                             if e.get("kind") == "reset_gpu"])
            return super().apply(step)

    reset_after_xid_48(pipeline(shipped_rules, Looks(), journal=journal))
    assert seen == [["started: the result is journaled when it returns"]]


def test_a_reset_the_actuator_did_not_take_up_is_attempted_again(shipped_rules):
    """The journaled intent is withdrawn when the actuator blocks the reset: a later pass resets the GPU."""

    class BlocksOnce(Resets):
        blocked = False

        def apply(self, step):
            if step.kind is StepKind.RESET_GPU and not self.blocked:
                self.blocked = True
                return StepResult.BLOCKED, "the API server is unavailable"
            return super().apply(step)

    p = pipeline(shipped_rules, BlocksOnce())
    assert [a.result for a in resets(reset_after_xid_48(p))] == [StepResult.BLOCKED]
    assert [a.result for a in resets(p.reconcile(400.0))] == [StepResult.APPLIED]  # after the cooldown


def gsp_timeout_then_a_recovery_reported(p, reported_from: int):
    """Xid 119 and Xid 154 0 -> 5 on GPU 0; then the driver's Xid 154 `reported_from` -> 0 and a clean poll."""
    p.handle(obs(Signal.XID, 119, 1.0), 1.0)
    p.handle(obs(Signal.XID, 154, 2.0, recovery_action_from=0, recovery_action=5), 2.0)
    p.handle(obs(Signal.XID, 154, 600.0, recovery_action_from=reported_from, recovery_action=0), 600.0)
    return p.handle(obs(Signal.GPU_POLLED, 1, 601.0, **CLEAN), 601.0).verdicts


def test_a_driver_reported_imex_recovery_verifies_no_reset_of_a_gsp_timeout(shipped_rules):
    """Xid 119, then the driver's Xid 154 0 -> 5 -> 0 and a clean poll: the IMEX fault clears, Xid 119 stays."""
    p = pipeline(shipped_rules, inline=False)
    verdicts = gsp_timeout_then_a_recovery_reported(p, 5)
    assert [(v.rule_id, str(v.kind)) for v in verdicts] == [("xid-154-action-5", "cleared")]
    assert (gpu(0).key, "xid-119") in p.shared.record.faults


def test_a_driver_reported_reset_still_clears_every_fault_a_reset_clears(shipped_rules):
    """The driver's Xid 154 1 -> 0 (the GPU was reset, by someone) and a clean poll: Xid 119 and the IMEX fault go."""
    verdicts = gsp_timeout_then_a_recovery_reported(pipeline(shipped_rules, inline=False), 1)
    assert sorted(v.rule_id for v in verdicts if str(v.kind) == "cleared") == ["xid-119", "xid-154-action-5"]


def test_a_recovery_the_driver_reported_keeps_awaiting_only_itself_across_a_restart():
    """The record keeps which GPUs await a clean poll for a driver-reported recovery that was no reset."""
    from agent.remediation import NodeState
    node = NodeState(verifying={gpu(0).key: 600.0}, recovering={gpu(0).key})
    assert NodeState.from_json(node.to_json()).recovering == {gpu(0).key}
    assert "recovering" not in NodeState().to_json()  # nothing awaited: the record (and the Node's copy) as before


def reset_of_a_mig_gpu(p):
    """GPU 0 polled with its 7 MIG devices, then Xid 48: reset at t=20."""
    p.handle(obs(Signal.GPU_POLLED, 1, 0.5, **CLEAN, mig_mode=1, mig_devices=7), 0.5)
    return reset_after_xid_48(p)


def test_a_reset_that_left_the_mig_gpu_without_its_instances_is_not_verified(shipped_rules):
    """Issue 41 row 11: the geometry (7 MIG devices) is recorded before the reset; a clean poll counting none is
    no verified reset (the GPU would advertise no MIG device), one counting the 7 again is."""
    p = pipeline(shipped_rules)
    reset_of_a_mig_gpu(p)
    assert p.node.mig_expected == {gpu(0).key: 7}
    assert p.handle(obs(Signal.GPU_POLLED, 1, 21.0, **CLEAN, mig_mode=1, mig_devices=0), 21.0).verdicts == []
    assert p.gpu_statuses()[gpu(0).key] == "fatal" and gpu(0).key in p.node.verifying
    cleared = p.handle(obs(Signal.GPU_POLLED, 1, 60.0, **CLEAN, mig_mode=1, mig_devices=7), 60.0)
    assert [v.rule_id for v in cleared.verdicts] == ["xid-48"]
    assert p.node.mig_expected == {} and p.gpu_statuses()[gpu(0).key] == "healthy"


def test_mig_instances_never_re_created_are_a_failed_reset(shipped_rules):
    """No poll with the geometry back within reset_verify_seconds: gpu-reset-failed, as for any unverified reset."""
    p = pipeline(shipped_rules, reset_verify_seconds=60.0)
    reset_of_a_mig_gpu(p)
    p.handle(obs(Signal.GPU_POLLED, 1, 30.0, **CLEAN, mig_mode=1, mig_devices=0), 30.0)
    [failed] = p.tick(80.0).verdicts
    assert failed.rule_id == "gpu-reset-failed" and p.node.mig_expected == {}


def test_the_recorded_mig_geometry_survives_a_restart(shipped_rules, tmp_path):
    """Recorded in the durable record before the reset runs: a restarted agent still waits for the instances."""
    from agent.journal import Journal
    p = pipeline(shipped_rules, journal=Journal(tmp_path / "j.db"))
    reset_of_a_mig_gpu(p)
    again = pipeline(shipped_rules, journal=Journal(tmp_path / "j.db"))
    assert again.node.mig_expected == {gpu(0).key: 7}
    assert again.handle(obs(Signal.GPU_POLLED, 1, 21.0, **CLEAN, mig_mode=1, mig_devices=0), 21.0).verdicts == []

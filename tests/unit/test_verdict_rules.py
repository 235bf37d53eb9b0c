"""The shipped rules where they depart from a naive reading, each against NVIDIA's guidance (docs/rules.md)."""

from agent.engine import EngineState, evaluate, tick
from agent.model import Action, Severity, Signal
from tests.conftest import obs


def verdicts_for(rules, *observations):
    state, out = EngineState(), []
    for o in observations:
        out += evaluate(o, state, o.at, rules=rules)
    return out, state


def test_xid_157_spare_resources_exhausted_is_not_info(shipped_rules):
    """No repair is possible any more: degraded for replacement planning, while work keeps running."""
    [verdict] = verdicts_for(shipped_rules, obs(Signal.XID, 157))[0]
    assert verdict.severity is Severity.DEGRADED and not verdict.action.evicts
    assert verdict.evidence["nvidia_action"] == "IGNORE" and verdict.evidence["reason"]


def test_xid_64_while_the_remap_state_is_unreadable_is_a_replacement_candidate(shipped_rules):
    verdicts, _ = verdicts_for(shipped_rules, obs(Signal.XID, 64, remap_state="unreadable"))
    assert {v.rule_id: v.action for v in verdicts} == {"xid-64": Action.RESET_GPU,
                                                       "xid-64-remap-state-unreadable": Action.REPLACE_GPU}


def test_xid_64_with_a_readable_remap_state_leaves_replacement_to_the_remap_rules(shipped_rules):
    verdicts, _ = verdicts_for(shipped_rules, obs(Signal.XID, 64, remap_state="readable"))
    assert [v.rule_id for v in verdicts] == ["xid-64"]


def test_the_sram_threshold_flag_marks_the_gpu_for_replacement(shipped_rules):
    [verdict] = verdicts_for(shipped_rules, obs(Signal.SRAM_THRESHOLD_EXCEEDED, 1))[0]
    assert (verdict.rule_id, verdict.action) == ("sram-threshold-exceeded", Action.REPLACE_GPU)


def test_dcgms_unrepairable_memory_is_a_replacement(shipped_rules):
    [verdict] = verdicts_for(shipped_rules, obs(Signal.MEMORY_UNREPAIRABLE, 1))[0]
    assert verdict.action is Action.REPLACE_GPU


def test_nvml_reset_required_is_a_fatal_reset(shipped_rules):
    [verdict] = verdicts_for(shipped_rules, obs(Signal.RESET_REQUIRED, 1, message="x"))[0]
    assert (verdict.severity, verdict.action) == (Severity.FATAL, Action.RESET_GPU)


def test_a_gpu_missing_after_a_boot_is_fatal(shipped_rules):
    [verdict] = verdicts_for(shipped_rules, obs(Signal.GPU_MISSING, 1, last_seen="boot 1"))[0]
    assert (verdict.rule_id, verdict.severity, verdict.action) == ("gpu-missing", Severity.FATAL, Action.REPLACE_GPU)


def test_a_gpu_missing_clears_only_when_it_reads_present_again(shipped_rules):
    _verdicts, state = verdicts_for(shipped_rules, obs(Signal.GPU_MISSING, 1, 0.0))
    assert tick(state, 7200.0, rules=shipped_rules) == []
    evaluate(obs(Signal.GPU_MISSING, 0, 7200.0), state, 7200.0, rules=shipped_rules)
    assert [v.kind for v in tick(state, 7300.0, rules=shipped_rules)] == ["cleared"]


def _slowdown(at: float, reasons: int = 0x8):
    return obs(Signal.CLOCK_EVENTS, reasons, at)


def test_a_prolonged_hardware_slowdown_stops_new_work_without_evicting(shipped_rules):
    verdicts, _ = verdicts_for(shipped_rules, *[_slowdown(t) for t in range(0, 901, 30)])
    prolonged = [v for v in verdicts if v.rule_id == "clocks-hw-slowdown-prolonged"]
    assert len(prolonged) == 1 and prolonged[0].quarantines and not prolonged[0].action.evicts


def test_a_short_hardware_slowdown_only_notifies(shipped_rules):
    verdicts, _ = verdicts_for(shipped_rules, *[_slowdown(t) for t in range(0, 300, 30)])
    assert verdicts and not any(v.quarantines for v in verdicts)


def test_a_prolonged_power_brake_clears_after_a_sustained_clean_period(shipped_rules):
    verdicts, state = verdicts_for(shipped_rules, *[_slowdown(t, 0x80) for t in range(0, 901, 30)])
    assert any(v.rule_id == "clocks-power-brake-prolonged" for v in verdicts)
    for t in range(930, 2700, 30):
        evaluate(_slowdown(t, 0), state, t, rules=shipped_rules)
        if t == 1800:
            assert "clocks-power-brake-prolonged" not in {v.rule_id for v in tick(state, t, rules=shipped_rules)}
    cleared = tick(state, 2700.0, rules=shipped_rules)
    assert "clocks-power-brake-prolonged" in {v.rule_id for v in cleared}


def test_one_owner_crash_looping_never_counts_as_several_workloads(shipped_rules):
    """Three pods of one job fault on the GPU: one workload, the application's; the node stays in service."""
    faults = [obs(Signal.XID, 13, t, workload="team-a/Job/train", pid=100 + t) for t in (0.0, 60.0, 120.0)]
    verdicts, _ = verdicts_for(shipped_rules, *faults)
    assert not any(v.quarantines for v in verdicts)


def test_faults_across_owners_wait_for_a_diagnostic_not_a_timer(shipped_rules):
    """Three different owners: NVIDIA's repeat pattern. Only a release (after a diagnostic) clears it."""
    faults = [obs(Signal.XID, 31, t, workload=f"ns/Deployment/app-{t:g}") for t in (0.0, 60.0, 120.0)]
    verdicts, state = verdicts_for(shipped_rules, *faults)
    assert any(v.rule_id == "xid-app-faults-across-workloads" and v.quarantines for v in verdicts)
    cleared = tick(state, 7 * 24 * 3600.0, rules=shipped_rules)
    assert "xid-app-faults-across-workloads" not in {v.rule_id for v in cleared}


def test_xid_13_repeating_on_one_gpc_and_tpc_waits_for_a_diagnostic(shipped_rules):
    """NVIDIA's WORKFLOW_XID_13: a repeat on the same GPC/TPC is a possible hardware issue."""
    verdicts, _ = verdicts_for(shipped_rules, obs(Signal.XID, 13, sm_location="GPC 4, TPC 1",
                                                  sm_location_workloads=3))
    [repeat] = [v for v in verdicts if v.rule_id == "xid-app-13-repeat-gpc-tpc"]
    assert repeat.quarantines and not repeat.action.evicts


def test_xid_13_from_one_process_is_the_applications(shipped_rules):
    verdicts, _ = verdicts_for(shipped_rules, obs(Signal.XID, 13, sm_location="GPC 4, TPC 1",
                                                  sm_location_workloads=1))
    assert not any(v.quarantines for v in verdicts)


def test_the_xid_74_register_decode_applies_only_to_hopper(shipped_rules):
    """NVIDIA: the registers are valid for Hopper-based products; on an A100 the caution stays."""
    from tests.conftest import gpu
    hopper = verdicts_for(shipped_rules, obs(Signal.XID, 74, nvlink_error_class="IGNORE"))[0]
    ampere = verdicts_for(shipped_rules, obs(Signal.XID, 74, gpu_ref=gpu(0, "NVIDIA A100-SXM4-80GB"),
                                             nvlink_error_class="IGNORE"))[0]
    assert [v.rule_id for v in hopper] == ["xid-74-ignorable"]
    assert [(v.rule_id, v.quarantines) for v in ampere] == [("xid-74", True)]


def test_a_contained_ecc_error_resets_when_idle_and_evicts_no_other_tenant(shipped_rules):
    """NVIDIA: Xid 94 is contained to one application; the others are unaffected; reset when convenient."""
    [verdict] = verdicts_for(shipped_rules, obs(Signal.XID, 94))[0]
    assert (verdict.action, verdict.action.evicts) == (Action.QUARANTINE_RESET_WHEN_IDLE, False)
    assert verdict.quarantines  # NoSchedule: new work stays off so that the GPU becomes idle


def test_xid_74_with_serious_bits_on_hopper_drains_and_resets(shipped_rules):
    """Hopper registers with bits of a likely hardware issue: pods using the GPU move, then the GPU is reset."""
    [verdict] = verdicts_for(shipped_rules, obs(Signal.XID, 74, nvlink_error_class="INVESTIGATE", link=3))[0]
    assert (verdict.rule_id, verdict.action.evicts, verdict.action.resets) == ("xid-74-serious", True, True)


def test_xid_74_serious_bits_on_a_gpu_without_the_decode_keep_the_caution(shipped_rules):
    """NVIDIA: the register decode is valid on Hopper only; an A100's bits decide nothing (the caution: new work
    stays off and the GPU is reset once idle)."""
    from tests.conftest import gpu
    [verdict] = verdicts_for(shipped_rules, obs(Signal.XID, 74, gpu_ref=gpu(0, "NVIDIA A100-SXM4-80GB"),
                                                nvlink_error_class="INVESTIGATE"))[0]
    assert (verdict.rule_id, verdict.action) == ("xid-74", Action.QUARANTINE_RESET_WHEN_IDLE)


def test_one_xid_74_ecc_parity_error_is_counted_not_an_eviction_or_a_reset(shipped_rules):
    """NVIDIA's workflow: ECC/parity bits are to be reported "if seen more than 2 times on the same link"."""
    [verdict] = verdicts_for(shipped_rules, obs(Signal.XID, 74, nvlink_error_class="ECC_PARITY", link=3))[0]
    assert (verdict.rule_id, verdict.action) == ("xid-74-ecc-parity", Action.NOTIFY)
    assert not verdict.quarantines and not verdict.action.resets


def test_a_third_xid_74_ecc_parity_error_on_the_same_link_keeps_new_work_off_and_resets_once_idle(shipped_rules):
    """The third within a day on one link is a hardware issue: nobody is evicted, the GPU is reset once idle."""
    verdicts, _ = verdicts_for(shipped_rules, *(obs(Signal.XID, 74, float(at), nvlink_error_class="ECC_PARITY",
                                                    link=3) for at in (0, 600, 7200)))
    repeated = [v for v in verdicts if v.rule_id == "xid-74-ecc-parity-repeated"]
    assert [(v.at, v.action) for v in repeated] == [(7200.0, Action.QUARANTINE_RESET_WHEN_IDLE)]
    assert not repeated[0].action.evicts


def test_xid_74_ecc_parity_errors_on_different_links_are_counted_apart(shipped_rules):
    """"On the same link": three errors on three links are three single errors, none repeated."""
    verdicts, _ = verdicts_for(shipped_rules, *(obs(Signal.XID, 74, float(at), nvlink_error_class="ECC_PARITY",
                                                    link=link) for at, link in ((0, 1), (60, 2), (120, 3))))
    assert [v.rule_id for v in verdicts] == ["xid-74-ecc-parity"]


def test_xid_74_ecc_parity_errors_a_day_apart_are_no_repeat(shipped_rules):
    verdicts, _ = verdicts_for(shipped_rules, *(obs(Signal.XID, 74, float(at), nvlink_error_class="ECC_PARITY",
                                                    link=3) for at in (0, 50_000, 100_000)))
    assert "xid-74-ecc-parity-repeated" not in {v.rule_id for v in verdicts}


def test_a_solo_xid_74_fabric_reset_bit_is_not_ignored(shipped_rules):
    """Fourth register bit 18: "a reset of the fabric is required": new work stays off, reset once idle."""
    [verdict] = verdicts_for(shipped_rules, obs(Signal.XID, 74, nvlink_error_class="FABRIC_RESET", link=5))[0]
    assert (verdict.rule_id, verdict.action) == ("xid-74-fabric-reset", Action.QUARANTINE_RESET_WHEN_IDLE)
    assert not verdict.action.evicts


def test_recovery_action_drain_p2p_moves_the_pods_using_the_gpu(shipped_rules):
    [level] = verdicts_for(shipped_rules, obs(Signal.RECOVERY_ACTION, 3))[0]
    [xid] = verdicts_for(shipped_rules, obs(Signal.XID, 154, recovery_action=3))[0]
    assert level.action.evicts and xid.action.evicts


def test_a_gpu_whose_calls_stay_hung_for_30_s_is_kept_from_new_work_and_reset_once_idle(shipped_rules):
    """Issue 41 row 10: a GSP that stopped answering wants a reset; no Xid is needed to keep work off the GPU."""
    hung = [obs(Signal.SOURCE_UNREADABLE, 1, t, source="nvml", hung="nvmlDeviceGetPowerUsage",
                message="nvmlDeviceGetPowerUsage is still hung in the driver") for t in (0.0, 10.0, 20.0, 30.0)]
    verdicts, _ = verdicts_for(shipped_rules, *hung)
    assert [(v.rule_id, v.at) for v in verdicts] == [("source-unreadable", 0.0), ("gpu-calls-hung", 30.0)]
    assert verdicts[1].action is Action.QUARANTINE_RESET_WHEN_IDLE and str(verdicts[1].fault_class) == "driver"


def test_calls_that_fail_or_hang_briefly_leave_the_gpu_only_unknown(shipped_rules):
    """NVML errors (ERROR_UNKNOWN) and a hang that ends within 30 s are Unknown, never a quarantine."""
    failing = [obs(Signal.SOURCE_UNREADABLE, 1, t, message="no NVML reading succeeded") for t in (0.0, 30.0, 60.0)]
    brief = [obs(Signal.SOURCE_UNREADABLE, 1, t, hung="nvmlDeviceGetPowerUsage") for t in (100.0, 110.0, 120.0)]
    verdicts, _ = verdicts_for(shipped_rules, *failing, obs(Signal.SOURCE_UNREADABLE, 0, 90.0), *brief,
                               obs(Signal.SOURCE_UNREADABLE, 0, 125.0), obs(Signal.SOURCE_UNREADABLE, 1, 131.0,
                                                                             hung="nvmlDeviceGetPowerUsage"))
    assert {v.rule_id for v in verdicts} == {"source-unreadable"}

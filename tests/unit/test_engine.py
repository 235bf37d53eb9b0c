"""The engine's semantics: firing, windows, debounce, recovery, fallbacks, overrides, determinism."""

from agent.engine import EngineState, evaluate, load_rule_texts, restore, tick
from agent.model import Action, Severity, Signal, VerdictKind
from tests.conftest import gpu, obs

RULES = load_rule_texts([("t.yaml", """
rules:
- {id: fatal-79, signal: xid, code: 79, severity: fatal, action: reboot_node, fault_class: hardware,
   summary: "Xid {code} on {gpu}", source: t, recovery: {kind: boot}}
- {id: app-13, signal: xid, code: 13, severity: warning, action: restart_app, fault_class: application,
   summary: "Xid 13 pid {pid}", source: t, recovery: {kind: quiet, quiet_seconds: 300}}
- {id: three-in-a-minute, signal: xid, code: 31, severity: degraded, action: quarantine, fault_class: hardware,
   window: {count: 3, seconds: 60}, summary: s, source: t, recovery: {kind: quiet, quiet_seconds: 60}}
- {id: distinct-pods, signal: xid, code: 43, severity: degraded, action: quarantine, fault_class: hardware,
   window: {count: 2, seconds: 600, distinct: workload}, summary: s, source: t,
   recovery: {kind: quiet, quiet_seconds: 60}}
- {id: same-link, signal: xid, code: 74, severity: degraded, action: quarantine, fault_class: interconnect,
   window: {count: 2, seconds: 600, per: link}, summary: s, source: t, recovery: {kind: quiet, quiet_seconds: 60}}
- {id: unknown, signal: xid, fallback: true, severity: warning, action: notify, fault_class: driver,
   summary: "unknown Xid {code}", source: t, recovery: {kind: quiet, quiet_seconds: 60}}
- {id: dbe, signal: ecc_dbe, when: [{field: value, op: ge, value: 1}], severity: fatal, action: reset_gpu,
   fault_class: hardware, summary: s, source: t, recovery: {kind: reset}}
- {id: hot, signal: temperature, when: [{field: value, op: ge, ref: slowdown_c}], sustain_seconds: 60,
   severity: degraded, action: notify, fault_class: hardware, summary: "{value} C >= {slowdown_c} C", source: t,
   recovery: {kind: quiet, quiet_seconds: 120},
   overrides: [{models: ["*A100*"], sustain_seconds: 10}]}
- {id: replace, signal: row_remap_failure, when: [{field: value, op: ge, value: 1}], severity: fatal,
   action: replace_gpu, fault_class: hardware, summary: s, source: t, recovery: {kind: operator}}
""")])


def run(*observations, state=None):
    state = state or EngineState()
    verdicts = []
    for o in observations:
        verdicts.extend(evaluate(o, state, o.at, rules=RULES))
    return verdicts, state


def test_one_fatal_xid_raises_one_fatal_verdict():
    [verdict], _ = run(obs(Signal.XID, 79, 5.0))
    assert (verdict.kind, verdict.rule_id, verdict.severity, verdict.action) == (
        VerdictKind.FAULT, "fatal-79", Severity.FATAL, Action.REBOOT_NODE)
    assert verdict.gpu_key == gpu().uuid


def test_the_evidence_keeps_the_value_as_a_float_whatever_type_the_source_gave():
    """A source may pass 79 or 79.0; the journal's evidence reads 79.0 in the interpreted and compiled builds."""
    [verdict], _ = run(obs(Signal.XID, 79, 5.0))
    assert type(verdict.evidence["value"]) is float and verdict.evidence["value"] == 79.0


def test_the_summary_is_filled_from_the_observation():
    [verdict], _ = run(obs(Signal.XID, 13, pid=4242))
    assert verdict.summary == "Xid 13 pid 4242"


def test_a_missing_placeholder_does_not_break_the_summary():
    [verdict], _ = run(obs(Signal.XID, 13))
    assert verdict.summary == "Xid 13 pid ?"


def test_repeats_of_an_active_fault_give_no_new_verdict_but_are_counted():
    state = EngineState()
    verdicts, _ = run(*(obs(Signal.XID, 79, i * 0.001) for i in range(5000)), state=state)
    assert len(verdicts) == 1
    assert state.rules[(gpu().uuid, "fatal-79")].occurrences == 5000


def test_deduplicated_counts_add_up():
    state = EngineState()
    run(obs(Signal.XID, 79, 0.0, count=700), state=state)
    assert state.rules[(gpu().uuid, "fatal-79")].occurrences == 700


def test_a_count_window_fires_on_the_nth_occurrence_within_the_span():
    verdicts, _ = run(obs(Signal.XID, 31, 0), obs(Signal.XID, 31, 10), obs(Signal.XID, 31, 20))
    assert [v.rule_id for v in verdicts] == ["three-in-a-minute"]


def test_occurrences_spread_wider_than_the_window_never_fire():
    verdicts, _ = run(obs(Signal.XID, 31, 0), obs(Signal.XID, 31, 50), obs(Signal.XID, 31, 100),
                      obs(Signal.XID, 31, 150))
    assert verdicts == []


def test_windows_are_per_gpu():
    verdicts, _ = run(obs(Signal.XID, 31, 0, gpu_ref=gpu(0)), obs(Signal.XID, 31, 1, gpu_ref=gpu(1)),
                      obs(Signal.XID, 31, 2, gpu_ref=gpu(2)))
    assert verdicts == []


def test_a_distinct_window_counts_different_workloads_not_repeats():
    same, _ = run(obs(Signal.XID, 43, 0, workload="a"), obs(Signal.XID, 43, 1, workload="a"))
    assert same == []
    different, _ = run(obs(Signal.XID, 43, 0, workload="a"), obs(Signal.XID, 43, 1, workload="b"))
    assert [v.rule_id for v in different] == ["distinct-pods"]


def test_a_per_value_window_counts_each_value_apart():
    """`per: link`: two occurrences on one link fire, one on each of two links do not."""
    apart, _ = run(obs(Signal.XID, 74, 0, link=1), obs(Signal.XID, 74, 1, link=2))
    assert apart == []
    same, _ = run(obs(Signal.XID, 74, 0, link=1), obs(Signal.XID, 74, 1, link=2), obs(Signal.XID, 74, 2, link=1))
    assert [(v.rule_id, v.at) for v in same] == [("same-link", 2)]


def test_a_per_value_window_counts_nothing_without_the_value():
    verdicts, _ = run(obs(Signal.XID, 74, 0), obs(Signal.XID, 74, 1))
    assert verdicts == []


def test_a_per_value_window_forgets_occurrences_older_than_its_span():
    verdicts, _ = run(obs(Signal.XID, 74, 0, link=1), obs(Signal.XID, 74, 700, link=1))
    assert verdicts == []


def test_an_unmapped_code_falls_back_to_a_warning():
    [verdict], _ = run(obs(Signal.XID, 999))
    assert (verdict.rule_id, verdict.severity, verdict.quarantines) == ("unknown", Severity.WARNING, False)


def test_the_fallback_stays_silent_when_a_specific_rule_matches():
    verdicts, _ = run(obs(Signal.XID, 79))
    assert [v.rule_id for v in verdicts] == ["fatal-79"]


def test_a_level_must_hold_for_the_sustain_time():
    reading = dict(slowdown_c=90)
    early, state = run(obs(Signal.TEMPERATURE, 95, 0, **reading), obs(Signal.TEMPERATURE, 95, 30, **reading))
    assert early == []
    later, _ = run(obs(Signal.TEMPERATURE, 95, 60, **reading), state=state)
    assert [v.rule_id for v in later] == ["hot"]


def test_a_flapping_level_is_debounced():
    readings = [obs(Signal.TEMPERATURE, 95 if i % 2 == 0 else 70, i * 5.0, slowdown_c=90) for i in range(40)]
    verdicts, _ = run(*readings)
    assert verdicts == []


def test_a_threshold_is_the_gpus_own():
    verdicts, _ = run(obs(Signal.TEMPERATURE, 85, 0, slowdown_c=84), obs(Signal.TEMPERATURE, 85, 60, slowdown_c=84))
    assert [v.rule_id for v in verdicts] == ["hot"]


def test_a_missing_threshold_never_matches():
    verdicts, _ = run(obs(Signal.TEMPERATURE, 200, 0), obs(Signal.TEMPERATURE, 200, 100))
    assert verdicts == []


def test_a_model_override_changes_the_rule_for_that_model_only():
    a100 = gpu(0, model="NVIDIA A100-SXM4-80GB")
    verdicts, _ = run(obs(Signal.TEMPERATURE, 95, 0, gpu_ref=a100, slowdown_c=90),
                      obs(Signal.TEMPERATURE, 95, 10, gpu_ref=a100, slowdown_c=90))
    assert [v.rule_id for v in verdicts] == ["hot"]


def test_an_event_fault_clears_after_its_quiet_window():
    _, state = run(obs(Signal.XID, 13, 0))
    assert tick(state, 299, rules=RULES) == []
    [cleared] = tick(state, 300, rules=RULES)
    assert (cleared.kind, cleared.rule_id, cleared.severity) == (VerdictKind.CLEARED, "app-13", Severity.OK)


def test_a_level_fault_needs_a_healthy_reading_before_it_clears():
    hot = [obs(Signal.TEMPERATURE, 95, t, slowdown_c=90) for t in (0, 30, 60)]
    _, state = run(*hot)
    assert tick(state, 1000, rules=RULES) == []
    run(obs(Signal.TEMPERATURE, 60, 1001, slowdown_c=90), state=state)
    assert [v.kind for v in tick(state, 1002, rules=RULES)] == [VerdictKind.CLEARED]


def test_a_reset_clears_reset_recoverable_faults_of_that_gpu_only():
    _, state = run(obs(Signal.ECC_DBE, 1, 0, gpu_ref=gpu(0)), obs(Signal.ECC_DBE, 1, 0, gpu_ref=gpu(1)))
    cleared, _ = run(obs(Signal.GPU_RESET, 1, 10, gpu_ref=gpu(0)), state=state)
    assert [(v.kind, v.gpu_key) for v in cleared] == [(VerdictKind.CLEARED, gpu(0).uuid)]


def test_a_failed_reset_clears_nothing():
    _, state = run(obs(Signal.ECC_DBE, 1, 0))
    cleared, _ = run(obs(Signal.GPU_RESET, 0, 10), state=state)
    assert cleared == []


def test_a_new_boot_clears_boot_and_reset_faults_but_not_operator_ones():
    _, state = run(obs(Signal.BOOT, 0, 0, boot_id="b1"), obs(Signal.XID, 79, 1), obs(Signal.ECC_DBE, 1, 1),
                   obs(Signal.ROW_REMAP_FAILURE, 1, 1))
    same_boot, _ = run(obs(Signal.BOOT, 0, 2, boot_id="b1"), state=state)
    assert same_boot == []
    cleared, _ = run(obs(Signal.BOOT, 0, 3, boot_id="b2"), state=state)
    assert sorted(v.rule_id for v in cleared) == ["dbe", "fatal-79"]


def test_only_an_operator_release_clears_a_replacement():
    _, state = run(obs(Signal.ROW_REMAP_FAILURE, 1, 0))
    assert tick(state, 10**9, rules=RULES) == []
    cleared, _ = run(obs(Signal.OPERATOR_RELEASE, 1, 5, by="alice"), state=state)
    assert [v.rule_id for v in cleared] == ["replace"]
    assert "alice" in cleared[0].summary


def test_a_cleared_fault_can_fire_again():
    _, state = run(obs(Signal.XID, 13, 0))
    tick(state, 400, rules=RULES)
    again, _ = run(obs(Signal.XID, 13, 500), state=state)
    assert [v.rule_id for v in again] == ["app-13"]


def test_restored_faults_are_not_raised_twice():
    [verdict], _ = run(obs(Signal.XID, 79, 0))
    state = EngineState()
    restore(state, [verdict])
    again, _ = run(obs(Signal.XID, 79, 10), state=state)
    assert again == []


def test_idle_state_is_forgotten():
    _, state = run(obs(Signal.XID, 31, 0))
    tick(state, 1000, rules=RULES)
    assert state.rules == {}


def test_evidence_carries_the_source_and_attributes():
    [verdict], _ = run(obs(Signal.XID, 13, 1.5, pid=7, source="kmsg"))
    assert verdict.evidence["source"] == "kmsg"
    assert verdict.evidence["pid"] == 7
    assert verdict.evidence["observed_at"] == 1.5

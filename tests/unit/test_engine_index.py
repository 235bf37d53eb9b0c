"""The engine's cost and memory do not grow with the catalog, with copies of its rules or with the addresses it
is shown; rules alike in when they fire are counted as one group, each keeping its own verdict; Xids are correlated
in time per GPU."""

import dataclasses

from agent.engine import EngineState, evaluate, load_rule_texts, restore, tick
from agent.engine.index import RuleIndex
from agent.engine.state import OVERFLOW_GPU_KEY, UNKNOWN_GPU_KEYS
from agent.model import Action, GpuRef, Severity, Signal, VerdictKind
from tests.conftest import gpu, obs

RULES = load_rule_texts([("t.yaml", """
rules:
- {id: mmu-31, signal: xid, code: 31, severity: warning, action: restart_app, fault_class: application,
   summary: s, source: t, recovery: {kind: quiet, quiet_seconds: 60}}
- {id: app-faults, signal: xid, code: [13, 31], severity: degraded, action: quarantine, fault_class: hardware,
   window: {count: 3, seconds: 3600, distinct: workload}, summary: s, source: t,
   recovery: {kind: quiet, quiet_seconds: 60}}
- {id: xid-45-follows, signal: xid, code: 45, severity: info, action: none, fault_class: driver,
   when: [{field: prior_xid, op: present}], summary: "Xid 45 after Xid {prior_xid} on {gpu}", source: t,
   recovery: {kind: quiet, quiet_seconds: 60}}
- {id: xid-45-solo, signal: xid, code: 45, severity: warning, action: notify, fault_class: driver,
   when: [{field: prior_xid, op: absent}], summary: "solo Xid 45 on {gpu}", source: t,
   recovery: {kind: quiet, quiet_seconds: 60}}
- {id: unknown, signal: xid, fallback: true, severity: warning, action: notify, fault_class: driver,
   summary: "unknown Xid {code}", source: t, recovery: {kind: quiet, quiet_seconds: 60}}
- {id: hot, signal: temperature, when: [{field: value, op: ge, value: 90}], severity: degraded, action: notify,
   fault_class: hardware, summary: s, source: t, recovery: {kind: quiet, quiet_seconds: 10}}
""")])


def at_pci(n: int) -> GpuRef:
    return GpuRef(pci_bus_id=f"0000:{n // 256:02x}:{n % 256:02x}.0")


def fired(*observations, state=None, rules=RULES):
    state = state if state is not None else EngineState()
    return [v.rule_id for o in observations for v in evaluate(o, state, o.at, rules=rules)
            if v.kind is VerdictKind.FAULT]


def test_an_observation_is_tried_only_against_the_rules_of_its_code():
    """Xid 31 sees its own rule, the multi-code rule and the fallback; never Xid 45's rules."""
    candidates = RuleIndex.of(RULES).candidates(Signal.XID, 31)
    assert [r.id for r in candidates.rules] == ["mmu-31", "app-faults", "unknown"]


def test_a_code_without_a_rule_is_tried_only_against_the_rules_without_a_code():
    assert [r.id for r in RuleIndex.of(RULES).candidates(Signal.XID, 999).rules] == ["unknown"]
    assert fired(obs(Signal.XID, 999)) == ["unknown"]


def test_a_replaced_rule_set_is_indexed_anew():
    state = EngineState()
    fired(obs(Signal.XID, 31, 0.0), state=state)
    other = load_rule_texts([("o.yaml", """
rules:
- {id: only-31, signal: xid, code: 31, severity: warning, action: notify, fault_class: driver,
   summary: s, source: t, recovery: {kind: quiet, quiet_seconds: 60}}
""")])
    assert fired(obs(Signal.XID, 31, 1.0), state=state, rules=other) == ["only-31"]


def test_a_distinct_window_still_forgets_values_older_than_its_span():
    observations = [obs(Signal.XID, 13, t, workload=w) for t, w in ((0, "a"), (3000, "b"), (3700, "c"))]
    assert fired(*observations) == []


def test_state_for_addresses_outside_the_node_is_bounded():
    state = EngineState()
    for n in range(5_000):
        evaluate(obs(Signal.XID, 31, float(n), gpu_ref=at_pci(n)), state, float(n), rules=RULES)
    assert len(state.gpu_keys()) <= UNKNOWN_GPU_KEYS + 1
    assert OVERFLOW_GPU_KEY in state.gpu_keys()


def test_the_nodes_own_gpus_always_keep_their_own_state():
    known = [GpuRef(index=n, uuid=f"GPU-{n}", pci_bus_id=f"0000:{n + 1:02x}:00.0") for n in range(8)]
    state = EngineState()
    for n in range(1_000):
        evaluate(obs(Signal.XID, 31, float(n), gpu_ref=at_pci(4096 + n)), state, float(n), rules=RULES)
    assert fired(*(obs(Signal.XID, 31, 2000.0, gpu_ref=g) for g in known), state=state) == ["mmu-31"] * 8
    assert {g.key for g in known} <= state.gpu_keys()


def test_an_overflowed_fault_is_raised_once_and_names_the_address_it_came_from():
    state = EngineState(unknown_gpu_keys=1)
    fired(obs(Signal.XID, 31, 0.0, gpu_ref=at_pci(1)), state=state)
    [verdict] = [v for v in evaluate(obs(Signal.XID, 31, 1.0, gpu_ref=at_pci(2)), state, 1.0, rules=RULES)]
    assert (verdict.gpu_key, verdict.gpu, verdict.evidence["overflow_of"]) == (OVERFLOW_GPU_KEY, None,
                                                                               at_pci(2).key)
    assert fired(obs(Signal.XID, 31, 2.0, gpu_ref=at_pci(3)), state=state) == []


def test_forgotten_state_frees_its_place_for_another_address():
    state = EngineState(unknown_gpu_keys=1)
    fired(obs(Signal.XID, 31, 0.0, gpu_ref=at_pci(1)), state=state)
    tick(state, 100.0, rules=RULES)
    tick(state, 10_000.0, rules=RULES)
    assert state.gpu_keys() == frozenset()
    assert fired(obs(Signal.XID, 31, 10_001.0, gpu_ref=at_pci(2)), state=state) == ["mmu-31"]


def test_xid_45_shortly_after_another_xid_on_the_same_gpu_follows_it():
    state = EngineState()
    fired(obs(Signal.XID, 31, 100.0), state=state)
    [verdict] = evaluate(obs(Signal.XID, 45, 102.0), state, 102.0, rules=RULES)
    assert verdict.rule_id == "xid-45-follows"
    assert verdict.summary.startswith("Xid 45 after Xid 31")
    assert verdict.evidence["prior_xid_age_seconds"] == 2.0


def test_xid_45_alone_is_solo_whatever_its_message_says():
    assert fired(obs(Signal.XID, 45, 5.0, caused_by=31, message="caused by Xid 31")) == ["xid-45-solo"]


def test_xid_45_after_an_xid_on_another_gpu_is_solo():
    state = EngineState()
    fired(obs(Signal.XID, 31, 100.0, gpu_ref=at_pci(1)), state=state)
    assert fired(obs(Signal.XID, 45, 101.0, gpu_ref=at_pci(2)), state=state) == ["xid-45-solo"]


def test_xid_45_long_after_the_last_xid_is_solo():
    state = EngineState()
    fired(obs(Signal.XID, 31, 100.0), state=state)
    assert fired(obs(Signal.XID, 45, 100.0 + 60), state=state) == ["xid-45-solo"]


def test_a_repeated_xid_45_still_follows_the_xid_before_it():
    state = EngineState()
    fired(obs(Signal.XID, 31, 100.0), state=state)
    fired(obs(Signal.XID, 45, 100.5), state=state)
    tick(state, 200.0, rules=RULES)
    assert fired(obs(Signal.XID, 31, 300.0), obs(Signal.XID, 45, 300.2), obs(Signal.XID, 45, 300.4),
                 state=state) == ["mmu-31", "xid-45-follows"]


def test_a_repeated_xid_follows_the_other_xid_before_it_not_itself():
    state = EngineState()
    assert state.prior_xid("k", 31, 100.0) is None
    assert state.prior_xid("k", 45, 101.0) == (31, 1.0)
    assert state.prior_xid("k", 45, 102.0) == (31, 2.0)
    assert state.prior_xid("k", 31, 103.0) == (45, 1.0)
    assert state.prior_xid("k", 13, 120.0) is None  # the last other Xid is too old


def test_a_level_reading_that_no_longer_matches_resets_its_rule():
    state = EngineState()
    fired(obs(Signal.TEMPERATURE, 95, 0.0), state=state)
    fired(obs(Signal.TEMPERATURE, 50, 5.0), state=state)
    assert state.rules[(gpu().key, "hot")].last_nonmatch == 5.0


PLAIN = load_rule_texts([("p.yaml", """
rules:
- {id: off-31, signal: xid, code: 31, enabled: false, severity: warning, action: notify, fault_class: driver,
   summary: s, source: t, recovery: {kind: quiet, quiet_seconds: 60}}
- {id: mmu-43, signal: xid, code: 43, severity: warning, action: notify, fault_class: driver,
   overrides: [{models: ["*A100*"], enabled: false}], summary: s, source: t,
   recovery: {kind: quiet, quiet_seconds: 60}}
- {id: unknown, signal: xid, fallback: true, severity: warning, action: notify, fault_class: driver,
   summary: "unknown Xid {code}", source: t, recovery: {kind: quiet, quiet_seconds: 60}}
""")])


def test_a_disabled_rule_without_conditions_never_matches():
    """A rule that needs no look at the event (the engine's shortcut) still counts only when enabled."""
    assert fired(obs(Signal.XID, 31), rules=PLAIN) == ["unknown"]


def test_a_per_model_override_applies_to_a_rule_without_conditions():
    """Disabled for A100s by an override: an A100's Xid 43 reaches the fallback, an H100's the rule."""
    assert fired(obs(Signal.XID, 43, gpu_ref=gpu(0, model="NVIDIA A100-SXM4-80GB")), rules=PLAIN) == ["unknown"]
    assert fired(obs(Signal.XID, 43, gpu_ref=gpu(0)), rules=PLAIN) == ["mmu-43"]


TWINS_TEXT = """
rules:
- {id: quiet, signal: xid, code: 31, window: {count: 3, seconds: 600}, severity: warning, action: notify,
   fault_class: driver, summary: "quiet twin on {gpu}", source: t, recovery: {kind: quiet, quiet_seconds: 10}}
- {id: other, signal: xid, code: 13, severity: warning, action: notify, fault_class: driver,
   summary: s, source: t, recovery: {kind: quiet, quiet_seconds: 100}}
- {id: operator, signal: xid, code: 31, window: {count: 3, seconds: 600}, severity: fatal, action: reset_gpu,
   fault_class: hardware, summary: "operator twin on {gpu}", source: t, recovery: {kind: operator}}
- {id: wider, signal: xid, code: 31, window: {count: 3, seconds: 1200}, severity: warning, action: notify,
   fault_class: driver, summary: s, source: t, recovery: {kind: operator}}
- {id: hot-a, signal: temperature, when: [{field: value, op: ge, value: 90}], sustain_seconds: 10, severity: warning,
   action: notify, fault_class: hardware, summary: s, source: t, recovery: {kind: quiet, quiet_seconds: 10}}
- {id: hot-b, signal: temperature, when: [{field: value, op: ge, value: 90}], sustain_seconds: 10, severity: warning,
   action: notify, fault_class: hardware, summary: s, source: t, recovery: {kind: operator}}
- {id: hot-c, signal: temperature, when: [{field: value, op: ge, value: 90}], sustain_seconds: 10, severity: warning,
   action: notify, fault_class: hardware, summary: s, source: t, recovery: {kind: operator}}
"""
TWINS = load_rule_texts([("g.yaml", TWINS_TEXT)])


def xid_31(*times: float, state: EngineState, rules=TWINS) -> list[tuple[str, int]]:
    """The (rule id, occurrences) of the faults raised by Xid 31 at these times."""
    return [(v.rule_id, v.evidence["occurrences"]) for t in times
            for v in evaluate(obs(Signal.XID, 31, t), state, t, rules=rules) if v.kind is VerdictKind.FAULT]


def release(rule_id: str, at: float, state: EngineState) -> list[str]:
    return [v.rule_id for v in evaluate(obs(Signal.OPERATOR_RELEASE, 1, at, rule=rule_id), state, at, rules=TWINS)]


def test_rules_alike_in_matching_and_window_are_one_group():
    """Severity, action, summary and recovery may differ: what decides when a rule fires may not."""
    groups = RuleIndex.of(TWINS).groups
    assert groups["quiet"] is groups["operator"]
    assert [r.id for r in groups["quiet"].rules] == ["quiet", "operator"]


def test_rules_with_different_windows_are_not_grouped():
    groups = RuleIndex.of(TWINS).groups
    assert groups["wider"] is not groups["quiet"]
    assert [r.id for r in groups["wider"].rules] == ["wider"]


def test_the_rules_of_a_group_share_one_window_per_gpu():
    """An observation is counted once for the whole group, not once per rule."""
    state = EngineState()
    xid_31(0.0, state=state)
    quiet, operator, wider = (state.rules[(gpu().key, rule_id)] for rule_id in ("quiet", "operator", "wider"))
    assert quiet.counting is operator.counting
    assert wider.counting is not quiet.counting
    assert quiet.hit_total == operator.hit_total == wider.hit_total == 1


def test_identical_rules_raise_together_and_each_keeps_its_own_verdict():
    state = EngineState()
    verdicts = [v for t in (0.0, 1.0, 2.0) for v in evaluate(obs(Signal.XID, 31, t), state, t, rules=TWINS)]
    assert [(v.rule_id, v.severity, v.action, v.summary.split(" ")[0]) for v in verdicts] == [
        ("quiet", Severity.WARNING, Action.NOTIFY, "quiet"), ("operator", Severity.FATAL, Action.RESET_GPU, "operator"),
        ("wider", Severity.WARNING, Action.NOTIFY, "s")]
    assert sorted(state.active()) == [(gpu().key, "operator"), (gpu().key, "quiet"), (gpu().key, "wider")]


def test_releasing_one_of_two_identical_rules_leaves_the_other_active_and_restarts_its_window():
    state = EngineState()
    xid_31(0.0, 1.0, 2.0, state=state)
    assert release("operator", 3.0, state) == ["operator"]
    assert state.rules[(gpu().key, "quiet")].active
    assert xid_31(4.0, 5.0, state=state) == []  # two in the released rule's window: not yet three
    assert xid_31(6.0, state=state) == [("operator", 3)]
    assert state.rules[(gpu().key, "quiet")].occurrences == 6


def test_rules_of_one_group_cleared_at_different_moments_count_apart():
    """Each counts from its own clear: one fills its window while the other, cleared later, does not yet."""
    state = EngineState()
    xid_31(0.0, 1.0, 2.0, state=state)
    release("operator", 3.0, state)
    xid_31(4.0, state=state)
    assert [v.rule_id for v in tick(state, 15.0, rules=TWINS)] == ["quiet"]
    assert xid_31(16.0, 17.0, state=state) == [("operator", 3)]
    assert xid_31(18.0, state=state) == [("quiet", 3)]


def test_each_rule_of_a_group_clears_by_its_own_recovery():
    state = EngineState()
    xid_31(0.0, 1.0, 2.0, state=state)
    assert [v.rule_id for v in tick(state, 12.0, rules=TWINS)] == ["quiet"]
    assert sorted(state.active()) == [(gpu().key, "operator"), (gpu().key, "wider")]


def test_restore_of_one_of_two_identical_rules():
    """The restored rule is not raised twice; its twin, not restored, is raised when its window fills."""
    state = EngineState()
    [fault, *_] = [v for t in (0.0, 1.0, 2.0) for v in evaluate(obs(Signal.XID, 31, t), state, t, rules=TWINS)]
    assert fault.rule_id == "quiet"
    restarted = EngineState()
    restore(restarted, [fault])
    assert xid_31(10.0, 11.0, 12.0, state=restarted) == [("operator", 3), ("wider", 3)]
    assert restarted.rules[(gpu().key, "quiet")].occurrences == 6
    assert [v.rule_id for v in tick(restarted, 22.0, rules=TWINS)] == ["quiet"]


def test_a_restored_rule_keeps_its_own_last_match_until_its_group_matches_again():
    """Restored beside a twin that is counting, it clears by quiet from when it was recorded."""
    state = EngineState()
    xid_31(0.0, 1.0, 2.0, state=state)
    [fault] = [v for v in tick(state, 12.0, rules=TWINS)]
    later = EngineState()
    xid_31(20.0, state=later)
    restore(later, [dataclasses.replace(fault, kind=VerdictKind.FAULT, at=15.0)])
    assert later.rules[(gpu().key, "quiet")].last_match == 15.0
    assert [v.rule_id for v in tick(later, 25.0, rules=TWINS)] == ["quiet"]


def test_the_idle_state_of_a_group_is_forgotten():
    state = EngineState()
    xid_31(0.0, state=state)
    tick(state, 10_000.0, rules=TWINS)
    assert (state.rules, state.groups) == ({}, {})


def test_a_reload_that_parts_two_rules_keeps_what_each_counted():
    """Grouped, the rules counted two hits; parted by a reload, each fires by its own new window."""
    state = EngineState()
    xid_31(0.0, 1.0, state=state)
    parted = load_rule_texts([("g.yaml", TWINS_TEXT.replace("window: {count: 3, seconds: 600}, severity: fatal",
                                                            "window: {count: 4, seconds: 600}, severity: fatal"))])
    assert RuleIndex.of(parted).groups["operator"] is not RuleIndex.of(parted).groups["quiet"]
    assert xid_31(2.0, state=state, rules=parted) == [("quiet", 3), ("wider", 3)]
    assert xid_31(3.0, state=state, rules=parted) == [("operator", 4)]


def test_a_healthy_reading_brings_a_group_back_to_one_window():
    """Rules of a group released at different moments count apart until a healthy reading empties both."""
    state = EngineState()
    for t, celsius in ((0.0, 95), (10.0, 95)):
        evaluate(obs(Signal.TEMPERATURE, celsius, t), state, t, rules=TWINS)
    for t, rule_id in ((11.0, "hot-b"), (13.0, "hot-c")):
        evaluate(obs(Signal.TEMPERATURE, 95, t - 1), state, t - 1, rules=TWINS)
        release(rule_id, t, state)
    group = state.rules[(gpu().key, "hot-b")].group
    assert len(group.counting) == 2
    evaluate(obs(Signal.TEMPERATURE, 50, 14.0), state, 14.0, rules=TWINS)
    assert len(group.counting) == 1

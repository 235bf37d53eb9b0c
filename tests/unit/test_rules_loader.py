from pathlib import Path

import pytest

from agent.engine import lint_rules, load_rule_texts, load_rules
from agent.errors import InputErrors

VALID = """
rules:
- id: demo-xid
  signal: xid
  code: 79
  severity: fatal
  action: reboot_node
  fault_class: hardware
  summary: "Xid {code} on {gpu}"
  source: test
  recovery: {kind: boot}
"""


def _problems(text: str, name: str = "demo.yaml") -> list[str]:
    with pytest.raises(InputErrors) as caught:
        load_rule_texts([(name, text)])
    return [p.line() for p in caught.value.problems]


def test_a_valid_rules_file_loads():
    rules = load_rule_texts([("demo.yaml", VALID)])
    assert [r.id for r in rules.rules] == ["demo-xid"]


def test_invalid_yaml_names_the_file_and_line():
    [line] = _problems("rules:\n  - id: [unclosed\n")
    assert line.startswith("demo.yaml: not valid YAML at line")


def test_an_unknown_field_names_file_rule_and_field():
    [line] = _problems(VALID.replace("source: test", "source: test\n  sevrity: fatal"))
    assert line.startswith("demo.yaml: rule demo-xid: field sevrity:")


def test_a_bad_enum_value_names_the_field():
    [line] = _problems(VALID.replace("severity: fatal", "severity: catastrophic"))
    assert "rule demo-xid: field severity:" in line


def test_a_rule_without_an_id_is_named_by_its_position():
    lines = _problems(VALID.replace("- id: demo-xid\n  ", "- "))
    assert any("rule #1: field id:" in line for line in lines)


def test_duplicate_ids_are_reported_with_both_files():
    with pytest.raises(InputErrors) as caught:
        load_rule_texts([("a.yaml", VALID), ("b.yaml", VALID)])
    [problem] = caught.value.problems
    assert problem.file == "b.yaml"
    assert problem.rule_id == "demo-xid"
    assert "a.yaml" in problem.message


def test_a_quarantining_action_needs_a_serious_severity():
    [line] = _problems(VALID.replace("severity: fatal", "severity: warning"))
    assert "needs severity degraded or fatal" in line


def test_a_telemetry_rule_may_never_quarantine():
    text = VALID.replace("fault_class: hardware", "fault_class: telemetry")
    assert any("must never quarantine" in line for line in _problems(text))


def test_a_contained_incident_may_never_evict():
    """A rule whose fault contains the GPU's errors (contains: true) keeps the tenants: a draining one fails."""
    text = VALID.replace("recovery: {kind: boot}", "recovery: {kind: boot}\n  contains: true")
    assert any("a contained incident (contains: true) evicts nobody" in line for line in _problems(text))


def test_comparison_needs_exactly_one_operand():
    text = VALID.replace("code: 79", "when: [{field: value, op: ge}]")
    assert any("field when.0" in line and "exactly one of value or ref" in line for line in _problems(text))


def test_a_count_window_needs_a_time_span():
    text = VALID.replace("code: 79", "code: 79\n  window: {count: 3}")
    assert any("field window" in line for line in _problems(text))


def test_a_window_counts_distinct_values_or_per_value_not_both():
    text = VALID.replace("code: 79", "code: 79\n  window: {count: 3, seconds: 60, distinct: pod, per: link}")
    assert any("field window" in line for line in _problems(text))


def test_every_problem_of_a_directory_is_listed(tmp_path: Path):
    (tmp_path / "a.yaml").write_text(VALID.replace("severity: fatal", "severity: nope"))
    (tmp_path / "b.yaml").write_text("rules: [")
    problems = lint_rules(tmp_path)
    assert {Path(p.file).name for p in problems} == {"a.yaml", "b.yaml"}


def test_a_missing_directory_is_one_clear_problem(tmp_path: Path):
    [problem] = lint_rules(tmp_path / "absent")
    assert problem.message == "rules directory not found"


def test_the_shipped_rules_are_valid(shipped_rules):
    assert len(shipped_rules.rules) > 172


def test_load_rules_raises_with_all_problems(tmp_path: Path):
    (tmp_path / "a.yaml").write_text("rules: 3")
    with pytest.raises(InputErrors):
        load_rules(tmp_path)


def _shipped_copy(tmp_path: Path) -> Path:
    from agent.engine import builtin_rules_dir
    for path in builtin_rules_dir().glob("*.yaml"):
        (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize(("left_out", "family"), [("xid.yaml", "the Xid rules"), ("node.yaml", "GPU loss"),
                                                  ("recovery_action.yaml", "the recovery-action rules")])
def test_rules_without_a_required_family_fail_lint_with_one_line(tmp_path: Path, left_out, family):
    """A rules directory that leaves out the Xid, GPU-loss or recovery rules would blind the agent."""
    rules_dir = _shipped_copy(tmp_path)
    (rules_dir / left_out).unlink()
    [problem] = lint_rules(rules_dir)
    assert "required rule families missing" in problem.line() and family in problem.line()


def test_an_override_that_turns_a_telemetry_rule_into_a_drain_fails():
    """A per-model override is checked like the rule it changes: it cannot open a loophole."""
    text = """
rules:
- id: cannot-read
  signal: source_unreadable
  severity: unknown
  action: notify
  fault_class: telemetry
  summary: "cannot read {gpu}"
  source: test
  recovery: {kind: quiet, quiet_seconds: 30}
  overrides:
  - models: ["*A100*"]
    severity: fatal
    action: drain
"""
    [line] = _problems(text)
    assert "override 1 (models *A100*)" in line and "telemetry" in line


def test_an_override_with_an_action_beyond_its_severity_fails():
    text = VALID.replace("recovery: {kind: boot}", "recovery: {kind: boot}\n  overrides:\n"
                         "  - models: [\"*H100*\"]\n    severity: warning")
    [line] = _problems(text)
    assert "override 1" in line and "needs severity degraded or fatal" in line


def test_lint_rejects_a_quarantine_whose_recovery_is_a_reset_it_never_does():
    """A quarantine never resets the GPU: a rule that waits for a reset after one would never clear."""
    text = VALID.replace("action: reboot_node", "action: quarantine").replace("severity: fatal", "severity: degraded") \
        .replace("{kind: boot}", "{kind: reset}")
    [line] = _problems(text)
    assert "rule demo-xid" in line and "recovery reset cannot follow action quarantine" in line


def test_lint_rejects_a_recovery_by_boot_that_the_action_never_asks_for():
    """A drain never asks for a reboot: waiting for a new boot after it may keep the GPU out for ever."""
    text = VALID.replace("action: reboot_node", "action: drain").replace("severity: fatal", "severity: degraded")
    [line] = _problems(text)
    assert "recovery boot cannot follow action drain" in line


def test_lint_rejects_an_override_that_leaves_a_recovery_its_action_cannot_bring_about():
    """An override that turns a reset into a quarantine for one model is judged like a rule of its own."""
    text = VALID.replace("action: reboot_node", "action: reset_gpu").replace("{kind: boot}", "{kind: reset}") + \
        "  overrides:\n  - models: ['*A100*']\n    action: quarantine\n    severity: degraded\n"
    [line] = _problems(text)
    assert "override 1" in line and "recovery reset cannot follow action quarantine" in line


def test_the_shipped_rules_give_every_quarantine_a_reachable_recovery():
    """rules lint passes on the shipped rules, every quarantine among them having a way back."""
    assert lint_rules(Path(__file__).resolve().parents[2] / "rules") == []


def test_a_model_variant_is_not_checked_against_the_other_models_overrides():
    """Each override is checked against the rule it changes, at load. A GPU model's variant (here quarantining)
    is not checked again against the overrides of other models (A100's warning fits the rule, not the variant)."""
    text = VALID.replace("action: reboot_node", "action: notify").replace(
        "recovery: {kind: boot}", "recovery: {kind: quiet, quiet_seconds: 60}\n  overrides:\n"
        "  - {models: ['H100*'], action: quarantine}\n  - {models: ['A100*'], severity: warning}")
    [rule] = load_rule_texts([("demo.yaml", text)]).rules
    assert (rule.for_model("H100 SXM").action, rule.for_model("A100 PCIe").severity) == ("quarantine", "warning")

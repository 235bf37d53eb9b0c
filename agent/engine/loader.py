"""Reads `rules/*.yaml` into a RuleSet, reporting every problem with its file, rule id and field."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent.engine.schema import Rule
from agent.errors import InputErrors, RuleError
from agent.model import Action, FaultClass, Signal
from agent.strict import RecordInvalid, convert
from agent.yamlload import safe_load

#: The attribute the classifier sets on an observation a contained incident governs: the incident's rule id.
CONTAINED_BY = "contained_by"


@dataclass(frozen=True, slots=True)
class RuleSet:
    """Validated rules, indexed by signal; per-model variants are computed once and cached."""

    rules: tuple[Rule, ...]
    files: tuple[str, ...] = ()
    #: Rule ids the files' `retired:` lists name: removed on purpose, so a hot reload may drop them.
    retired: frozenset[str] = frozenset()
    _by_signal: dict[Signal, tuple[Rule, ...]] = field(default_factory=dict, repr=False)
    _by_id: dict[str, Rule] = field(default_factory=dict, repr=False)
    _per_model: dict[tuple[str, str], Rule] = field(default_factory=dict, repr=False)
    _by_distinct: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    #: (signal, code or None) of the rules that read CONTAINED_BY: the observations a contained incident governs.
    _containable: set[tuple[Signal, int | None]] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        for rule in self.rules:
            self._by_id[rule.id] = rule
            self._by_signal[rule.signal] = (*self._by_signal.get(rule.signal, ()), rule)
            distinct = rule.window.distinct
            if distinct:
                self._by_distinct[distinct] = (*self._by_distinct.get(distinct, ()), rule.id)
            if any(cond.field == CONTAINED_BY for cond in rule.when):
                codes: list[int | None] = [*rule.codes] or [None]
                self._containable.update((rule.signal, code) for code in codes)

    def containable(self, signal: Signal, value: float) -> bool:
        """Whether a contained incident on the GPU governs this observation: a rule of its signal (and code) reads
        CONTAINED_BY (ecc-dbe, xid-48, xid-64 and their -contained counterparts)."""
        containable = self._containable
        if not containable:
            return False
        if (signal, None) in containable:
            return True
        return math.isfinite(value) and (signal, int(value)) in containable

    def counting_distinct(self, attr: str) -> tuple[str, ...]:
        """The ids of the rules whose window counts distinct values of this attribute."""
        return self._by_distinct.get(attr, ())

    def for_signal(self, signal: Signal) -> tuple[Rule, ...]:
        return self._by_signal.get(signal, ())

    def get(self, rule_id: str) -> Rule | None:
        return self._by_id.get(rule_id)

    def fault_class_of(self, rule_id: str) -> FaultClass | None:
        """The rule's fault class; None for a rule not in the set."""
        rule = self._by_id.get(rule_id)
        return rule.fault_class if rule is not None else None

    def effective(self, rule: Rule, model: str) -> Rule:
        """The rule as it applies to a GPU of this model (overrides applied)."""
        if not rule.overrides:
            return rule
        key = (rule.id, model)
        cached = self._per_model.get(key)
        if cached is None:
            cached = rule.for_model(model)
            self._per_model[key] = cached
        return cached


def rule_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix in {".yaml", ".yml"} and p.is_file())


#: Rule families without which the agent would be blind to a whole class of fault: a rule set missing one
#: is rejected (lint fails; a reload keeps the last good rules).
REQUIRED_FAMILIES: tuple[tuple[Signal, str], ...] = (
    (Signal.XID, "the Xid rules (signal xid)"),
    (Signal.GPU_LOST, "GPU loss (signal gpu_lost)"),
    (Signal.RECOVERY_ACTION, "the recovery-action rules (signal recovery_action)"),
)


def missing_families(rules: Iterable[Rule]) -> list[str]:
    """The required families that no enabled rule covers."""
    covered = {rule.signal for rule in rules if rule.enabled}
    return [name for signal, name in REQUIRED_FAMILIES if signal not in covered]


def lint_rules(directory: Path) -> list[RuleError]:
    """Every problem in the rules directory; an empty list means the rules are valid."""
    _, problems = _load(directory)
    return problems


def unreached_recoveries(ruleset: RuleSet, *, quarantines: bool, resets: bool, reboots: bool) -> list[str]:
    """The enabled rules (overrides included) whose quarantine the agent's own recovery never reaches in a mode
    that quarantines but does not reset or request reboots: one line each, saying what the fault waits for."""
    if not quarantines:
        return []  # a mode that quarantines nothing holds nothing for a recovery
    lines = []
    for rule in ruleset.rules:
        if not rule.enabled:
            continue
        actions = sorted({rule.action, *(o.action for o in rule.overrides if o.action is not None)},
                         key=lambda a: a.rank)
        held = [a for a in actions if a.quarantines]
        if not held:
            continue
        if rule.recovery.kind == "reset" and not resets:
            lines.append(f"rule {rule.id}: its quarantine ({held[-1]}) clears by a verified reset, which this mode "
                         "never runs: the GPU waits for a reset by hand or a reboot (condition GpuResetRequired, "
                         "alert GpuHealthResetRequired; only that GPU is held where it can be kept off alone)")
        elif rule.recovery.kind == "boot" and Action.REBOOT_NODE in held and not reboots:
            lines.append(f"rule {rule.id}: its quarantine clears by a new boot, and this mode never requests the "
                         "reboot: the node stays tainted until someone reboots it")
    return lines


def load_rules(directory: Path) -> RuleSet:
    """Load and validate a rules directory, or raise InputErrors listing every problem."""
    ruleset, problems = _load(directory)
    if problems:
        raise InputErrors(list(problems))
    return ruleset


def load_rule_texts(texts: Iterable[tuple[str, str]]) -> RuleSet:
    """Load rules from (file name, YAML text) pairs; used by tests and by hot reload."""
    located: list[tuple[str, Rule]] = []
    problems: list[RuleError] = []
    names: list[str] = []
    retired: set[str] = set()
    for name, text in texts:
        names.append(name)
        file_rules, file_retired, file_problems = _parse_file(name, text)
        located.extend((name, rule) for rule in file_rules)
        retired.update(file_retired)
        problems.extend(file_problems)
    problems.extend(_duplicate_ids(located))
    if problems:
        raise InputErrors(list(problems))
    return RuleSet(rules=tuple(rule for _, rule in located), files=tuple(names), retired=frozenset(retired))


def _load(directory: Path) -> tuple[RuleSet, list[RuleError]]:
    if not directory.is_dir():
        return RuleSet(rules=()), [RuleError("rules directory not found", file=str(directory))]
    paths = rule_files(directory)
    if not paths:
        return RuleSet(rules=()), [RuleError("no *.yaml rule files in directory", file=str(directory))]
    located: list[tuple[str, Rule]] = []
    problems: list[RuleError] = []
    retired: set[str] = set()
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(RuleError(f"cannot read: {exc}", file=str(path)))
            continue
        file_rules, file_retired, file_problems = _parse_file(str(path), text)
        located.extend((str(path), rule) for rule in file_rules)
        retired.update(file_retired)
        problems.extend(file_problems)
    problems.extend(_duplicate_ids(located))
    rules = tuple(rule for _, rule in located)
    missing = missing_families(rules)
    if missing and not problems:
        problems.append(RuleError(f"required rule families missing: {'; '.join(missing)}", file=str(directory)))
    return RuleSet(rules=rules, files=tuple(str(p) for p in paths), retired=frozenset(retired)), problems


def _parse_file(name: str, text: str) -> tuple[list[Rule], list[str], list[RuleError]]:
    """The file's rules, the rule ids it retires, and its problems."""
    try:
        data = safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        return [], [], [RuleError(f"not valid YAML{where}: {getattr(exc, 'problem', exc)}", file=name)]
    if data is None:
        return [], [], []
    if not isinstance(data, dict) or not isinstance(data.get("rules", []), list):
        return [], [], [RuleError("expected a mapping with a 'rules' list", file=name, field="rules")]
    extra = sorted(set(data) - {"rules", "retired"})
    problems = [RuleError("unknown top-level key", file=name, field=key) for key in extra]
    retired = data.get("retired") or []
    if not isinstance(retired, list) or not all(isinstance(r, str) and r for r in retired):
        problems.append(RuleError("expected a list of rule ids", file=name, field="retired"))
        retired = []
    rules: list[Rule] = []
    for position, raw in enumerate(data.get("rules") or []):
        rule_id = _raw_id(raw, position)
        try:
            rules.append(convert(raw, Rule))
        except RecordInvalid as exc:
            problems.append(RuleError(exc.reason, file=name, rule_id=rule_id, field=exc.field or "(rule)"))
    return rules, [str(r) for r in retired], problems


def _raw_id(raw: Any, position: int) -> str:
    if isinstance(raw, dict) and isinstance(raw.get("id"), str) and raw["id"]:
        return str(raw["id"])
    return f"#{position + 1}"


def _duplicate_ids(located: list[tuple[str, Rule]]) -> list[RuleError]:
    problems: list[RuleError] = []
    first_file: dict[str, str] = {}
    for file, rule in located:
        if rule.id in first_file:
            message = f"duplicate rule id (first defined in {first_file[rule.id]})"
            problems.append(RuleError(message, file=file, rule_id=rule.id, field="id"))
        else:
            first_file[rule.id] = file
    return problems


def builtin_rules_dir() -> Path:
    """The rules shipped with the agent: inside the wheel, or at the top of a source checkout."""
    package_dir = Path(__file__).resolve().parent.parent
    for candidate in (package_dir / "rules", package_dir.parent / "rules"):
        if candidate.is_dir():
            return candidate
    return package_dir / "rules"

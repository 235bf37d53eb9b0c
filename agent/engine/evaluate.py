"""The pure classifier: observations in, verdicts out, over per-GPU windows on an injected clock."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from agent.engine.loader import RuleSet
from agent.engine.schema import Condition, Rule
from agent.model import (
    LIFECYCLE_SIGNALS,
    NODE_KEY,
    AttrValue,
    GpuRef,
    Observation,
    Severity,
    Signal,
    Verdict,
    VerdictKind,
    frozen_attrs,
)


@dataclass(slots=True)
class RuleState:
    """What one rule remembers about one GPU."""

    hits: deque[tuple[float, int, str]] = field(default_factory=deque)
    active: bool = False
    since: float | None = None
    last_match: float | None = None
    last_nonmatch: float | None = None
    sustain_since: float | None = None
    occurrences: int = 0
    gpu: GpuRef | None = None


@dataclass(slots=True)
class EngineState:
    """All per-GPU, per-rule state; the engine mutates it and nothing else."""

    rules: dict[tuple[str, str], RuleState] = field(default_factory=dict)
    boot_id: str = ""

    def active(self) -> list[tuple[str, str]]:
        """(gpu key, rule id) of every active fault."""
        return [key for key, st in self.rules.items() if st.active]


def evaluate(observation: Observation, state: EngineState, now: float, *, rules: RuleSet) -> list[Verdict]:
    """Classify one observation; return the verdicts it raises or clears (often none)."""
    if observation.signal in LIFECYCLE_SIGNALS:
        return _lifecycle(observation, state, now, rules)
    model = observation.gpu.model if observation.gpu else ""
    candidates = [rules.effective(rule, model) for rule in rules.for_signal(observation.signal)]
    candidates = [rule for rule in candidates if rule.enabled]
    primary = [r for r in candidates if not r.fallback and _matches(r, observation)]
    fallbacks = [r for r in candidates if r.fallback and _matches(r, observation)]
    matched = primary or [r for r in fallbacks if r.codes] or fallbacks
    matched_ids = {r.id for r in matched}
    verdicts: list[Verdict] = []
    for rule in candidates:
        if rule.id in matched_ids:
            verdict = _on_match(rule, observation, state, now)
            if verdict is not None:
                verdicts.append(verdict)
        elif not observation.signal.is_event:
            _on_healthy_reading(rule, observation, state, now)
    return verdicts


def tick(state: EngineState, now: float, *, rules: RuleSet) -> list[Verdict]:
    """Advance the clock: clear faults whose quiet window has passed, forget idle state."""
    verdicts: list[Verdict] = []
    for (gpu_key, rule_id), st in list(state.rules.items()):
        rule = rules.get(rule_id)
        if rule is None:
            if not st.active:
                del state.rules[(gpu_key, rule_id)]
            continue
        rule = rules.effective(rule, st.gpu.model if st.gpu else "")
        if st.active and _quiet_recovered(rule, st, now):
            verdicts.append(_clear(rule, gpu_key, st, now, f"quiet for {rule.recovery.quiet_seconds:g}s"))
        elif not st.active and _forgettable(rule, st, now):
            del state.rules[(gpu_key, rule_id)]
    return verdicts


def restore(state: EngineState, active: Iterable[Verdict]) -> None:
    """Mark faults recorded before a restart as active again, so they are not raised twice."""
    for verdict in active:
        st = state.rules.setdefault((verdict.gpu_key, verdict.rule_id), RuleState())
        st.active = True
        st.since = verdict.at
        st.last_match = verdict.at
        st.gpu = verdict.gpu
        st.occurrences = int(verdict.evidence.get("occurrences", 1))


def _lifecycle(obs: Observation, state: EngineState, now: float, rules: RuleSet) -> list[Verdict]:
    if obs.signal is Signal.BOOT:
        boot_id = str(obs.attrs.get("boot_id", ""))
        previous, state.boot_id = state.boot_id, boot_id
        if not previous or previous == boot_id:
            return []
        return _clear_where(state, now, rules, "new boot", lambda key, kind: kind in {"boot", "reset"})
    if obs.signal is Signal.GPU_RESET:
        if not obs.value:
            return []
        target = obs.gpu_key
        return _clear_where(state, now, rules, "verified GPU reset",
                            lambda key, kind: key == target and kind == "reset")
    target = obs.gpu_key
    return _clear_where(state, now, rules, f"released by {obs.attrs.get('by', 'operator')}",
                        lambda key, kind: target in {NODE_KEY, key})


def _clear_where(
    state: EngineState, now: float, rules: RuleSet, why: str, applies: Callable[[str, str], bool]
) -> list[Verdict]:
    verdicts = []
    for (gpu_key, rule_id), st in state.rules.items():
        rule = rules.get(rule_id)
        if not st.active or rule is None:
            continue
        if applies(gpu_key, rule.recovery.kind):
            verdicts.append(_clear(rule, gpu_key, st, now, why))
    return verdicts


def _on_match(rule: Rule, obs: Observation, state: EngineState, now: float) -> Verdict | None:
    st = state.rules.setdefault((obs.gpu_key, rule.id), RuleState())
    st.gpu = obs.gpu or st.gpu
    st.last_match = now
    st.occurrences += obs.count
    if st.sustain_since is None:
        st.sustain_since = now
    if st.active:
        return None
    _record_hit(rule, st, obs, now)
    if not _window_met(rule, st) or now - st.sustain_since < rule.sustain_seconds:
        return None
    st.active = True
    st.since = now
    return Verdict(
        kind=VerdictKind.FAULT,
        rule_id=rule.id,
        gpu_key=obs.gpu_key,
        severity=rule.severity,
        action=rule.action,
        fault_class=rule.fault_class,
        at=now,
        summary=_summary(rule, obs),
        gpu=obs.gpu,
        evidence=_evidence(rule, obs, st),
    )


def _on_healthy_reading(rule: Rule, obs: Observation, state: EngineState, now: float) -> None:
    st = state.rules.get((obs.gpu_key, rule.id))
    if st is None:
        return
    st.last_nonmatch = now
    st.sustain_since = None
    if not st.active:
        st.hits.clear()


def _record_hit(rule: Rule, st: RuleState, obs: Observation, now: float) -> None:
    distinct_attr = rule.window.distinct
    distinct = str(obs.attrs.get(distinct_attr, "")) if distinct_attr else ""
    st.hits.append((now, obs.count, distinct))
    if rule.window.seconds:
        while st.hits and now - st.hits[0][0] > rule.window.seconds:
            st.hits.popleft()
    if distinct_attr:
        return
    # Keep only as many hits as the window needs: storms cost constant memory.
    while len(st.hits) > 1 and sum(count for _, count, _ in st.hits) - st.hits[0][1] >= rule.window.count:
        st.hits.popleft()


def _window_met(rule: Rule, st: RuleState) -> bool:
    if rule.window.distinct:
        return len({key for _, _, key in st.hits if key}) >= rule.window.count
    return sum(count for _, count, _ in st.hits) >= rule.window.count


def _quiet_recovered(rule: Rule, st: RuleState, now: float) -> bool:
    if rule.recovery.kind != "quiet" or st.last_match is None:
        return False
    if now - st.last_match < rule.recovery.quiet_seconds:
        return False
    if rule.signal.is_event:
        return True
    return st.last_nonmatch is not None and st.last_nonmatch > st.last_match


def _forgettable(rule: Rule, st: RuleState, now: float) -> bool:
    last = st.last_match if st.last_match is not None else now
    horizon = max(rule.window.seconds, rule.sustain_seconds)
    holding = st.sustain_since is not None and not rule.signal.is_event
    return not holding and now - last > horizon


def _clear(rule: Rule, gpu_key: str, st: RuleState, now: float, why: str) -> Verdict:
    st.active = False
    st.hits.clear()
    st.sustain_since = None
    occurrences, since = st.occurrences, st.since
    st.occurrences = 0
    st.since = None
    return Verdict(
        kind=VerdictKind.CLEARED,
        rule_id=rule.id,
        gpu_key=gpu_key,
        severity=Severity.OK,
        action=rule.action,
        fault_class=rule.fault_class,
        at=now,
        summary=f"cleared: {why}",
        gpu=st.gpu,
        evidence=frozen_attrs(
            {"occurrences": occurrences, "active_since": since if since is not None else now, "why": why}
        ),
    )


def _matches(rule: Rule, obs: Observation) -> bool:
    if rule.codes and (not math.isfinite(obs.value) or int(obs.value) not in rule.codes):
        return False
    return all(_holds(cond, obs) for cond in rule.when)


def _holds(cond: Condition, obs: Observation) -> bool:
    actual = obs.value if cond.field == "value" else obs.attrs.get(cond.field)
    if cond.op == "present":
        return actual is not None
    if cond.op == "absent":
        return actual is None
    if actual is None:
        return False
    if cond.op in {"in", "not_in"}:
        inside = any(_equal(actual, item) for item in cond.value or [])  # type: ignore[union-attr]
        return inside if cond.op == "in" else not inside
    if cond.op in {"bits_any", "bits_none"}:
        if not isinstance(actual, int | float) or isinstance(actual, bool) or not math.isfinite(actual):
            return False
        overlap = int(actual) & int(cond.value)  # type: ignore[arg-type]
        return bool(overlap) if cond.op == "bits_any" else not overlap
    expected = _operand(cond, obs.attrs)
    if expected is None:
        return False
    if cond.op == "eq":
        return _equal(actual, expected)
    if cond.op == "ne":
        return not _equal(actual, expected)
    return _ordered(cond.op, actual, expected)


def _operand(cond: Condition, attrs: Mapping[str, AttrValue]) -> AttrValue | None:
    if cond.ref is None:
        return cond.value  # type: ignore[return-value]
    ref = attrs.get(cond.ref)
    if isinstance(ref, bool) or not isinstance(ref, int | float):
        return None
    return ref + cond.offset


def _equal(actual: AttrValue, expected: object) -> bool:
    if isinstance(actual, bool) or isinstance(expected, bool):
        return actual is expected or actual == expected
    if isinstance(actual, int | float) and isinstance(expected, int | float):
        return float(actual) == float(expected)
    return str(actual) == str(expected)


def _ordered(op: str, actual: AttrValue, expected: AttrValue) -> bool:
    if isinstance(actual, bool) or not isinstance(actual, int | float):
        return False
    if isinstance(expected, bool) or not isinstance(expected, int | float):
        return False
    return {"gt": actual > expected, "ge": actual >= expected, "lt": actual < expected, "le": actual <= expected}[op]


class _FormatDict(dict[str, object]):
    def __missing__(self, key: str) -> str:
        return "?"


def _summary(rule: Rule, obs: Observation) -> str:
    values = _FormatDict(obs.attrs)
    gpu = obs.gpu.describe() if obs.gpu else "node"
    values.update(value=_number(obs.value), code=_number(obs.value), gpu=gpu, source=obs.source)
    try:
        return rule.summary.format_map(values)
    except (ValueError, IndexError, AttributeError):
        return rule.summary


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _evidence(rule: Rule, obs: Observation, st: RuleState) -> Mapping[str, AttrValue]:
    evidence: dict[str, AttrValue] = {
        "signal": str(obs.signal),
        "value": obs.value,
        "source": obs.source,
        "occurrences": st.occurrences,
        "window_count": rule.window.count,
        "window_seconds": rule.window.seconds,
        "first_seen": st.hits[0][0] if st.hits else obs.at,
        "observed_at": obs.at,
    }
    if rule.nvidia_action:
        evidence["nvidia_action"] = rule.nvidia_action
    if rule.reason:
        evidence["reason"] = rule.reason
    for key, value in obs.attrs.items():
        evidence.setdefault(key, value)
    return frozen_attrs(evidence)

"""The pure classifier: observations in, verdicts out, over per-GPU windows on an injected clock.

Rules are matched and counted by group (index.RuleGroup, state.GroupState): an observation is tried once per
group, counted once per group and GPU, and touches a rule of its own only when that rule's verdict changes."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Iterable, Mapping

from agent.engine.index import DERIVED_XID_FIELDS, Candidates, RuleGroup
from agent.engine.loader import RuleSet
from agent.engine.schema import Condition, Rule, Window
from agent.engine.state import OVERFLOW_GPU_KEY, PER_VALUE_KEYS, Counting, EngineState, GroupState, RuleState
from agent.model import (
    LIFECYCLE_SIGNALS,
    NODE_KEY,
    AttrValue,
    Observation,
    Severity,
    Signal,
    Verdict,
    VerdictKind,
    frozen_attrs,
)

#: Signal.XID, read once: an enum member costs a class attribute lookup on each read.
_XID = Signal.XID


def evaluate(observation: Observation, state: EngineState, now: float, *, rules: RuleSet) -> list[Verdict]:
    """Classify one observation; return the verdicts it raises or clears (often none)."""
    signal = observation.signal
    if signal in LIFECYCLE_SIGNALS:
        return _lifecycle(observation, state, now, rules)
    candidates = state.index_of(rules).candidates(signal, observation.value)
    gpu_key = state.key_for(observation)
    if signal is _XID and math.isfinite(observation.value):
        prior = state.prior_xid(gpu_key, int(observation.value), now)
        if candidates.needs_prior_xid:
            observation = _with_prior(observation, prior)
    if not candidates.rules:
        return []
    if candidates.unconditional:
        return _on_matches(candidates.unconditional, observation, gpu_key, state, now, rules)
    model = observation.gpu.model if observation.gpu else ""
    if not signal.is_event:
        return _on_reading(candidates, observation, model, gpu_key, state, now, rules)
    matched = [*candidates.plain, *_holding(candidates.checked, observation, model, rules)]
    if not matched:  # an event that a rule matched never reaches the fallbacks
        matched = _fallbacks_holding(candidates, observation, model, rules)
    return _on_matches(matched, observation, gpu_key, state, now, rules)


def _on_reading(candidates: Candidates, obs: Observation, model: str, gpu_key: str, state: EngineState,
                now: float, rules: RuleSet) -> list[Verdict]:
    """A level reading: the groups it matches count it, the other enabled groups read it as healthy."""
    matched = _holding(candidates.primary, obs, model, rules)
    if not matched:
        matched = _fallbacks_holding(candidates, obs, model, rules)
    verdicts = _on_matches(matched, obs, gpu_key, state, now, rules)
    states = state.groups.get(gpu_key, {})
    for group in (*candidates.primary, *candidates.fallback):
        group_state = states.get(group)
        if group_state is not None and group not in matched and _effective(group, model, rules).enabled:
            group_state.healthy(now)
    return verdicts


def _fallbacks_holding(candidates: Candidates, obs: Observation, model: str, rules: RuleSet) -> list[RuleGroup]:
    """When no other rule matched: the fallback groups that hold; only those with a code, where any of them do."""
    fallbacks = _holding(candidates.fallback, obs, model, rules)
    return [g for g in fallbacks if g.lead.code is not None] or fallbacks


def _effective(group: RuleGroup, model: str, rules: RuleSet) -> Rule:
    """The group's rule as it applies to a GPU of this model."""
    lead = group.lead
    return rules.effective(lead, model) if lead.overrides else lead


def _holding(groups: Iterable[RuleGroup], obs: Observation, model: str, rules: RuleSet) -> list[RuleGroup]:
    """The groups whose rule, for this GPU's model, is enabled and whose conditions the observation meets."""
    holding = []
    for group in groups:
        rule = _effective(group, model, rules)
        if rule.enabled and (not rule.when or _all_hold(rule.when, obs)):
            holding.append(group)
    return holding


def tick(state: EngineState, now: float, *, rules: RuleSet) -> list[Verdict]:
    """Advance the clock: clear faults whose quiet window has passed, forget idle state."""
    verdicts: list[Verdict] = []
    for (gpu_key, rule_id), st in list(state.rules.items()):
        rule = rules.get(rule_id)
        if rule is None:
            if not st.active:
                state.forget(gpu_key, rule_id)
            continue
        rule = rules.effective(rule, st.gpu.model if st.gpu else "")
        if st.active and _quiet_recovered(rule, st, now):
            verdicts.append(_clear(rule, gpu_key, st, now, f"quiet for {rule.recovery.quiet_seconds:g}s"))
        elif not st.active and _forgettable(rule, st, now):
            state.forget(gpu_key, rule_id)
    return verdicts


def withdraw(state: EngineState, gpu_key: str, rule_id: str, now: float, *, rules: RuleSet, why: str) -> Verdict | None:
    """End one active fault that a later judgement of the same observation replaces (a contained incident governs
    it): its CLEARED verdict, None when the rule is not active on that GPU."""
    st = state.rules.get((gpu_key, rule_id))
    rule = rules.get(rule_id)
    if st is None or not st.active or rule is None:
        return None
    return _clear(rules.effective(rule, st.gpu.model if st.gpu else ""), gpu_key, st, now, why)


def restore(state: EngineState, active: Iterable[Verdict]) -> None:
    """Mark faults recorded before a restart as active again, so they are not raised twice."""
    for verdict in active:
        st = state.state(verdict.gpu_key, verdict.rule_id, verdict.gpu)
        st.restore(verdict.at, verdict.gpu, int(verdict.evidence.get("occurrences", 1)))


def _with_prior(obs: Observation, prior: tuple[int, float] | None) -> Observation:
    attrs = {k: v for k, v in obs.attrs.items() if k not in DERIVED_XID_FIELDS}
    if prior is not None:
        attrs["prior_xid"], attrs["prior_xid_age_seconds"] = prior[0], round(prior[1], 6)
    return dataclasses.replace(obs, attrs=frozen_attrs(attrs))


def _lifecycle(obs: Observation, state: EngineState, now: float, rules: RuleSet) -> list[Verdict]:
    if obs.signal is Signal.BOOT:
        boot_id = str(obs.attrs.get("boot_id", ""))
        previous, state.boot_id = state.boot_id, boot_id
        if not previous or previous == boot_id:
            return []
        return _clear_where(state, now, rules, "new boot",
                            lambda key, kind, rule_id: kind in {"boot", "reset", "recovered"})
    if obs.signal is Signal.GPU_RESET:
        if not obs.value:
            return []
        target = obs.gpu_key
        why = obs.attrs.get("why")
        clears = reset_clears(obs)
        return _clear_where(state, now, rules, why if isinstance(why, str) and why else "verified GPU reset",
                            lambda key, kind, rule_id: key == target and kind in clears)
    target = obs.gpu_key
    only = str(obs.attrs.get("rule", ""))  # a release of one fault (a drill's end), not of the whole GPU
    return _clear_where(state, now, rules, f"released by {obs.attrs.get('by', 'operator')}",
                        lambda key, kind, rule_id: target in {NODE_KEY, key} and only in {"", rule_id})


def reset_clears(observation: Observation) -> frozenset[str]:
    """The recovery kinds a gpu_reset observation clears: a verified reset clears what a reset clears and what
    the driver recovers; a recovery the driver reported done without a reset (`clears: recovered`, Xid 154
    5 -> 0 and a clean poll) clears only what the driver recovers."""
    return _RECOVERED_ONLY if observation.attrs.get("clears") == "recovered" else _RESET_CLEARS


_RESET_CLEARS = frozenset({"reset", "recovered"})
_RECOVERED_ONLY = frozenset({"recovered"})


def _clear_where(
    state: EngineState, now: float, rules: RuleSet, why: str, applies: Callable[[str, str, str], bool]
) -> list[Verdict]:
    verdicts = []
    for (gpu_key, rule_id), st in state.rules.items():
        rule = rules.get(rule_id)
        if not st.active or rule is None:
            continue
        if applies(gpu_key, st.recovery or rule.recovery.kind, rule_id):
            verdicts.append(_clear(rule, gpu_key, st, now, why))
    return verdicts


def _all_hold(conditions: Iterable[Condition], obs: Observation) -> bool:
    for cond in conditions:  # noqa: SIM110 - all() over a generator costs a frame per rule on the storm path
        if not _holds(cond, obs):
            return False
    return True


def _on_matches(matched: Iterable[RuleGroup], obs: Observation, gpu_key: str, state: EngineState, now: float,
                rules: RuleSet) -> list[Verdict]:
    """Count the observation once per matched group; the verdicts of the rules it raises, in the rule set's
    order. A group whose rules are all active does no more than note the match."""
    verdicts: list[Verdict] = []
    states = state.groups.get(gpu_key)
    gpu = obs.gpu if gpu_key != OVERFLOW_GPU_KEY else None
    count = obs.count
    for group in matched:
        group_state = states.get(group) if states is not None else None
        if group_state is None or len(group_state.members) < len(group.rules):
            state.add_rules(gpu_key, matched, obs.gpu)
            states = state.groups[gpu_key]
            group_state = states[group]
        matches = group_state.matches = group_state.matches + 1
        group_state.last_match = now
        group_state.occurrences += count
        if gpu is not None:
            group_state.gpu = gpu
            group_state.gpu_at = matches
        if group_state.counting:  # some of its rules are inactive: count
            rule = _effective(group, obs.gpu.model if obs.gpu else "", rules)
            for st in _count(rule, group_state, obs, now):
                verdicts.append(_raise(st, obs, gpu_key, now, rules))
    if len(verdicts) > 1:
        position = state.index.position if state.index is not None else {}
        verdicts.sort(key=lambda v: position.get(v.rule_id, 0))
    return verdicts


def _count(rule: Rule, group: GroupState, obs: Observation, now: float) -> list[RuleState]:
    """Count the observation in each of the group's windows; the rules whose window it fills (now active)."""
    window = rule.window
    distinct, per, count = window.distinct, window.per, window.count
    fired: list[RuleState] = []
    for counting in group.counting:
        if counting.sustain_since is None:
            counting.sustain_since = now
        if distinct:
            _record_distinct(distinct, window, counting, obs, now)
            if len(counting.distinct) < count:
                continue
        elif per:
            if _record_per_value(per, window, counting, obs, now) < count:
                continue
        else:
            _record_hit(window, counting, obs, now)
            if counting.hit_total < count:
                continue
        if now - counting.sustain_since < rule.sustain_seconds:
            continue
        fired.extend(counting.waiting)
        counting.waiting = []
    if fired:
        group.counting = [c for c in group.counting if c.waiting]
    return fired


def _raise(st: RuleState, obs: Observation, gpu_key: str, now: float, rules: RuleSet) -> Verdict:
    """The fault verdict of one rule whose window filled."""
    base = rules.get(st.rule_id)
    if base is None:
        raise KeyError(st.rule_id)  # a group holds only rules of the rule set it was built from
    rule = rules.effective(base, obs.gpu.model if obs.gpu else "")
    st.active = True
    st.since = now
    return Verdict(
        kind=VerdictKind.FAULT,
        rule_id=rule.id,
        gpu_key=gpu_key,
        severity=rule.severity,
        action=rule.action,
        fault_class=rule.fault_class,
        at=now,
        summary=_summary(rule, obs),
        gpu=obs.gpu if gpu_key != OVERFLOW_GPU_KEY else None,
        evidence=_evidence(rule, obs, st, gpu_key),
    )


def _record_distinct(attr: str, window: Window, counting: Counting, obs: Observation, now: float) -> None:
    """O(1) amortised: the last time of each distinct value, oldest first, at most `count` of them."""
    value = obs.attrs.get(attr)
    key = "" if value is None else value if type(value) is str else str(value)
    distinct = counting.distinct
    if key:
        if key in distinct:
            distinct.move_to_end(key)
        distinct[key] = now
    count = window.count
    while len(distinct) > count:
        distinct.popitem(last=False)
    seconds = window.seconds
    if seconds:
        while distinct and now - distinct[next(iter(distinct))] > seconds:
            distinct.popitem(last=False)


def _record_per_value(attr: str, window: Window, counting: Counting, obs: Observation, now: float) -> int:
    """The hits of this observation's value of `attr`, counted apart from the other values' (0 without one)."""
    value = obs.attrs.get(attr)
    if value is None or value == "":
        return 0
    key = value if type(value) is str else str(value)
    per = counting.per
    hits = per.get(key)
    if hits is None:
        hits = per[key] = Counting()
        while len(per) > PER_VALUE_KEYS:
            per.popitem(last=False)
    else:
        per.move_to_end(key)
    _record_hit(window, hits, obs, now)
    return hits.hit_total


def _record_hit(window: Window, counting: Counting, obs: Observation, now: float) -> None:
    """O(1) amortised: each hit is added once and dropped once; storms cost constant memory."""
    hits = counting.hits
    hits.append((now, obs.count))
    counting.hit_total += obs.count
    if window.seconds:
        while hits and now - hits[0][0] > window.seconds:
            counting.hit_total -= hits.popleft()[1]
    # Keep only as many hits as the window needs.
    while len(hits) > 1 and counting.hit_total - hits[0][1] >= window.count:
        counting.hit_total -= hits.popleft()[1]


def _quiet_recovered(rule: Rule, st: RuleState, now: float) -> bool:
    if rule.recovery.kind != "quiet" or st.recovery not in {"", "quiet"} or st.last_match is None:
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
    occurrences, since = st.occurrences, st.since
    st.restart()
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


def _holds(cond: Condition, obs: Observation) -> bool:
    op, field = cond.op, cond.field  # read once: a rule's fields cost more to read than a local
    actual = obs.value if field == "value" else obs.attrs.get(field)
    if op == "present":
        return actual is not None
    if op == "absent":
        return actual is None
    if actual is None:
        return False
    if op in {"in", "not_in"}:
        inside = any(_equal(actual, item) for item in cond.value or [])  # type: ignore[union-attr]
        return inside if op == "in" else not inside
    if op in {"bits_any", "bits_none"}:
        if not isinstance(actual, int | float) or isinstance(actual, bool) or not math.isfinite(actual):
            return False
        overlap = int(actual) & int(cond.value)  # type: ignore[arg-type]
        return bool(overlap) if op == "bits_any" else not overlap
    expected = _operand(cond, obs.attrs)
    if expected is None:
        return False
    if op == "eq":
        return _equal(actual, expected)
    if op == "ne":
        return not _equal(actual, expected)
    return _ordered(op, actual, expected)


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
    return _ORDERINGS[op](actual, expected)


_ORDERINGS: Mapping[str, Callable[[float, float], bool]] = {
    "gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le}


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


def _evidence(rule: Rule, obs: Observation, st: RuleState, gpu_key: str) -> Mapping[str, AttrValue]:
    evidence: dict[str, AttrValue] = {
        "signal": str(obs.signal),
        "value": float(obs.value),  # a float in both builds: compiled code reads the declared float as one
        "source": obs.source,
        "occurrences": st.occurrences,
        "window_count": rule.window.count,
        "window_seconds": rule.window.seconds,
        "first_seen": first if (first := st.first_seen()) is not None else obs.at,
        "observed_at": obs.at,
    }
    if gpu_key == OVERFLOW_GPU_KEY:
        evidence["overflow_of"] = obs.gpu_key
    if rule.nvidia_action:
        evidence["nvidia_action"] = rule.nvidia_action
    if rule.reason:
        evidence["reason"] = rule.reason
    for key, value in obs.attrs.items():
        evidence.setdefault(key, value)
    return frozen_attrs(evidence)

"""The pure classifier: observations in, verdicts out, over per-GPU windows on an injected clock."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from agent.engine.index import DERIVED_XID_FIELDS, RuleIndex
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

#: How long after another Xid on the same GPU an Xid still counts as following it (NVIDIA's Xid 45 is
#: "solo" or "follows another Xid"): the engine adds `prior_xid` (and its age) to Xid observations within it.
XID_CORRELATION_SECONDS = 10.0
#: Per-GPU state is kept for the node's GPUs and at most this many other GPU keys (addresses that are not in
#: the inventory, mangled or forged); anything beyond them is charged to OVERFLOW_GPU_KEY.
UNKNOWN_GPU_KEYS = 16
OVERFLOW_GPU_KEY = "gpu:overflow"
_RECENT_XIDS = 4


@dataclass(slots=True)
class RuleState:
    """What one rule remembers about one GPU.

    `hits` holds (time, count) of the occurrences a count window still needs, with their running total;
    `distinct` the last time of each distinct value a distinct window counts (at most `count` of them).
    """

    hits: deque[tuple[float, int]] = field(default_factory=deque)
    hit_total: int = 0
    distinct: OrderedDict[str, float] = field(default_factory=OrderedDict)
    active: bool = False
    since: float | None = None
    last_match: float | None = None
    last_nonmatch: float | None = None
    sustain_since: float | None = None
    occurrences: int = 0
    gpu: GpuRef | None = None

    def clear_hits(self) -> None:
        self.hits.clear()
        self.hit_total = 0
        self.distinct.clear()

    def first_seen(self) -> float | None:
        if self.distinct:
            return next(iter(self.distinct.values()))
        return self.hits[0][0] if self.hits else None


@dataclass(slots=True)
class EngineState:
    """All per-GPU, per-rule state; the engine mutates it and nothing else.

    `known_gpus` are the keys of the node's GPUs (the inventory); state for other keys is bounded by
    `unknown_gpu_keys`, beyond which they share OVERFLOW_GPU_KEY, so a flood of addresses costs bounded memory.
    """

    rules: dict[tuple[str, str], RuleState] = field(default_factory=dict)
    boot_id: str = ""
    known_gpus: frozenset[str] = frozenset()
    unknown_gpu_keys: int = UNKNOWN_GPU_KEYS
    xid_correlation_seconds: float = XID_CORRELATION_SECONDS
    index: RuleIndex | None = None
    _states_per_gpu: dict[str, int] = field(default_factory=dict)
    _unknown: set[str] = field(default_factory=set)
    _recent_xids: dict[str, dict[int, float]] = field(default_factory=dict)

    def active(self) -> list[tuple[str, str]]:
        """(gpu key, rule id) of every active fault."""
        return [key for key, st in self.rules.items() if st.active]

    def gpu_keys(self) -> frozenset[str]:
        """Every GPU key that holds state now."""
        return frozenset(self._states_per_gpu)

    def index_of(self, rules: RuleSet) -> RuleIndex:
        """The index of `rules`, built once per rule set (a reload builds a new one)."""
        if self.index is None or self.index.ruleset is not rules:
            self.index = RuleIndex.of(rules)
        return self.index

    def key_for(self, obs: Observation) -> str:
        """The key state of this observation's GPU is kept under: its own, or the overflow key."""
        key = obs.gpu_key
        if key == NODE_KEY or key in self._states_per_gpu or key in self.known_gpus:
            return key
        if obs.gpu is not None and obs.gpu.index is not None:
            return key  # resolved against the inventory: one of the node's GPUs
        if key in self._unknown or len(self._unknown) < self.unknown_gpu_keys:
            return key
        return OVERFLOW_GPU_KEY

    def state(self, gpu_key: str, rule_id: str, gpu: GpuRef | None = None) -> RuleState:
        """The state of one rule on one GPU, created on first use."""
        st = self.rules.get((gpu_key, rule_id))
        if st is None:
            st = self.rules[(gpu_key, rule_id)] = RuleState(gpu=gpu)
            count = self._states_per_gpu.get(gpu_key, 0)
            self._states_per_gpu[gpu_key] = count + 1
            if not count and self._is_unknown(gpu_key, gpu):
                self._unknown.add(gpu_key)
        return st

    def _is_unknown(self, gpu_key: str, gpu: GpuRef | None) -> bool:
        if gpu_key in self.known_gpus or gpu_key in {NODE_KEY, OVERFLOW_GPU_KEY}:
            return False
        return gpu is None or gpu.index is None

    def forget(self, gpu_key: str, rule_id: str) -> None:
        if self.rules.pop((gpu_key, rule_id), None) is None:
            return
        left = self._states_per_gpu.get(gpu_key, 1) - 1
        if left > 0:
            self._states_per_gpu[gpu_key] = left
            return
        self._states_per_gpu.pop(gpu_key, None)
        self._unknown.discard(gpu_key)
        self._recent_xids.pop(gpu_key, None)

    def prior_xid(self, gpu_key: str, code: int, now: float) -> tuple[int, float] | None:
        """The latest other Xid on this GPU within the correlation window (code, age); remembers this one."""
        recent = self._recent_xids.get(gpu_key)
        if recent is None:
            if len(self._recent_xids) > len(self._states_per_gpu):
                return None  # only GPUs that hold state are remembered: bounded like them
            recent = self._recent_xids[gpu_key] = {}
        prior = None
        for other in reversed(recent):
            if other != code:
                age = now - recent[other]
                if 0 <= age <= self.xid_correlation_seconds:
                    prior = (other, age)
                break
        recent.pop(code, None)
        recent[code] = now
        if len(recent) > _RECENT_XIDS:
            del recent[next(iter(recent))]
        return prior


def evaluate(observation: Observation, state: EngineState, now: float, *, rules: RuleSet) -> list[Verdict]:
    """Classify one observation; return the verdicts it raises or clears (often none)."""
    signal = observation.signal
    if signal in LIFECYCLE_SIGNALS:
        return _lifecycle(observation, state, now, rules)
    candidates = state.index_of(rules).candidates(signal, observation.value)
    gpu_key = state.key_for(observation)
    if signal is Signal.XID and math.isfinite(observation.value):
        prior = state.prior_xid(gpu_key, int(observation.value), now)
        if candidates.needs_prior_xid:
            observation = _with_prior(observation, prior)
    if not candidates.rules:
        return []
    if candidates.unconditional:
        return _on_matches(candidates.unconditional, observation, gpu_key, state, now)
    model = observation.gpu.model if observation.gpu else ""
    level = not signal.is_event
    primary: list[Rule] = []
    fallbacks: list[Rule] = []
    enabled: list[Rule] = []
    for group in (candidates.primary, candidates.fallback):
        if primary and not level:
            break  # an event that a rule matched never reaches the fallbacks
        for base in group:
            rule = rules.effective(base, model) if base.overrides else base
            if not rule.enabled:
                continue
            if level:
                enabled.append(rule)
            if rule.when and not _all_hold(rule.when, observation):
                continue
            if rule.fallback:
                fallbacks.append(rule)
            else:
                primary.append(rule)
    matched = primary or [r for r in fallbacks if r.code is not None] or fallbacks
    verdicts = _on_matches(matched, observation, gpu_key, state, now)
    if level:
        matched_ids = {rule.id for rule in matched}
        for rule in enabled:
            if rule.id not in matched_ids:
                _on_healthy_reading(rule, gpu_key, state, now)
    return verdicts


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


def restore(state: EngineState, active: Iterable[Verdict]) -> None:
    """Mark faults recorded before a restart as active again, so they are not raised twice."""
    for verdict in active:
        st = state.state(verdict.gpu_key, verdict.rule_id, verdict.gpu)
        st.active = True
        st.since = verdict.at
        st.last_match = verdict.at
        st.gpu = verdict.gpu
        st.occurrences = int(verdict.evidence.get("occurrences", 1))


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
        return _clear_where(state, now, rules, "new boot", lambda key, kind, rule_id: kind in {"boot", "reset"})
    if obs.signal is Signal.GPU_RESET:
        if not obs.value:
            return []
        target = obs.gpu_key
        return _clear_where(state, now, rules, "verified GPU reset",
                            lambda key, kind, rule_id: key == target and kind == "reset")
    target = obs.gpu_key
    only = str(obs.attrs.get("rule", ""))  # a release of one fault (a drill's end), not of the whole GPU
    return _clear_where(state, now, rules, f"released by {obs.attrs.get('by', 'operator')}",
                        lambda key, kind, rule_id: target in {NODE_KEY, key} and only in {"", rule_id})


def _clear_where(
    state: EngineState, now: float, rules: RuleSet, why: str, applies: Callable[[str, str, str], bool]
) -> list[Verdict]:
    verdicts = []
    for (gpu_key, rule_id), st in state.rules.items():
        rule = rules.get(rule_id)
        if not st.active or rule is None:
            continue
        if applies(gpu_key, rule.recovery.kind, rule_id):
            verdicts.append(_clear(rule, gpu_key, st, now, why))
    return verdicts


def _all_hold(conditions: Iterable[Condition], obs: Observation) -> bool:
    for cond in conditions:  # noqa: SIM110 - all() over a generator costs a frame per rule on the storm path
        if not _holds(cond, obs):
            return False
    return True


def _on_matches(matched: Iterable[Rule], obs: Observation, gpu_key: str, state: EngineState,
                now: float) -> list[Verdict]:
    verdicts: list[Verdict] = []
    for rule in matched:
        verdict = _on_match(rule, obs, gpu_key, state, now)
        if verdict is not None:
            verdicts.append(verdict)
    return verdicts


def _on_match(rule: Rule, obs: Observation, gpu_key: str, state: EngineState, now: float) -> Verdict | None:
    st = state.rules.get((gpu_key, rule.id)) or state.state(gpu_key, rule.id, obs.gpu)
    if obs.gpu is not None and gpu_key != OVERFLOW_GPU_KEY:
        st.gpu = obs.gpu
    st.last_match = now
    st.occurrences += obs.count
    if st.sustain_since is None:
        st.sustain_since = now
    if st.active:
        return None
    window = rule.window
    if window.distinct:
        _record_distinct(window.distinct, window.count, window.seconds, st, obs, now)
        if len(st.distinct) < window.count:
            return None
    else:
        _record_hit(rule, st, obs, now)
        if st.hit_total < window.count:
            return None
    if now - st.sustain_since < rule.sustain_seconds:
        return None
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


def _on_healthy_reading(rule: Rule, gpu_key: str, state: EngineState, now: float) -> None:
    st = state.rules.get((gpu_key, rule.id))
    if st is None:
        return
    st.last_nonmatch = now
    st.sustain_since = None
    if not st.active:
        st.clear_hits()


def _record_distinct(attr: str, count: int, seconds: float, st: RuleState, obs: Observation, now: float) -> None:
    """O(1) amortised: the last time of each distinct value, oldest first, at most `count` of them."""
    value = obs.attrs.get(attr)
    key = "" if value is None else value if type(value) is str else str(value)
    distinct = st.distinct
    if key:
        if key in distinct:
            distinct.move_to_end(key)
        distinct[key] = now
    while len(distinct) > count:
        distinct.popitem(last=False)
    if seconds:
        while distinct and now - next(iter(distinct.values())) > seconds:
            distinct.popitem(last=False)


def _record_hit(rule: Rule, st: RuleState, obs: Observation, now: float) -> None:
    """O(1) amortised: each hit is added once and dropped once; storms cost constant memory."""
    window = rule.window
    if window.distinct:
        _record_distinct(window.distinct, window.count, window.seconds, st, obs, now)
        return
    hits = st.hits
    hits.append((now, obs.count))
    st.hit_total += obs.count
    if window.seconds:
        while hits and now - hits[0][0] > window.seconds:
            st.hit_total -= hits.popleft()[1]
    # Keep only as many hits as the window needs.
    while len(hits) > 1 and st.hit_total - hits[0][1] >= window.count:
        st.hit_total -= hits.popleft()[1]


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
    st.clear_hits()
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
        "value": obs.value,
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

"""The engine's per-GPU state: one GroupState per rule group and GPU, one RuleState per rule and GPU.

The rules of a group (index.RuleGroup) match the same observations and count them alike, so what they remember
in common is kept once, in their GroupState: when they last matched, how often, on which GPU, and the windows
they count in. An observation updates that once, whatever the size of the group; a rule does work of its own only
when its verdict changes. Each RuleState keeps the rule's own verdict (`active`, `since`) and reads the rest
through its group: `occurrences`, `last_match`, `last_nonmatch` and `gpu` are the rule's own value as last set
(on creation, restore or a clear), overtaken by the group's as soon as the group matches (or reads healthy) again.

Windows. An active rule counts nothing (its window is frozen until it clears, then empty), so only the group's
inactive rules count, in a Counting: the window plus when the match began to be sustained. Rules that clear at
different moments must count afresh, each from its own clear: a clear moves the rule out of the Counting it
shared into a fresh one (joining another rule's fresh Counting when there is one), so the others keep counting
undisturbed and the released rule starts from an empty window. A group thus holds one Counting per moment its
inactive rules began counting; usually one, or none while they are all active. A healthy reading empties every
window of the group, so its Countings merge back into one.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from agent.engine.index import RuleGroup, RuleIndex
from agent.engine.loader import RuleSet
from agent.model import NODE_KEY, GpuRef, Observation

#: How long after another Xid on the same GPU an Xid still counts as following it (NVIDIA's Xid 45 is
#: "solo" or "follows another Xid"): the engine adds `prior_xid` (and its age) to Xid observations within it.
XID_CORRELATION_SECONDS = 10.0
#: Per-GPU state is kept for the node's GPUs and at most this many other GPU keys (addresses that are not in
#: the inventory, mangled or forged); anything beyond them is charged to OVERFLOW_GPU_KEY.
UNKNOWN_GPU_KEYS = 16
OVERFLOW_GPU_KEY = "gpu:overflow"
#: A per-value window (Window.per) counts at most this many values apart on one GPU (an H100 has 18 NVLinks).
PER_VALUE_KEYS = 64


@dataclass(slots=True, eq=False)
class Counting:
    """A window some inactive rules of a group count in on one GPU, and since when their match is sustained.

    `hits` holds (time, count) of the occurrences a count window still needs, with their running total;
    `distinct` the last time of each distinct value a distinct window counts (at most `count` of them); `per`
    the hits of each value a per-value window counts apart (at most PER_VALUE_KEYS values, the least recent
    forgotten first).
    `waiting` are the inactive rules counting in it (an active rule keeps the Counting it fired with, frozen).
    """

    hits: deque[tuple[float, int]] = field(default_factory=deque)
    hit_total: int = 0
    distinct: OrderedDict[str, float] = field(default_factory=OrderedDict)
    sustain_since: float | None = None
    waiting: list[RuleState] = field(default_factory=list)
    per: OrderedDict[str, Counting] = field(default_factory=OrderedDict)

    @property
    def fresh(self) -> bool:
        """Nothing counted yet: a rule that starts counting afresh may join it."""
        return not self.hits and not self.distinct and not self.per and self.sustain_since is None

    def same_count(self, other: Counting) -> bool:
        return (self.hits, self.hit_total, self.distinct, self.sustain_since) == (
            other.hits, other.hit_total, other.distinct, other.sustain_since) and (
            list(self.per) == list(other.per)
            and all(mine.same_count(other.per[key]) for key, mine in self.per.items()))

    def copy(self) -> Counting:
        """The same window, counted apart from now on (no waiting rules)."""
        return Counting(deque(self.hits), self.hit_total, OrderedDict(self.distinct), self.sustain_since,
                        per=OrderedDict((key, value.copy()) for key, value in self.per.items()))

    def clear(self) -> None:
        self.hits.clear()
        self.hit_total = 0
        self.distinct.clear()
        self.per.clear()
        self.sustain_since = None

    def first_seen(self) -> float | None:
        if self.distinct:
            return next(iter(self.distinct.values()))
        if self.per:  # the value counted last is the one that filled the window
            return next(reversed(self.per.values())).first_seen()
        return self.hits[0][0] if self.hits else None


@dataclass(slots=True, eq=False)
class GroupState:
    """What the rules of one group remember in common about one GPU (see the module docstring).

    `matches` and `nonmatches` number the group's matches and healthy readings: a rule's own value set when
    they stood lower has been overtaken by the group's. `occurrences` is the sum of the counts of all matches.
    """

    group: RuleGroup
    members: list[RuleState] = field(default_factory=list)
    counting: list[Counting] = field(default_factory=list)
    matches: int = 0
    occurrences: int = 0
    last_match: float | None = None
    gpu: GpuRef | None = None
    gpu_at: int = 0
    nonmatches: int = 0
    last_nonmatch: float | None = None

    def fresh_counting(self) -> Counting:
        """The Counting a rule that starts counting afresh joins: one with nothing counted, new if none."""
        for counting in self.counting:
            if counting.fresh:
                return counting
        counting = Counting()
        self.counting.append(counting)
        return counting

    def stop_counting(self, st: RuleState) -> None:
        """`st` no longer counts (it became active or was forgotten); a Counting left without rules goes."""
        counting = st.counting
        if st in counting.waiting:
            counting.waiting.remove(st)
            if not counting.waiting:
                self.counting.remove(counting)

    def healthy(self, now: float) -> None:
        """A reading that none of the group's rules matches: every window restarts, so they merge into one."""
        self.nonmatches += 1
        self.last_nonmatch = now
        if not self.counting:
            return
        first, *others = self.counting
        first.clear()
        for counting in others:
            for st in counting.waiting:
                st.counting = first
            first.waiting.extend(counting.waiting)
        self.counting = [first]


@dataclass(slots=True, eq=False)
class RuleState:
    """What one rule remembers about one GPU: its own verdict, and through its group the rest (module docstring).

    The underscored fields are the rule's own values, valid while the group has not matched (`_matches`) or
    read healthy (`_nonmatches`) since they were set; `_counted` is the group's occurrences when
    `_occurrences` was set.
    """

    rule_id: str
    group: GroupState
    counting: Counting
    active: bool = False
    since: float | None = None
    #: How this active fault clears when not as its rule says (""): an escalated replacement is "operator".
    recovery: str = ""
    _matches: int = 0
    _last_match: float | None = None
    _gpu: GpuRef | None = None
    _occurrences: int = 0
    _counted: int = 0
    _nonmatches: int = 0
    _last_nonmatch: float | None = None

    @property
    def last_match(self) -> float | None:
        group = self.group
        return group.last_match if group.matches > self._matches else self._last_match

    @property
    def gpu(self) -> GpuRef | None:
        group = self.group
        return group.gpu if group.gpu_at > self._matches else self._gpu

    @property
    def occurrences(self) -> int:
        return self._occurrences + self.group.occurrences - self._counted

    @property
    def last_nonmatch(self) -> float | None:
        group = self.group
        return group.last_nonmatch if group.nonmatches > self._nonmatches else self._last_nonmatch

    @property
    def hits(self) -> deque[tuple[float, int]]:
        return self.counting.hits

    @property
    def hit_total(self) -> int:
        return self.counting.hit_total

    @property
    def distinct(self) -> OrderedDict[str, float]:
        return self.counting.distinct

    @property
    def sustain_since(self) -> float | None:
        return self.counting.sustain_since

    def first_seen(self) -> float | None:
        return self.counting.first_seen()

    def own(self, *, last_match: float | None, gpu: GpuRef | None, occurrences: int,
            last_nonmatch: float | None) -> None:
        """Take these as the rule's own values, until its group overtakes them."""
        group = self.group
        self._matches, self._last_match, self._gpu = group.matches, last_match, gpu
        self._occurrences, self._counted = occurrences, group.occurrences
        self._nonmatches, self._last_nonmatch = group.nonmatches, last_nonmatch

    def restart(self) -> None:
        """Cleared: the rule reports no occurrences and counts afresh, in its group's fresh Counting."""
        self.active = False
        self.since = None
        self.recovery = ""
        self._occurrences, self._counted = 0, self.group.occurrences
        self.group.stop_counting(self)
        self.counting = self.group.fresh_counting()
        self.counting.waiting.append(self)

    def restore(self, at: float, gpu: GpuRef | None, occurrences: int) -> None:
        """Active again after a restart, as recorded; its window frozen as it stands."""
        self.group.stop_counting(self)
        self.counting = self.counting.copy()
        self.active, self.since = True, at
        self.own(last_match=at, gpu=gpu, occurrences=occurrences, last_nonmatch=self.last_nonmatch)


@dataclass(slots=True)
class EngineState:
    """All per-GPU, per-rule state; the engine mutates it and nothing else.

    `rules` holds each rule's state per (gpu key, rule id), `groups` the state its group keeps for that GPU.
    `known_gpus` are the keys of the node's GPUs (the inventory); state for other keys is bounded by
    `unknown_gpu_keys`, beyond which they share OVERFLOW_GPU_KEY, so a flood of addresses costs bounded memory.
    """

    rules: dict[tuple[str, str], RuleState] = field(default_factory=dict)
    groups: dict[str, dict[RuleGroup, GroupState]] = field(default_factory=dict)
    boot_id: str = ""
    known_gpus: frozenset[str] = frozenset()
    unknown_gpu_keys: int = UNKNOWN_GPU_KEYS
    xid_correlation_seconds: float = XID_CORRELATION_SECONDS
    index: RuleIndex | None = None
    _states_per_gpu: dict[str, int] = field(default_factory=dict)
    _unknown: set[str] = field(default_factory=set)
    _recent_xids: dict[str, RecentXids] = field(default_factory=dict)

    def active(self) -> list[tuple[str, str]]:
        """(gpu key, rule id) of every active fault."""
        return [key for key, st in self.rules.items() if st.active]

    def gpu_keys(self) -> frozenset[str]:
        """Every GPU key that holds state now."""
        return frozenset(self._states_per_gpu)

    def index_of(self, rules: RuleSet) -> RuleIndex:
        """The index of `rules`, built once per rule set (a reload builds a new one, and regroups the state)."""
        if self.index is None or self.index.ruleset is not rules:
            self.index = RuleIndex.of(rules)
            self._regroup(self.index)
        return self.index

    def key_for(self, obs: Observation) -> str:
        """The key state of this observation's GPU is kept under: its own, or the overflow key."""
        gpu = obs.gpu
        key = gpu.key if gpu is not None else NODE_KEY
        if key == NODE_KEY or key in self._states_per_gpu or key in self.known_gpus:
            return key
        if gpu is not None and gpu.index is not None:
            return key  # resolved against the inventory: one of the node's GPUs
        if key in self._unknown or len(self._unknown) < self.unknown_gpu_keys:
            return key
        return OVERFLOW_GPU_KEY

    def add_rules(self, gpu_key: str, groups: Iterable[RuleGroup], gpu: GpuRef | None) -> None:
        """Create the state on one GPU of every rule of `groups` that has none, in the rule set's order (the
        order `rules` is kept in, as if each rule had been met one by one)."""
        position = self.index.position if self.index is not None else {}
        new = sorted(((rule.id, group) for group in groups for rule in group.rules
                      if (gpu_key, rule.id) not in self.rules), key=lambda pair: position.get(pair[0], 0))
        states = self.groups.setdefault(gpu_key, {})
        for rule_id, group in new:
            self._new(gpu_key, rule_id, states.get(group) or states.setdefault(group, GroupState(group)), gpu)

    def state(self, gpu_key: str, rule_id: str, gpu: GpuRef | None = None) -> RuleState:
        """The state of one rule on one GPU, created on first use (in its group of the current index, if any)."""
        st = self.rules.get((gpu_key, rule_id))
        if st is not None:
            return st
        group = self.index.groups.get(rule_id) if self.index is not None else None
        if group is None:  # no index yet, or a rule it does not know: alone until the next index regroups it
            return self._new(gpu_key, rule_id, GroupState(RuleGroup(())), gpu)
        groups = self.groups.setdefault(gpu_key, {})
        return self._new(gpu_key, rule_id, groups.get(group) or groups.setdefault(group, GroupState(group)), gpu)

    def _new(self, gpu_key: str, rule_id: str, group: GroupState, gpu: GpuRef | None) -> RuleState:
        counting = group.fresh_counting()
        st = self.rules[(gpu_key, rule_id)] = RuleState(rule_id, group, counting)
        st.own(last_match=None, gpu=gpu, occurrences=0, last_nonmatch=None)
        group.members.append(st)
        counting.waiting.append(st)
        count = self._states_per_gpu.get(gpu_key, 0)
        self._states_per_gpu[gpu_key] = count + 1
        if not count and self._is_unknown(gpu_key, gpu):
            self._unknown.add(gpu_key)
        return st

    def _is_unknown(self, gpu_key: str, gpu: GpuRef | None) -> bool:
        if gpu_key in self.known_gpus or gpu_key in {NODE_KEY, OVERFLOW_GPU_KEY}:
            return False
        return gpu is None or gpu.index is None

    def pin_recovery(self, gpu_key: str, rule_id: str, kind: str) -> None:
        """This active fault clears by `kind` (e.g. "operator"), not by its rule's recovery, until it clears."""
        st = self.rules.get((gpu_key, rule_id))
        if st is not None and st.active:
            st.recovery = kind

    def forget(self, gpu_key: str, rule_id: str) -> None:
        st = self.rules.pop((gpu_key, rule_id), None)
        if st is None:
            return
        group = st.group
        group.stop_counting(st)
        group.members.remove(st)
        groups = self.groups.get(gpu_key, {})
        if not group.members and groups.get(group.group) is group:
            del groups[group.group]
            if not groups:
                self.groups.pop(gpu_key, None)
        left = self._states_per_gpu.get(gpu_key, 1) - 1
        if left > 0:
            self._states_per_gpu[gpu_key] = left
            return
        self._states_per_gpu.pop(gpu_key, None)
        self._unknown.discard(gpu_key)
        self._recent_xids.pop(gpu_key, None)

    def _regroup(self, index: RuleIndex) -> None:
        """Every rule's state into its group of `index`, keeping what it reported and counted: its own values
        are read out and it joins the group anew; an inactive rule counts in a copy of its window, shared with
        the group's rules that counted the same."""
        old = self.rules
        if not old:
            return
        self.groups = {}
        for (gpu_key, rule_id), st in old.items():
            group = index.groups.get(rule_id)
            if group is None:
                state = GroupState(RuleGroup(()))
            else:
                groups = self.groups.setdefault(gpu_key, {})
                state = groups.get(group) or groups.setdefault(group, GroupState(group))
            last_match, gpu, occurrences, last_nonmatch = st.last_match, st.gpu, st.occurrences, st.last_nonmatch
            st.group = state
            state.members.append(st)
            st.own(last_match=last_match, gpu=gpu, occurrences=occurrences, last_nonmatch=last_nonmatch)
            if st.active:
                continue
            counting = next((c for c in state.counting if c.same_count(st.counting)), None)
            if counting is None:
                counting = st.counting.copy()
                state.counting.append(counting)
            st.counting = counting
            counting.waiting.append(st)

    def prior_xid(self, gpu_key: str, code: int, now: float) -> tuple[int, float] | None:
        """The latest other Xid on this GPU within the correlation window (code, age); remembers this one."""
        recent = self._recent_xids.get(gpu_key)
        if recent is None:
            if len(self._recent_xids) > len(self._states_per_gpu):
                return None  # only GPUs that hold state are remembered: bounded like them
            recent = self._recent_xids[gpu_key] = RecentXids()
        if code == recent.last:
            other, at = recent.before, recent.before_at
            recent.last_at = now
        else:
            other, at = recent.last, recent.last_at
            recent.before, recent.before_at, recent.last, recent.last_at = recent.last, recent.last_at, code, now
        if other is None or not 0 <= now - at <= self.xid_correlation_seconds:
            return None
        return other, now - at


@dataclass(slots=True)
class RecentXids:
    """The last two distinct Xid codes seen on one GPU and when: the latest Xid other than a new one's code is
    one of them (the one before, if the last had the same code)."""

    last: int | None = None
    last_at: float = 0.0
    before: int | None = None
    before_at: float = 0.0

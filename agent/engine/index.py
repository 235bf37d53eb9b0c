"""The rules of a RuleSet indexed by signal and code, built once per rule set, so one observation costs the
same whatever the size of the catalog: only the rules that can match it are ever looked at.

Rules alike in everything that decides whether and when they fire (signal, codes, conditions, fallback, enabled,
window, sustain, per-model overrides) form one RuleGroup: they match the same observations and count them the
same way, so the engine keeps one window per group and GPU and tries each group once (evaluate.py). Rules that
differ in any of it are never grouped; a rule like no other is a group of one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import msgspec

from agent.engine.loader import RuleSet
from agent.engine.schema import Rule
from agent.model import Signal

#: The attributes the engine derives itself for Xid observations (see evaluate.PRIOR_XID).
DERIVED_XID_FIELDS = frozenset({"prior_xid", "prior_xid_age_seconds"})
#: What decides whether and when a rule fires, besides its codes: rules alike in all of it are one group.
_MATCHING_FIELDS = frozenset({"signal", "when", "fallback", "enabled", "window", "sustain_seconds", "overrides"})


@dataclass(frozen=True, slots=True, eq=False)
class RuleGroup:
    """Rules that match the same observations and count them alike, in file order; the first one (`lead`)
    stands for all of them when matching and counting. Compared by identity: one object per group and index."""

    rules: tuple[Rule, ...]

    @property
    def lead(self) -> Rule:
        return self.rules[0]


@dataclass(frozen=True, slots=True)
class Candidates:
    """The rules one observation must be tried against, in file order, and what they need; the groups of the
    other rules and of the fallback rules (tried only when no other rule matched an event) apart."""

    rules: tuple[Rule, ...]
    needs_prior_xid: bool = False
    primary: tuple[RuleGroup, ...] = ()
    fallback: tuple[RuleGroup, ...] = ()
    #: Of the primary groups, those an event matches whatever it carries (enabled, without conditions or
    #: per-model overrides), and the others (each to be checked against the event).
    plain: tuple[RuleGroup, ...] = ()
    checked: tuple[RuleGroup, ...] = ()
    #: For an event, the groups it matches whatever it carries when they are all of the primary groups (so the
    #: fallbacks are never reached); empty when that needs looking at the event.
    unconditional: tuple[RuleGroup, ...] = ()


_NONE = Candidates(())


@dataclass(frozen=True, slots=True)
class SignalRules:
    """The rules of one signal: per code (coded rules plus those without a code), and for any other value."""

    by_code: Mapping[int, Candidates]
    any_value: Candidates


@dataclass(frozen=True, slots=True)
class RuleIndex:
    """Every signal's rules, frozen (`signals` in plain dicts that nothing writes to, the faster to read on every
    observation); `of(rules)` builds it for one RuleSet. `groups` gives each rule id its group, `position` each
    rule id its place in the rule set (the order verdicts are given in)."""

    ruleset: RuleSet
    signals: Mapping[Signal, SignalRules]
    groups: Mapping[str, RuleGroup]
    position: Mapping[str, int]

    @classmethod
    def of(cls, ruleset: RuleSet) -> RuleIndex:
        groups = _groups(ruleset.rules)
        signals: dict[Signal, SignalRules] = {}
        for signal in Signal:
            rules = ruleset.for_signal(signal)
            if rules:
                signals[signal] = _index_signal(rules, groups)
        position = {rule.id: n for n, rule in enumerate(ruleset.rules)}
        return cls(ruleset, signals, MappingProxyType(groups), MappingProxyType(position))

    def candidates(self, signal: Signal, value: float) -> Candidates:
        rules = self.signals.get(signal)
        if rules is None:
            return _NONE
        if not rules.by_code or not math.isfinite(value):
            return rules.any_value
        return rules.by_code.get(int(value), rules.any_value)


def codes_of(rule: Rule) -> frozenset[int]:
    if rule.code is None:
        return frozenset()
    return frozenset([rule.code] if isinstance(rule.code, int) else rule.code)


def _matching(rule: Rule) -> bytes:
    """The rule's matching fields as JSON (in a fixed order): equal for rules alike in all of them."""
    return msgspec.json.encode({name: getattr(rule, name) for name in sorted(_MATCHING_FIELDS)})


def _groups(rules: tuple[Rule, ...]) -> dict[str, RuleGroup]:
    """Each rule id's group: the rules alike in codes and in every matching field, in file order."""
    alike: dict[tuple[frozenset[int], bytes], list[Rule]] = {}
    for rule in rules:
        alike.setdefault((codes_of(rule), _matching(rule)), []).append(rule)
    return {rule.id: group for members in alike.values() for group in [RuleGroup(tuple(members))]
            for rule in members}


def _index_signal(rules: tuple[Rule, ...], groups: Mapping[str, RuleGroup]) -> SignalRules:
    uncoded = tuple(rule for rule in rules if rule.code is None)
    coded: dict[int, list[Rule]] = {}
    for rule in rules:
        for code in codes_of(rule):
            coded.setdefault(code, []).append(rule)
    position = {id(rule): n for n, rule in enumerate(rules)}
    by_code = {code: _candidates(tuple(sorted((*matching, *uncoded), key=lambda r: position[id(r)])), groups)
               for code, matching in coded.items()}
    return SignalRules(by_code, _candidates(uncoded, groups))


def _candidates(rules: tuple[Rule, ...], groups: Mapping[str, RuleGroup]) -> Candidates:
    needs = any(cond.field in DERIVED_XID_FIELDS or cond.ref in DERIVED_XID_FIELDS
                for rule in rules for cond in rule.when) or any("{prior_xid" in rule.summary for rule in rules)
    primary = _groups_of(tuple(r for r in rules if not r.fallback), groups)
    plain = tuple(g for g in primary if g.lead.signal.is_event and g.lead.enabled and not g.lead.when
                  and not g.lead.overrides)
    checked = tuple(g for g in primary if g not in plain)
    return Candidates(rules, needs, primary, _groups_of(tuple(r for r in rules if r.fallback), groups), plain,
                      checked, () if checked else plain)


def _groups_of(rules: tuple[Rule, ...], groups: Mapping[str, RuleGroup]) -> tuple[RuleGroup, ...]:
    """The groups of `rules`, each once, in the order of their first rule."""
    return tuple(dict.fromkeys(groups[rule.id] for rule in rules))

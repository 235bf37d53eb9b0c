"""The rules of a RuleSet indexed by signal and code, built once per rule set, so one observation costs the
same whatever the size of the catalog: only the rules that can match it are ever looked at."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from agent.engine.loader import RuleSet
from agent.engine.schema import Rule
from agent.model import Signal

#: The attributes the engine derives itself for Xid observations (see evaluate.PRIOR_XID).
DERIVED_XID_FIELDS = frozenset({"prior_xid", "prior_xid_age_seconds"})


@dataclass(frozen=True, slots=True)
class Candidates:
    """The rules one observation must be tried against, in file order, and what they need; the fallback
    rules (tried only when no other rule matched an event) apart."""

    rules: tuple[Rule, ...]
    needs_prior_xid: bool = False
    primary: tuple[Rule, ...] = ()
    fallback: tuple[Rule, ...] = ()
    #: For an event, the rules it matches whatever it carries (every primary rule enabled, without conditions
    #: or per-model overrides, so the fallbacks are never reached); empty when that needs looking at the event.
    unconditional: tuple[Rule, ...] = ()


_NONE = Candidates(())


@dataclass(frozen=True, slots=True)
class SignalRules:
    """The rules of one signal: per code (coded rules plus those without a code), and for any other value."""

    by_code: Mapping[int, Candidates]
    any_value: Candidates

    def for_value(self, value: float) -> Candidates:
        if not self.by_code or not math.isfinite(value):
            return self.any_value
        return self.by_code.get(int(value), self.any_value)


@dataclass(frozen=True, slots=True)
class RuleIndex:
    """Every signal's rules, frozen; `of(rules)` builds it for one RuleSet."""

    ruleset: RuleSet
    signals: Mapping[Signal, SignalRules]

    @classmethod
    def of(cls, ruleset: RuleSet) -> RuleIndex:
        signals: dict[Signal, SignalRules] = {}
        for signal in Signal:
            rules = ruleset.for_signal(signal)
            if rules:
                signals[signal] = _index_signal(rules)
        return cls(ruleset, MappingProxyType(signals))

    def candidates(self, signal: Signal, value: float) -> Candidates:
        rules = self.signals.get(signal)
        return rules.for_value(value) if rules is not None else _NONE


def codes_of(rule: Rule) -> frozenset[int]:
    if rule.code is None:
        return frozenset()
    return frozenset([rule.code] if isinstance(rule.code, int) else rule.code)


def _index_signal(rules: tuple[Rule, ...]) -> SignalRules:
    uncoded = tuple(rule for rule in rules if rule.code is None)
    coded: dict[int, list[Rule]] = {}
    for rule in rules:
        for code in codes_of(rule):
            coded.setdefault(code, []).append(rule)
    position = {id(rule): n for n, rule in enumerate(rules)}
    by_code = {code: _candidates(tuple(sorted((*matching, *uncoded), key=lambda r: position[id(r)])))
               for code, matching in coded.items()}
    return SignalRules(MappingProxyType(by_code), _candidates(uncoded))


def _candidates(rules: tuple[Rule, ...]) -> Candidates:
    needs = any(cond.field in DERIVED_XID_FIELDS or cond.ref in DERIVED_XID_FIELDS
                for rule in rules for cond in rule.when) or any("{prior_xid" in rule.summary for rule in rules)
    primary = tuple(r for r in rules if not r.fallback)
    plain = all(r.signal.is_event and r.enabled and not r.when and not r.overrides for r in primary)
    return Candidates(rules, needs, primary, tuple(r for r in rules if r.fallback), primary if plain else ())

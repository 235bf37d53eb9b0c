"""Whether a hot reload may replace the running rules: it must not lose rules or leave a catalog Xid uncovered."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agent.engine.loader import RuleSet
from agent.model import Signal

#: How many ids a refusal names (the count says how many there are in all).
NAMED = 10


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a reload is refused: `reason` is a metric label (two values), `missing` what it would lose."""

    reason: str
    missing: tuple[str, ...]
    fix: str


def covered_xids(rules: RuleSet, catalog: Iterable[int]) -> frozenset[int]:
    """The catalog's Xid codes that an enabled rule of its own (signal xid, that code) handles."""
    wanted = frozenset(catalog)
    return frozenset(code for rule in rules.for_signal(Signal.XID) if rule.enabled
                     for code in rule.codes if code in wanted)


def refusal(running: RuleSet, candidate: RuleSet, *, catalog: Iterable[int]) -> Refusal | None:
    """None when `candidate` may replace `running`. Refused: a rule of the running set that the candidate
    neither has nor lists under `retired:` (a file that lost its tail, a half-written file; named in file
    order, so the first is where a cut file ends), and, retired or not, a catalog Xid the running set
    handles that no enabled rule of the candidate handles."""
    ids = {rule.id for rule in candidate.rules}
    lost = tuple(rule.id for rule in running.rules if rule.id not in ids and rule.id not in candidate.retired)
    if lost:
        return Refusal("rules_lost", lost, "a rule removed on purpose is named in a rules file's `retired:` list "
                                           "in the same change; a restart loads any valid set")
    codes = tuple(catalog)
    uncovered = covered_xids(running, codes) - covered_xids(candidate, codes)
    if uncovered:
        return Refusal("catalog_uncovered", tuple(f"xid {code}" for code in sorted(uncovered)),
                       "every Xid of NVIDIA's catalog keeps a rule: change its action or severity instead of "
                       "removing or disabling it")
    return None

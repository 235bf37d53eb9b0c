"""The rules engine: rule schema and loading, and the pure evaluation over per-GPU state."""

from agent.engine.evaluate import evaluate, reset_clears, restore, tick, withdraw
from agent.engine.loader import (
    CONTAINED_BY,
    RuleSet,
    builtin_rules_dir,
    lint_rules,
    load_rule_texts,
    load_rules,
    unreached_recoveries,
)
from agent.engine.schema import Rule
from agent.engine.state import EngineState

__all__ = [
    "CONTAINED_BY",
    "EngineState",
    "Rule",
    "RuleSet",
    "builtin_rules_dir",
    "evaluate",
    "lint_rules",
    "load_rule_texts",
    "load_rules",
    "reset_clears",
    "restore",
    "tick",
    "unreached_recoveries",
    "withdraw",
]

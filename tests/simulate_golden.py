"""The `simulate --json` output of a built-in scenario with its run-dependent parts (wall times) normalised."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from agent.cli import main

#: Where scripts/record-simulate-golden writes each scenario's output and tests/unit/test_simulate_golden.py
#: reads it back.
GOLDEN_DIR = Path(__file__).resolve().parent / "fixtures" / "simulate"

#: The variants recorded for every scenario: the default run and a dry run (which must write nothing).
VARIANTS: dict[str, tuple[str, ...]] = {"": (), "dry-run": ("--dry-run",)}

#: A wall-clock RFC3339 time (the fake cluster stamps taints, conditions and Events with it).
_WALL_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)")
#: A wall-clock time in Unix seconds where the agent records one: the quarantine's start in its record and
#: its fleet summary (JSON inside an annotation), and the label the quarantine brake counts.
_WALL_SECONDS = re.compile(r'("quarantined(?:_since)?":)\d{9,}(?:\.\d+)?')
_WALL_SECONDS_LABELS = frozenset({"gpu-health-agent.io/quarantined-since"})


def golden_path(scenario: str, variant: str) -> Path:
    return GOLDEN_DIR / (f"{scenario}.{variant}.json" if variant else f"{scenario}.json")


def normalise(value: Any) -> Any:
    """The output with every wall-clock time replaced by a placeholder, inside JSON strings too."""
    if isinstance(value, dict):
        return {k: "<wall-seconds>" if k in _WALL_SECONDS_LABELS else normalise(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v) for v in value]
    if isinstance(value, str):
        return _WALL_SECONDS.sub(r'\1"<wall-seconds>"', _WALL_TIME.sub("<wall-time>", value))
    return value


def live_output(scenario: str, variant: str) -> Any:
    """Runs `simulate --json` for the scenario in this process and returns the normalised document."""
    result = CliRunner().invoke(main, ["simulate", "--json", scenario, *VARIANTS[variant]])
    if result.exit_code != 0:
        raise RuntimeError(f"simulate {scenario} {variant}: exit {result.exit_code}: {result.output}")
    return normalise(json.loads(result.stdout))  # the JSON alone: a log line on stderr is not the output


def render(document: Any) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"

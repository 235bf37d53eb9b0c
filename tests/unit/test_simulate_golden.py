"""Every built-in scenario's `simulate --json` output equals the one recorded by scripts/record-simulate-golden."""

from __future__ import annotations

import json

import pytest

from agent.sources.scenario import builtin_names
from tests.simulate_golden import VARIANTS, golden_path, live_output


@pytest.mark.parametrize("variant", list(VARIANTS), ids=lambda v: v or "default")
@pytest.mark.parametrize("scenario", builtin_names())
def test_simulate_output_equals_the_recorded_golden(scenario: str, variant: str) -> None:
    """The live output equals the recorded one (rerun scripts/record-simulate-golden and name the change)."""
    path = golden_path(scenario, variant)
    assert path.exists(), f"no golden for {scenario} {variant or 'default'}: run scripts/record-simulate-golden"
    assert live_output(scenario, variant) == json.loads(path.read_text())

"""Fault injection: agents killed at random I/O points of a remediation and restarted leave the cluster right.

A bounded, seeded number of trials per scenario for CI; `scripts/fault_injection.py` runs hundreds and
prints the table.
"""

from pathlib import Path

import pytest

from agent.k8s import retry
from tests.restart_harness import SCENARIOS, fleet, run_trial

TRIALS = 3


@pytest.fixture(autouse=True)
def no_retry_sleep(monkeypatch):
    monkeypatch.setattr(retry, "WAIT", False)
    monkeypatch.setattr(retry, "DEFAULT_DEADLINE_SECONDS", 0.3)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("seed", range(TRIALS))
def test_a_killed_and_restarted_agent_leaves_the_cluster_right(scenario, seed, tmp_path: Path):
    """No pod off a faulty GPU evicted, none twice, no fault lost, no released node quarantined again,
    every owed Event delivered once."""
    result = run_trial(scenario, seed, directory=tmp_path)
    assert (result.wrong_evictions, result.double_evictions, result.faults_lost, result.requarantined,
            result.events_missing, result.events_duplicated) == (0, 0, 0, 0, 0, 0), result


def test_a_fleet_with_killed_agents_and_aging_slots_stays_within_its_budget(tmp_path: Path):
    """20 faulty nodes, a budget of 2, slots older than their lifetime, agents killed: never more than 2
    nodes disrupted, every node remediated in turn, a blocked node cheap for the API server."""
    result = fleet(7, nodes=20, budget=2, hours=4.0, step=30.0, kill_rate=0.01, directory=tmp_path)
    assert (result.over_budget_holders, result.over_budget_disrupted) == (0, 0), result
    assert (result.wrong_evictions, result.double_evictions) == (0, 0), result
    assert result.blocked_requests_per_minute_max <= 10, result

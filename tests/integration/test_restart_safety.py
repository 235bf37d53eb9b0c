"""Fault injection: agents killed at random I/O points of a remediation and restarted leave the cluster right.

A bounded, seeded number of trials per scenario for CI; `scripts/fault_injection.py` runs hundreds and
prints the table.
"""

from pathlib import Path

import pytest

from tests.restart_harness import SCENARIOS, fleet, run_trial

TRIALS = 3


pytestmark = pytest.mark.usefixtures("no_retry_sleep")


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("seed", range(TRIALS))
def test_a_killed_and_restarted_agent_leaves_the_cluster_right(scenario, seed, tmp_path: Path):
    """No pod off a faulty GPU evicted, none twice, no fault lost, no released node quarantined again,
    every owed Event delivered once."""
    result = run_trial(scenario, seed, directory=tmp_path)
    assert (result.wrong_evictions, result.double_evictions, result.faults_lost, result.requarantined,
            result.events_missing, result.events_duplicated) == (0, 0, 0, 0, 0, 0), result


@pytest.mark.timeout(600)  # 4 virtual hours of 20 agents: ~80 s alone, up to 150 s on a loaded 2-core machine
def test_a_fleet_with_killed_agents_and_aging_slots_stays_within_its_budget(tmp_path: Path):
    """20 faulty nodes, a budget of 2, slots older than their lifetime, agents killed: never more than 2
    nodes disrupted, every node remediated in turn, a blocked node cheap for the API server."""
    result = fleet(7, nodes=20, budget=2, hours=4.0, step=30.0, kill_rate=0.01, directory=tmp_path)
    assert (result.over_budget_holders, result.over_budget_disrupted) == (0, 0), result
    assert (result.wrong_evictions, result.double_evictions) == (0, 0), result
    assert result.blocked_requests_per_minute_max <= 10, result


def test_a_fleet_under_the_rate_bound_disrupts_at_most_its_rate_within_any_hour(tmp_path: Path):
    """8 nodes faulty within 5 minutes, 2 slots, 3 an hour, clocks off by up to 6 h, agents killed: at most 3
    nodes newly disrupted within any one hour, never more than 2 at once."""
    result = fleet(5, nodes=8, budget=2, hours=2.5, step=30.0, kill_rate=0.01, skew_hours=6.0, per_hour=3,
                   directory=tmp_path)
    assert 0 < result.most_newly_disrupted_in_an_hour <= 3, result
    assert (result.over_budget_holders, result.over_budget_disrupted) == (0, 0), result
    assert (result.wrong_evictions, result.double_evictions) == (0, 0), result


def test_an_agent_process_killed_with_sigkill_mid_remediation_is_finished_by_the_next(tmp_path: Path):
    """A real process, a real SIGKILL right after its first eviction: the next process repeats no eviction
    and no Event, keeps the node quarantined, and stops within 10 s of SIGTERM while the API server hangs."""
    import dataclasses
    import os
    import signal
    import subprocess
    import sys
    import time

    import yaml

    from agent.simulation.fake_apiserver import populate
    from agent.sources.scenario import inventory, load_scenario
    from tests.conftest import wait_for
    from tests.restart_harness import start_backend

    backend = start_backend()
    try:
        node = dataclasses.replace(inventory(load_scenario("xid79")), name="n1")
        populate(backend.cluster, node)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(backend.server.kubeconfig()))
        env = dict(os.environ, GPU_HEALTH_JOURNAL_PATH=str(tmp_path / "j.db"), GPU_HEALTH_HTTP__HOST="127.0.0.1",
                   GPU_HEALTH_SOURCES__KMSG__ENABLED="off", GPU_HEALTH_SOURCES__NVML__ENABLED="off",
                   GPU_HEALTH_SOURCES__DCGM__ENABLED="off", GPU_HEALTH_MODE="remediate", NODE_NAME="n1",
                   KUBECONFIG=str(kubeconfig), POD_NAMESPACE="gpu-health", POD_NAME="gpu-health-agent-n1")

        def agent() -> subprocess.Popen[str]:
            return subprocess.Popen([sys.executable, "-m", "agent", "run", "--scenario", "xid79", "--speed", "50",
                                     "--port", "0"], env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, text=True)

        first = agent()
        try:
            assert wait_for(lambda: any(code == 201 for _, code in backend.evictions()), timeout=30)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        evicted = sorted(pod for pod, code in backend.evictions() if code == 201)
        second = agent()
        try:
            assert wait_for(lambda: "gpu-health-agent.io/reboot-requested" in
                            (backend.node("n1")["metadata"].get("annotations") or {}), timeout=30)
            assert wait_for(lambda: any(e["reason"] == "GpuFatalFault" for e in backend.events()))
            time.sleep(1.0)  # the scenario replays its Xid to the second agent: nothing may follow from it
            backend.cluster.faults.latency_seconds = 30.0
            started = time.monotonic()
            second.send_signal(signal.SIGTERM)
            second.wait(15)
            assert time.monotonic() - started < 10
        finally:
            backend.cluster.faults.latency_seconds = 0.0
            if second.poll() is None:
                second.kill()
        # Without the kubelet or NVML, every GPU pod may hold the GPU: the second agent evicts those the first
        # had not reached yet, none of them twice.
        accepted = [pod for pod, code in backend.evictions() if code == 201]
        assert set(evicted) <= set(accepted) and len(accepted) == len(set(accepted))
        assert [code for _, code in backend.evictions() if code != 201] == []
        assert [e["reason"] for e in backend.events()].count("GpuFatalFault") == 1
        assert backend.node("n1")["spec"]["taints"]
    finally:
        backend.stop()

"""Evictions through the real client against the fake API server: what is retried, what escalates at once."""

import pytest

from agent.k8s.client import client_for
from agent.k8s.errors import Unavailable
from agent.k8s.evictions import EvictionOutcome, Evictor
from agent.k8s.raw import RawApi
from agent.model import StepKind, StepResult
from tests.k8s_helpers import gpu_node, make_agent, running_pods, start_cluster


@pytest.fixture
def fake(no_retry_sleep):
    """A fake cluster served over HTTP, with retries that do not sleep and give up after 0.3 s."""
    cluster, server = start_cluster()
    yield cluster, server
    server.stop()


def two_budgets(cluster) -> None:
    for name in ("team", "service"):
        cluster.add("poddisruptionbudgets", {"metadata": {"name": name}, "spec": {
            "maxUnavailable": 8, "selector": {"matchLabels": {"app": "n1-trainer"}}}}, group="policy", namespace="ml")


def evictions(cluster) -> list:
    return [entry for entry in cluster.log if entry[1].endswith("/eviction")]


def test_a_pod_under_two_budgets_is_stuck_at_the_first_refusal(fake):
    """The 500 for more than one PodDisruptionBudget is final: STUCK at once, one request, no retry."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    two_budgets(cluster)
    evictor = Evictor(RawApi(client_for(server.url)), deadline_seconds=600, clock=lambda: 0.0)
    result = evictor.evict("ml", "n1-trainer-3")
    assert result.outcome is EvictionOutcome.STUCK
    assert "more than one PodDisruptionBudget" in result.message
    assert "ml/n1-trainer-3" in evictor.stuck
    assert len(evictions(cluster)) == 1
    assert "n1-trainer-3" in running_pods(cluster, "n1")
    del agent


def test_a_pod_under_two_budgets_escalates_to_a_human_through_the_ladder(fake):
    """The eviction step fails as stuck on the first pass, the stuck hook and Event fire, nothing is forced."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    two_budgets(cluster)
    outcome = agent.fault(3)
    evict = {(a.step.kind, a.step.target): a for a in outcome.actions}[(StepKind.EVICT, "ml/n1-trainer-3")]
    assert evict.result is StepResult.FAILED
    assert agent.stuck == ["ml/n1-trainer-3"]
    assert any(e["reason"] == "EvictionStuck" for e in cluster.events())
    later = {(a.step.kind, a.step.target): a.result for a in agent.pipeline.tick(40.0).actions}
    assert later.get((StepKind.EVICT, "ml/n1-trainer-3")) is StepResult.SKIPPED
    assert len(evictions(cluster)) == 1


def test_a_server_error_on_eviction_is_retried_not_stuck(fake):
    """Any other 500 is transient: the eviction waits and is tried again, never reported stuck."""
    cluster, server = fake
    make_agent(cluster, server, gpu_node("n1"))
    cluster.faults.fail_next_writes.extend([500] * 100_000)  # more than the deadline lets it try
    evictor = Evictor(RawApi(client_for(server.url)), deadline_seconds=600, clock=lambda: 0.0)
    with pytest.raises(Unavailable):
        evictor.evict("ml", "n1-trainer-3")
    assert not evictor.stuck

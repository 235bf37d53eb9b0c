"""The quarantine brake's claims on the fake API server: agents whose counts all had room claim at once and
only the bound goes through; a refused claim is deleted, an admitted one lives a window, and one an earlier
process left is made anew."""

from __future__ import annotations

from typing import Any

import pytest

from agent.fleet import BrakePolicy, NodeSummary
from agent.fleet.published import SUMMARY_ANNOTATION
from agent.fleetapi.brake_claims import CLAIM_LABEL, BrakeClaims, claim_name
from agent.k8s.errors import Forbidden
from agent.k8s.raw import RawApi
from tests.integration.test_budget import LEASE_RESOURCE
from tests.k8s_helpers import Agent, agent_client, gpu_node, make_agent, operator_client

pytestmark = [pytest.mark.usefixtures("no_retry_sleep"), pytest.mark.fake_only]
BRAKE = BrakePolicy(max_share=0.15, min_nodes=2, max_nodes=200, window_seconds=600.0)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def fleet(fake: Any, count: int, clock: Clock) -> list[Agent]:
    cluster, server = fake
    return [make_agent(cluster, server, gpu_node(f"n{i}", gpus=1), brake=BRAKE, fleet_clock=clock)
            for i in range(count)]


def claims(fake: Any) -> set[str]:
    return {lease["metadata"]["name"] for lease in fake[0].list_objects(LEASE_RESOURCE, "gpu-health")
            if (lease["metadata"].get("labels") or {}).get(CLAIM_LABEL) == "true"}


def test_agents_whose_counts_all_had_room_quarantine_no_more_than_the_bound(fake):
    """Six agents read the count at once (nobody quarantined yet: room for each, bound 2), then each claims:
    two are granted, four wait, and the four refused claims are gone."""
    agents = fleet(fake, 6, Clock())
    readings = [a.side.fleet.read(count=True) for a in agents]
    assert all(r.gpu_nodes == 6 and not r.quarantined_at for r in readings)
    answers = [a.side.fleet.claim(a.inventory.name) for a in agents]
    assert answers[:2] == ["", ""]
    refused = "quarantine brake: 2 of 6 GPU nodes newly quarantined or claimed first"
    assert all(a.startswith(refused) for a in answers[2:])
    assert claims(fake) == {claim_name("n0"), claim_name("n1")}


def test_a_refused_claim_stands_for_the_retry_time_without_claiming_again(fake):
    """The refusal is in the next readings (the taint waits on it, no request) for two retry times."""
    clock = Clock()
    agents = fleet(fake, 3, clock)
    for agent in agents:
        agent.side.fleet.read(count=True)
        agent.side.fleet.claim(agent.inventory.name)
    third = agents[2].side.fleet
    assert third.read(count=True).refused.startswith("quarantine brake: 2 of 3")
    clock.now += 37.5  # the next pass, one jittered retry time later
    assert third.read(count=True).refused.startswith("quarantine brake: 2 of 3")
    clock.now += 22.5
    assert third.read(count=True).refused == ""


def test_an_admitted_claim_is_deleted_by_its_holder_a_window_later(fake):
    """Tidying before the window has passed keeps the claim; after it, deletes it."""
    clock = Clock()
    [agent] = fleet(fake, 1, clock)
    agent.side.fleet.read(count=True)
    assert agent.side.fleet.claim("n0") == ""
    agent.side.fleet.tidy()
    assert claims(fake) == {claim_name("n0")}
    clock.now += BRAKE.window_seconds
    agent.side.fleet.tidy()
    assert claims(fake) == set()


def test_a_claim_an_earlier_process_left_is_made_anew(fake):
    """A restarted agent does not rank by its predecessor's claim (its stamp and place are of another time):
    it deletes it and creates its own, with a new uid and a later version."""
    cluster, server = fake
    make_agent(cluster, server, gpu_node("n0", gpus=1))
    raw = RawApi(agent_client(server, "n0"))
    before = BrakeClaims(raw, node_name="n0", namespace="gpu-health", window_seconds=600.0)
    assert before.rank(bound=2, units={}) == (True, 0)
    old = cluster.get(LEASE_RESOURCE, "gpu-health", claim_name("n0"))
    after = BrakeClaims(raw, node_name="n0", namespace="gpu-health", window_seconds=600.0)
    assert after.rank(bound=2, units={}) == (True, 0)
    new = cluster.get(LEASE_RESOURCE, "gpu-health", claim_name("n0"))
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    assert int(new["metadata"]["resourceVersion"]) > int(old["metadata"]["resourceVersion"])


def test_an_older_agents_quarantine_in_the_window_takes_a_place_from_the_claims(fake):
    """An older agent (no claims) quarantined its node 10 s ago, by its summary: of six agents that all see
    room (bound 2, one taken), one is granted."""
    _, server = fake
    clock = Clock()
    agents = fleet(fake, 6, clock)
    older = NodeSummary(node="old", driver_version="570.86.15", quarantined_since=clock.now - 10.0)
    RawApi(operator_client(server)).create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": "old", "labels": {"nvidia.com/gpu.present": "true"},
        "annotations": {SUMMARY_ANNOTATION: older.to_json()}}})
    readings = [a.side.fleet.read(count=True) for a in agents]
    assert all(set(r.quarantined_at) == {"old"} and r.gpu_nodes == 7 for r in readings)
    answers = [a.side.fleet.claim(a.inventory.name) for a in agents]
    assert answers.count("") == 1 and answers[0] == ""


class _NoDeletes(RawApi):
    """An API whose deletes are refused (an admission policy older than the claims)."""

    def delete(self, path: str, *, resource_version: str = "") -> dict[str, Any]:
        raise Forbidden(f"DELETE {path}: forbidden", status=403)


def test_a_refused_claim_whose_delete_fails_stays_refused(fake):
    """Bound 2, two granted; the third's claim is refused and its delete fails: it is still refused (the
    count, which has room, is not asked instead)."""
    cluster, server = fake
    for i in range(3):
        make_agent(cluster, server, gpu_node(f"n{i}", gpus=1))
    answers = []
    for i in range(3):
        raw = (_NoDeletes if i == 2 else RawApi)(agent_client(server, f"n{i}"))
        answers.append(BrakeClaims(raw, node_name=f"n{i}", namespace="gpu-health", window_seconds=600.0)
                       .rank(bound=2, units={}))
    assert answers == [(True, 0), (True, 1), (False, 2)]
    assert claims(fake) == {claim_name("n0"), claim_name("n1"), claim_name("n2")}


def test_a_new_process_gives_back_the_claim_an_earlier_one_left_and_keeps_its_own(fake):
    """At its first tidying a process deletes its node's leftover claim (a reboot within the window); a claim
    it made itself stays until its window has passed."""
    cluster, server = fake
    make_agent(cluster, server, gpu_node("n0", gpus=1))
    raw = RawApi(agent_client(server, "n0"))
    BrakeClaims(raw, node_name="n0", namespace="gpu-health", window_seconds=600.0).rank(bound=2, units={})
    assert claims(fake) == {claim_name("n0")}
    assert BrakeClaims(raw, node_name="n0", namespace="gpu-health", window_seconds=600.0).expire()
    assert claims(fake) == set()
    fresh = BrakeClaims(raw, node_name="n0", namespace="gpu-health", window_seconds=600.0)
    fresh.rank(bound=2, units={})
    assert not fresh.expire() and claims(fake) == {claim_name("n0")}

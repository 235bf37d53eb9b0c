"""The brake's claims ranked from a watch of them (agent.fleetapi.claims_watch): no list where the watch delivered
the claim's own create, the same places as a list would give, a list where the watch cannot say, and a claim
this process holds ranked again without a request."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.fleetapi.brake_claims import CLAIM_LABEL, BrakeClaims, claim_name
from agent.fleetapi.claims_watch import ClaimsWatch
from agent.k8s.raw import RawApi
from tests.k8s_helpers import agent_client, gpu_node, make_agent, operator_client

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
LEASES = "/apis/coordination.k8s.io/v1/namespaces/gpu-health/leases"


class Watched:
    """One node's claims with its watch running on a thread."""

    def __init__(self, fake: Any, node: str, *, run: bool = True) -> None:
        cluster, server = fake
        make_agent(cluster, server, gpu_node(node, gpus=1))
        client = agent_client(server, node)
        self.watch = ClaimsWatch(client, "gpu-health", watch_seconds=60.0)
        self.claims = BrakeClaims(RawApi(client), node_name=node, namespace="gpu-health", window_seconds=600.0,
                                  delivered=self.watch.through)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.watch.run, args=(self.stop,), daemon=True)
        if run:
            self.thread.start()
            self.synced()

    def synced(self) -> None:
        """Until the watch has listed (a ranking before that lists itself)."""
        deadline = time.monotonic() + 10.0
        while not self.watch.through(1, wait_seconds=0.0) and time.monotonic() < deadline:
            self.watch.answered = self.watch.missed = 0
            time.sleep(0.01)
        self.watch.answered = self.watch.missed = 0

    def delivered_without(self, name: str) -> None:
        """Until the watch has delivered the delete of claim `name` (a delete it has not yet delivered is
        ranked as still held: docs/fleet.md)."""
        deadline = time.monotonic() + 10.0
        while any(c.name == name for c in self.watch.through(1) or []) and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        self.watch.close()
        if self.thread.is_alive():
            self.thread.join(5.0)


@pytest.fixture
def watched(fake: Any) -> Iterator[list[Watched]]:
    made: list[Watched] = []
    yield made
    for one in made:
        one.close()


def lease_lists(fake: Any, since: int) -> int:
    return sum(1 for method, path, _ in fake[0].log[since:] if (method, path) == ("GET", LEASES))


def test_agents_ranking_from_their_watches_quarantine_no_more_than_the_bound(fake, watched):
    """Three agents claim one after another with their watches live, bound 2: the first two are let through,
    the third waits, and every ranking was answered by its watch."""
    watched.extend(Watched(fake, f"n{i}") for i in range(3))
    answers = [w.claims.rank(bound=2, units={}) for w in watched]
    assert answers == [(True, 0), (True, 1), (False, 2)]
    assert [(w.watch.answered, w.watch.missed) for w in watched] == [(1, 0)] * 3


@pytest.mark.fake_only  # counts the requests in the fake's log
def test_a_claim_ranked_from_the_watch_lists_no_claims(fake, watched):
    """The create is the ranking's only request: the watch's claims stand in for the list."""
    watched.append(Watched(fake, "n0"))
    before = len(fake[0].log)
    assert watched[0].claims.rank(bound=2, units={}) == (True, 0)
    assert lease_lists(fake, before) == 0
    assert [m for m, p, _ in fake[0].log[before:] if p.startswith(LEASES)] == ["POST"]


@pytest.mark.fake_only  # counts the requests in the fake's log
def test_a_watch_that_has_not_listed_yet_leaves_the_ranking_to_a_list(fake, watched):
    """Not synced (the thread not started): the ranking lists the claims at once and ranks as before."""
    watched.append(Watched(fake, "n0", run=False))
    before = len(fake[0].log)
    assert watched[0].claims.rank(bound=2, units={}) == (True, 0)
    assert lease_lists(fake, before) == 1
    assert (watched[0].watch.answered, watched[0].watch.missed) == (0, 1)


def test_a_claim_created_while_the_watch_is_down_still_ranks_ahead(fake, watched):
    """n0's watch stops; n1 claims; n0's ranking then lists and sees n1's claim ahead of its own."""
    watched.extend([Watched(fake, "n0"), Watched(fake, "n1")])
    watched[0].close()
    assert watched[1].claims.rank(bound=1, units={}) == (True, 0)
    assert watched[0].claims.rank(bound=1, units={}) == (False, 1)
    assert watched[0].watch.missed == 1


@pytest.mark.fake_only  # counts the requests in the fake's log
def test_a_claim_held_within_its_window_is_ranked_again_without_a_request(fake, watched):
    """A second ranking within the window (the node released and faulting again) neither creates, fetches
    nor lists its claim: the claim is never written, and the watch holds the others."""
    watched.append(Watched(fake, "n0"))
    assert watched[0].claims.rank(bound=2, units={}) == (True, 0)
    before = len(fake[0].log)
    assert watched[0].claims.rank(bound=2, units={}) == (True, 0)
    assert [p for _, p, _ in fake[0].log[before:] if p.startswith(LEASES)] == []


def test_a_held_claim_someone_deleted_is_made_anew(fake, watched):
    """An operator deletes the claim this process holds: the next ranking does not rank by the claim it
    remembers but makes a new one, which is there afterwards."""
    watched.append(Watched(fake, "n0"))
    assert watched[0].claims.rank(bound=2, units={}) == (True, 0)
    operator = RawApi(operator_client(fake[1]))
    old = operator.get(f"{LEASES}/{claim_name('n0')}")
    operator.delete(f"{LEASES}/{claim_name('n0')}")
    watched[0].delivered_without(claim_name("n0"))
    assert watched[0].claims.rank(bound=2, units={}) == (True, 0)
    new = operator.get(f"{LEASES}/{claim_name('n0')}")
    assert new["metadata"]["uid"] != old["metadata"]["uid"]


def test_the_watch_answers_only_once_it_has_delivered_the_create_it_is_asked_about(fake, watched):
    """Asked right after a create's answer, the watch waits for that create to arrive: the claim is among those
    it gives (an answer from before it would miss the claim and every one committed just before)."""
    watched.extend([Watched(fake, "n0"), Watched(fake, "n1")])
    for _ in range(5):
        created = watched[1].claims.raw.create(LEASES, {
            "metadata": {"name": claim_name("n1"), "labels": {CLAIM_LABEL: "true"}},
            "spec": {"holderIdentity": "n1", "leaseDurationSeconds": 600}})
        version = int(created["metadata"]["resourceVersion"])
        claims = watched[0].watch.through(version, wait_seconds=5.0)
        assert claims is not None and claim_name("n1") in {c.name for c in claims}
        watched[1].claims.raw.delete(f"{LEASES}/{claim_name('n1')}")
        watched[0].delivered_without(claim_name("n1"))

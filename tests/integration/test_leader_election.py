"""agent.fleetapi.leader over the fake API server: the Lease taken, renewed, lost and released, each candidate
judging the holder by the renewals it observed on its own clock."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agent.fleetapi.leader import LeaderElector, LeaseConfig
from agent.k8s.client import client_for
from agent.k8s.errors import Unavailable
from agent.k8s.raw import RawApi
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
LEASE = "/apis/coordination.k8s.io/v1/namespaces/gpu-health/leases/fleet"


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    fake = FakeApiServer(FakeCluster()).start()
    yield fake
    fake.stop()


def candidate(server: FakeApiServer, identity: str, clock: Clock) -> LeaderElector:
    return LeaderElector(RawApi(client_for(server.url)), LeaseConfig(namespace="gpu-health", name="fleet",
                                                                     identity=identity), clock=clock)


def lease(server: FakeApiServer) -> dict:
    return RawApi(client_for(server.url)).get(LEASE)["spec"]


def test_a_missing_lease_is_created_and_led(server):
    """The first candidate creates the Lease with itself as holder and leads."""
    a = candidate(server, "a", Clock())
    assert a.try_acquire_or_renew() and a.leading
    assert lease(server)["holderIdentity"] == "a" and lease(server)["leaseDurationSeconds"] == 15


def test_a_held_lease_is_taken_only_after_a_whole_duration_without_renewal_on_the_candidates_clock(server):
    """B waits a full leaseDurationSeconds from when it first saw A's record, on B's clock, whatever the
    renewTime written in it says."""
    a, b_clock = candidate(server, "a", Clock(5.0)), Clock(0.0)
    b = candidate(server, "b", b_clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    b_clock.now = 14.9
    assert not b.try_acquire_or_renew() and not b.leading
    b_clock.now = 15.1
    assert b.try_acquire_or_renew() and b.leading
    assert lease(server)["holderIdentity"] == "b" and lease(server)["leaseTransitions"] == 1


def test_a_holder_that_keeps_renewing_keeps_the_lease(server):
    """Each renewal is a new record B observes, so however long B's clock runs B never takes the Lease."""
    a, b_clock = candidate(server, "a", Clock()), Clock(0.0)
    b = candidate(server, "b", b_clock)
    for _ in range(5):
        assert a.try_acquire_or_renew()
        b_clock.now += 10.0
        assert not b.try_acquire_or_renew()
    assert lease(server)["holderIdentity"] == "a"


def test_a_leader_that_cannot_renew_within_the_deadline_steps_down(server):
    """With the API server down the leader stops leading once the renew deadline passes on its own clock."""
    clock = Clock()
    a = candidate(server, "a", clock)
    assert a.try_acquire_or_renew()
    server.cluster.faults.down = True
    clock.now += 5.0
    with pytest.raises(Unavailable):
        a.try_acquire_or_renew()
    assert a.leading
    clock.now += 5.1
    assert not a.leading


def test_a_released_lease_is_taken_by_a_standby_at_once(server):
    """release() leaves no holder, so a standby takes over at its next round instead of a lease later."""
    a, b = candidate(server, "a", Clock()), candidate(server, "b", Clock())
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    assert a.release() and not a.leading
    assert b.try_acquire_or_renew()
    assert lease(server)["holderIdentity"] == "b"


def test_a_write_that_raced_another_candidate_does_not_lead(server):
    """Every write carries the resourceVersion read: a 409 means another candidate wrote first."""
    a = candidate(server, "a", Clock())
    assert a.try_acquire_or_renew()
    a.release()
    server.cluster.faults.fail_next_writes.append(409)
    b = candidate(server, "b", Clock())
    assert not b.try_acquire_or_renew() and not b.leading


def test_lease_settings_must_order_retry_deadline_and_duration():
    """A renew deadline at or past the lease duration would let two leaders overlap: refused."""
    with pytest.raises(ValueError):
        LeaseConfig(namespace="n", name="l", identity="a", lease_seconds=10, renew_deadline_seconds=10.0)

"""The budget's ranks on the real kube-apiserver, each agent with its own bound token: a slot an agent did
not confirm in this process is re-taken (a write every reader sees) and ranked as taken now."""

from __future__ import annotations

import time

import pytest

from agent.fleetapi.budget import LeaseBudget
from agent.fleetapi.budget_slots import slot_name
from tests.realcluster.budget_tokens import agent_raw
from tests.realcluster.controlplane import ControlPlane

pytestmark = pytest.mark.usefixtures("no_retry_sleep")


class Clocks:
    """One machine's clocks: a wall clock that stands still (so two writes stamp the same second) and a
    monotonic clock the test moves."""

    def __init__(self) -> None:
        self.wall = time.time()
        self.elapsed = 0.0

    def monotonic(self) -> float:
        return 1000.0 + self.elapsed


def gate(plane: ControlPlane, node: str, clocks: Clocks) -> LeaseBudget:
    plane.forget("coordination.k8s.io", "leases", "gpu-health", slot_name(node))
    return LeaseBudget(agent_raw(plane, node), node_name=node, namespace="gpu-health", max_nodes=1,
                       max_percent=0, clock=lambda: clocks.wall, monotonic=clocks.monotonic)


@pytest.fixture
def two_nodes(control_plane: ControlPlane) -> tuple[str, str]:
    a, b = control_plane.unique("rank-a"), control_plane.unique("rank-b")
    control_plane.add_gpu_node(a)
    control_plane.add_gpu_node(b)
    return a, b


def test_an_earlier_processs_slot_does_not_rank_ahead_of_a_node_that_took_the_budget_since(control_plane, two_nodes):
    """a's slot lapses for b (unrenewed for b's lifetime), b takes the budget a second later; a's next
    process is refused, although a's slot has the older creationTimestamp."""
    a, b = two_nodes
    assert gate(control_plane, a, Clocks()).acquire().held
    time.sleep(1.1)  # b's slot is created in a later second than a's
    clocks = Clocks()
    taker = gate(control_plane, b, clocks)
    assert not taker.acquire().held
    clocks.elapsed = 7201.0
    assert taker.acquire().held
    assert not gate(control_plane, a, Clocks()).acquire().held


def test_a_restarted_holders_re_take_is_a_change_other_readers_see(control_plane, two_nodes):
    """a's next process re-takes its slot within the same wall-clock second as the first took it: the write
    still changes the Lease on the real server, so b counts it for a new lifetime."""
    a, b = two_nodes
    stamps = Clocks()
    assert gate(control_plane, a, stamps).acquire().held
    clocks = Clocks()
    reader = gate(control_plane, b, clocks)
    assert not reader.acquire().held
    clocks.elapsed = 7000.0
    assert gate(control_plane, a, stamps).acquire().held
    clocks.elapsed = 7201.0
    assert not reader.acquire().held

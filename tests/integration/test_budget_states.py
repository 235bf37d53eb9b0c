"""The budget slot's states on the fake API server and the real control plane: a slot given back leaves
nothing live, whatever state the giving back starts from (a kept slot written over, an answer lost)."""

from __future__ import annotations

from typing import Any

import pytest

from agent.fleetapi.budget import LeaseBudget
from agent.fleetapi.budget_slots import slot_name
from agent.k8s.errors import K8sError
from agent.k8s.raw import RawApi
from tests.integration.test_budget import Faulty
from tests.integration.test_budget_rate import LEASES, Fleet
from tests.k8s_helpers import agent_client

pytestmark = pytest.mark.usefixtures("no_retry_sleep")


def slot_patches(method: str, path: str) -> bool:
    return method == "PATCH" and "/leases/" in path


def faulty_gate(fleet: Fleet, name: str, *, rate: int, max_nodes: int = 1) -> tuple[LeaseBudget, Faulty]:
    """A new agent process of the node whose slot patches can be made to land with their answers lost."""
    faulty = Faulty(agent_client(fleet.server, name), slot_patches, after=True, times=10**9)
    clock = fleet.clocks[name]
    gate = LeaseBudget(RawApi(faulty.api), node_name=name, namespace="gpu-health", max_nodes=max_nodes,
                       max_percent=0, max_per_hour=rate, clock=clock.wall, monotonic=clock.monotonic)
    return gate, faulty


def answers_lost(faulty: Faulty, call: Any) -> None:
    """`call`'s slot patches land on the server and their answers are lost, past the retries' deadline."""
    faulty.fail_at, faulty.failed = faulty.seen + 1, 0
    with pytest.raises(K8sError):
        call()
    faulty.fail_at = None


def test_a_slot_taken_after_its_kept_one_was_deleted_is_released_when_given_back(fake):
    """Rate 2: n1 done (its slot kept), an operator deletes the kept slot, n1 faults again within the window and
    takes a new slot: giving it back releases it at once (not left live until the old keep's window ends)."""
    fleet = Fleet(fake, 2)
    n1, _ = fleet.names
    gate = fleet.gate(n1, rate=2)
    assert gate.acquire().held
    gate.release()
    fleet.operator.delete(f"{LEASES}/{slot_name(n1)}")
    assert gate.acquire().held
    gate.release()
    assert fleet.slot(n1) is not None and fleet.held() == set()


def test_a_re_take_of_a_kept_slot_whose_answer_was_lost_is_released_when_given_back(fake):
    """Rate 2: n1 done (its slot kept); its re-take lands (the released mark removed) but the answer is lost:
    the next release marks the slot released again, so no live slot is left behind."""
    fleet = Fleet(fake, 2)
    n1, _ = fleet.names
    gate, faulty = faulty_gate(fleet, n1, rate=2)
    assert gate.acquire().held
    gate.release()
    answers_lost(faulty, gate.acquire)
    assert fleet.held() == {slot_name(n1)}  # the re-take landed
    gate.release()
    assert fleet.held() == set()


def test_a_release_whose_answer_was_lost_does_not_leave_a_released_slot_held(fake):
    """Limit 1, rate 2: n1's release lands but its answer is lost, then n1 is disrupted again: its slot is
    taken again (live to every reader), so n2 is refused the one place rather than overbooking it."""
    fleet = Fleet(fake, 2)
    n1, n2 = fleet.names
    gate, faulty = faulty_gate(fleet, n1, rate=2)
    assert gate.acquire().held
    answers_lost(faulty, gate.release)
    assert gate.acquire().held
    assert fleet.held() == {slot_name(n1)}
    assert not fleet.gate(n2, rate=2, max_nodes=1).acquire().held

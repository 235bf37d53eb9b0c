"""The budget's Leases under the shipped RBAC and admission policy, on the real kube-apiserver, each agent
with its own bound token: its own slot it may write, another node's slot and the pause Lease it may not."""

from __future__ import annotations

import pytest

from agent.fleetapi.brake_claims import BrakeClaims, claim_name
from agent.fleetapi.budget import PAUSE_LEASE
from agent.fleetapi.budget_slots import slot_name
from agent.k8s.errors import Forbidden
from tests.realcluster.budget_tokens import (
    LEASES,
    accepted,
    agent_budget,
    agent_raw,
    attempts,
    claim_attempts,
    hiding_slot_attempts,
    operator_pause_attempts,
    own_claim_attempts,
    pause,
)
from tests.realcluster.controlplane import ControlPlane

pytestmark = pytest.mark.usefixtures("no_retry_sleep")


@pytest.fixture
def two_nodes(control_plane: ControlPlane) -> tuple[str, str]:
    a, b = control_plane.unique("slot-a"), control_plane.unique("slot-b")
    control_plane.add_gpu_node(a)
    control_plane.add_gpu_node(b)
    return a, b


def lease(plane: ControlPlane, name: str) -> dict | None:
    try:
        return plane.rest("GET", f"{LEASES}/{name}")
    except Exception:
        return None


def test_an_agent_takes_renews_and_gives_back_its_own_slot(control_plane, two_nodes):
    """Create, renew (patch), list and delete of its own node's slot are all allowed with its own token."""
    a, _ = two_nodes
    gate = agent_budget(control_plane, a)
    control_plane.forget("coordination.k8s.io", "leases", "gpu-health", slot_name(a))
    assert gate.acquire().held
    assert gate.acquire().held  # the renewal
    assert gate.read().held
    gate.release()
    assert lease(control_plane, slot_name(a)) is None


@pytest.mark.parametrize("direction", ["a against b", "b against a"])
def test_an_agent_may_not_touch_another_nodes_slot_or_create_the_pause(control_plane, two_nodes, direction):
    """With its own token, neither agent may renew, take over or delete the other's live slot, create a slot
    for another node or a ghost, or create the pause Lease: the real API server refuses every request."""
    a, b = two_nodes
    own, other = (a, b) if direction == "a against b" else (b, a)
    control_plane.forget("coordination.k8s.io", "leases", "gpu-health", slot_name(other))
    assert agent_budget(control_plane, other).acquire().held
    before = lease(control_plane, slot_name(other))
    assert accepted(attempts(agent_raw(control_plane, own), own, other)) == []
    assert lease(control_plane, slot_name(other)) == before
    assert lease(control_plane, PAUSE_LEASE) is None


def test_no_agent_may_hide_its_slot_from_the_others_count(control_plane, two_nodes):
    """Every budget read lists the Leases but the brake's claims: an agent may neither create its slot
    labelled as a claim nor label its live slot so, and the other node still counts the slot."""
    a, b = two_nodes
    control_plane.forget("coordination.k8s.io", "leases", "gpu-health", slot_name(a))
    tries = hiding_slot_attempts(agent_raw(control_plane, a), a)
    create, label = list(tries)
    assert accepted({create: tries[create]}) == []
    assert agent_budget(control_plane, a).acquire().held
    assert accepted({label: tries[label]}) == []
    assert a in agent_budget(control_plane, b).holders()


def test_no_agent_may_lift_or_change_an_operators_pause(control_plane, two_nodes):
    """The operator's pause Lease stays whatever an agent's token tries; the agent still reads it."""
    a, _ = two_nodes
    pause(control_plane)
    raw = agent_raw(control_plane, a)
    assert accepted(operator_pause_attempts(raw)) == []
    assert agent_budget(control_plane, a, raw=raw).read().paused


def test_the_slot_policy_names_the_node_the_token_is_bound_to(control_plane, two_nodes):
    """The refusal says whose slot the token may write."""
    a, b = two_nodes
    control_plane.forget("coordination.k8s.io", "leases", "gpu-health", slot_name(b))
    assert agent_budget(control_plane, b).acquire().held
    refusal = f"only its own node's budget slot and brake claim \\(Leases gpu-health-slot-{a} "
    with pytest.raises(Forbidden, match=refusal):
        agent_raw(control_plane, a).delete(f"{LEASES}/{slot_name(b)}")


def claims_of(plane: ControlPlane, node: str) -> BrakeClaims:
    return BrakeClaims(agent_raw(plane, node), node_name=node, namespace="gpu-health", window_seconds=600.0)


def test_an_agent_makes_ranks_and_deletes_its_own_brake_claim(control_plane, two_nodes):
    """Create, list and delete of its own node's claim are allowed with its own token; the real server's
    versions rank the second node's claim behind the first's."""
    a, b = two_nodes
    for node in (a, b):
        control_plane.forget("coordination.k8s.io", "leases", "gpu-health", claim_name(node))
    first, second = claims_of(control_plane, a), claims_of(control_plane, b)
    assert first.rank(bound=200, units={}) == (True, 0)
    admitted, ahead = second.rank(bound=200, units={})
    assert admitted and ahead >= 1
    first.withdraw()
    second.withdraw()
    assert lease(control_plane, claim_name(a)) is None and lease(control_plane, claim_name(b)) is None


@pytest.mark.parametrize("direction", ["a against b", "b against a"])
def test_an_agent_may_not_touch_another_nodes_brake_claim_or_change_its_own(control_plane, two_nodes, direction):
    """With its own token, no agent may delete or change another node's claim, change its own (its place is
    the version its create got), make a claim named for another node or a ghost, or make its own held by
    another node or unlabelled: the real API server refuses every request."""
    a, b = two_nodes
    own, other = (a, b) if direction == "a against b" else (b, a)
    for node in (own, other):
        control_plane.forget("coordination.k8s.io", "leases", "gpu-health", claim_name(node))
    raw = agent_raw(control_plane, own)
    assert accepted(own_claim_attempts(raw, own, other)) == []
    claims_of(control_plane, own).rank(bound=200, units={})
    claims_of(control_plane, other).rank(bound=200, units={})
    before = lease(control_plane, claim_name(other)), lease(control_plane, claim_name(own))
    assert accepted(claim_attempts(raw, own, other)) == []
    assert (lease(control_plane, claim_name(other)), lease(control_plane, claim_name(own))) == before

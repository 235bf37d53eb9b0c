"""One agent's own bound token turned on the shared budget objects: another node's slot, the pause Lease.

Each attempt is one request a misbehaving (or compromised) agent could make; the real API server must refuse
every one (RBAC and the admission policy gpu-health-agent-own-slot-only). Used by the tests and by
scripts/fault_injection.py's token row.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.fleetapi.brake_claims import CLAIM_LABEL, claim_name
from agent.fleetapi.budget import PAUSE_LEASE, LeaseBudget
from agent.fleetapi.budget_slots import SLOT_LABEL, slot_name
from agent.k8s.errors import Forbidden
from agent.k8s.raw import JsonDocument, RawApi, api_path
from tests.realcluster.backend import RealServer
from tests.realcluster.controlplane import ControlPlane

LEASES = api_path("coordination.k8s.io", "v1", "leases", namespace="gpu-health")


def agent_raw(plane: ControlPlane, node: str) -> RawApi:
    return RawApi(RealServer(plane).agent_client(node))


def agent_budget(plane: ControlPlane, node: str, *, raw: RawApi | None = None) -> LeaseBudget:
    return LeaseBudget(raw or agent_raw(plane, node), node_name=node, namespace="gpu-health", max_nodes=5,
                       max_percent=0)


def slot_body(name: str, holder: str) -> JsonDocument:
    return {"metadata": {"name": name, "namespace": "gpu-health", "labels": {SLOT_LABEL: "true"}},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 7200}}


def pause(plane: ControlPlane) -> None:
    """An operator pauses the fleet (admin credentials)."""
    try:
        plane.rest("POST", LEASES, {"metadata": {"name": PAUSE_LEASE}, "spec": {}})
    except Exception as exc:
        if "AlreadyExists" not in str(exc) and "409" not in str(exc):
            raise
    plane.forget("coordination.k8s.io", "leases", "gpu-health", PAUSE_LEASE)


def attempts(raw: RawApi, own: str, other: str) -> dict[str, Callable[[], object]]:
    """What the agent of `own` must not be able to do to `other`'s live slot and to the pause Lease."""
    theirs = f"{LEASES}/{slot_name(other)}"
    ghost = "2057-01-01T00:00:00.000000Z"
    return {
        "renew another node's slot": lambda: raw.merge_patch(theirs, {"spec": {"renewTime": ghost}}),
        "take over another node's slot": lambda: raw.merge_patch(theirs, {"spec": {"holderIdentity": own}}),
        "delete another node's slot": lambda: raw.delete(theirs),
        "create a slot named for another node": lambda: raw.create(LEASES, slot_body(slot_name(f"{other}-x"), own)),
        "create its own slot held by another node": lambda: raw.create(LEASES, slot_body(slot_name(own), other)),
        "create a ghost slot": lambda: raw.create(LEASES, slot_body("gpu-health-slot-ghost", "ghost")),
        "create the pause Lease": lambda: raw.create(LEASES, {"metadata": {"name": PAUSE_LEASE}, "spec": {}}),
    }


def hiding_slot_attempts(raw: RawApi, own: str) -> dict[str, Callable[[], object]]:
    """Its own slot labelled as a brake claim too, which every other agent's budget list leaves out: created
    so (none there yet), or so labelled once it is there."""
    hidden = slot_body(slot_name(own), own)
    hidden["metadata"]["labels"][CLAIM_LABEL] = "true"
    return {
        "create its own slot labelled as a brake claim": lambda: raw.create(LEASES, hidden),
        "label its own slot as a brake claim": lambda: raw.merge_patch(
            f"{LEASES}/{slot_name(own)}", {"metadata": {"labels": {CLAIM_LABEL: "true"}}}),
    }


def claim_body(name: str, holder: str, *, labelled: bool = True) -> JsonDocument:
    return {"metadata": {"name": name, "namespace": "gpu-health", "labels": {CLAIM_LABEL: "true"} if labelled else {}},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 600}}


def claim_attempts(raw: RawApi, own: str, other: str) -> dict[str, Callable[[], object]]:
    """What the agent of `own` must not be able to do to the quarantine brake's claims: `other`'s (there) and
    its own (there: a claim is never changed, its place is the version its create got)."""
    mine, theirs = f"{LEASES}/{claim_name(own)}", f"{LEASES}/{claim_name(other)}"
    return {
        "delete another node's claim": lambda: raw.delete(theirs),
        "change another node's claim": lambda: raw.merge_patch(theirs, {"spec": {"holderIdentity": own}}),
        "change its own claim": lambda: raw.merge_patch(mine, {"metadata": {"labels": {"moved": "up"}}}),
        "create a claim named for another node":
            lambda: raw.create(LEASES, claim_body(claim_name(f"{other}-x"), own)),
        "create a ghost claim": lambda: raw.create(LEASES, claim_body("gpu-health-brake-ghost", "ghost")),
    }


def own_claim_attempts(raw: RawApi, own: str, other: str) -> dict[str, Callable[[], object]]:
    """Its own claim made wrongly (none there yet): held by another node, or without the claim label."""
    return {
        "create its own claim held by another node": lambda: raw.create(LEASES, claim_body(claim_name(own), other)),
        "create its own claim unlabelled":
            lambda: raw.create(LEASES, claim_body(claim_name(own), own, labelled=False)),
    }


def operator_pause_attempts(raw: RawApi) -> dict[str, Callable[[], object]]:
    """What no agent may do to the operator's pause Lease once it exists."""
    paused = f"{LEASES}/{PAUSE_LEASE}"
    return {
        "change the pause Lease": lambda: raw.merge_patch(paused, {"spec": {"holderIdentity": "agent"}}),
        "delete the pause Lease": lambda: raw.delete(paused),
    }


def accepted(tries: dict[str, Callable[[], object]]) -> list[str]:
    """The attempts the server did not refuse with 403 (carried out, or failed some other way)."""
    done = []
    for what, attempt in tries.items():
        try:
            attempt()
        except Forbidden:
            continue
        except Exception as exc:
            done.append(f"{what}: {type(exc).__name__}: {exc}")
            continue
        done.append(what)
    return done

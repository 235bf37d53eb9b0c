"""Evictions as a real API server and a kubelet (kwok) answer them, through the agent's Evictor and token."""

from __future__ import annotations

import pytest

from agent.k8s.errors import K8sError
from agent.k8s.evictions import EvictionOutcome, Evictor
from agent.k8s.raw import RawApi, api_path
from tests.realcluster.backend import RealServer
from tests.realcluster.controlplane import ControlPlane, wait_until

pytestmark = pytest.mark.usefixtures("no_retry_sleep")


def trainers(plane: ControlPlane, count: int, *, grace_seconds: int = 1) -> tuple[str, str, list[str]]:
    """A GPU node with `count` pods labelled app=<app>, Running; (node, app, pod names)."""
    node, app = plane.unique("node"), plane.unique("trainer")
    plane.add_gpu_node(node)
    names = [f"{app}-{i}" for i in range(count)]
    for name in names:
        plane.add_pod("ml", name, node, labels={"app": app}, grace_seconds=grace_seconds)
    return node, app, names


def evictor(plane: ControlPlane, node: str, **options: float) -> Evictor:
    return Evictor(RawApi(RealServer(plane).agent_client(node)), **options)


def test_an_eviction_a_pdb_forbids_is_refused_with_429_and_waits(control_plane):
    """minAvailable 2 of 2 Ready pods: the disruption controller allows none, the server answers 429."""
    node, app, names = trainers(control_plane, 2)
    control_plane.add_pdb("ml", app, {"app": app}, min_available=2)
    result = evictor(control_plane, node).evict("ml", names[0])
    assert result.outcome is EvictionOutcome.WAITING
    assert "disruption budget" in result.message
    assert not control_plane.core.read_namespaced_pod(names[0], "ml").metadata.deletion_timestamp


def test_an_eviction_a_pdb_allows_is_accepted(control_plane):
    """minAvailable 1 of 2: one eviction goes through, and the second is then refused."""
    node, app, names = trainers(control_plane, 2)
    control_plane.add_pdb("ml", app, {"app": app}, min_available=1)
    agent = evictor(control_plane, node)
    assert agent.evict("ml", names[0]).outcome is EvictionOutcome.EVICTED
    assert agent.evict("ml", names[1]).outcome is EvictionOutcome.WAITING


def test_a_pod_under_two_pdbs_gets_500_from_the_eviction_api(control_plane):
    """The eviction subresource does not support a pod covered by more than one PDB: HTTP 500, every time.
    (The agent must report such an eviction stuck instead of retrying it as transient: issue 16.)"""
    node, app, names = trainers(control_plane, 2)
    control_plane.add_pdb("ml", f"{app}-a", {"app": app}, min_available=0)
    control_plane.add_pdb("ml", f"{app}-b", {"app": app}, min_available=0)
    raw = RawApi(RealServer(control_plane).agent_client(node))
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": names[0], "namespace": "ml"}}
    with pytest.raises(K8sError) as refused:
        raw.create(api_path("", "v1", "pods", namespace="ml", name=names[0], subresource="eviction"), body)
    assert refused.value.status == 500
    assert "more than one PodDisruptionBudget" in str(refused.value)


def test_an_accepted_eviction_leaves_the_pod_terminating_until_its_grace_period_ends(control_plane):
    """The pod is still there (Terminating) after the eviction is accepted, and gone once kwok, as its
    kubelet, finished the graceful deletion."""
    node, _, names = trainers(control_plane, 1, grace_seconds=3)
    assert evictor(control_plane, node).evict("ml", names[0]).outcome is EvictionOutcome.EVICTED
    pod = control_plane.core.read_namespaced_pod(names[0], "ml")
    assert pod.metadata.deletion_timestamp is not None
    assert pod.metadata.deletion_grace_period_seconds == 3

    def gone() -> bool:
        return not control_plane.core.list_namespaced_pod("ml", field_selector=f"metadata.name={names[0]}").items

    assert wait_until(gone, "kwok to finish the graceful deletion", timeout=30)

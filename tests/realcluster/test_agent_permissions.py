"""The shipped RBAC and admission policy, enforced by a real kube-apiserver on the agent's own token."""

from __future__ import annotations

from typing import Any

import pytest

from agent.k8s.client import Apis
from agent.k8s.errors import Forbidden, api_call
from agent.k8s.node import AGENT_CONDITIONS, NodeWriter
from tests.k8s_helpers import TAINT
from tests.realcluster.backend import RealServer
from tests.realcluster.controlplane import ControlPlane


def agent_apis(plane: ControlPlane, node: str) -> Apis:
    """The agent of `node`, built as the agent builds its client, from a kubeconfig of its own token."""
    return Apis.of(RealServer(plane).agent_client(node))


@pytest.fixture
def two_nodes(control_plane: ControlPlane) -> tuple[str, str]:
    a, b = control_plane.unique("node-a"), control_plane.unique("node-b")
    control_plane.add_gpu_node(a)
    control_plane.add_gpu_node(b)
    return a, b


def node(plane: ControlPlane, name: str) -> Any:
    return plane.core.read_node(name)


def test_an_agent_may_taint_and_set_every_condition_of_its_own_node(control_plane, two_nodes):
    """Its quarantine taint and each of its conditions land on the node whose pod holds the token."""
    a, _ = two_nodes
    writer = NodeWriter(agent_apis(control_plane, a).core, a, taint_key=TAINT)
    assert writer.set_taint(True)
    for kind in AGENT_CONDITIONS:
        assert writer.set_condition(kind, status=True, reason=kind, message="test")
    stored = node(control_plane, a)
    assert [t.key for t in stored.spec.taints] == [TAINT]
    assert {c.type for c in stored.status.conditions} >= set(AGENT_CONDITIONS)


def test_an_agent_may_not_taint_another_node(control_plane, two_nodes):
    """The admission policy denies a patch of node B by the agent of node A."""
    a, b = two_nodes
    writer = NodeWriter(agent_apis(control_plane, a).core, b, taint_key=TAINT)
    with pytest.raises(Forbidden, match=f"may only modify the node it runs on, not {b}"):
        writer.set_taint(True)
    assert not node(control_plane, b).spec.taints


def test_an_agent_may_not_set_conditions_on_another_node(control_plane, two_nodes):
    """nodes/status is pinned to the agent's node as well."""
    a, b = two_nodes
    writer = NodeWriter(agent_apis(control_plane, a).core, b, taint_key=TAINT)
    with pytest.raises(Forbidden, match="may only modify the node it runs on"):
        writer.set_condition("GpuFatalFault", status=True, reason="GpuFatalFault", message="test")


def test_the_node_name_claim_of_the_token_is_what_the_policy_checks(control_plane, two_nodes):
    """The same ServiceAccount with a token bound to the pod on B may patch B and may not patch A."""
    a, b = two_nodes
    as_b = agent_apis(control_plane, b).core
    assert NodeWriter(as_b, b, taint_key=TAINT).set_taint(True)
    with pytest.raises(Forbidden, match=f"not {a}"):
        NodeWriter(as_b, a, taint_key=TAINT).set_taint(True)


def test_an_agent_may_not_touch_taints_it_did_not_set(control_plane, two_nodes):
    """Removing someone else's taint from its own node is denied."""
    a, _ = two_nodes
    control_plane.core.patch_node(a, {"spec": {"taints": [{"key": "someone/else", "effect": "NoSchedule"}]}})
    core = agent_apis(control_plane, a).core
    with pytest.raises(Forbidden, match=r"only its own gpu-health-agent\.io/ taints"):
        api_call(core.patch_node, a, {"spec": {"taints": []}})
    assert [t.key for t in node(control_plane, a).spec.taints] == ["someone/else"]


@pytest.mark.parametrize("field", ["labels", "annotations"])
def test_an_agent_may_change_only_its_own_labels_and_annotations(control_plane, two_nodes, field):
    """gpu-health-agent.io/ keys are its own; any other key on its node is not."""
    a, _ = two_nodes
    writer = NodeWriter(agent_apis(control_plane, a).core, a, taint_key=TAINT)
    assert writer.set_metadata(**{field: {"gpu-health-agent.io/needs-replacement": "true"}})
    with pytest.raises(Forbidden, match=rf"only {field} under gpu-health-agent\.io/"):
        writer.set_metadata(**{field: {"nvidia.com/gpu.present": "false"}})


def test_an_agent_may_not_change_conditions_it_does_not_own(control_plane, two_nodes):
    """Ready is the kubelet's: the agent may not write it."""
    a, _ = two_nodes
    writer = NodeWriter(agent_apis(control_plane, a).core, a, taint_key=TAINT)
    with pytest.raises(Forbidden, match="only its own Gpu"):
        writer.set_condition("Ready", status=False, reason="Broken", message="test")


def test_an_agent_may_not_change_the_gpus_its_node_advertises(control_plane, two_nodes):
    """Capacity and allocatable are the device plugin's."""
    a, _ = two_nodes
    core = agent_apis(control_plane, a).core
    with pytest.raises(Forbidden, match="capacity or allocatable"):
        api_call(core.patch_node_status, a, {"status": {"allocatable": {"nvidia.com/gpu": "0"}}})


def test_an_agent_may_not_read_secrets(control_plane, two_nodes):
    """RBAC grants nothing on secrets."""
    a, _ = two_nodes
    core = agent_apis(control_plane, a).core
    with pytest.raises(Forbidden):
        api_call(core.list_namespaced_secret, "gpu-health")
    with pytest.raises(Forbidden):
        api_call(core.list_secret_for_all_namespaces)


def test_an_agent_may_not_delete_pods(control_plane, two_nodes):
    """It evicts through the Eviction API; delete (which ignores PodDisruptionBudgets) is denied."""
    a, _ = two_nodes
    control_plane.add_pod("ml", control_plane.unique("trainer"), a)
    victim = control_plane.core.list_namespaced_pod("ml", field_selector=f"spec.nodeName={a}").items[0]
    core = agent_apis(control_plane, a).core
    with pytest.raises(Forbidden):
        api_call(core.delete_namespaced_pod, victim.metadata.name, "ml")
    assert not control_plane.core.read_namespaced_pod(victim.metadata.name, "ml").metadata.deletion_timestamp


def test_an_agent_may_not_create_pods_or_delete_nodes(control_plane, two_nodes):
    """Nothing to run workloads with, nothing to remove a node with."""
    a, _ = two_nodes
    core = agent_apis(control_plane, a).core
    with pytest.raises(Forbidden):
        api_call(core.create_namespaced_pod, "ml", {"metadata": {"name": "x"},
                                                    "spec": {"containers": [{"name": "x", "image": "x"}]}})
    with pytest.raises(Forbidden):
        api_call(core.delete_node, a)

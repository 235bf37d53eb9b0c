"""The shipped RBAC and admission policy, enforced by a real kube-apiserver on the agent's own token."""

from __future__ import annotations

import ssl
from typing import Any

import pytest
from click.testing import CliRunner
from kubernetes import client

from agent.cli import main
from agent.config import RemediationConfig
from agent.k8s.client import ApiClient, Credentials
from agent.k8s.errors import Forbidden
from agent.k8s.node import AGENT_CONDITIONS, CONFIRM_ANNOTATION, NodeWriter
from agent.k8s.raw import RawApi, api_path
from agent.remediation.guard import BRAKED
from tests.k8s_helpers import TAINT
from tests.realcluster.backend import RealServer
from tests.realcluster.controlplane import ControlPlane, wait_until


def agent_apis(plane: ControlPlane, node: str) -> RawApi:
    """The agent of `node`, built as the agent builds its client, from a kubeconfig of its own token."""
    return RawApi(RealServer(plane).agent_client(node))


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
    writer = NodeWriter(agent_apis(control_plane, a), a, taint_key=TAINT)
    assert writer.set_taint(True)
    for kind in AGENT_CONDITIONS:
        assert writer.set_condition(kind, status=True, reason=kind, message="test")
    stored = node(control_plane, a)
    assert [t.key for t in stored.spec.taints] == [TAINT]
    assert {c.type for c in stored.status.conditions} >= set(AGENT_CONDITIONS)


def test_an_agent_may_not_taint_another_node(control_plane, two_nodes):
    """The admission policy denies a patch of node B by the agent of node A."""
    a, b = two_nodes
    writer = NodeWriter(agent_apis(control_plane, a), b, taint_key=TAINT)
    with pytest.raises(Forbidden, match=f"may only modify the node it runs on, not {b}"):
        writer.set_taint(True)
    assert not node(control_plane, b).spec.taints


def test_an_agent_may_not_set_conditions_on_another_node(control_plane, two_nodes):
    """nodes/status is pinned to the agent's node as well."""
    a, b = two_nodes
    writer = NodeWriter(agent_apis(control_plane, a), b, taint_key=TAINT)
    with pytest.raises(Forbidden, match="may only modify the node it runs on"):
        writer.set_condition("GpuFatalFault", status=True, reason="GpuFatalFault", message="test")


def test_the_node_name_claim_of_the_token_is_what_the_policy_checks(control_plane, two_nodes):
    """The same ServiceAccount with a token bound to the pod on B may patch B and may not patch A."""
    a, b = two_nodes
    as_b = agent_apis(control_plane, b)
    assert NodeWriter(as_b, b, taint_key=TAINT).set_taint(True)
    with pytest.raises(Forbidden, match=f"not {a}"):
        NodeWriter(as_b, a, taint_key=TAINT).set_taint(True)


def test_an_agent_may_not_touch_taints_it_did_not_set(control_plane, two_nodes):
    """Removing someone else's taint from its own node is denied."""
    a, _ = two_nodes
    control_plane.core.patch_node(a, {"spec": {"taints": [{"key": "someone/else", "effect": "NoSchedule"}]}})
    core = agent_apis(control_plane, a)
    with pytest.raises(Forbidden, match=r"only its own gpu-health-agent\.io/ taints"):
        core.strategic_patch(api_path("", "v1", "nodes", name=a), {"spec": {"taints": []}})
    assert [t.key for t in node(control_plane, a).spec.taints] == ["someone/else"]


@pytest.mark.parametrize("field", ["labels", "annotations"])
def test_an_agent_may_change_only_its_own_labels_and_annotations(control_plane, two_nodes, field):
    """gpu-health-agent.io/ keys are its own; any other key on its node is not."""
    a, _ = two_nodes
    writer = NodeWriter(agent_apis(control_plane, a), a, taint_key=TAINT)
    assert writer.set_metadata(**{field: {"gpu-health-agent.io/needs-replacement": "true"}})
    with pytest.raises(Forbidden, match=rf"only {field} under gpu-health-agent\.io/"):
        writer.set_metadata(**{field: {"nvidia.com/gpu.present": "false"}})


def test_an_agents_own_token_cannot_confirm_its_braked_taint(control_plane, two_nodes):
    """gpu-health-agent.io/brake-confirm is the operator's: the agent may neither add nor change it."""
    a, _ = two_nodes
    writer = NodeWriter(agent_apis(control_plane, a), a, taint_key=TAINT)
    with pytest.raises(Forbidden, match="never write one"):
        writer.set_metadata(annotations={CONFIRM_ANNOTATION: "2026-12-02T10:00:00Z"})
    control_plane.core.patch_node(a, {"metadata": {"annotations": {CONFIRM_ANNOTATION: "2026-12-02T10:00:00Z"}}})
    with pytest.raises(Forbidden, match="never write one"):
        writer.set_metadata(annotations={CONFIRM_ANNOTATION: "2026-12-02T11:00:00Z"})


def test_fleet_confirm_run_with_the_agents_own_token_is_refused_in_one_line(control_plane, two_nodes):
    """`gpu-health-agent fleet confirm` inside the agent's pod (its token) is denied: one line, exit 1."""
    a, _ = two_nodes
    control_plane.core.patch_node_status(a, {"status": {"conditions": [
        {"type": "GpuFatalFault", "status": "True", "reason": "GpuFatalFault", "message": f"xid-79 ({BRAKED})"}]}})
    result = CliRunner().invoke(main, ["fleet", "confirm", a, "--kubeconfig",
                                       str(control_plane.agent_kubeconfig(a))])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "never write one" in result.output and len(result.output.strip().splitlines()) == 1
    assert CONFIRM_ANNOTATION not in (node(control_plane, a).metadata.annotations or {})


def test_an_agent_may_remove_the_confirm_an_operator_wrote(control_plane, two_nodes):
    """The agent consumes the operator's confirm: removing it from its own node is allowed."""
    a, _ = two_nodes
    control_plane.core.patch_node(a, {"metadata": {"annotations": {CONFIRM_ANNOTATION: "2026-12-02T10:00:00Z"}}})
    assert NodeWriter(agent_apis(control_plane, a), a, taint_key=TAINT).set_metadata(
        annotations={CONFIRM_ANNOTATION: None})
    assert CONFIRM_ANNOTATION not in (node(control_plane, a).metadata.annotations or {})


def test_an_agent_may_not_change_conditions_it_does_not_own(control_plane, two_nodes):
    """Ready is the kubelet's: the agent may not write it."""
    a, _ = two_nodes
    writer = NodeWriter(agent_apis(control_plane, a), a, taint_key=TAINT)
    with pytest.raises(Forbidden, match="only its own Gpu"):
        writer.set_condition("Ready", status=False, reason="Broken", message="test")


def test_an_agent_may_not_read_secrets(control_plane, two_nodes):
    """RBAC grants nothing on secrets."""
    a, _ = two_nodes
    core = agent_apis(control_plane, a)
    with pytest.raises(Forbidden):
        core.get(api_path("", "v1", "secrets", namespace="gpu-health"))
    with pytest.raises(Forbidden):
        core.get(api_path("", "v1", "secrets"))


def test_an_agent_may_not_delete_pods(control_plane, two_nodes):
    """It evicts through the Eviction API; delete (which ignores PodDisruptionBudgets) is denied."""
    a, _ = two_nodes
    control_plane.add_pod("ml", control_plane.unique("trainer"), a)
    victim = control_plane.core.list_namespaced_pod("ml", field_selector=f"spec.nodeName={a}").items[0]
    core = agent_apis(control_plane, a)
    with pytest.raises(Forbidden):
        core.delete(api_path("", "v1", "pods", namespace="ml", name=victim.metadata.name))
    assert not control_plane.core.read_namespaced_pod(victim.metadata.name, "ml").metadata.deletion_timestamp


def test_an_agent_may_not_create_pods_or_delete_nodes(control_plane, two_nodes):
    """Nothing to run workloads with, nothing to remove a node with."""
    a, _ = two_nodes
    core = agent_apis(control_plane, a)
    with pytest.raises(Forbidden):
        core.create(api_path("", "v1", "pods", namespace="ml"), {"metadata": {"name": "x"},
                    "spec": {"containers": [{"name": "x", "image": "x"}]}})
    with pytest.raises(Forbidden):
        core.delete(api_path("", "v1", "nodes", name=a))


def test_a_token_bound_to_no_pod_may_change_no_node(control_plane, two_nodes):
    """A ServiceAccount token bound to no pod carries no node-name claim: every Node change is denied."""
    a, _ = two_nodes
    control_plane.apply_shipped_manifests()
    token = control_plane.core.create_namespaced_service_account_token(
        "gpu-health-agent", "gpu-health", {"spec": {"expirationSeconds": 600}}).status.token
    admin = control_plane.admin.configuration
    context = ssl.create_default_context(cafile=admin.ssl_ca_cert)
    with ApiClient(admin.host, ssl_context=context, credentials=Credentials(token=token)) as api_client:
        writer = NodeWriter(RawApi(api_client), a, taint_key=TAINT)
        with pytest.raises(Forbidden, match="may only modify the node it runs on") as denied:
            writer.set_taint(True)
    assert denied.value.status == 403


def test_the_shipped_policy_type_checks_against_the_real_node_schema(control_plane):
    """Every expression compiles against the server's Node type (a field CEL cannot see is a silent hole)."""
    control_plane.apply_shipped_manifests()
    api = client.AdmissionregistrationV1Api(control_plane.admin)

    def checked() -> Any:
        policy = api.read_validating_admission_policy("gpu-health-agent-own-node-only")
        return policy.status if policy.status and policy.status.type_checking else None

    status = wait_until(checked, "the type check of the admission policy")
    assert status.type_checking.expression_warnings in (None, [])


def test_a_kubeconfig_with_an_exec_plugin_reaches_the_real_server(control_plane, two_nodes, tmp_path):
    """An operator's kubeconfig for a managed cluster (exec plugin, as EKS/GKE/AKS write) authenticates: the
    plugin's token is what the real API server sees, and the node is read with it."""
    import json
    import sys

    import yaml

    from agent.k8s.client import load_api_client

    a, _ = two_nodes
    credential = {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": {"token": control_plane.agent_token(a)}}
    plugin = tmp_path / "plugin.py"
    plugin.write_text(f"print({json.dumps(json.dumps(credential))})\n")
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": control_plane.url,
                                               "certificate-authority": str(control_plane.ca_file)}}],
        "users": [{"name": "u", "user": {"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                                                  "command": sys.executable, "args": [str(plugin)]}}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    api_client, _ = load_api_client(kubeconfig=str(kubeconfig))
    with api_client:
        assert RawApi(api_client).get(api_path("", "v1", "nodes", name=a))["metadata"]["name"] == a


#: The labels a reset pauses by default (mig-manager's included: back, it re-creates the MIG instances).
OPERANDS = tuple(RemediationConfig().reset_operand_labels)


def test_an_agent_may_pause_and_restore_the_gpu_operator_operands_of_its_own_node(control_plane, two_nodes):
    """A reset's operand pause passes RBAC and admission: true -> paused-for-gpu-reset -> true, with its record,
    and the pause's own NoSchedule taint on while the device plugin is paused, off after."""
    from agent.k8s.node_marks import RESET_PAUSE_TAINT
    from agent.k8s.operands import PAUSED_VALUE, OperandPauser

    a, _ = two_nodes
    control_plane.apply_shipped_manifests()
    control_plane.core.patch_node(a, {"metadata": {"labels": dict.fromkeys(OPERANDS, "true")}})
    apis = agent_apis(control_plane, a)
    operands = OperandPauser(NodeWriter(apis, a, taint_key=TAINT), apis, labels=OPERANDS, wait_seconds=0)
    operands.pause()
    assert {k: node(control_plane, a).metadata.labels[k] for k in OPERANDS} == dict.fromkeys(OPERANDS, PAUSED_VALUE)
    assert [(t.key, t.effect) for t in node(control_plane, a).spec.taints] == [(RESET_PAUSE_TAINT, "NoSchedule")]
    operands.restore()
    assert {k: node(control_plane, a).metadata.labels[k] for k in OPERANDS} == dict.fromkeys(OPERANDS, "true")
    assert not node(control_plane, a).spec.taints


@pytest.mark.parametrize("change", [{"nvidia.com/gpu.deploy.device-plugin": "false"},
                                    {"nvidia.com/gpu.deploy.device-plugin": None},
                                    {"nvidia.com/gpu.deploy.dcgm": "paused-for-gpu-reset"},
                                    {"nvidia.com/gpu.deploy.driver": "paused-for-gpu-reset"}])
def test_an_agent_may_move_an_operand_label_only_between_true_and_its_pause(control_plane, two_nodes, change):
    """Disabling, removing or adding an operand label, or touching another GPU Operator label, is denied."""
    a, _ = two_nodes
    control_plane.apply_shipped_manifests()
    control_plane.core.patch_node(a, {"metadata": {"labels": {"nvidia.com/gpu.deploy.device-plugin": "true",
                                                              "nvidia.com/gpu.deploy.driver": "true"}}})
    writer = NodeWriter(agent_apis(control_plane, a), a, taint_key=TAINT)
    with pytest.raises(Forbidden):
        writer.set_metadata(labels=change)
    assert node(control_plane, a).metadata.labels["nvidia.com/gpu.deploy.device-plugin"] == "true"


def test_the_agents_pod_with_its_reset_container_passes_admission(control_plane, two_nodes):
    """The shipped DaemonSet's pod (agent and gpu-reset containers) is admitted in the agent's namespace:
    validation and Pod Security as the namespace enforces it, server-side (dry run)."""
    import subprocess

    import yaml

    from tests.conftest import REPO

    a, _ = two_nodes
    control_plane.apply_shipped_manifests()
    rendered = subprocess.run(["kubectl", "kustomize", str(REPO / "daemonset")], check=True, capture_output=True,
                              text=True).stdout
    [ds] = [d for d in yaml.safe_load_all(rendered)
            if d and d.get("kind") == "DaemonSet" and d["metadata"]["name"] == "gpu-health-agent"]
    template = ds["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": control_plane.unique("agent"), "labels": template["metadata"]["labels"]},
           "spec": {**template["spec"], "nodeName": a}}
    created = control_plane.core.create_namespaced_pod("gpu-health", pod, dry_run="All")
    assert {c.name for c in created.spec.containers} == {"agent", "gpu-reset"}
    reset = next(c for c in created.spec.containers if c.name == "gpu-reset")
    assert reset.security_context.capabilities.add == ["SYS_ADMIN"]
    assert "host-proc" not in {m.name for m in reset.volume_mounts}

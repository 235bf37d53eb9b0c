"""The Helm chart on a real kube-apiserver: install, upgrade and uninstall leave what they say."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.conftest import REPO

CHART = REPO / "daemonset" / "helm" / "gpu-health-agent"
# Its own name and namespace, so the test never meets objects the kustomize base put there.
NAME, NAMESPACE = "gha-helm-test", "gha-helm-test"


@pytest.fixture
def helm(control_plane):
    binary = subprocess.run([str(REPO / "scripts" / "build-helm")], capture_output=True, text=True, check=True,
                            timeout=1200).stdout.strip().splitlines()[-1]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([binary, "--kubeconfig", str(control_plane.admin_kubeconfig), "--namespace", NAMESPACE,
                               *args], capture_output=True, text=True, timeout=300, check=True)

    yield run
    subprocess.run([binary, "--kubeconfig", str(control_plane.admin_kubeconfig), "--namespace", NAMESPACE,
                    "uninstall", "gha", "--ignore-not-found"], capture_output=True, timeout=300, check=False)


def apis(control_plane):
    api = control_plane.admin
    return client.AppsV1Api(api), client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)


def test_install_upgrade_and_uninstall(helm, control_plane):
    """install creates the DaemonSet and its RBAC; upgrade changes the config; uninstall removes both."""
    apps, core, rbac = apis(control_plane)
    helm("install", "gha", str(CHART), "--create-namespace", "--set", f"nameOverride={NAME}")
    assert apps.read_namespaced_daemon_set(NAME, NAMESPACE).spec.template.spec.service_account_name == NAME
    assert rbac.read_cluster_role(NAME).rules

    helm("upgrade", "gha", str(CHART), "--reuse-values", "--set", "mode=observe")
    config_map = core.read_namespaced_config_map(f"{NAME}-config", NAMESPACE)
    assert yaml.safe_load(config_map.data["config.yaml"])["mode"] == "observe"

    helm("uninstall", "gha", "--wait")
    for read in (lambda: apps.read_namespaced_daemon_set(NAME, NAMESPACE), lambda: rbac.read_cluster_role(NAME)):
        with pytest.raises(ApiException) as gone:
            read()
        assert gone.value.status == 404


def test_the_dra_switch_installs_and_removes_the_dra_grants_and_policy(helm, control_plane):
    """dra.enabled installs daemonset/dra's ClusterRole, binding (to the release's account) and admission policy;
    turning it off in an upgrade removes them."""
    _, _, rbac = apis(control_plane)
    admission = client.AdmissionregistrationV1Api(control_plane.admin)
    helm("install", "gha", str(CHART), "--create-namespace", "--set", f"nameOverride={NAME}",
         "--set", "dra.enabled=true")
    role = rbac.read_cluster_role(f"{NAME}-dra")
    assert {g for rule in role.rules for g in rule.api_groups} == {"resource.k8s.io"}
    subject = rbac.read_cluster_role_binding(f"{NAME}-dra").subjects[0]
    assert (subject.name, subject.namespace) == (NAME, NAMESPACE)
    assert admission.read_validating_admission_policy(f"{NAME}-own-devices-only").spec.validations

    helm("upgrade", "gha", str(CHART), "--reuse-values", "--set", "dra.enabled=false")
    for read in (lambda: rbac.read_cluster_role(f"{NAME}-dra"),
                 lambda: admission.read_validating_admission_policy(f"{NAME}-own-devices-only")):
        with pytest.raises(ApiException) as gone:
            read()
        assert gone.value.status == 404

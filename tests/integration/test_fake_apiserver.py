"""The fake API server's fidelity, checked with kubectl as an independent client."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster, populate
from tests.k8s_helpers import gpu_node

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is installed by scripts/test")


@pytest.fixture
def kube(tmp_path: Path):
    cluster = FakeCluster()
    populate(cluster, gpu_node("n1"))
    server = FakeApiServer(cluster).start()
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump(server.kubeconfig()))

    def kubectl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["kubectl", "--kubeconfig", str(config), *args], capture_output=True, text=True,
                              timeout=60, check=check)

    yield cluster, kubectl
    server.stop()


def test_kubectl_gets_nodes_and_pods(kube):
    _, kubectl = kube
    nodes = json.loads(kubectl("get", "nodes", "-o", "json").stdout)
    assert [n["metadata"]["name"] for n in nodes["items"]] == ["n1"]
    pods = kubectl("get", "pods", "-A", "--field-selector", "spec.nodeName=n1", "-o", "name").stdout.split()
    assert len(pods) == 9
    assert kubectl("get", "nodes", "-l", "nvidia.com/gpu.present=true", "-o", "name").stdout.split() == ["node/n1"]
    assert kubectl("get", "nodes", "-l", "nvidia.com/gpu.present=false", "-o", "name").stdout.split() == []


def test_kubectl_taints_and_untaints(kube):
    cluster, kubectl = kube
    kubectl("taint", "nodes", "n1", "example.com/broken=yes:NoSchedule")
    assert cluster.node("n1")["spec"]["taints"] == [{"key": "example.com/broken", "value": "yes",
                                                     "effect": "NoSchedule"}]
    kubectl("taint", "nodes", "n1", "example.com/broken-")
    assert cluster.node("n1")["spec"].get("taints", []) == []


def test_kubectl_cordons_and_uncordons(kube):
    cluster, kubectl = kube
    kubectl("cordon", "n1")
    assert cluster.node("n1")["spec"]["unschedulable"] is True
    kubectl("uncordon", "n1")
    assert not cluster.node("n1")["spec"].get("unschedulable")


def test_kubectl_patches_with_each_patch_type(kube):
    cluster, kubectl = kube
    kubectl("patch", "node", "n1", "--type=merge", "-p", '{"metadata":{"labels":{"a":"1"}}}')
    kubectl("patch", "node", "n1", "--type=json", "-p", '[{"op":"add","path":"/metadata/labels/b","value":"2"}]')
    kubectl("patch", "node", "n1", "--type=strategic", "-p", '{"metadata":{"labels":{"a":null}}}')
    labels = cluster.node("n1")["metadata"]["labels"]
    assert (labels.get("a"), labels.get("b")) == (None, "2")


def test_a_stale_resource_version_is_a_conflict(kube):
    cluster, kubectl = kube
    stale = cluster.node("n1")["metadata"]["resourceVersion"]
    kubectl("label", "node", "n1", "fresh=yes")
    result = kubectl("patch", "node", "n1", "--type=merge", "-p",
                     json.dumps({"metadata": {"resourceVersion": stale, "labels": {"late": "yes"}}}), check=False)
    assert result.returncode != 0
    assert "the object has been modified" in result.stderr
    assert "late" not in cluster.node("n1")["metadata"]["labels"]


def test_kubectl_drain_honours_the_pod_disruption_budget(kube):
    cluster, kubectl = kube
    selector = {"matchLabels": {"app": "n1-trainer"}}
    cluster.add("poddisruptionbudgets", {"metadata": {"name": "trainers"},
                                         "spec": {"minAvailable": 7, "selector": selector}},
                group="policy", namespace="ml")
    result = kubectl("drain", "n1", "--ignore-daemonsets", "--timeout=6s", check=False)
    assert result.returncode != 0
    assert "disruption budget" in result.stderr or "global timeout" in result.stderr
    left = {p["metadata"]["name"] for p in cluster.pods_on("n1") if not p["metadata"].get("deletionTimestamp")}
    assert "gpu-health-agent-n1" in left  # DaemonSet pods stay
    assert len([p for p in left if p.startswith("n1-trainer")]) == 7  # the budget kept seven (one terminates)
    assert cluster.node("n1")["spec"]["unschedulable"] is True

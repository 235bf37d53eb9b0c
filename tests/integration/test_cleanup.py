"""`gpu-health-agent cleanup` against the fake API server: the agent's marks go, everyone else's stay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from agent.cli import main
from agent.k8s.client import client_for
from agent.k8s.raw import RawApi
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster, populate
from tests.k8s_helpers import gpu_node

TAINT = "gpu-health-agent.io/unhealthy"


@pytest.fixture
def cluster(tmp_path: Path):
    """Two GPU nodes marked the way a quarantining agent and an operator would mark them, through the API."""
    fake = FakeCluster()
    populate(fake, gpu_node("n1"))
    populate(fake, gpu_node("n2"))
    server = FakeApiServer(fake).start()
    api = client_for(server.url)
    raw = RawApi(api)
    raw.strategic_patch("/api/v1/nodes/n1", {
        "metadata": {"labels": {"gpu-health-agent.io/needs-replacement": "true", "gpu-health-agent.io/opt-out": "true",
                                "team": "ml"},
                     "annotations": {"gpu-health-agent.io/state": "{}", "gpu-health-agent.io/cordoned": "2026-01-01",
                                     "gpu-health-agent.io/reboot-requested": "x", "owner": "ops"}},
        "spec": {"unschedulable": True, "taints": [
            {"key": TAINT, "value": "gpu-fault", "effect": "NoSchedule"},
            {"key": "example.com/maintenance", "value": "yes", "effect": "NoSchedule"}]}})
    raw.strategic_patch("/api/v1/nodes/n1/status", {"status": {"conditions": [
        {"type": "GpuFatalFault", "status": "True", "reason": "Xid79", "message": "m"},
        {"type": "GpuDegraded", "status": "False", "reason": "Clear", "message": "m"}]}})
    # n2: cordoned by an operator (no agent annotation): the cordon is not the agent's.
    raw.strategic_patch("/api/v1/nodes/n2", {"spec": {"unschedulable": True}})
    for name in ("gpu-health-disruption-budget", "gpu-health-pause"):
        raw.create("/apis/coordination.k8s.io/v1/namespaces/gpu-health/leases",
                   {"metadata": {"name": name}, "spec": {}})
    raw.create("/apis/coordination.k8s.io/v1/namespaces/gpu-health/leases",  # n1's quarantine-brake claim
               {"metadata": {"name": "gpu-health-brake-n1", "labels": {"gpu-health-agent.io/brake-claim": "true"}},
                "spec": {"holderIdentity": "n1"}})
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(server.kubeconfig()))
    yield fake, str(kubeconfig)
    server.stop()


def cleanup(kubeconfig: str, *args: str):
    return CliRunner().invoke(main, ["cleanup", "--kubeconfig", kubeconfig, *args], env={"NODE_NAME": "operator"})


def node(fake: FakeCluster, name: str) -> dict[str, Any]:
    return fake.node(name)


def lease_names(fake: FakeCluster) -> set[str]:
    from agent.simulation.fake_apiserver.resources import RESOURCES

    leases = next(r for r in RESOURCES if r.plural == "leases")
    return {lease["metadata"]["name"] for lease in fake.list_objects(leases, "gpu-health")}


def test_dry_run_lists_every_mark_and_changes_nothing(cluster):
    """The list an operator reviews first: taint, cordon, conditions, labels, annotations, the brake's claim,
    the budget Lease."""
    fake, kubeconfig = cluster
    before = node(fake, "n1")["metadata"]["resourceVersion"]
    result = cleanup(kubeconfig, "--all-nodes", "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "would remove node/n1: taint gpu-health-agent.io/unhealthy (gpu-fault:NoSchedule)",
        "would remove node/n1: cordon unschedulable (cordoned by the agent at 2026-01-01)",
        "would remove node/n1: condition GpuFatalFault (status True)",
        "would remove node/n1: condition GpuDegraded (status False)",
        "would remove node/n1: label gpu-health-agent.io/needs-replacement (true)",
        "would remove node/n1: annotation gpu-health-agent.io/state",
        "would remove node/n1: annotation gpu-health-agent.io/reboot-requested",
        "would remove lease/gpu-health/gpu-health-brake-n1: lease gpu-health-brake-n1 (a node's quarantine-brake "
        "claim)",
        "would remove lease/gpu-health/gpu-health-disruption-budget: lease gpu-health-disruption-budget "
        "(the disruption budget)",
    ]
    assert node(fake, "n1")["metadata"]["resourceVersion"] == before
    assert "gpu-health-disruption-budget" in lease_names(fake)


def test_cleanup_removes_the_agents_marks_and_keeps_everyone_elses(cluster):
    """After cleanup n1 carries only what others set; n2's operator cordon and the pause Lease stay."""
    fake, kubeconfig = cluster
    result = cleanup(kubeconfig, "--all-nodes")
    assert result.exit_code == 0, result.output
    n1 = node(fake, "n1")
    assert [t["key"] for t in n1["spec"].get("taints") or []] == ["example.com/maintenance"]
    assert not n1["spec"].get("unschedulable")
    assert [c["type"] for c in n1["status"]["conditions"]] == ["Ready"]
    assert n1["metadata"]["labels"] == {"nvidia.com/gpu.present": "true", "kubernetes.io/hostname": "n1",
                                        "gpu-health-agent.io/opt-out": "true", "team": "ml"}
    assert n1["metadata"]["annotations"] == {"owner": "ops"}
    assert node(fake, "n2")["spec"]["unschedulable"] is True
    assert lease_names(fake) == {"gpu-health-pause"}
    assert "left lease/gpu-health/gpu-health-pause" in result.stderr


def test_cleanup_removes_the_fleet_summary_a_brake_confirm_and_the_quarantine_label(cluster):
    """The fleet summary and quarantine label the agent publishes, and an operator's confirm waiting for it,
    are the agent's too."""
    fake, kubeconfig = cluster
    url = yaml.safe_load(Path(kubeconfig).read_text())["clusters"][0]["cluster"]["server"]
    RawApi(client_for(url)).strategic_patch("/api/v1/nodes/n2", {"metadata": {
        "labels": {"gpu-health-agent.io/quarantined-since": "1700000000"}, "annotations": {
            "gpu-health-agent.io/fleet-summary": "{}", "gpu-health-agent.io/brake-confirm": "2026-12-02T10:00:00Z"}}})
    assert cleanup(kubeconfig, "--all-nodes").exit_code == 0
    assert not node(fake, "n2")["metadata"].get("annotations")
    assert "gpu-health-agent.io/quarantined-since" not in node(fake, "n2")["metadata"].get("labels", {})


def test_a_second_cleanup_finds_nothing(cluster):
    """Cleanup converges: run again, it removes nothing and says so."""
    _, kubeconfig = cluster
    cleanup(kubeconfig, "--all-nodes")
    result = cleanup(kubeconfig, "--all-nodes")
    assert result.stdout == ""
    assert "removed 0 mark(s) (nothing the agent set was found)" in result.stderr


def test_one_node_only_touches_that_node(cluster):
    """--node limits the work to the named node; cluster-wide Leases stay."""
    fake, kubeconfig = cluster
    result = cleanup(kubeconfig, "--node", "n2")
    assert result.exit_code == 0
    assert "gpu-health-disruption-budget" in lease_names(fake)
    assert any(t["key"] == TAINT for t in node(fake, "n1")["spec"]["taints"])


def test_cleanup_refuses_while_the_agent_still_runs(cluster):
    """Running agents would put their marks straight back: uninstall first, or --force."""
    fake, kubeconfig = cluster
    fake.add("pods", {"metadata": {"name": "gpu-health-agent-x", "namespace": "gpu-health",
                                   "labels": {"app.kubernetes.io/name": "gpu-health-agent"}},
                      "spec": {"nodeName": "n1", "containers": [{"name": "agent", "image": "a"}]}},
             namespace="gpu-health")
    result = cleanup(kubeconfig, "--all-nodes")
    assert result.exit_code == 1
    assert "1 agent pod(s) still run in namespace gpu-health" in result.stderr
    assert any(t["key"] == TAINT for t in node(fake, "n1")["spec"]["taints"])


def test_cleanup_needs_a_scope():
    """Neither --all-nodes nor --node: a usage error, nothing touched."""
    result = CliRunner().invoke(main, ["cleanup", "--kubeconfig", "/nonexistent"])
    assert result.exit_code == 2


def test_cleanup_removes_a_reset_pause_taint_an_agent_left(cluster):
    """The short NoSchedule of a device plugin paused for a reset is the agent's too: cleanup takes it off."""
    fake, kubeconfig = cluster
    api = RawApi(client_for(yaml.safe_load(Path(kubeconfig).read_text())["clusters"][0]["cluster"]["server"]))
    api.strategic_patch("/api/v1/nodes/n2", {"spec": {"taints": [
        {"key": "gpu-health-agent.io/gpu-reset-pause", "value": "device-plugin-paused", "effect": "NoSchedule"}]}})
    result = cleanup(kubeconfig, "--node", "n2")
    assert result.exit_code == 0, result.output
    assert not node(fake, "n2")["spec"].get("taints")

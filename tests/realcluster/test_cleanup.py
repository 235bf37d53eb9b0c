"""`gpu-health-agent cleanup` on a real kube-apiserver: the agent's marks go, an operator's stay."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner
from kubernetes import client

from agent.cli import main

TAINT = "gpu-health-agent.io/unhealthy"
NAMESPACE = "gha-cleanup-test"  # no agent runs here, so cleanup need not be forced


def test_cleanup_removes_the_agents_marks_from_a_real_node(control_plane, tmp_path: Path):
    """Taint, condition, label and annotation set as the agent sets them are removed; the operator's stay."""
    control_plane.add_gpu_node("cleanup-n1")
    api = control_plane.admin
    core = client.CoreV1Api(api)
    core.patch_node("cleanup-n1", {
        "metadata": {"labels": {"gpu-health-agent.io/needs-replacement": "true", "gpu-health-agent.io/opt-out": "true"},
                     "annotations": {"gpu-health-agent.io/state": "{}"}},
        "spec": {"taints": [{"key": TAINT, "value": "gpu-fault", "effect": "NoSchedule"},
                            {"key": "example.com/maintenance", "value": "yes", "effect": "NoSchedule"}]}})
    core.patch_node_status("cleanup-n1", {"status": {"conditions": [
        {"type": "GpuFatalFault", "status": "True", "reason": "Xid79", "message": "m"}]}})
    settings = tmp_path / "config.yaml"
    settings.write_text(f"remediation: {{namespace: {NAMESPACE}}}\n")

    result = CliRunner().invoke(main, ["cleanup", "--node", "cleanup-n1", "--config", str(settings),
                                       "--kubeconfig", str(control_plane.admin_kubeconfig)])

    assert result.exit_code == 0, result.output
    node = core.read_node("cleanup-n1")
    assert [t.key for t in node.spec.taints] == ["example.com/maintenance"]
    assert "GpuFatalFault" not in {c.type for c in node.status.conditions or []}
    assert "gpu-health-agent.io/needs-replacement" not in node.metadata.labels
    assert node.metadata.labels["gpu-health-agent.io/opt-out"] == "true"
    assert "gpu-health-agent.io/state" not in (node.metadata.annotations or {})

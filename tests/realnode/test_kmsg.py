"""The kernel log in the agent's unprivileged pod on the real node: the shipped kmsg device plugin
(daemonset/kmsg-device-plugin.yaml) registers with the real kubelet, the agent's container requests its
resource, containerd makes /dev/kmsg in the container and allows it in its device cgroup; the kernel-log
source runs, and a fire drill run inside the pod (docs/operations.md) is admitted and reported."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import FakeNvml
from tests.realnode import agent
from tests.realnode.node import NODE_NAME, RealNode
from tests.realnode.runtime import wait_until

KMSG_RESOURCE = "gpu-health-agent.io/kmsg"


def _agent_log(node: RealNode, pod: Any) -> str:
    return str(node.plane.core.read_namespaced_pod_log(pod.metadata.name, agent.AGENT_NAMESPACE, container="agent"))


@pytest.mark.shares_install
@pytest.mark.parametrize("installed", ["quarantine", "quarantine:helm"], indirect=True)
def test_the_agents_pod_runs_the_kernel_log_source_through_the_kmsg_device_plugin(
        installed: tuple[str, Any, int], real_node: RealNode):
    """From the kustomize base or the chart: the plugin's devices allocatable on the node, the agent's pod
    holding one, and its startup naming the kmsg source among those running (no warning that it is not)."""
    _, pod, _ = installed
    log = _agent_log(real_node, pod)
    [startup] = [line for line in log.splitlines() if line.startswith("gpu-health-agent: node ")]
    assert "sources kmsg, nvml" in startup, startup
    assert "source_not_running" not in log and "not running" not in log
    allocatable = real_node.node().status.allocatable or {}
    assert allocatable.get(KMSG_RESOURCE) == "4"
    [plugin] = real_node.plane.core.list_namespaced_pod(
        agent.AGENT_NAMESPACE, label_selector="app.kubernetes.io/name=gpu-health-kmsg-device").items
    assert plugin.spec.node_name == NODE_NAME and plugin.status.phase == "Running"
    container = next(c for c in pod.spec.containers if c.name == "agent")
    assert container.resources.limits[KMSG_RESOURCE] == "1"


@pytest.mark.shares_install
def test_a_fire_drill_run_inside_the_agents_pod_is_admitted_and_reported(
        installed: tuple[str, Any, int], real_node: RealNode, healthy_gpus: FakeNvml):
    """`kubectl exec ... gpu-health-agent drill`: the record goes through the host's kernel log to the agent,
    which admits it, counts a verdict marked drill="true", and takes no action (no taint in quarantine)."""
    _, pod, port = installed
    out = real_node.plane.kubectl("exec", "-n", agent.AGENT_NAMESPACE, pod.metadata.name, "-c", "agent", "--",
                                  "gpu-health-agent", "drill", "--config", "/etc/gpu-health-agent/config/config.yaml",
                                  "--wait", "30")
    assert "admitted: drill" in out, out
    wait_until(lambda: agent.metric(agent.metrics(port), "gpu_health_verdicts_total", drill="true") >= 1,
               "the drill's verdict counted with drill=\"true\"", timeout=30)
    assert not any(t.key.startswith("gpu-health-agent.io/") for t in real_node.node().spec.taints or [])

"""`cleanup` on the real node: refused, then undone by the agent, inside its pod; complete after the uninstall."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from agent.cleanup import node_marks
from tests.conftest import FakeNvml
from tests.realnode import agent
from tests.realnode.node import NODE_NAME, RealNode
from tests.realnode.runtime import REPO, wait_until
from tests.realnode.test_node import GPU_UUIDS, given_devices, gpu_pod

TAINT = "gpu-health-agent.io/unhealthy"
SLOT = f"gpu-health-slot-{NODE_NAME}"


def _marks(node: RealNode) -> set[tuple[str, str]]:
    """The agent's marks on the Node, (kind, name), as `cleanup` itself finds them."""
    raw = node.plane.admin.sanitize_for_serialization(node.node())
    return {(m.kind, m.name) for m in node_marks(raw, TAINT)}


def _slot_leases(node: RealNode) -> list[str]:
    leases = node.plane.kubectl("get", "leases", "-n", agent.AGENT_NAMESPACE, "-o", "name")
    return [name for name in leases.split() if name.startswith("lease.coordination.k8s.io/gpu-health-slot-")]


def _in_pod(node: RealNode, pod: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """`gpu-health-agent cleanup ARGS` run inside the agent's container, as an operator would exec it."""
    return subprocess.run(["kubectl", f"--kubeconfig={node.plane.admin_kubeconfig}", "exec", "-n",
                           agent.AGENT_NAMESPACE, pod.metadata.name, "-c", "agent", "--",
                           "gpu-health-agent", "cleanup", *args], capture_output=True, text=True, check=False)


def _as_operator(node: RealNode, *args: str) -> subprocess.CompletedProcess[str]:
    """`gpu-health-agent cleanup ARGS` on the operator's machine with the admin kubeconfig."""
    return subprocess.run([sys.executable, "-m", "agent", "cleanup", *args,
                           f"--kubeconfig={node.plane.admin_kubeconfig}"], capture_output=True, text=True,
                          check=False, cwd=REPO)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("installed", ["remediate"], indirect=True)
def test_cleanup_inside_the_pod_is_undone_by_the_agent_and_after_the_uninstall_removes_every_mark(
        installed: tuple[str, Any, int], real_node: RealNode, healthy_gpus: FakeNvml):
    """Xid 79 under a GPU pod: the agent taints, sets its condition and annotations, takes its budget slot.
    Inside its pod, `cleanup --node` is refused (agent pods run); forced, it removes the marks with the
    agent's token and the running agent taints the node again. Uninstalled, `cleanup --all-nodes --dry-run`
    lists the marks and the slot, and `cleanup --all-nodes` leaves none of them."""
    _, pod, _ = installed
    gpu_pod(real_node, "held", gpus=1)
    agent.xid(healthy_gpus, GPU_UUIDS.index(given_devices(real_node, "held")[0]))
    wait_until(lambda: {("taint", TAINT), ("condition", "GpuFatalFault")} <= _marks(real_node) and _slot_leases(
        real_node), "the agent's taint, condition and budget slot", timeout=60)

    refused = _in_pod(real_node, pod, "--node", NODE_NAME)
    assert refused.returncode == 1, refused
    assert "agent pod(s) still run" in refused.stderr and "uninstall first" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stdout + refused.stderr
    assert ("taint", TAINT) in _marks(real_node)

    forced = _in_pod(real_node, pod, "--node", NODE_NAME, "--force")
    assert forced.returncode == 0, forced
    assert f"removed: node/{NODE_NAME}: taint {TAINT}" in forced.stdout, forced.stdout
    wait_until(lambda: ("taint", TAINT) in _marks(real_node), "the running agent to taint its node again",
               timeout=60)

    real_node.plane.kubectl("delete", "daemonset", "-n", agent.AGENT_NAMESPACE, "gpu-health-agent", "--wait=false")
    wait_until(lambda: not agent.agent_pods(real_node.plane), "the agent's pod gone", timeout=90)
    listed = _as_operator(real_node, "--all-nodes", "--dry-run")
    assert listed.returncode == 0, listed
    for line in (f"would remove node/{NODE_NAME}: taint {TAINT}", f"node/{NODE_NAME}: condition GpuFatalFault",
                 f"lease/{agent.AGENT_NAMESPACE}/{SLOT}"):
        assert line in listed.stdout, listed.stdout
    assert ("taint", TAINT) in _marks(real_node)  # a dry run changes nothing
    done = _as_operator(real_node, "--all-nodes")
    assert done.returncode == 0, done
    assert _marks(real_node) == set() and _slot_leases(real_node) == []

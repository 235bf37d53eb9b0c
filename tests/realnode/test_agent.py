"""The agent installed on the real node from the shipped kustomize base (with the test overlay, agent.py):
the DaemonSet controller makes its pod, the kubelet admits it and its probes make it Ready, it reads the
kubelet's PodResources from inside the pod, and a GPU fault in `remediate` mode evicts exactly the pod
holding that GPU, which the kubelet then stops with SIGTERM; in `quarantine` mode nobody is evicted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from tests.conftest import REPO, FakeNvml, eight_gpus
from tests.realnode import agent
from tests.realnode.node import NODE_NAME, RealNode
from tests.realnode.runtime import wait_until
from tests.realnode.test_node import GPU_UUIDS, given_devices, gpu_pod, stopped_by


@pytest.mark.shares_install
@pytest.mark.parametrize("installed", ["quarantine", "quarantine:helm"], indirect=True)
def test_the_daemonset_pod_is_admitted_and_ready_by_its_probes(installed: tuple[str, Any, int], real_node: RealNode):
    """From the kustomize base or the Helm chart: the real DaemonSet controller made the pod on node 127.0.0.1,
    under the agent's ServiceAccount, and the kubelet counts its readiness probes succeeding."""
    _, pod, _ = installed
    assert pod.spec.node_name == NODE_NAME
    assert pod.metadata.owner_references[0].kind == "DaemonSet"
    assert pod.spec.service_account_name == "gpu-health-agent"
    assert pod.status.container_statuses[0].ready
    # Ready by its probe: the kubelet itself counts readiness probes it ran on the agent that succeeded.
    wait_until(lambda: real_node.probe_results("agent").get(("Readiness", "successful")),
               "the kubelet's count of the agent's successful readiness probes", timeout=30)
    # A figure, not an assertion: the agent's RSS in its pod (for docs/testing.md beside bench_memory's).
    container = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    pid = real_node.containerd.ctr("tasks", "list").stdout.split(container, 1)[1].split()[0]
    rss = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS"))
    print(f"agent pod {pod.metadata.name}: {rss}")


@pytest.mark.shares_install
@pytest.mark.parametrize("installed", ["quarantine", "quarantine:helm"], indirect=True)
def test_the_probe_finds_the_installed_agent_ready_and_answering(installed: tuple[str, Any, int],
                                                                 real_node: RealNode):
    """`gpu-health-agent probe` (what the chart's `helm test` runs) against the real install: the DaemonSet
    controller's one node covered, the agent's pod Ready and its /healthz and /readyz answering at its pod IP;
    the Helm release carries the probe as its test hook."""
    key, pod, port = installed
    done = subprocess.run([sys.executable, "-m", "agent", "probe", "--namespace", agent.AGENT_NAMESPACE,
                           "--port", str(port), f"--kubeconfig={real_node.plane.admin_kubeconfig}"],
                          capture_output=True, text=True, check=False, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"probe: node {NODE_NAME}: pod {pod.metadata.name} answers: mode quarantine" in done.stdout
    assert "probe: 1 of 1 agent(s) answer" in done.stdout
    if key.endswith(":helm"):
        hooks = agent.helm("get", "hooks", "gpu-health-agent", plane=real_node.plane)
        assert "name: gpu-health-agent-probe" in hooks and '"probe"' in hooks


def read_from_inside(node: RealNode, pod: Any) -> dict[str, list[str]]:
    """The GPUs of each pod as the agent's own PodResources decoder reads them inside its container, through
    the DaemonSet's hostPath (`kubectl exec`, through the kubelet)."""
    script = ("import json; from agent.k8s.podresources import list_pod_devices; "
              "print(json.dumps({f'{p.namespace}/{p.name}': p.gpu_ids() for p in list_pod_devices()}))")
    out = node.plane.kubectl("exec", "-n", agent.AGENT_NAMESPACE, pod.metadata.name, "-c", "agent", "--",
                             "/opt/gpu-health-agent/bin/python", "-c", script)
    return dict(json.loads(out))


@pytest.mark.shares_install
def test_pod_resources_are_read_from_inside_the_agents_pod(installed: tuple[str, Any, int], real_node: RealNode,
                                                            healthy_gpus: FakeNvml):
    """Through the DaemonSet's hostPath, the agent's decoder in its own pod names the GPUs a trainer holds."""
    _, pod, _ = installed
    gpu_pod(real_node, "reader", gpus=2)
    given = given_devices(real_node, "reader")
    assert read_from_inside(real_node, pod)["trainers/reader"] == given


@pytest.mark.shares_install
def test_mig_devices_are_read_from_inside_the_agents_pod_as_the_plugin_names_them(
        installed: tuple[str, Any, int], real_node: RealNode, healthy_gpus: FakeNvml):
    """GPU 0 in MIG mode: the plugin advertises its MIG devices' UUIDs instead of its own, and the agent's
    decoder in its pod names the MIG UUIDs a pod holding every device was given."""
    _, pod, _ = installed
    mig = [f"MIG-fa4e0000-0000-0000-0000-0000000000{n}0" for n in range(1, 3)]
    healthy_gpus.write(eight_gpus(**{"0": {"mig_mode": 1, "mig_devices": mig}}))
    try:
        wait_until(lambda: real_node.allocatable_gpus() == 9, "nine devices (two MIG) allocatable", timeout=30)
        gpu_pod(real_node, "mig", gpus=9)
        given = given_devices(real_node, "mig")
        assert set(mig) <= set(given) and GPU_UUIDS[0] not in given
        assert read_from_inside(real_node, pod)["trainers/mig"] == given
    finally:
        real_node.plane.reset()  # the pod gone before GPU 0 leaves MIG mode
        healthy_gpus.write(eight_gpus())
        wait_until(lambda: real_node.allocatable_gpus() == 8, "eight GPUs allocatable again", timeout=30)


@pytest.mark.shares_install
def test_time_sliced_replicas_are_read_from_inside_the_agents_pod_as_their_gpus(
        installed: tuple[str, Any, int], real_node: RealNode, healthy_gpus: FakeNvml):
    """The plugin time-slicing each GPU twice ("UUID::N"): the agent's decoder in its pod names the GPUs
    behind the replicas a pod was given."""
    _, pod, _ = installed
    real_node.start_plugin(replicas=2)
    try:
        wait_until(lambda: real_node.allocatable_gpus() == 16, "sixteen replicas allocatable", timeout=30)
        gpu_pod(real_node, "sliced", gpus=3)
        given = given_devices(real_node, "sliced")
        assert all("::" in device for device in given), given
        expected = sorted({device.split("::", 1)[0] for device in given})
        assert read_from_inside(real_node, pod)["trainers/sliced"] == expected
    finally:
        real_node.plane.reset()
        real_node.start_plugin()
        wait_until(lambda: real_node.allocatable_gpus() == 8, "eight GPUs allocatable again", timeout=30)


@pytest.mark.parametrize("installed", ["remediate", "quarantine"], indirect=True)
def test_a_fault_evicts_exactly_the_holder_in_remediate_mode_and_nobody_in_quarantine(
        installed: tuple[str, Any, int], real_node: RealNode, healthy_gpus: FakeNvml, tmp_path: Path):
    """Xid 79 on the GPU one trainer holds: in remediate mode that trainer (only) is evicted and the kubelet
    stops its container with SIGTERM; in quarantine mode the node is tainted and both keep running."""
    mode, _, port = installed
    gpu_pod(real_node, "held", gpus=1)
    gpu_pod(real_node, "other", gpus=1)
    faulty = GPU_UUIDS.index(given_devices(real_node, "held")[0])
    agent.xid(healthy_gpus, faulty)
    core = real_node.plane.core

    def tainted() -> bool:
        return any(t.key.startswith("gpu-health-agent.io/") for t in real_node.node().spec.taints or [])

    wait_until(tainted, "the agent's taint on the node", timeout=60)
    if mode == "remediate":
        def evicted() -> bool:
            try:
                pod = core.read_namespaced_pod("held", "trainers")
            except ApiException as exc:
                gone = exc.status == 404
            else:
                gone = pod.metadata.deletion_timestamp is not None
            return gone and stopped_by(real_node, "held") == "SIGTERM"

        wait_until(evicted, "the holder evicted and its container stopped by SIGTERM", timeout=60)
    else:
        # The taint shows the agent decided; the eviction it planned with it is recorded skipped (the mode's
        # word, counted once): past that, none may have happened.
        wait_until(lambda: agent.metric(agent.metrics(port), "gpu_health_remediation_steps_total", kind="evict",
                                        result="skipped") >= 1, "the eviction recorded skipped", timeout=30)
        assert stopped_by(real_node, "held") == ""
        assert core.read_namespaced_pod("held", "trainers").metadata.deletion_timestamp is None
    pod = core.read_namespaced_pod("other", "trainers")
    assert pod.metadata.deletion_timestamp is None and pod.status.phase == "Running"


def _stuck_evictions(port: int) -> float:
    """gpu_health_evictions_stuck_total from the agent's /metrics."""
    return agent.metric(agent.metrics(port), "gpu_health_evictions_stuck_total")


@pytest.mark.parametrize("installed", ["remediate"], indirect=True)
def test_a_disruption_budget_that_forbids_the_eviction_keeps_the_holder_and_the_agent_reports_it_stuck(
        installed: tuple[str, Any, int], real_node: RealNode, healthy_gpus: FakeNvml):
    """Xid 79 under a PDB that allows no disruption: the real API refuses the eviction (429) until the
    agent's deadline, the agent counts it stuck and never forces it, the holder keeps running."""
    _, _, port = installed
    gpu_pod(real_node, "held", gpus=1)
    real_node.plane.add_pdb("trainers", "held", {"app": "held"}, min_available=1)
    agent.xid(healthy_gpus, GPU_UUIDS.index(given_devices(real_node, "held")[0]))
    # The agent asks again every remediation.retry_seconds (the overlay's 2 s) until the 5 s deadline has passed.
    wait_until(lambda: _stuck_evictions(port) >= 1, "the agent to count the eviction stuck", timeout=30)
    held = real_node.plane.core.read_namespaced_pod("held", "trainers")
    assert held.metadata.deletion_timestamp is None and held.status.phase == "Running"
    assert stopped_by(real_node, "held") == ""

"""The agent installed on the real node from the shipped kustomize base (with the test overlay, agent.py):
the DaemonSet controller makes its pod, the kubelet admits it and its probes make it Ready, it reads the
kubelet's PodResources from inside the pod, and a GPU fault in `remediate` mode evicts exactly the pod
holding that GPU, which the kubelet then stops with SIGTERM; in `quarantine` mode nobody is evicted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from tests.conftest import FakeNvml, eight_gpus
from tests.realnode import agent
from tests.realnode.node import AGENT_STATE, NODE_NAME, RealNode
from tests.realnode.runtime import REPO, wait_until
from tests.realnode.test_node import GPU_UUIDS, given_devices, gpu_pod, stopped_by


@pytest.fixture
def installed(request: pytest.FixtureRequest, real_node: RealNode, node_nvml: FakeNvml,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any, int]]:
    """The overlay applied (in the shipped mode, quarantine, unless parametrized), the agent's pod Ready by
    the kubelet's probes; uninstalled after the test, so each test starts on a node without its marks."""
    mode = str(getattr(request, "param", "quarantine"))
    node_nvml.write(eight_gpus())
    directory, port = agent.overlay(tmp_path_factory.mktemp(f"overlay-{mode}"), real_node.plane, node_nvml.path, mode)
    agent.install(real_node.plane, directory)

    def ready_pod() -> Any:
        real_node.check_alive()
        for pod in agent.agent_pods(real_node.plane):
            conditions = pod.status.conditions or []
            if pod.metadata.deletion_timestamp is None and any(
                    c.type == "Ready" and c.status == "True" for c in conditions):
                return pod
        return None

    try:
        pod = wait_until(ready_pod, f"the agent's pod Ready on the real node ({mode})", timeout=120)
    except Exception:
        _print_agent_log(real_node)
        raise
    yield mode, pod, port  # the metrics port: where probes (and a test) reach it, on the host's network
    _print_agent_log(real_node)
    # Uninstalled as docs/operations.md says: the DaemonSet deleted, then `cleanup` with operator credentials
    # removes the marks the agent left; the state hostPath wiped, so the next mode starts on a fresh node.
    real_node.plane.kubectl("delete", "daemonset", "-n", agent.AGENT_NAMESPACE, "gpu-health-agent", "--wait=false")
    wait_until(lambda: not agent.agent_pods(real_node.plane), "the agent's pod gone", timeout=90)
    done = subprocess.run([sys.executable, "-m", "agent", "cleanup", "--all-nodes",
                           f"--kubeconfig={real_node.plane.admin_kubeconfig}"], capture_output=True, text=True,
                          check=False, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    shutil.rmtree(AGENT_STATE, ignore_errors=True)


def _print_agent_log(node: RealNode) -> None:
    for pod in agent.agent_pods(node.plane):
        try:
            print(node.plane.core.read_namespaced_pod_log(pod.metadata.name, agent.AGENT_NAMESPACE, tail_lines=40))
        except ApiException as exc:
            print(f"no log of {pod.metadata.name}: {exc.reason}")


def test_the_daemonset_pod_is_admitted_and_ready_by_its_probes(installed: tuple[str, Any, int], real_node: RealNode):
    """The real DaemonSet controller made the pod on node 127.0.0.1, under the agent's ServiceAccount."""
    _, pod, _ = installed
    assert pod.spec.node_name == NODE_NAME
    assert pod.metadata.owner_references[0].kind == "DaemonSet"
    assert pod.spec.service_account_name == "gpu-health-agent"
    assert pod.status.container_statuses[0].ready
    # A figure, not an assertion: the agent's RSS in its pod (for docs/testing.md beside bench_memory's).
    container = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    pid = real_node.containerd.ctr("tasks", "list").stdout.split(container, 1)[1].split()[0]
    rss = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS"))
    print(f"agent pod {pod.metadata.name}: {rss}")


def test_pod_resources_are_read_from_inside_the_agents_pod(installed: tuple[str, Any, int], real_node: RealNode,
                                                            healthy_gpus: FakeNvml):
    """Through the DaemonSet's hostPath, the agent's decoder in its own pod names the GPUs a trainer holds."""
    _, pod, _ = installed
    gpu_pod(real_node, "reader", gpus=2)
    given = given_devices(real_node, "reader")
    script = ("import json; from agent.k8s.podresources import list_pod_devices; "
              "print(json.dumps({f'{p.namespace}/{p.name}': p.gpu_ids() for p in list_pod_devices()}))")
    out = real_node.plane.kubectl("exec", "-n", agent.AGENT_NAMESPACE, pod.metadata.name, "-c", "agent", "--",
                                  "/opt/gpu-health-agent/bin/python", "-c", script)
    assert json.loads(out)["trainers/reader"] == given


def _xid(state: FakeNvml, gpu_index: int, code: int = 79) -> None:
    """The fake NVML delivers an Xid event on one GPU, as the driver would."""
    current = eight_gpus()
    current["events"] = [{"id": int(time.time() * 1000) % 1_000_000, "gpu": gpu_index, "type": 8, "data": code,
                          "gi": 4294967295, "ci": 4294967295}]
    state.write(current)


@pytest.mark.parametrize("installed", ["remediate", "quarantine"], indirect=True)
def test_a_fault_evicts_exactly_the_holder_in_remediate_mode_and_nobody_in_quarantine(
        installed: tuple[str, Any, int], real_node: RealNode, healthy_gpus: FakeNvml, tmp_path: Path):
    """Xid 79 on the GPU one trainer holds: in remediate mode that trainer (only) is evicted and the kubelet
    stops its container with SIGTERM; in quarantine mode the node is tainted and both keep running."""
    mode, _, _ = installed
    gpu_pod(real_node, "held", gpus=1)
    gpu_pod(real_node, "other", gpus=1)
    faulty = GPU_UUIDS.index(given_devices(real_node, "held")[0])
    _xid(healthy_gpus, faulty)
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
        # The taint shows the agent decided; give an eviction (it follows the taint in remediate mode within
        # a second here) ample time to show, then none may have happened.
        time.sleep(5)
        assert stopped_by(real_node, "held") == ""
        assert core.read_namespaced_pod("held", "trainers").metadata.deletion_timestamp is None
    pod = core.read_namespaced_pod("other", "trainers")
    assert pod.metadata.deletion_timestamp is None and pod.status.phase == "Running"


def _stuck_evictions(port: int) -> float:
    """gpu_health_evictions_stuck_total from the agent's /metrics (hostNetwork: on the host's loopback)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("gpu_health_evictions_stuck_total "):
                return float(line.split()[1])
    return 0.0


@pytest.mark.timeout(300)  # the agent's retry a minute after the fault, on top of the install
@pytest.mark.parametrize("installed", ["remediate"], indirect=True)
def test_a_disruption_budget_that_forbids_the_eviction_keeps_the_holder_and_the_agent_reports_it_stuck(
        installed: tuple[str, Any, int], real_node: RealNode, healthy_gpus: FakeNvml):
    """Xid 79 under a PDB that allows no disruption: the real API refuses the eviction (429) until the
    agent's deadline, the agent counts it stuck and never forces it, the holder keeps running."""
    _, _, port = installed
    gpu_pod(real_node, "held", gpus=1)
    real_node.plane.add_pdb("trainers", "held", {"app": "held"}, min_available=1)
    _xid(healthy_gpus, GPU_UUIDS.index(given_devices(real_node, "held")[0]))
    # The agent retries a refused eviction on its next pass (a minute later), past the 5 s deadline.
    wait_until(lambda: _stuck_evictions(port) >= 1, "the agent to count the eviction stuck", timeout=150)
    held = real_node.plane.core.read_namespaced_pod("held", "trainers")
    assert held.metadata.deletion_timestamp is None and held.status.phase == "Running"
    assert stopped_by(real_node, "held") == ""

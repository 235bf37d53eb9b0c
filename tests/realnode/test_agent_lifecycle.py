"""The agent's pod across what happens to a node's processes: a hung agent restarted by the kubelet's
liveness probe resumes from its journal without acting again, and the agent keeps finding GPU holders
through PodResources after the kubelet itself restarts (its socket re-created, the device plugin
re-registered)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FakeNvml
from tests.realnode import agent
from tests.realnode.marks import agent_taints, evicted, eviction_events, holder_evicted_by_xid
from tests.realnode.node import POD_RESOURCES, RealNode
from tests.realnode.runtime import wait_until
from tests.realnode.test_node import GPU_UUIDS, given_devices, gpu_pod


def _identity(path: Path) -> tuple[int, int]:
    """Which file `path` is (inode and change time: an inode number alone may be reused)."""
    status = path.stat()
    return status.st_ino, status.st_ctime_ns


def _restarted_and_ready(node: RealNode) -> Any:
    node.check_alive()
    for pod in agent.agent_pods(node.plane):
        status = next((c for c in pod.status.container_statuses or [] if c.name == "agent"), None)
        if status is not None and status.restart_count >= 1 and status.ready:
            return pod
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("installed", ["remediate:fast-liveness"], indirect=True)
def test_a_hung_agent_is_restarted_by_its_liveness_probe_and_does_not_act_again(
        installed: tuple[str, Any, int], real_node: RealNode, healthy_gpus: FakeNvml):
    """Xid 79 evicts the holder; the agent then hangs (SIGSTOP): its /healthz stops answering, the kubelet's
    liveness probe fails and the kubelet restarts the container, and the new agent resumes from the
    journal on the state hostPath: Ready, the taint as it was, no second eviction or eviction Event."""
    _, pod, port = installed
    held_uid = holder_evicted_by_xid(real_node, healthy_gpus)
    taints = agent_taints(real_node)
    assert taints
    os.kill(agent.agent_pid(real_node, pod), signal.SIGSTOP)
    restarted = wait_until(lambda: _restarted_and_ready(real_node), "the kubelet to restart the hung agent",
                           timeout=90)
    assert restarted.metadata.uid == pod.metadata.uid  # the same pod: the kubelet restarted its container
    assert real_node.probe_results("agent").get(("Liveness", "failed"), 0) >= 1
    text = agent.metrics(port)
    assert agent.metric(text, "gpu_health_remediation_steps_total", kind="evict") == 0, text
    assert agent_taints(real_node) == taints
    events = eviction_events(real_node, held_uid)
    assert len(events) == 1 and (events[0].count or 1) == 1, events


@pytest.mark.timeout(300)
@pytest.mark.parametrize("installed", ["remediate"], indirect=True)
def test_the_agent_finds_the_holder_through_pod_resources_after_the_kubelet_restarts(
        installed: tuple[str, Any, int], real_node: RealNode, healthy_gpus: FakeNvml):
    """The kubelet restarted under a running agent: PodResources' socket is a new one, the device plugin
    registers again, the agent's container keeps running, and Xid 79 still evicts exactly the pod the
    kubelet now says holds that GPU."""
    _, pod, _ = installed
    assert real_node.plugin is not None
    plugin_log = real_node.plugin.log
    socket_before, registered_before = _identity(POD_RESOURCES), plugin_log.read_text().count("registering again")
    real_node.restart_kubelet()
    wait_until(lambda: _identity(POD_RESOURCES) != socket_before, "the kubelet's new PodResources socket", timeout=30)
    wait_until(lambda: plugin_log.read_text().count("registering again") > registered_before,
               "the device plugin to register again", timeout=30)
    wait_until(lambda: real_node.allocatable_gpus() == 8, "eight GPUs allocatable after the restart", timeout=30)
    gpu_pod(real_node, "held", gpus=1)
    gpu_pod(real_node, "other", gpus=1)
    agent.xid(healthy_gpus, GPU_UUIDS.index(given_devices(real_node, "held")[0]))
    wait_until(lambda: evicted(real_node, "held"), "the holder evicted after the kubelet's restart", timeout=60)
    other = real_node.plane.core.read_namespaced_pod("other", "trainers")
    assert other.metadata.deletion_timestamp is None and other.status.phase == "Running"
    current = next(p for p in agent.agent_pods(real_node.plane) if p.metadata.uid == pod.metadata.uid)
    assert next(c for c in current.status.container_statuses if c.name == "agent").restart_count == 0

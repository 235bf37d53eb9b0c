"""The agent's pod across what happens to a node's processes: a hung agent restarted by the kubelet's
liveness probe resumes from its journal without acting again, and the agent keeps finding GPU holders
through PodResources after the kubelet itself restarts (its socket re-created, the device plugin
re-registered)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from tests.conftest import FakeNvml, eight_gpus
from tests.realnode import agent
from tests.realnode.node import AGENT_STATE, NODE_NAME, POD_RESOURCES, RealNode
from tests.realnode.runtime import wait_until
from tests.realnode.test_node import GPU_UUIDS, given_devices, gpu_pod, stopped_by


def _evicted(node: RealNode, name: str) -> bool:
    """The pod deleted through the API and its container stopped by SIGTERM."""
    try:
        pod = node.plane.core.read_namespaced_pod(name, "trainers")
    except ApiException as exc:
        gone = exc.status == 404
    else:
        gone = pod.metadata.deletion_timestamp is not None
    return gone and stopped_by(node, name) == "SIGTERM"


def _identity(path: Path) -> tuple[int, int]:
    """Which file `path` is (inode and change time: an inode number alone may be reused)."""
    status = path.stat()
    return status.st_ino, status.st_ctime_ns


def _agent_taints(node: RealNode) -> list[tuple[str, str, Any]]:
    return sorted((t.key, t.effect, t.time_added) for t in node.node().spec.taints or []
                  if t.key.startswith("gpu-health-agent.io/"))


def _eviction_events(node: RealNode, pod_uid: str) -> list[Any]:
    """The EvictedForGpuFault Events regarding this pod (by uid: earlier tests evicted pods of the same name,
    and their Events live on for an hour)."""
    events = node.plane.core.list_event_for_all_namespaces(field_selector="reason=EvictedForGpuFault").items
    return [e for e in events if e.involved_object is not None and e.involved_object.uid == pod_uid]


def _journaled_record(node: RealNode) -> dict[str, Any] | None:
    """The node's record as the agent's journal on the state hostPath holds it (what a new process resumes
    from); read-only, beside the running agent (SQLite in WAL mode)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{AGENT_STATE / 'journal.db'}?mode=ro", uri=True)) as db:
            row = db.execute("SELECT value FROM cursors WHERE name = ?", (f"record:{NODE_NAME}",)).fetchone()
    except sqlite3.Error:  # busy for a moment, or not there yet: asked again
        return None
    return dict(json.loads(row[0])) if row else None


def _owed_eviction_events(node: RealNode) -> list[Any]:
    """EvictedForGpuFault Events the journaled record still owes (not yet acknowledged as delivered)."""
    record = _journaled_record(node) or {}
    return [e for e in record.get("owed") or [] if e.get("reason") == "EvictedForGpuFault"]


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
    held_uid = gpu_pod(real_node, "held", gpus=1)["metadata"]["uid"]
    agent.xid(healthy_gpus, GPU_UUIDS.index(given_devices(real_node, "held")[0]))
    wait_until(lambda: _evicted(real_node, "held"), "the holder evicted (SIGTERM)", timeout=60)
    wait_until(lambda: _eviction_events(real_node, held_uid), "the agent's EvictedForGpuFault Event", timeout=30)
    # Its delivery acknowledged in the journal: an agent killed between the two sends the Event again (Events
    # are delivered at least once).
    wait_until(lambda: _journaled_record(real_node) is not None and not _owed_eviction_events(real_node),
               "the Event's delivery acknowledged in the journal", timeout=30)
    healthy_gpus.write(eight_gpus())  # NVML does not deliver an event again to a new process
    taints = _agent_taints(real_node)
    assert taints
    os.kill(agent.agent_pid(real_node, pod), signal.SIGSTOP)
    restarted = wait_until(lambda: _restarted_and_ready(real_node), "the kubelet to restart the hung agent",
                           timeout=90)
    assert restarted.metadata.uid == pod.metadata.uid  # the same pod: the kubelet restarted its container
    assert real_node.probe_results("agent").get(("Liveness", "failed"), 0) >= 1
    text = agent.metrics(port)
    assert agent.metric(text, "gpu_health_remediation_steps_total", kind="evict") == 0, text
    assert _agent_taints(real_node) == taints
    events = _eviction_events(real_node, held_uid)
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
    wait_until(lambda: _evicted(real_node, "held"), "the holder evicted after the kubelet's restart", timeout=60)
    other = real_node.plane.core.read_namespaced_pod("other", "trainers")
    assert other.metadata.deletion_timestamp is None and other.status.phase == "Running"
    current = next(p for p in agent.agent_pods(real_node.plane) if p.metadata.uid == pod.metadata.uid)
    assert next(c for c in current.status.container_statuses if c.name == "agent").restart_count == 0

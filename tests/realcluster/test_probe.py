"""`gpu-health-agent probe` (the chart's `helm test`) on a real kube-apiserver: the DaemonSet controller's
count of nodes and kwok's Ready pods, each asked over HTTP at its pod IP by the agent's own health server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner
from kubernetes import client

from agent.cli import main
from agent.httpserver import AgentHttpServer
from tests.realcluster.controlplane import wait_until

NAMESPACE = "gha-probe-test"
HEALTHY = {"loop_age_seconds": 0.4, "sources": ["kmsg", "nvml"], "failing_sources": [], "ready": True,
           "journal_failing": "", "mode": "quarantine", "dry_run": False}


class Agent:
    """The agent's own HTTP server on 127.0.0.1 (each kwok pod's IP: its node's, host network), its health
    answer settable."""

    def __init__(self) -> None:
        self.details: dict[str, Any] = dict(HEALTHY)
        self.lock = threading.Lock()
        self.server = AgentHttpServer("127.0.0.1", 0, metrics=lambda: b"", health=self.health)
        self.server.start()

    def health(self) -> tuple[bool, dict[str, object]]:
        with self.lock:
            return True, dict(self.details)


@pytest.fixture
def agent() -> Iterator[Agent]:
    served = Agent()
    yield served
    served.server.close()


def node_at_loopback(plane: Any, name: str) -> None:
    """A kwok GPU node whose address is 127.0.0.1: a host-network pod on it gets that IP."""
    plane.add_gpu_node(name)
    client.CoreV1Api(plane.admin).patch_node_status(name, {"status": {"addresses": [
        {"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}]}})


def agent_daemonset(plane: Any, name: str, nodes: list[str]) -> None:
    """A DaemonSet on the host network and its pods, one a node, as its controller makes them (this control
    plane runs no DaemonSet controller): the status's count of nodes, each pod bound and owned; kwok runs them."""
    plane.ensure_namespace(NAMESPACE)
    apps, core = client.AppsV1Api(plane.admin), client.CoreV1Api(plane.admin)
    labels = {"app.kubernetes.io/name": name}
    pod_spec = {"hostNetwork": True, "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "agent", "image": "example.invalid/gpu-health-agent:1"}]}
    created = apps.create_namespaced_daemon_set(NAMESPACE, {
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": pod_spec}}})
    plane._created.append(("apps", "daemonsets", NAMESPACE, name))
    apps.patch_namespaced_daemon_set_status(name, NAMESPACE, {"status": {
        "desiredNumberScheduled": len(nodes), "currentNumberScheduled": len(nodes), "numberMisscheduled": 0,
        "numberReady": 0}})
    owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": name, "uid": created.metadata.uid,
             "controller": True, "blockOwnerDeletion": True}
    for i, node in enumerate(nodes):
        pod = f"{name}-{i}"
        core.create_namespaced_pod(NAMESPACE, {
            "metadata": {"name": pod, "namespace": NAMESPACE, "labels": labels, "ownerReferences": [owner]},
            "spec": {**pod_spec, "nodeName": node}})
        plane._created.append(("", "pods", NAMESPACE, pod))

    def running() -> bool:
        pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"app.kubernetes.io/name={name}").items
        return len(pods) == len(nodes) and all(
            p.status.pod_ip and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            for p in pods)
    wait_until(running, f"kwok to run the DaemonSet {name}'s {len(nodes)} pod(s)")


def probe(plane: Any, name: str, port: int) -> Any:
    return CliRunner().invoke(main, ["probe", "--namespace", NAMESPACE, "--daemonset", name, "--port", str(port),
                                     "--timeout", "2", "--kubeconfig", str(plane.admin_kubeconfig)])


def test_probe_passes_when_every_node_has_its_agent_ready_and_answering(control_plane, agent: Agent):
    """Two nodes, each with its agent Ready and answering: exit 0, one line a node with what the agent said."""
    nodes = [control_plane.unique("probe-ok"), control_plane.unique("probe-ok")]
    for node in nodes:
        node_at_loopback(control_plane, node)
    agent_daemonset(control_plane, "probe-ok", nodes)
    result = probe(control_plane, "probe-ok", agent.server.port)
    assert result.exit_code == 0, result.output
    for node in nodes:
        assert f"node {node}: pod probe-ok-" in result.output
    assert "answers: mode quarantine, sources kmsg,nvml" in result.output
    assert "2 of 2 agent(s) answer" in result.output


def test_probe_fails_naming_the_node_whose_agent_is_not_ready(control_plane, agent: Agent):
    """An agent unready (its journal failing) answers /readyz 503: exit 1, its node named with why."""
    node = control_plane.unique("probe-unready")
    node_at_loopback(control_plane, node)
    agent_daemonset(control_plane, "probe-unready", [node])
    with agent.lock:
        agent.details.update(ready=False, journal_failing="save: database or disk is full")
    result = probe(control_plane, "probe-unready", agent.server.port)
    assert result.exit_code == 1, result.output
    assert f"node {node}: pod probe-unready-" in result.output
    assert "/readyz answered 503" in result.output and "database or disk is full" in result.output
    assert "0 of 1 agent(s) answer: not every node is covered" in result.output


def test_probe_fails_when_an_agent_does_not_answer(control_plane, agent: Agent):
    """Nothing listens on the port asked: each agent unreachable, exit 1."""
    node = control_plane.unique("probe-silent")
    node_at_loopback(control_plane, node)
    agent_daemonset(control_plane, "probe-silent", [node])
    port = agent.server.port
    agent.server.close()
    result = probe(control_plane, "probe-silent", port)
    assert result.exit_code == 1, result.output
    assert "/healthz unreachable" in result.output

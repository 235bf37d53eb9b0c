"""Issue 38 on the real control plane: the agents, each with its own bound token, talk to kube-apiserver
through the fault-injection proxy (tests/realcluster/faultproxy.py), which fails the holds read with 503 and
429 as a loaded API server does; the shipped RBAC and admission decide everything else. The holds stand."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from agent.fleet.published import HOLDS_CONFIGMAP
from agent.k8s.client import load_api_client
from agent.remediation import Mode
from tests.integration.test_fleet_agents import NS, fleet_controller, gsp_timeouts, storm, tainted
from tests.k8s_helpers import gpu_node, make_agent
from tests.realcluster.backend import RealCluster, RealServer
from tests.realcluster.controlplane import ControlPlane
from tests.realcluster.faultproxy import FaultProxy, Rule

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
HOLDS = rf"^/api/v1/namespaces/{NS}/configmaps/{HOLDS_CONFIGMAP}(\?|$)"


@pytest.fixture
def proxied(control_plane: ControlPlane) -> Iterator[tuple[RealCluster, RealServer, FaultProxy]]:
    plane = control_plane
    proxy = FaultProxy(plane.url, ca_file=plane.ca_file, cert_file=plane.pki.serving[0],
                       key_file=plane.pki.serving[1]).start()
    cluster, server = RealCluster(plane), RealServer(plane)
    try:
        yield cluster, server, proxy
    finally:
        proxy.stop()
        server.stop()


def through(proxy: FaultProxy, plane: ControlPlane, node: str) -> Any:
    """The agent's own client (its ServiceAccount token bound to its pod), pointed at the proxy."""
    config = yaml.safe_load(plane.agent_kubeconfig(node).read_text())
    config["clusters"][0]["cluster"]["server"] = proxy.url
    path = plane.workdir / f"proxied-{node}.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    client, how = load_api_client(kubeconfig=str(path))
    assert client is not None, how
    return client


def fleet(proxied: tuple[RealCluster, RealServer, FaultProxy], count: int = 6) -> list[Any]:
    cluster, server, proxy = proxied
    made = []
    for i in range(count):
        inventory = gpu_node(f"n{i}", gpus=2)
        cluster.populate(inventory)  # the agent's pod first: its token is bound to it
        made.append(make_agent(cluster, server, inventory, mode=Mode.QUARANTINE, fleet=True, populate_node=False,
                               api_client=through(proxy, server.plane, inventory.name)))
    return made


def test_a_503_on_the_holds_read_leaves_the_hold_standing_on_the_real_server(proxied, fault_row):
    """A driver-version hold over six real nodes; then every holds read the agents make answers 503 at the
    proxy: the holds they last read still keep the rule's taint off every node."""
    cluster, server, proxy = proxied
    agents = fleet(proxied)
    storm((cluster, server), agents, fleet_controller((cluster, server)), gsp_timeouts)
    assert tainted((cluster, server), agents) == []
    rule = proxy.add(Rule("GET", HOLDS, status=503))
    for agent in agents:
        agent.settle(400.0)
    assert rule.matched > 0
    fault_row("503 on every holds read (TLS proxy, real server)", held_tainted=len(tainted((cluster, server), agents)))


def test_a_429_on_the_holds_read_is_retried_on_the_real_server(proxied, fault_row):
    """A driver-version hold over six real nodes; each agent restarts (no holds read yet) and the proxy
    answers its first two holds reads 429 (priority and fairness): it reads again within its pass and is
    held, never tainted."""
    cluster, server, proxy = proxied
    agents = fleet(proxied)
    storm((cluster, server), agents, fleet_controller((cluster, server)), gsp_timeouts)
    for agent in agents:
        agent.close()
    restarted = []
    for agent in agents:
        rule = proxy.add(Rule("GET", HOLDS, status=429, times=2))
        name = agent.inventory.name
        fresh = make_agent(cluster, server, agent.inventory, mode=Mode.QUARANTINE, fleet=True, populate_node=False,
                           restore=True, api_client=through(proxy, server.plane, name))
        fresh.settle(400.0)
        assert rule.matched == 2
        restarted.append(fresh)
    fault_row("429 twice on restarted agents' holds reads (TLS proxy, real server)",
              held_tainted=len(tainted((cluster, server), restarted)))

"""Issue 24 (d), the node side: a fabric fault confined to one fabric domain, with the fleet controller, takes
the domain out as one unit (every node tainted and drained, counted as one under the budget); without the
controller the brake and the budget bound it node by node."""

from __future__ import annotations

from typing import Any

import pytest

from agent.fleet.unit import UNIT_ANNOTATION
from agent.model import Observation, Signal, frozen_attrs
from agent.remediation import Mode
from tests.integration.test_budget import LEASE_RESOURCE
from tests.integration.test_fleet_agents import BRAKE, Clock, correlate, fleet_controller
from tests.k8s_helpers import Agent, gpu_node, make_agent

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
FLEET = 20
DOMAIN = [f"n{i}" for i in range(6)]  # fabric-1; every other node is on fabric-0
UNIT = "sxid-fatal/fabric-domain/fabric-1"


#: The agents' fleet clock: the settle (10 s) ends when a test moves it.
CLOCK = Clock()


def remediating(fake: Any, *, controller: bool = True) -> list[Agent]:
    """20 agents in remediate mode, a budget of 2 nodes at a time, the quarantine brake on (3 of 20 nodes),
    each waiting the fleet settle for the controller's word."""
    cluster, server = fake
    return [make_agent(cluster, server, gpu_node(f"n{i}", gpus=2), mode=Mode.REMEDIATE, max_nodes=2,
                       max_percent=0, fleet=controller, brake=BRAKE, fleet_clock=CLOCK, settle_seconds=10.0,
                       fabric_domain="fabric-1" if i < 6 else "fabric-0")
            for i in range(FLEET)]


def nvswitch_fatal(agent: Agent, at: float = 1.0) -> None:
    """A fatal NVSwitch SXid on the node's switch (a node-level fault: fabric class, a reboot)."""
    attrs = frozen_attrs({"severity": "fatal", "switch": "nvidia-nvswitch0", "message": "Link 4 fatal error",
                          "pci": "0000:06:00.0"})
    agent.pipeline.handle(Observation(Signal.SXID, 20034, at, "kmsg", None, attrs), at)


def domain_fault(fake: Any, fleet: list[Agent], controller: Any) -> None:
    """Every node's first poll and pass (each publishes its summary, with its GPU model), then the SXid on each
    node of the domain in turn, the controller passing after each, then passes."""
    for agent in fleet:
        agent.poll(0, 0.2)
        agent.settle(0.5)
    correlate(fake, controller)
    for agent in fleet[:len(DOMAIN)]:
        nvswitch_fatal(agent)
        correlate(fake, controller)
    if controller is not None:  # the fault stayed in its domain for the unit's settle: named a unit
        controller.clock.now += controller.settings.unit_settle_seconds  # type: ignore[attr-defined]
        correlate(fake, controller)
    CLOCK.now += 10.0  # the agents' settle ends: the unit is published by then
    for at in (200.0, 400.0):
        for agent in fleet:
            agent.settle(at)


def disrupted(agent: Agent) -> bool:
    node = agent.pipeline.record.node
    return bool(node.reboot_requested or any(node.evicted.values()))


def tainted(fake: Any, fleet: list[Agent]) -> list[str]:
    return [a.inventory.name for a in fleet if fake[0].node(a.inventory.name)["spec"].get("taints")]


@pytest.mark.fake_only  # the budget counts the session's other slots on the shared real control plane
def test_an_nvswitch_fault_of_one_domain_takes_the_whole_domain_out_as_one_unit(fake):
    """Six nodes of fabric-1, budget 2, brake 3: all six tainted and drained together, their slots (each naming
    the unit) and their quarantines counted as one."""
    fleet = remediating(fake)
    domain_fault(fake, fleet, fleet_controller(fake))
    assert tainted(fake, fleet) == DOMAIN
    assert [a.inventory.name for a in fleet if disrupted(a)] == DOMAIN
    for agent in fleet[:len(DOMAIN)]:
        agent.settle(700.0)
    units = [lease["metadata"]["name"] for lease in fake[0].list_objects(LEASE_RESOURCE, "gpu-health")
             if (lease["metadata"].get("annotations") or {}).get(UNIT_ANNOTATION) == UNIT]
    assert len(units) == len(DOMAIN)


@pytest.mark.fake_only
def test_a_unit_leaves_the_other_nodes_the_rest_of_the_budget(fake):
    """With the domain out as one unit, one node elsewhere with its own fatal fault takes the second place;
    a third is refused."""
    fleet = remediating(fake)
    domain_fault(fake, fleet, fleet_controller(fake))
    fleet[10].fault(0, at=500.0)
    fleet[11].fault(0, at=501.0)
    assert [a.inventory.name for a in fleet if disrupted(a)] == [*DOMAIN, "n10"]


@pytest.mark.fake_only
def test_without_the_controller_the_domain_goes_node_by_node_under_the_brake_and_budget(fake):
    """No controller, no unit: the brake lets max(2, 15 % of 20) = 3 nodes be tainted, the budget drains 2."""
    fleet = remediating(fake, controller=False)
    domain_fault(fake, fleet, None)
    assert len(tainted(fake, fleet)) == 3
    assert len([a for a in fleet if disrupted(a)]) == 2


@pytest.mark.fake_only
def test_a_unit_is_announced_by_one_event_naming_the_domain(fake):
    """One FleetCorrelation Event, action TakeOut, on the holds ConfigMap, naming the fabric domain and unit."""
    fleet = remediating(fake)
    domain_fault(fake, fleet, fleet_controller(fake))
    [event] = [e for e in fake[0].events() if e.get("reason") == "FleetCorrelation"]
    assert event["action"] == "TakeOut" and event["regarding"]["kind"] == "ConfigMap"
    assert "the NVLink fabric domain fabric-1" in event["note"] and f"unit {UNIT}" in event["note"]

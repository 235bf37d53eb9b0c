"""Issue 24 (d) on the real control plane: the fleet controller, on its own ServiceAccount's token, publishes a
fabric fault confined to one fabric domain as a unit, and an agent's reader finds the unit with its nodes."""

from __future__ import annotations

import pytest

from agent.engine import builtin_rules_dir, load_rules
from agent.fleet import CorrelationPolicy, FaultSummary, NodeSummary
from agent.fleet.published import HOLDS_CONFIGMAP, SUMMARY_ANNOTATION, decode
from agent.fleetapi.fleet_gate import FleetGate
from agent.fleetctl.controller import FleetController
from agent.fleetctl.settings import FleetSettings
from agent.k8s.client import load_api_client
from agent.k8s.events import EventRecorder
from agent.k8s.raw import RawApi
from agent.model import Action, FaultClass, Severity
from tests.realcluster.controlplane import AGENT_NAMESPACE, ControlPlane, wait_until
from tests.realcluster.test_fleet import Clock, fleet_client, watching

pytestmark = pytest.mark.usefixtures("no_retry_sleep")


def publish(plane: ControlPlane, name: str, domain: str, *, faulty: bool) -> None:
    """The node's summary as its agent publishes it: its fabric domain, and a fatal NVSwitch SXid or none."""
    faults = (FaultSummary("sxid-fatal", FaultClass.INTERCONNECT, Severity.FATAL, Action.REBOOT_NODE),) \
        if faulty else ()
    text = NodeSummary(node=name, uptime_seconds=86400.0, fabric_domain=domain, faults=faults).to_json()
    plane.core.patch_node(name, {"metadata": {"annotations": {SUMMARY_ANNOTATION: text}}})


def test_an_nvswitch_fault_of_one_domain_is_published_as_a_unit_of_the_whole_domain(control_plane):
    """Four of a domain's five nodes with a fatal SXid: one unit naming all five, read back by an agent's
    fleet reader as a live unit."""
    plane = control_plane
    domain = plane.unique("fabric")
    names = [plane.unique("unit") for _ in range(5)]
    for name in names:
        plane.add_gpu_node(name, gpus=8)
    raw = RawApi(fleet_client(plane))
    clock = Clock()
    settings = FleetSettings(namespace=AGENT_NAMESPACE, policy=CorrelationPolicy(min_nodes=3, min_group=4))
    controller = FleetController(raw, settings, identity="fleet-unit-test", clock=clock,
                                 events=EventRecorder(raw, instance="fleet-unit-test", namespace=AGENT_NAMESPACE,
                                                      fold_seconds=0.0))
    with watching(controller, raw.api_client):
        for i, name in enumerate(names):
            publish(plane, name, domain, faulty=i < 4)
        wait_until(lambda: all(n in controller.view.summaries for n in names), "the summaries over the watch")
        controller.reconcile()  # the fault is new: its domain's cause settles (--unit-settle), nothing named
        clock.now += settings.unit_settle_seconds
        controller.reconcile()
    published = plane.core.read_namespaced_config_map(HOLDS_CONFIGMAP, AGENT_NAMESPACE)
    [unit] = [h for h in decode(published.data, observed_at=0.0) if h.key == domain]
    assert unit.unit and unit.nodes == set(names)
    admin = load_api_client(kubeconfig=str(plane.admin_kubeconfig))[0]
    # Wired as an agent's is: its own rules say whether the unit's rule is a fabric fault.
    gate = FleetGate(RawApi(admin), namespace=AGENT_NAMESPACE, gpu_node_selector="", brake=None,
                     rule_class=load_rules(builtin_rules_dir()).fault_class_of)
    assert gate.units()[unit.id] == frozenset(names)

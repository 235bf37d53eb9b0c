"""The log lines an operator greps for when the budget, the Node mirror or the fleet controller's leadership
goes wrong (issue 40 found them asserted nowhere): each is logged with what it is about."""

from __future__ import annotations

import threading
from typing import Any
from unittest import mock

import pytest

from agent.fleetapi.budget_slots import slot_name
from agent.fleetapi.leader import LeaderElector, LeaseConfig
from agent.fleetctl.controller import FleetController
from agent.k8s.client import client_for
from agent.k8s.errors import status_error
from agent.k8s.events import EventRecorder
from agent.k8s.raw import RawApi
from agent.k8s.watch import ListWatch, WatchOptions
from agent.logs import capture_logs
from tests.integration.test_budget import LEASE_RESOURCE, Clock, budget, slots, three_gpu_nodes
from tests.integration.test_fleet_controller import NS, SETTINGS, _wait, add_nodes
from tests.k8s_helpers import gpu_node, make_agent

pytestmark = pytest.mark.usefixtures("no_retry_sleep")


@pytest.fixture
def fake():
    cluster, server = three_gpu_nodes()
    yield cluster, server
    server.stop()


def lines(captured: list[dict[str, object]], event: str) -> list[dict[str, object]]:
    return [e for e in captured if e["event"] == event]


def test_a_disrupted_node_whose_slot_the_budget_no_longer_grants_logs_slot_not_renewed(fake):
    """n1 is disrupted (Xid 79: its pod evicted) and holds the budget's one slot; an operator deletes the slot
    and n2 takes the budget: n1's renewal is refused, one warning says why."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), populate_node=False)
    agent.fault(0)
    assert slots(cluster) == {slot_name("n1")}
    cluster.delete(LEASE_RESOURCE, "gpu-health", slot_name("n1"))
    assert budget(server, "n2", Clock()).acquire().held
    with capture_logs() as captured:
        agent.settle(700.0)  # past the slot's renewal period (600 s)
    [line] = lines(captured, "slot_not_renewed")
    assert line["log_level"] == "warning" and "budget spent" in str(line["reason"]) and line["node"] == "n1"


def test_a_failing_budget_write_is_logged_as_budget_slot_failed_with_its_error(fake):
    """The disruption label (the slot's view on the Node) cannot be written: one warning names the API's
    error (the next pass repairs the label: test_budget.py)."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), populate_node=False)
    agent.side.gate.show = mock.Mock(  # type: ignore[method-assign]
        side_effect=status_error(503, "Service Unavailable", ""))
    with capture_logs() as captured:
        agent.fault(0)
    [line] = lines(captured, "budget_slot_failed")
    assert line["log_level"] == "warning" and "503" in str(line["error"])


def test_a_failing_record_mirror_is_logged_as_mirror_failed_and_the_pass_goes_on(fake):
    """The record's copy on the Node cannot be written: one error line names it, and the pass's other steps
    (the taint, the eviction) are carried out all the same."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), populate_node=False)

    class RefusedMirror:
        """The agent's actuator, whose record mirror the API server refuses."""

        def __getattr__(self, name: str) -> Any:
            return getattr(agent.actuator, name)

        def mirror(self, document: Any) -> None:
            raise status_error(422, "Unprocessable Entity", "metadata.annotations: Too long")

    agent.pipeline.runner.actuator = RefusedMirror()
    with capture_logs() as captured:
        outcome = agent.fault(0)
    [line] = lines(captured, "mirror_failed")
    assert line["log_level"] == "error" and "422 Unprocessable Entity" in str(line["error"])
    assert cluster.node("n1")["spec"].get("taints") and any(a.step.kind.value == "evict" for a in outcome.actions)


def test_the_fleet_controller_logs_when_it_starts_and_stops_leading():
    """`fleet_leader` with leading=true once elected, and leading=false when it gives the Lease back on the
    way out: who led when, from the controller's own log."""
    from tests.k8s_helpers import start_cluster

    cluster, server = start_cluster()
    try:
        add_nodes(cluster, 3)
        raw = RawApi(client_for(server.url))
        controller = FleetController(raw, SETTINGS, identity="fleet-a",
                                     events=EventRecorder(raw, instance="a", namespace=NS))
        nodes = ListWatch(client_for(server.url), "/api/v1/nodes", WatchOptions(metadata_only=True))
        elector = LeaderElector(raw, LeaseConfig(namespace=NS, name="fleet", identity="fleet-a", retry_seconds=0.2,
                                                 renew_deadline_seconds=5, lease_seconds=10))
        stop = threading.Event()
        with capture_logs() as captured:
            thread = threading.Thread(target=controller.run, kwargs={"stop": stop, "nodes": nodes, "elector": elector},
                                      daemon=True)
            thread.start()
            try:
                _wait(lambda: elector.leading, "leading")
            finally:
                stop.set()
                thread.join(timeout=10)
        said = [(e["identity"], e["leading"]) for e in lines(captured, "fleet_leader")]
        assert said == [("fleet-a", True), ("fleet-a", False)]
    finally:
        server.stop()

"""The fleet controller on the real control plane: its watch, its Lease, its holds and Events, on the fleet
ServiceAccount's own token, and daemonset/fleet/rbac.yaml derived from what the audit log shows it did."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from agent.fleet import CorrelationPolicy, FaultSummary, NodeSummary
from agent.fleet.published import HOLDS_CONFIGMAP, LEASE_NAME, SUMMARY_ANNOTATION, decode
from agent.fleetapi.leader import LeaderElector, LeaseConfig
from agent.fleetctl.controller import FleetController
from agent.fleetctl.settings import FleetSettings
from agent.k8s.client import load_api_client
from agent.k8s.events import EventRecorder
from agent.k8s.raw import RawApi
from agent.k8s.watch import ListWatch, WatchOptions
from agent.model import Action, FaultClass, Severity
from tests.realcluster.controlplane import (
    AGENT_NAMESPACE,
    FLEET_USER,
    REPO,
    ControlPlane,
    audit_events,
    wait_until,
)
from tests.realcluster.fleetbed import fleet_kubeconfig
from tests.realcluster.test_rbac_from_use import granted, used

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
FLEET_RBAC = REPO / "daemonset" / "fleet" / "rbac.yaml"
JOB = "fleet-ml/Job/train"


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def fleet_client(plane: ControlPlane) -> Any:
    """An ApiClient on the fleet ServiceAccount's token, as the Deployment's pod would have."""
    return load_api_client(kubeconfig=str(fleet_kubeconfig(plane)))[0]


@contextlib.contextmanager
def watching(controller: FleetController, api: Any) -> Iterator[ListWatch]:
    """The controller's metadata-only watch of the Nodes on its own thread, open until the block ends."""
    nodes = ListWatch(api, "/api/v1/nodes", WatchOptions(metadata_only=True))
    stop = threading.Event()
    watcher = threading.Thread(target=nodes.run, daemon=True, kwargs={
        "stop": stop, "on_sync": controller.on_sync, "on_event": controller.on_event})
    watcher.start()
    try:
        wait_until(lambda: nodes.watches, "the watch")
        yield nodes
    finally:
        stop.set()
        nodes.close()
        watcher.join(timeout=30)


def annotate(plane: ControlPlane, name: str, *rules: str) -> None:
    faults = tuple(FaultSummary(r, FaultClass.APPLICATION, Severity.FATAL, Action.QUARANTINE, owners=(JOB,))
                   for r in rules)
    text = NodeSummary(node=name, uptime_seconds=86400.0, workloads=(JOB,), faults=faults).to_json()
    plane.core.patch_node(name, {"metadata": {"annotations": {SUMMARY_ANNOTATION: text}}})


def test_the_fleet_controller_correlates_holds_and_uses_exactly_what_its_rbac_grants(control_plane):
    """Four nodes of one job with Xid 13: elected on the Lease, the controller lists and watches the Nodes
    (metadata only), publishes one hold, renews it and puts one Event on the Job; nothing it did was denied and
    nothing granted went unused."""
    plane = control_plane
    plane.ensure_namespace("fleet-ml")
    names = [plane.unique("fleet") for _ in range(4)]
    for name in names:
        plane.add_gpu_node(name, gpus=8)
    api = fleet_client(plane)
    plane.forget("coordination.k8s.io", "leases", AGENT_NAMESPACE, LEASE_NAME)
    plane.forget("", "configmaps", AGENT_NAMESPACE, HOLDS_CONFIGMAP)
    # An earlier test's agents may have left the holds object: this controller must create it itself.
    with contextlib.suppress(ApiException):
        plane.core.delete_namespaced_config_map(HOLDS_CONFIGMAP, AGENT_NAMESPACE)
    start = len(audit_events(plane.audit_log, user=FLEET_USER))
    raw = RawApi(api)
    clock = Clock()
    elector = LeaderElector(raw, LeaseConfig(namespace=AGENT_NAMESPACE, name=LEASE_NAME, identity="fleet-test"),
                            clock=clock)
    assert elector.try_acquire_or_renew()  # created
    assert elector.try_acquire_or_renew()  # renewed
    settings = FleetSettings(namespace=AGENT_NAMESPACE, policy=CorrelationPolicy(min_nodes=3, min_group=4))
    controller = FleetController(raw, settings, identity="fleet-test", clock=clock,
                                 events=EventRecorder(raw, instance="fleet-test", namespace=AGENT_NAMESPACE,
                                                      fold_seconds=0.0))
    with watching(controller, api):
        for name in names:
            annotate(plane, name, "xid-13")
        wait_until(lambda: all(n in controller.view.summaries for n in names), "the summaries over the watch")
        assert len(controller.reconcile()) == 1  # creates the holds object
        clock.now += 120.0
        controller.reconcile()  # renews it: an update under the version read
    holds_object = plane.core.read_namespaced_config_map(HOLDS_CONFIGMAP, AGENT_NAMESPACE)
    [held] = decode(holds_object.data, observed_at=0.0)
    assert held.rule_id == "xid-13" and set(names) <= held.nodes
    events = [e for e in plane.rest("GET", "/apis/events.k8s.io/v1/namespaces/fleet-ml/events")["items"]
              if e.get("reason") == "FleetCorrelation"]
    assert [(e["regarding"]["kind"], e["regarding"]["name"]) for e in events] == [("Job", "train")]
    elector.release()

    def audited() -> list[dict[str, Any]]:
        return audit_events(plane.audit_log, user=FLEET_USER)[start:]

    wait_until(lambda: any(e["verb"] == "watch" for e in audited()), "the watch's audit record")
    events_seen = audited()
    denied = [(e["verb"], e["requestURI"]) for e in events_seen if e["responseStatus"]["code"] == 403]
    assert denied == []
    assert used(events_seen) - granted(FLEET_RBAC) == set(), "used but not granted"
    assert granted(FLEET_RBAC) - used(events_seen) == set(), "granted but never used: remove it"


def test_a_standby_takes_the_lease_only_after_the_leader_stops_renewing(control_plane):
    """Two candidates on the real Lease: B waits while A renews, and takes over a lease duration (on B's own
    clock) after A's last renewal; A's release hands over at once."""
    plane = control_plane
    plane.ensure_namespace(AGENT_NAMESPACE)  # in a random order, this may be the session's first fleet test
    raw = RawApi(load_api_client(kubeconfig=str(plane.admin_kubeconfig))[0])
    name = plane.unique("lease")
    plane.forget("coordination.k8s.io", "leases", AGENT_NAMESPACE, name)
    a_clock, b_clock = Clock(), Clock(0.0)
    a = LeaderElector(raw, LeaseConfig(namespace=AGENT_NAMESPACE, name=name, identity="a"), clock=a_clock)
    b = LeaderElector(raw, LeaseConfig(namespace=AGENT_NAMESPACE, name=name, identity="b"), clock=b_clock)
    assert a.try_acquire_or_renew()
    for _ in range(3):
        time.sleep(0.01)  # a renewTime with a new microsecond: a record B sees change
        assert a.try_acquire_or_renew()
        b_clock.now += 10.0
        assert not b.try_acquire_or_renew()
    b_clock.now += 15.1
    assert b.try_acquire_or_renew() and b.leading
    assert b.release()
    assert a.try_acquire_or_renew()


def test_a_metadata_only_watch_resumes_across_the_servers_timeout(control_plane):
    """On the real server: PartialObjectMetadata lists and watches; a watch the server ends (timeoutSeconds)
    is resumed from the last resourceVersion without a relist, and no change is missed or repeated."""
    plane = control_plane
    api = load_api_client(kubeconfig=str(plane.admin_kubeconfig))[0]
    prefix = plane.unique("watch")
    lw = ListWatch(api, "/api/v1/nodes", WatchOptions(metadata_only=True, watch_seconds=1,
                                                      label_selector=f"watch-test={prefix}"))
    seen: list[tuple[str, str, str]] = []
    stop = threading.Event()
    thread = threading.Thread(target=lw.run, daemon=True, kwargs={
        "stop": stop, "on_sync": lambda items: None,
        "on_event": lambda kind, obj: seen.append((kind, obj["metadata"]["name"], obj.get("kind", "")))})
    thread.start()
    try:
        wait_until(lambda: lw.watches, "the first watch")
        for index in range(2):
            name = f"{prefix}-{index}"
            plane.core.create_node({"metadata": {"name": name, "labels": {"watch-test": prefix}}})
            plane.forget("", "nodes", "", name)
            first = lw.watches
            wait_until(lambda first=first: lw.watches > first + 1, "the server ending a watch and a resume")
        wait_until(lambda: len([e for e in seen if e[0] == "ADDED"]) >= 2, "both nodes")
    finally:
        stop.set()
        lw.close()
        thread.join(timeout=30)
    assert lw.lists == 1
    # (the node lifecycle controller's changes to them come as MODIFIED events in between)
    assert [e for e in seen if e[0] == "ADDED"] == [("ADDED", f"{prefix}-0", "PartialObjectMetadata"),
                                                    ("ADDED", f"{prefix}-1", "PartialObjectMetadata")]
    assert {e[2] for e in seen} == {"PartialObjectMetadata"}

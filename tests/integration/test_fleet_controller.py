"""The fleet controller over the fake API server: summaries in, one hold and one Event out per cause,
restart-safe, and an operator's edits kept."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.fleet import CorrelationPolicy, Dimension, FaultSummary, Hold, NodeSummary
from agent.fleet.published import (
    ALIVE_KEY,
    HEARD_KEY,
    HOLDS_CONFIGMAP,
    QUARANTINE_LABEL,
    SUMMARY_ANNOTATION,
    decode,
    decode_census,
    decode_heard,
)
from agent.fleetapi.holds_store import Deposed, HoldsStore
from agent.fleetapi.leader import LeaderElector, LeaseConfig
from agent.fleetctl.controller import FleetController
from agent.fleetctl.settings import FleetSettings
from agent.k8s.client import client_for
from agent.k8s.events import EventRecorder
from agent.k8s.raw import RawApi
from agent.k8s.watch import ListWatch, WatchOptions
from agent.logs import capture_logs
from agent.model import Action, FaultClass, Severity
from agent.simulation.fake_apiserver import ApiError, FakeApiServer, FakeCluster
from agent.simulation.fake_apiserver.resources import RESOURCES

pytestmark = pytest.mark.usefixtures("no_retry_sleep")
NS = "gpu-health"
JOB = "ml/Job/train"
SETTINGS = FleetSettings(namespace=NS, policy=CorrelationPolicy(min_nodes=3), hold_seconds=600.0,
                         max_hold_seconds=3600.0, tick_seconds=600.0, settle_seconds=0.0)
NODES = next(r for r in RESOURCES if r.plural == "nodes")


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    fake = FakeApiServer(FakeCluster()).start()
    yield fake
    fake.stop()


def summary(name: str, *faults: tuple[str, FaultClass], owner: str = JOB, driver: str = "570.86.15") -> str:
    return NodeSummary(node=name, driver_version=driver, uptime_seconds=86400.0, workloads=(owner,), faults=tuple(
        FaultSummary(rule, cls, Severity.FATAL, Action.QUARANTINE, owners=(owner,) if cls is FaultClass.APPLICATION
                     else ()) for rule, cls in faults)).to_json()


def add_nodes(cluster: FakeCluster, count: int, *faults: tuple[str, FaultClass], **kw: Any) -> list[str]:
    names = [f"gpu-{i}" for i in range(count)]
    for name in names:
        cluster.add("nodes", {"metadata": {"name": name, "annotations": {SUMMARY_ANNOTATION: summary(name, *faults,
                                                                                                      **kw)}}})
    return names


def set_faults(cluster: FakeCluster, name: str, *faults: tuple[str, FaultClass]) -> None:
    cluster.patch(NODES, "", name, "application/merge-patch+json",
                  {"metadata": {"annotations": {SUMMARY_ANNOTATION: summary(name, *faults)}}})


def controller(server: FakeApiServer, clock: Clock, identity: str = "fleet-a", *,
               wall: Clock | None = None) -> FleetController:
    raw = RawApi(client_for(server.url))
    made = FleetController(raw, SETTINGS, identity=identity, clock=clock, wall=wall or Clock(1.7e9),
                           events=EventRecorder(raw, instance=identity, namespace=NS))
    made.on_sync(server.cluster.list_objects(NODES, None))
    return made


def published(server: FakeApiServer, clock: Clock) -> list[Hold]:
    store = HoldsStore(RawApi(client_for(server.url)), NS, writer="test", clock=clock, wall=lambda: 0.0)
    return store.read()[0]  # a wall clock behind every writer's: placed as just written


def holds_data(server: FakeApiServer) -> dict[str, str]:
    raw = RawApi(client_for(server.url))
    return dict(raw.get(f"/api/v1/namespaces/{NS}/configmaps/{HOLDS_CONFIGMAP}").get("data") or {})


def fleet_events(server: FakeApiServer) -> list[dict[str, Any]]:
    return [e for e in server.cluster.events() if e.get("reason") == "FleetCorrelation"]


XID13 = ("xid-13", FaultClass.APPLICATION)


def test_a_correlated_fault_is_published_as_one_hold_covering_the_group(server):
    """Xid 13 on the four nodes of one job: one hold for xid-13 on those nodes, in the holds ConfigMap."""
    add_nodes(server.cluster, 4, XID13)
    clock = Clock()
    controller(server, clock).reconcile()
    [held] = published(server, clock)
    assert (held.rule_id, held.dimension, held.key) == ("xid-13", Dimension.WORKLOAD, JOB)
    assert held.nodes == {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}
    assert held.expires_at == pytest.approx(clock.now + 600.0, abs=1.0)


def test_a_new_correlation_is_announced_once_on_the_workload(server):
    """One Event, on the Job, naming the job as the cause; later passes announce nothing more."""
    add_nodes(server.cluster, 4, XID13)
    clock = Clock()
    made = controller(server, clock)
    assert len(made.reconcile()) == 1
    clock.now += 30.0
    assert made.reconcile() == []
    [event] = fleet_events(server)
    assert event["regarding"] == {"apiVersion": "batch/v1", "kind": "Job", "namespace": "ml", "name": "train"}
    assert "the workload ml/Job/train" in event["note"] and event["action"] == "Hold"


def test_a_cause_that_is_no_workload_is_announced_on_the_holds_object(server):
    """GSP timeouts on every node of one driver version: the Event names the driver, on the holds ConfigMap."""
    add_nodes(server.cluster, 4, ("xid-119", FaultClass.DRIVER))
    controller(server, Clock()).reconcile()
    [event] = fleet_events(server)
    assert event["regarding"]["kind"] == "ConfigMap" and event["regarding"]["name"] == HOLDS_CONFIGMAP
    assert "the driver version 570.86.15" in event["note"]


def test_a_hardware_cause_is_announced_but_never_held(server):
    """Double-bit ECC on many nodes is each node's own evidence: an Event, no hold."""
    add_nodes(server.cluster, 4, ("xid-48", FaultClass.HARDWARE))
    controller(server, Clock()).reconcile()
    assert published(server, Clock()) == []
    [event] = fleet_events(server)
    assert event["action"] == "Correlate"


def test_a_restarted_controller_adopts_the_published_holds_and_announces_nothing_again(server):
    """A new process (fresh view, other clock) keeps the one hold, with its expiry, and sends no second Event."""
    add_nodes(server.cluster, 4, XID13)
    first_clock = Clock(1000.0)
    controller(server, first_clock).reconcile()
    before = published(server, Clock(0.0))
    clock = Clock(50_000.0)
    assert controller(server, clock, identity="fleet-b").reconcile() == []
    after = published(server, Clock(0.0))
    assert [h.id for h in after] == [h.id for h in before]
    assert after[0].started_at == pytest.approx(before[0].started_at, abs=1.0)
    assert len(fleet_events(server)) == 1


def test_a_restart_after_the_faults_ended_keeps_the_hold_until_it_expires(server):
    """The cause no longer stands when the new controller starts: the hold lives out its last renewal, it is
    not dropped by a controller that never saw it."""
    names = add_nodes(server.cluster, 4, XID13)
    wall = Clock(1.7e9)
    controller(server, Clock(), wall=wall).reconcile()
    for name in names:
        set_faults(server.cluster, name)
    clock = Clock(7.0)
    controller(server, clock, identity="fleet-b", wall=wall).reconcile()
    assert [h.rule_id for h in published(server, clock)] == ["xid-13"]
    clock.now += 601.0
    wall.now += 601.0
    controller(server, clock, identity="fleet-c", wall=wall).reconcile()
    assert published(server, clock) == []


def test_an_operators_hold_written_between_passes_is_kept(server):
    """The controller reads the object each pass: a hold an operator added is published on, not overwritten."""
    add_nodes(server.cluster, 4, XID13)
    clock = Clock()
    made = controller(server, clock)
    made.reconcile()
    store = HoldsStore(RawApi(client_for(server.url)), NS, writer="operator", clock=clock, wall=lambda: 1.7e9)
    mine = Hold("operator/xid-31/x", "xid-31", FaultClass.APPLICATION, Dimension.OPERATOR, "gpu-9", "by hand",
                frozenset({"gpu-9"}), clock.now, clock.now + 3000.0, by_operator=True)
    store.update(lambda holds: [*holds, mine])
    clock.now += 10.0
    made.reconcile()
    assert {h.id for h in published(server, clock)} == {"xid-13/workload/ml/Job/train", "operator/xid-31/x"}


def test_a_released_hold_is_not_started_again_while_its_cause_stands(server):
    """Released (spent) by an operator, a correlated hold stays spent on the next passes: its nodes act."""
    add_nodes(server.cluster, 4, XID13)
    clock = Clock()
    made = controller(server, clock)
    made.reconcile()
    store = HoldsStore(RawApi(client_for(server.url)), NS, writer="operator", clock=clock, wall=lambda: 1.7e9)
    store.update(lambda holds: [Hold(**{**{f: getattr(h, f) for f in Hold.__slots__},  # type: ignore[arg-type]
                                        "spent": True, "expires_at": clock.now}) for h in holds])
    clock.now += 10.0
    made.reconcile()
    [held] = published(server, clock)
    assert held.spent and held.expires_at <= clock.now


def test_rereading_an_unchanged_object_does_not_move_an_expiry(server):
    """A version seen before keeps its placement: reading it again later does not push the expiry out."""
    add_nodes(server.cluster, 4, XID13)
    writer_clock = Clock()
    controller(server, writer_clock).reconcile()
    clock = Clock(0.0)
    store = HoldsStore(RawApi(client_for(server.url)), NS, writer="reader", clock=clock, wall=lambda: 0.0)
    first = store.read()[0][0].expires_at
    clock.now += 500.0
    assert store.read()[0][0].expires_at == first


def test_a_pass_that_changes_nothing_writes_nothing(server):
    """Renewal moves the expiry, so a pass writes; with the hold and its nodes unchanged within a second, no."""
    add_nodes(server.cluster, 4, XID13)
    clock = Clock()
    made = controller(server, clock)
    made.reconcile()
    writes = made.store.writes
    made.reconcile()
    assert made.store.writes == writes


def test_a_pass_publishes_the_holdable_faults_it_heard_of(server):
    """Two nodes with Xid 13 (no cause yet) and one with a DBE: the word names the two, never the hardware
    fault (no node waits for the controller's word on one)."""
    add_nodes(server.cluster, 2, XID13)
    server.cluster.add("nodes", {"metadata": {"name": "gpu-9", "annotations": {
        SUMMARY_ANNOTATION: summary("gpu-9", ("xid-48", FaultClass.HARDWARE))}}})
    controller(server, Clock(), wall=Clock(1.7e9)).reconcile()
    heard, alive_until = decode_heard(holds_data(server))
    assert heard == {"xid-13": frozenset({"gpu-0", "gpu-1"})}
    assert alive_until == 1.7e9 + 3 * SETTINGS.tick_seconds


def test_a_new_sighting_alone_is_published_at_the_next_pass(server):
    """The holds are unchanged (still no cause), but a third node's fault is news a settling node waits for."""
    add_nodes(server.cluster, 1, XID13)
    clock = Clock()
    made = controller(server, clock)
    made.reconcile()
    server.cluster.add("nodes", {"metadata": {"name": "gpu-7", "annotations": {
        SUMMARY_ANNOTATION: summary("gpu-7", ("xid-31", FaultClass.APPLICATION))}}})
    made.on_sync(server.cluster.list_objects(NODES, None))
    made.reconcile()
    assert decode_heard(holds_data(server))[0] == {"xid-13": frozenset({"gpu-0"}), "xid-31": frozenset({"gpu-7"})}


def test_an_idle_controller_writes_again_before_its_promise_lapses(server):
    """Nothing changes, yet a tick later the pass renews its promise (every third of it), so agents can tell
    a live controller from a gone one."""
    add_nodes(server.cluster, 1, XID13)
    clock, wall = Clock(), Clock(1.7e9)
    made = controller(server, clock, wall=wall)
    made.reconcile()
    writes = made.store.writes
    clock.now += SETTINGS.tick_seconds
    wall.now += SETTINGS.tick_seconds
    made.reconcile()
    assert made.store.writes == writes + 1
    assert float(holds_data(server)[ALIVE_KEY]) == wall.now + 3 * SETTINGS.tick_seconds


def test_an_operators_write_carries_the_controllers_word_over(server):
    """`fleet hold` between two passes keeps what the controller heard and its promise, unchanged."""
    add_nodes(server.cluster, 2, XID13)
    clock = Clock()
    controller(server, clock).reconcile()
    word = {k: v for k, v in holds_data(server).items() if k in (HEARD_KEY, ALIVE_KEY)}
    store = HoldsStore(RawApi(client_for(server.url)), NS, writer="operator", clock=clock, wall=lambda: 1.7e9)
    mine = Hold("operator/xid-31/x", "xid-31", FaultClass.APPLICATION, Dimension.OPERATOR, "gpu-9", "by hand",
                frozenset({"gpu-9"}), clock.now, clock.now + 3000.0, by_operator=True)
    store.update(lambda holds: [*holds, mine])
    data = holds_data(server)
    assert data["writer"] == "operator" and {k: data[k] for k in word} == word


def test_metrics_show_the_standing_correlation_and_the_live_hold(server):
    """gpu_health_fleet_correlation{rule,dimension,key} 1 and one live correlated hold on four nodes."""
    add_nodes(server.cluster, 4, XID13)
    made = controller(server, Clock())
    made.reconcile()
    text = made.metrics.exposition().decode()
    assert 'gpu_health_fleet_correlation{dimension="workload",key="ml/Job/train",rule="xid-13"} 1.0' in text
    assert 'gpu_health_fleet_holds{origin="correlated",state="live"} 1.0' in text
    assert "gpu_health_fleet_held_nodes 4.0" in text
    assert 'gpu_health_fleet_nodes{summary="valid"} 4.0' in text


def test_the_running_leader_publishes_a_hold_when_a_watched_summary_changes(server):
    """run(): elected, it lists and watches the Nodes; faults arriving on the watch lead to a pass and a hold
    without waiting for the tick."""
    names = add_nodes(server.cluster, 4)
    raw = RawApi(client_for(server.url))
    made = FleetController(raw, SETTINGS, identity="fleet-a", events=EventRecorder(raw, instance="a", namespace=NS))
    nodes = ListWatch(client_for(server.url), "/api/v1/nodes", WatchOptions(metadata_only=True))
    elector = LeaderElector(raw, LeaseConfig(namespace=NS, name="fleet", identity="fleet-a", retry_seconds=0.2,
                                             renew_deadline_seconds=5, lease_seconds=10))
    stop = threading.Event()
    thread = threading.Thread(target=made.run, kwargs={"stop": stop, "nodes": nodes, "elector": elector},
                              daemon=True)
    thread.start()
    try:
        _wait(lambda: elector.leading and nodes.watches, "leading and watching")
        for name in names:
            set_faults(server.cluster, name, XID13)
        _wait(lambda: _held(server), "the hold published")
    finally:
        stop.set()
        thread.join(timeout=10)
    assert [h.rule_id for h in _held(server)] == ["xid-13"]
    assert not thread.is_alive()
    lease = raw.get(f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/fleet")
    assert lease["spec"]["holderIdentity"] == ""  # released on the way out


def test_a_standby_publishes_nothing(server):
    """While another candidate holds the Lease, run() watches but writes no holds and no Events."""
    add_nodes(server.cluster, 4, XID13)
    raw = RawApi(client_for(server.url))
    other = LeaderElector(raw, LeaseConfig(namespace=NS, name="fleet", identity="other"))
    assert other.try_acquire_or_renew()
    made = FleetController(raw, SETTINGS, identity="fleet-a", events=EventRecorder(raw, instance="a", namespace=NS))
    nodes = ListWatch(client_for(server.url), "/api/v1/nodes")
    elector = LeaderElector(raw, LeaseConfig(namespace=NS, name="fleet", identity="fleet-a", retry_seconds=0.2,
                                             renew_deadline_seconds=5, lease_seconds=10))
    stop = threading.Event()
    thread = threading.Thread(target=made.run, kwargs={"stop": stop, "nodes": nodes, "elector": elector},
                              daemon=True)
    thread.start()
    try:
        _wait(lambda: nodes.watches and len(made.view.summaries) == 4, "the standby's view")
        made.changed.set()
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert _held(server) == [] and fleet_events(server) == []


def _held(server: FakeApiServer) -> list[Hold]:
    try:
        obj = server.cluster.get(next(r for r in RESOURCES if r.plural == "configmaps"), NS, HOLDS_CONFIGMAP)
    except ApiError:  # not created yet
        return []
    return decode(obj.get("data"), observed_at=0.0)


def _wait(predicate: Any, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


def test_a_write_that_conflicts_reads_the_object_again_and_publishes(server):
    """A 409 on the holds write (someone wrote in between) is a fresh read and the change applied again."""
    add_nodes(server.cluster, 4, XID13)
    clock = Clock()
    made = controller(server, clock)
    made.reconcile()
    clock.now += 120.0
    server.cluster.faults.fail_next_writes.append(409)
    made.reconcile()
    [held] = published(server, clock)
    assert held.expires_at == pytest.approx(clock.now + 600.0, abs=1.0)


def test_a_broken_holds_object_is_reported_kept_and_not_overwritten(server):
    """A holds object someone broke by hand: the running controller counts the failure and keeps trying;
    it never overwrites what it cannot read (an operator's holds may be in it)."""
    add_nodes(server.cluster, 4, XID13)
    server.cluster.add("configmaps", {"metadata": {"name": HOLDS_CONFIGMAP, "namespace": NS},
                                      "data": {"holds.json": "[{", "written": "1"}}, namespace=NS)
    raw = RawApi(client_for(server.url))
    made = FleetController(raw, SETTINGS, identity="fleet-a", events=EventRecorder(raw, instance="a", namespace=NS))
    nodes = ListWatch(client_for(server.url), "/api/v1/nodes")
    elector = LeaderElector(raw, LeaseConfig(namespace=NS, name="fleet", identity="fleet-a", retry_seconds=0.2,
                                             renew_deadline_seconds=5, lease_seconds=10))
    stop = threading.Event()
    thread = threading.Thread(target=made.run, kwargs={"stop": stop, "nodes": nodes, "elector": elector},
                              daemon=True)
    thread.start()
    try:
        _wait(lambda: made.metrics.errors.labels("holds")._value.get() >= 2, "two failed passes")
    finally:
        stop.set()
        thread.join(timeout=10)
    obj = server.cluster.get(next(r for r in RESOURCES if r.plural == "configmaps"), NS, HOLDS_CONFIGMAP)
    assert obj["data"]["holds.json"] == "[{"


GPU = {"nvidia.com/gpu.present": "true"}


def quarantined(name: str, since: float = 1.7e9 - 30.0) -> str:
    return NodeSummary(node=name, driver_version="570.86.15", quarantined_since=since).to_json()


def test_a_pass_publishes_the_census_of_gpu_nodes_and_unlabelled_quarantines(server):
    """Two GPU nodes (one quarantined by an older agent, no label; one by a current agent, labelled) and a
    CPU node: the census counts 2 GPU nodes and names the older agent's quarantine alone."""
    server.cluster.add("nodes", {"metadata": {"name": "old", "labels": GPU,
                                              "annotations": {SUMMARY_ANNOTATION: quarantined("old")}}})
    server.cluster.add("nodes", {"metadata": {"name": "new", "labels": {**GPU, QUARANTINE_LABEL: "1699999970"},
                                              "annotations": {SUMMARY_ANNOTATION: quarantined("new")}}})
    server.cluster.add("nodes", {"metadata": {"name": "cpu"}})
    controller(server, Clock()).reconcile()
    census = decode_census(holds_data(server))
    assert census is not None
    assert (census.selector, census.gpu_nodes, dict(census.unlabelled)) == (
        "nvidia.com/gpu.present=true", 2, {"old": 1.7e9 - 30.0})


def test_an_older_agents_new_quarantine_is_published_at_the_next_pass(server):
    """The brake must see it at once: an unlabelled quarantine is a change that writes."""
    server.cluster.add("nodes", {"metadata": {"name": "old", "labels": GPU,
                                              "annotations": {SUMMARY_ANNOTATION: summary("old")}}})
    made = controller(server, Clock())
    made.reconcile()
    server.cluster.patch(NODES, "", "old", "application/merge-patch+json",
                         {"metadata": {"annotations": {SUMMARY_ANNOTATION: quarantined("old")}}})
    made.on_sync(server.cluster.list_objects(NODES, None))
    made.reconcile()
    census = decode_census(holds_data(server))
    assert census is not None and set(census.unlabelled) == {"old"}


def test_a_gpu_node_joining_is_counted_at_the_next_promised_write_not_at_once(server):
    """A count of GPU nodes may be a tick old: a node joining alone writes nothing until the promise is due."""
    server.cluster.add("nodes", {"metadata": {"name": "a", "labels": GPU}})
    clock = Clock()
    made = controller(server, clock)
    made.reconcile()
    writes = made.store.writes
    server.cluster.add("nodes", {"metadata": {"name": "b", "labels": GPU}})
    made.on_sync(server.cluster.list_objects(NODES, None))
    made.reconcile()
    assert made.store.writes == writes
    clock.now += SETTINGS.tick_seconds
    made.reconcile()
    census = decode_census(holds_data(server))
    assert census is not None and census.gpu_nodes == 2


LINKS = ("nvlink-link-down", FaultClass.INTERCONNECT)


def add_domain(cluster: FakeCluster, domain: str, names: list[str], *faulty: str) -> None:
    """Nodes of one NVLink fabric domain; those in `faulty` show every link down."""
    for name in names:
        faults = (FaultSummary(*LINKS, Severity.FATAL, Action.QUARANTINE),) if name in faulty else ()
        text = NodeSummary(node=name, driver_version="570.86.15", fabric_domain=domain, uptime_seconds=86400.0,
                           faults=faults).to_json()
        cluster.add("nodes", {"metadata": {"name": name, "annotations": {SUMMARY_ANNOTATION: text}}})


def test_a_fabric_fault_of_one_domain_is_named_a_unit_only_once_it_stayed_there_for_the_unit_settle(server):
    """Links down on 4 of domain d1's 6 nodes: the first pass names nothing and says it heard none of them (they
    wait); once the fault stayed in d1 for the unit settle, the next pass takes d1 out as one unit."""
    add_domain(server.cluster, "d1", [f"a{i}" for i in range(6)], "a0", "a1", "a2", "a3")
    add_domain(server.cluster, "d2", [f"b{i}" for i in range(6)])
    clock = Clock()
    made = controller(server, clock)
    made.reconcile()
    assert published(server, clock) == [] and fleet_events(server) == []
    assert decode_heard(holds_data(server))[0] == {}
    assert made.recheck_at == clock.now + SETTINGS.unit_settle_seconds
    clock.now += SETTINGS.unit_settle_seconds
    made.reconcile()
    [unit] = published(server, clock)
    assert unit.unit and unit.key == "d1" and len(fleet_events(server)) == 1
    assert decode_heard(holds_data(server))[0] == {"nvlink-link-down": frozenset({"a0", "a1", "a2", "a3"})}


def test_a_fabric_fault_that_reaches_another_domain_while_settling_is_one_fabric_wide_hold(server):
    """Links down first on 3 nodes of d1, then on d2 too (every NVLink dropping, heard node by node): one hold
    naming the fabric across both domains, one Event, and no unit ever published."""
    add_domain(server.cluster, "d1", [f"a{i}" for i in range(6)], "a0", "a1", "a2")
    add_domain(server.cluster, "d2", [f"b{i}" for i in range(6)])
    clock = Clock()
    made = controller(server, clock)
    made.reconcile()
    for name in ("b0", "b1", "b2"):
        server.cluster.patch(NODES, "", name, "application/merge-patch+json", {"metadata": {"annotations": {
            SUMMARY_ANNOTATION: NodeSummary(node=name, driver_version="570.86.15", fabric_domain="d2",
                                            uptime_seconds=86400.0, faults=(FaultSummary(
                                                *LINKS, Severity.FATAL, Action.QUARANTINE),)).to_json()}}})
    clock.now += 5.0
    made.on_sync(server.cluster.list_objects(NODES, None))
    made.reconcile()
    clock.now += SETTINGS.unit_settle_seconds
    made.reconcile()
    [held] = published(server, clock)
    assert (held.dimension, held.key, held.unit, len(held.nodes)) == \
        (Dimension.FABRIC_DOMAIN, "several-domains", False, 12)
    assert len(fleet_events(server)) == 1


def test_an_entry_of_a_newer_format_is_kept_and_every_other_hold_renewed(server):
    """One holds entry this controller cannot read (a newer controller's dimension): its passes go on, the
    holds it can read are renewed, and the entry is written back as it was until its own expiry."""
    clock, wall = Clock(), Clock(1.7e9)
    add_nodes(server.cluster, 4, XID13)
    made = controller(server, clock, wall=wall)
    made.reconcile()
    raw = RawApi(client_for(server.url))
    path = f"/api/v1/namespaces/{NS}/configmaps/{HOLDS_CONFIGMAP}"
    entries = json.loads(holds_data(server)["holds.json"])
    newer = dict(entries[0], id="xid-13/pcie-switch/sw-3", dimension="pcie-switch", expires=1.7e9 + 900.0)
    raw.merge_patch(path, {"data": {"holds.json": json.dumps([*entries, newer])}})
    clock.now += 300.0
    wall.now += 300.0
    with capture_logs() as captured:
        made.reconcile()
    written = json.loads(holds_data(server)["holds.json"])
    assert [e["id"] for e in written] == ["xid-13/workload/ml/Job/train", "xid-13/pcie-switch/sw-3"]
    assert written[0]["expires"] > entries[0]["expires"] and written[1] == newer
    assert [e["event"] for e in captured].count("fleet_holds_entry_unread") == 1


def test_a_hold_that_ends_is_announced_once_on_the_holds_object(server):
    """The cause ended and the hold lived out its last renewal: one FleetHoldEnded Event says so, and a later
    pass sends no second one."""
    names = add_nodes(server.cluster, 4, XID13)
    clock, wall = Clock(), Clock(1.7e9)
    made = controller(server, clock, wall=wall)
    made.reconcile()
    for name in names:
        set_faults(server.cluster, name)
    made.on_sync(server.cluster.list_objects(NODES, None))
    clock.now += 601.0
    wall.now += 601.0
    made.reconcile()
    made.reconcile()
    ended = [e for e in server.cluster.events() if e.get("reason") == "FleetHoldEnded"]
    assert len(ended) == 1 and "xid-13/workload/ml/Job/train ended" in ended[0]["note"]
    assert ended[0]["regarding"]["name"] == HOLDS_CONFIGMAP


def test_a_hold_spent_while_its_cause_stands_is_announced(server):
    """A hold renewed for its whole bound while the faults go on is kept spent: one Event says its nodes act
    on the rule from now on."""
    add_nodes(server.cluster, 4, XID13)
    clock, wall = Clock(), Clock(1.7e9)
    made = controller(server, clock, wall=wall)
    made.settings = dataclasses.replace(SETTINGS, policy=CorrelationPolicy(min_nodes=3, window_seconds=1e6))
    made.reconcile()
    for _ in range(7):  # renewed each pass while the cause stands, up to max_hold (3,600 s)
        clock.now += 590.0
        wall.now += 590.0
        made.on_sync(server.cluster.list_objects(NODES, None))
        made.reconcile()
    spent = [e for e in server.cluster.events() if e.get("reason") == "FleetHoldEnded"]
    assert [("reached its longest life" in e["note"]) for e in spent] == [True]


def test_the_watch_is_not_kept_waiting_while_a_pass_correlates(server, monkeypatch):
    """A pass whose correlation takes long (hundreds of jobs at 10,000 nodes): the watch's events are taken
    in meanwhile, not queued behind the pass's lock."""
    import agent.fleetctl.controller as module

    add_nodes(server.cluster, 4, XID13)
    made = controller(server, Clock())
    entered, finish = threading.Event(), threading.Event()
    real = module.correlate

    def slow(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        finish.wait(10.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "correlate", slow)
    passing = threading.Thread(target=made.reconcile, daemon=True)
    passing.start()
    try:
        assert entered.wait(10.0)
        observed = threading.Thread(target=made.on_event, daemon=True, args=("ADDED", {"metadata": {
            "name": "gpu-9", "annotations": {SUMMARY_ANNOTATION: summary("gpu-9", XID13)}}}))
        observed.start()
        observed.join(2.0)
        assert not observed.is_alive()
    finally:
        finish.set()
        passing.join(10.0)


def test_a_deposed_leader_writes_nothing(server):
    """A pass under way when the controller lost its Lease (not renewed within the deadline): its write is
    refused before it is sent, and the holds object stays as the new leader will find it."""
    add_nodes(server.cluster, 4, XID13)
    leading = [True]
    raw = RawApi(client_for(server.url))
    made = FleetController(raw, SETTINGS, identity="fleet-a", clock=Clock(), wall=Clock(1.7e9),
                           events=EventRecorder(raw, instance="fleet-a", namespace=NS), fence=lambda: leading[0])
    made.on_sync(server.cluster.list_objects(NODES, None))
    leading[0] = False
    with pytest.raises(Deposed):
        made.reconcile()
    with pytest.raises(ApiError):
        server.cluster.get(next(r for r in RESOURCES if r.plural == "configmaps"), NS, HOLDS_CONFIGMAP)
    assert fleet_events(server) == []


def test_the_driver_version_is_grouped_by_its_gfd_label_not_by_the_summary(server):
    """Four nodes' summaries say driver 575 while GPU Feature Discovery labelled two of them 570 (a label no
    agent token may write): grouped by what the labels say, the four are no one cause of driver 575."""
    names = add_nodes(server.cluster, 4, ("xid-119", FaultClass.DRIVER), driver="575.51.03")
    for name in names[:2]:
        server.cluster.patch(NODES, "", name, "application/merge-patch+json",
                             {"metadata": {"labels": {"nvidia.com/cuda.driver.major": "570",
                                                      "nvidia.com/cuda.driver.minor": "86",
                                                      "nvidia.com/cuda.driver.rev": "15"}}})
    made = controller(server, Clock())
    assert {s.driver_version for s in made.view.summaries.values()} == {"570.86.15", "575.51.03"}
    assert made.reconcile() == []


@pytest.mark.parametrize("skew", [900.0, -900.0], ids=["ahead", "behind"])
def test_an_operators_skewed_clock_moves_no_other_hold(server, skew):
    """The controller publishes two holds; an operator whose laptop runs 15 minutes ahead (or behind) releases
    one: the other keeps its expiry for every reader, one that reads the object afresh included (the operator
    reads without its own clock's correction and writes on the object's own timeline)."""
    clock, wall = Clock(), Clock(1.7e9)
    add_nodes(server.cluster, 4, XID13)
    add_nodes_of = [f"gpu-{i}" for i in range(4, 8)]
    for name in add_nodes_of:
        server.cluster.add("nodes", {"metadata": {"name": name, "annotations": {
            SUMMARY_ANNOTATION: summary(name, ("xid-31", FaultClass.APPLICATION), owner="ml/Job/other")}}})
    made = controller(server, clock, wall=wall)
    made.reconcile()
    before = {h.id: h.expires_at for h in published(server, clock)}
    assert len(before) == 2
    operator = HoldsStore(RawApi(client_for(server.url)), NS, writer="operator", clock=Clock(50.0),
                          wall=lambda: 1.7e9 + skew, own_clock=False)
    operator.update(lambda holds: [h for h in holds if h.rule_id != "xid-13"])
    fresh = HoldsStore(RawApi(client_for(server.url)), NS, writer="reader", clock=clock, wall=wall)
    [(kept, expires)] = [(h.id, h.expires_at) for h in fresh.read()[0]]
    assert kept.startswith("xid-31/") and expires == pytest.approx(before[kept], abs=1.0)

"""One test per defect of issue 11 (and three of issue 16): each failed on the design before the durable record."""

import threading
import time

import msgspec
import pytest

from agent.cluster_side import request_release
from agent.journal import Journal
from agent.k8s.client import client_for
from agent.model import GpuRef, NodeInventory, Observation, Signal, StepKind
from agent.remediation import Mode
from tests.conftest import wait_for
from tests.k8s_helpers import (
    RULES,
    TAINT,
    eviction_requests,
    gpu_node,
    grace_period_passes,
    make_agent,
    operator_client,
    restart,
    running_pods,
)

BUDGET_LEASE = ("coordination.k8s.io", "leases", "gpu-health", "gpu-health-disruption-budget")


pytestmark = pytest.mark.usefixtures("no_retry_sleep")


def pods_left(cluster, node):
    """The node's pods not evicted: an evicted pod stays listed while it terminates, so it is not counted."""
    return running_pods(cluster, node)


def taint_keys(cluster, node):
    return [t["key"] for t in cluster.node(node)["spec"].get("taints") or []]


def release(server, node, gpu="all"):
    request_release(operator_client(server), node, gpu)


def test_a_lost_gpu_seen_at_start_evicts_only_the_pod_on_that_gpu(fake, tmp_path):
    """Defect 1: a GPU NVML knows only by index after a restart is resolved through the persisted inventory."""
    cluster, server = fake
    inventory = gpu_node("n1")
    first = make_agent(cluster, server, inventory, journal=tmp_path / "j.db")
    first.pipeline.handle(Observation(Signal.TEMPERATURE, 40, 1.0, "nvml", inventory.gpus[3]), 1.0)
    # The restarted agent knows no GPU yet (the daemon learns them from NVML); GPU 3 is already lost.
    blank = NodeInventory("n1", (), inventory.pods)
    second = restart(first, inventory=blank)
    second.pipeline.handle(Observation(Signal.GPU_LOST, 1, 5.0, "nvml", GpuRef(index=3)), 5.0)
    second.settle(6.0)
    grace_period_passes(cluster)
    assert pods_left(cluster, "n1") == {f"n1-trainer-{i}" for i in (0, 1, 2, 4, 5, 6, 7)} | {"gpu-health-agent-n1"}


def test_an_unresolved_gpu_never_means_every_gpu_pod(fake):
    """Defect 1: a fault on a GPU nobody can name moves no pod (the whole node is its own escalation)."""
    cluster, server = fake
    inventory = gpu_node("n1")
    agent = make_agent(cluster, server, NodeInventory("n1", (), inventory.pods))
    start = len(cluster.log)
    agent.pipeline.handle(Observation(Signal.XID, 79, 1.0, "kmsg", GpuRef(pci_bus_id="0000:99:00")), 1.0)
    agent.settle(2.0)
    assert eviction_requests(cluster, start) == []
    assert len(pods_left(cluster, "n1")) == 9
    assert taint_keys(cluster, "n1") == [TAINT]


def test_a_node_released_by_a_restarted_agent_stays_released_after_the_next_restart(fake):
    """Defect 2: the clear is written to the Node by whichever process sees it."""
    cluster, server = fake
    inventory = gpu_node("n1")
    make_agent(cluster, server, inventory).fault(3)
    second = restart(None, cluster=cluster, server=server, inventory=inventory)
    release(server, "n1")
    second.settle(100.0)
    assert taint_keys(cluster, "n1") == []
    third = restart(None, cluster=cluster, server=server, inventory=inventory)
    third.settle(200.0)
    assert taint_keys(cluster, "n1") == []
    assert third.pipeline.gpu_statuses()["GPU-n1-0003"] == "healthy"
    conditions = {c["type"]: c["status"] for c in cluster.node("n1")["status"]["conditions"]}
    assert conditions.get("GpuFatalFault") != "True" and conditions.get("GpuRebootRequired") != "True"


def test_a_record_read_but_not_yet_classified_is_read_again_after_a_restart(tmp_path):
    """Defect 3: the kernel-log cursor moves only once a record is classified and durable."""
    import os

    from agent.sources.kmsg import KmsgSource
    from tests.integration.test_kmsg_source import RECORD, fifo, start

    boot_id = tmp_path / "boot_id"
    boot_id.write_text("boot-aaaa\n")
    journal = Journal(tmp_path / "j.db")
    path, writer = fifo(tmp_path)
    lines = RECORD.format(seq=1, ts=1, code=79, msg="a") + RECORD.format(seq=2, ts=2, code=48, msg="b")
    os.write(writer, lines.encode())
    collected, stop, thread = start(KmsgSource(path=path, boot_id_path=boot_id, cursor=journal))
    assert wait_for(lambda: len(collected.xids()) == 2)
    stop.set()
    thread.join(5)  # queued, never classified: the agent was killed here
    os.write(writer, lines.encode())  # the ring buffer still holds both
    collected, stop, thread = start(KmsgSource(path=path, boot_id_path=boot_id, cursor=journal))
    try:
        assert wait_for(lambda: len(collected.xids()) == 2)
    finally:
        stop.set()
        thread.join(5)
        os.close(writer)


def test_a_node_that_stays_disrupted_keeps_its_slot_past_the_slot_lifetime(fake):
    """Defect 4: the slot is renewed while the node waits for its reboot."""
    cluster, server = fake
    now = [0.0]
    first = make_agent(cluster, server, gpu_node("n1"), max_nodes=1, max_percent=0, budget_clock=lambda: now[0])
    second = make_agent(cluster, server, gpu_node("n2"), max_nodes=1, max_percent=0, budget_clock=lambda: now[0])
    first.fault(3)  # Xid 79: evict, then a reboot request; the node stays disrupted until it reboots
    for t in range(600, 3 * 3600, 600):
        now[0] = float(t)
        first.settle(float(t))
    now[0] = 3 * 3600.0
    second.fault(3, at=3 * 3600.0)
    assert "n2-trainer-3" in pods_left(cluster, "n2")
    assert set(first.side.gate.holders()) == {"n1"}


def test_a_slot_taken_for_a_reset_without_a_taint_is_given_back(fake):
    """Defect 4: a node that is no longer disrupted releases its slot, whatever its step was."""
    cluster, server = fake
    inventory = gpu_node("n1")
    agent = make_agent(cluster, server, NodeInventory("n1", inventory.gpus, ()), max_nodes=1, max_percent=0)
    agent.pipeline.handle(Observation(Signal.ROW_REMAP_PENDING, 1, 1.0, "nvml", inventory.gpus[2]), 1.0)
    agent.settle(20.0)  # idle GPU: reset once the incident settled
    assert taint_keys(cluster, "n1") == []
    assert agent.side.gate.holders() == {}


@pytest.mark.fake_only
@pytest.mark.parametrize("mode,dry_run", [(Mode.QUARANTINE, False), (Mode.REMEDIATE, True)])
def test_quarantine_mode_and_dry_run_write_no_lease(fake, mode, dry_run):
    """Defect 4: the guard decides before the budget is asked; a step that will not run takes no slot."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"), mode=mode, dry_run=dry_run)
    agent.fault(3)
    agent.settle(40.0)
    assert BUDGET_LEASE not in cluster.objects


def test_an_opted_out_node_gets_events_and_nothing_else(fake):
    """Defect 4: opt-out means Events only: no taint, no condition, no eviction."""
    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    agent.side.writer.set_metadata(labels={"gpu-health-agent.io/opt-out": "true"})
    start = len(cluster.log)
    agent.fault(3)
    agent.settle(5.0)
    assert eviction_requests(cluster, start) == []
    node = cluster.node("n1")
    assert taint_keys(cluster, "n1") == []
    assert not [c["type"] for c in node["status"]["conditions"] if c["type"].startswith("Gpu")]
    assert len(pods_left(cluster, "n1")) == 9
    assert any(e["reason"] == "GpuFatalFault" for e in cluster.events())


@pytest.mark.fake_only
def test_a_blocked_node_costs_the_api_server_few_requests(fake):
    """Defect 5: a blocked step backs off; observations that change nothing cost no API request."""
    cluster, server = fake
    holder = make_agent(cluster, server, gpu_node("n1"), max_nodes=1, max_percent=0)
    holder.fault(3)
    blocked = make_agent(cluster, server, gpu_node("n2"), max_nodes=1, max_percent=0)
    blocked.fault(3, at=1.0)
    before = cluster.faults.requests
    inventory = blocked.inventory
    for tenth in range(600):  # one minute of NVML readings, 10 a second
        at = 1.0 + tenth / 10
        blocked.pipeline.handle(Observation(Signal.TEMPERATURE, 40, at, "nvml", inventory.gpus[tenth % 8]), at)
        blocked.settle(at)
    assert "n2-trainer-3" in pods_left(cluster, "n2")
    assert cluster.faults.requests - before <= 10


@pytest.mark.fake_only
def test_an_event_owed_when_the_agent_died_is_delivered_by_the_next_agent(fake, tmp_path):
    """Defect 6: owed Events are part of the durable record and are sent until acknowledged."""
    cluster, server = fake
    inventory = gpu_node("n1")
    first = make_agent(cluster, server, inventory, journal=tmp_path / "j.db")
    cluster.faults.down = True
    first.fault(3)
    cluster.faults.down = False
    second = restart(first)
    second.settle(40.0)
    reasons = [e["reason"] for e in cluster.events()]
    assert reasons.count("GpuFatalFault") == 1


@pytest.mark.parametrize("damage", [b"garbage" * 100, b"SQLite format 3\x00" + b"\xff" * 200, b"SQLite format 3\x00"])
def test_a_damaged_journal_is_moved_aside_and_recreated(tmp_path, damage):
    """Defect 7: a damaged journal never stops the agent."""
    path = tmp_path / "j.db"
    path.write_bytes(damage)
    journal = Journal(path)
    journal.set_cursor("x", "1")
    assert journal.cursor("x") == "1"
    assert journal.recreated
    assert list(tmp_path.glob("j.db.damaged-*"))


def test_a_zero_length_journal_takes_its_kernel_log_position_from_the_node(fake, tmp_path):
    """Defect 7: an emptied journal does not replay the ring buffer: the Node's record knows how far it got."""
    cluster, server = fake
    inventory = gpu_node("n1")
    path = tmp_path / "j.db"
    first = make_agent(cluster, server, inventory, journal=path)
    first.pipeline.handle(Observation(Signal.BOOT, 0, 0.5, "kmsg", None, {"boot_id": "boot-a"}), 0.5)
    first.pipeline.handle(Observation(Signal.XID, 79, 1.0, "kmsg", inventory.gpus[3], {"kmsg_seq": 7}), 1.0)
    release(server, "n1")
    first.settle(100.0)
    first.close()
    for leftover in tmp_path.glob("j.db*"):
        leftover.unlink()
    path.write_bytes(b"")
    second = restart(first)
    assert second.journal.cursor("kmsg") == "boot-a:7"
    assert taint_keys(cluster, "n1") == []


def test_a_fault_whose_rule_was_renamed_by_a_reload_can_still_be_released(fake):
    """Defect 8: a fault keeps its rule id across a reload and clears on release."""

    from agent.engine import RuleSet

    cluster, server = fake
    agent = make_agent(cluster, server, gpu_node("n1"))
    agent.fault(3)
    renamed = [msgspec.structs.replace(r, id="xid-79-renamed") if r.id == "xid-79" else r for r in RULES.rules]
    agent.pipeline.replace_rules(RuleSet(rules=tuple(renamed)))
    release(server, "n1")
    agent.settle(100.0)
    assert taint_keys(cluster, "n1") == []
    assert agent.pipeline.gpu_statuses()["GPU-n1-0003"] == "healthy"


def test_a_gpu_is_not_reset_while_an_evicted_pod_is_still_terminating():
    """Issue 16: an accepted eviction leaves the pod Terminating; the reset waits until the pod is gone."""
    from agent.model import Action, PodRef, Severity
    from agent.remediation.planner import PlanOptions, plan
    from agent.remediation.state import ActiveFault, NodeState

    gpu = GpuRef(2, "GPU-2", "0000:1a:00.0")
    fault = ActiveFault("xid-48", gpu.key, Severity.FATAL, Action.RESET_GPU, "dbe", 0.0, gpu)
    node = NodeState(tainted=True, evicted={gpu.key: {"ml/p2"}})
    inventory = NodeInventory("n1", (gpu,), (PodRef("ml", "p2", "u2", (gpu.uuid,)),))  # still listed
    steps = plan([], {(gpu.key, "xid-48"): fault}, node, inventory, options=live_options(PlanOptions), now=100.0)
    assert not any(s.kind is StepKind.RESET_GPU for s in steps)


def live_options(options_type):
    try:
        return options_type(node_name="n1", pods_live=True)
    except TypeError:
        return options_type(node_name="n1")


@pytest.mark.fake_only
def test_detection_goes_on_while_the_api_server_hangs(fake, tmp_path):
    """Issue 16: API work is off the detection path: a hung API server never stops classification."""
    from prometheus_client import CollectorRegistry

    from agent.cluster_side import build_cluster_side
    from agent.config import load_config
    from agent.daemon import Daemon

    cluster, server = fake
    inventory = gpu_node("n1")
    from agent.simulation.fake_apiserver import populate
    populate(cluster, inventory)
    config = load_config(None, env={"NODE_NAME": "n1", "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db"),
                                    "GPU_HEALTH_MODE": "remediate"})
    side = build_cluster_side(client_for(server.url), config, on_stuck=lambda pod: None)
    daemon = Daemon(config, rules=RULES, sources=[_Idle()], inventory=inventory, registry=CollectorRegistry(),
                    cluster=side)
    cluster.faults.latency_seconds = 20.0
    stop = threading.Event()
    runner = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    runner.start()
    try:
        daemon.emit(Observation(Signal.XID, 79, time.time(), "kmsg", inventory.gpus[3]))
        daemon.emit(Observation(Signal.XID, 48, time.time(), "kmsg", inventory.gpus[5]))
        assert wait_for(lambda: daemon.pipeline.gpu_statuses().get("GPU-n1-0005") == "fatal", timeout=5)
        stop.set()
        started = time.monotonic()
        runner.join(15)
        assert not runner.is_alive() and time.monotonic() - started < 10  # SIGTERM honoured while the API hangs
    finally:
        cluster.faults.latency_seconds = 0.0
        stop.set()
    reopened = Journal(tmp_path / "j.db")
    assert {v.rule_id for v in reopened.active_faults("n1")} == {"xid-79", "xid-48"}


class _Idle:
    name = "idle"

    def run(self, emit, stop):
        stop.wait()

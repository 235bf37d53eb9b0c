"""Pausing the GPU Operator's operands for a reset through the agent's Node writer, against the fake API server."""

from __future__ import annotations

import json

import pytest

from agent.k8s.client import client_for
from agent.k8s.node import NodeWriter
from agent.k8s.node_marks import RESET_PAUSE_TAINT
from agent.k8s.operands import OPERAND_LABELS, PAUSED_ANNOTATION, PAUSED_VALUE, OperandPauser
from agent.k8s.raw import RawApi, api_path
from tests.k8s_helpers import TAINT, gpu_node, grace_period_passes, populate_any, start_cluster

PLUGIN, GFD, EXPORTER, DCGM = OPERAND_LABELS


@pytest.fixture
def node():
    cluster, server = start_cluster()
    populate_any(cluster, gpu_node("n1"))
    raw = RawApi(client_for(server.url))
    raw.strategic_patch(api_path("", "v1", "nodes", name="n1"), {"metadata": {"labels": {
        PLUGIN: "true", GFD: "true", EXPORTER: "true", DCGM: "false"}}})
    yield cluster, raw
    server.stop()


def operand_pod(cluster, name: str, label: str) -> None:
    """An operand's DaemonSet pod on n1: it selects the node by the operand's gpu.deploy label."""
    cluster.add("pods", {"metadata": {"name": name, "namespace": "gpu-operator"},
                         "spec": {"nodeName": "n1", "nodeSelector": {label: "true"},
                                  "containers": [{"name": "c", "image": "nvcr.io/nvidia/x"}]}})


def pauser(raw, **options) -> OperandPauser:
    return OperandPauser(NodeWriter(raw, "n1", taint_key=TAINT), raw, labels=OPERAND_LABELS, **options)


def labels(cluster) -> dict[str, str]:
    return {k: v for k, v in cluster.node("n1")["metadata"]["labels"].items() if k in OPERAND_LABELS}


def test_a_pause_moves_only_running_operands_to_paused_and_records_their_values_on_the_node(node):
    """Labels at `true` become paused-for-gpu-reset; a disabled operand stays; the originals are annotated."""
    cluster, raw = node
    message = pauser(raw, wait_seconds=0).pause()
    assert labels(cluster) == {PLUGIN: PAUSED_VALUE, GFD: PAUSED_VALUE, EXPORTER: PAUSED_VALUE, DCGM: "false"}
    recorded = json.loads(cluster.node("n1")["metadata"]["annotations"][PAUSED_ANNOTATION])
    assert recorded == {PLUGIN: "true", GFD: "true", EXPORTER: "true"}
    assert "paused device-plugin, gpu-feature-discovery, dcgm-exporter" in message


def test_a_restore_puts_back_only_labels_still_paused_by_the_agent(node):
    """A label someone else moved meanwhile (a driver upgrade's pause) is theirs; the record goes."""
    cluster, raw = node
    operands = pauser(raw, wait_seconds=0)
    operands.pause()
    raw.strategic_patch(api_path("", "v1", "nodes", name="n1"),
                        {"metadata": {"labels": {EXPORTER: "paused-for-driver-upgrade"}}})
    operands.restore()
    assert labels(cluster) == {PLUGIN: "true", GFD: "true", EXPORTER: "paused-for-driver-upgrade", DCGM: "false"}
    assert PAUSED_ANNOTATION not in cluster.node("n1")["metadata"]["annotations"]


def test_a_pause_a_crashed_agent_left_is_restored_by_the_next_agent(node):
    """The record on the Node is all a new agent needs: its restore puts the operands back."""
    cluster, raw = node
    pauser(raw, wait_seconds=0).pause()  # the agent dies here, mid-reset
    assert pauser(raw).restore() == "restored 3 operand label(s) and lifted the reset pause taint"
    assert labels(cluster) == {PLUGIN: "true", GFD: "true", EXPORTER: "true", DCGM: "false"}


def test_a_reset_after_a_crash_mid_reset_pauses_the_same_operands_again(node):
    """The next reset's pause restores what the crash left first, so it pauses (and records) them again."""
    cluster, raw = node
    pauser(raw, wait_seconds=0).pause()  # the agent dies here, mid-reset
    assert "paused device-plugin, gpu-feature-discovery, dcgm-exporter" in pauser(raw, wait_seconds=0).pause()
    recorded = json.loads(cluster.node("n1")["metadata"]["annotations"][PAUSED_ANNOTATION])
    assert recorded == {PLUGIN: "true", GFD: "true", EXPORTER: "true"}


def test_a_pause_waits_for_the_paused_operands_pods_to_go(node):
    """The pause returns once no pod on the node selects a paused label (the DaemonSet controller deletes them)."""
    cluster, raw = node
    operand_pod(cluster, "nvidia-device-plugin-x", PLUGIN)
    operand_pod(cluster, "nvidia-dcgm-exporter-y", EXPORTER)
    operand_pod(cluster, "nvidia-dcgm-z", DCGM)  # disabled on this node already: not waited for
    waits: list[float] = []

    def daemonset_controller(seconds: float) -> None:  # deletes one paused operand's pod per poll
        waits.append(seconds)
        left = [p for p in cluster.pods_on("n1") if p["metadata"]["namespace"] == "gpu-operator"
                and p["metadata"]["name"] != "nvidia-dcgm-z"]
        raw.delete(api_path("", "v1", "pods", namespace="gpu-operator", name=left[0]["metadata"]["name"]))
        grace_period_passes(cluster)

    clock = iter(range(0, 1000, 10))
    message = pauser(raw, wait_seconds=60, clock=lambda: float(next(clock)), sleep=daemonset_controller).pause()
    assert len(waits) == 2
    assert "their pods are gone" in message


def test_a_pause_whose_pods_do_not_go_in_time_says_which_are_left(node):
    """Bounded: after wait_seconds the pause returns, naming the pods still there (the reset then decides)."""
    cluster, raw = node
    operand_pod(cluster, "nvidia-device-plugin-x", PLUGIN)
    clock = iter(range(0, 1000, 10))
    message = pauser(raw, wait_seconds=30, clock=lambda: float(next(clock)), sleep=lambda s: None).pause()
    assert "still on the node: gpu-operator/nvidia-device-plugin-x" in message


def test_an_agent_started_after_a_crash_mid_reset_restores_the_operands(node, tmp_path):
    """The daemon wires the GPU edge's reset procedure and its pass puts back a pause an earlier agent left."""
    from functools import partial

    from prometheus_client import CollectorRegistry

    from agent.cluster_side import build_cluster_side
    from agent.config import load_config
    from agent.daemon import Daemon
    from agent.gpu.reset import ResetProcedure
    from tests.k8s_helpers import RULES

    cluster, raw = node
    pauser(raw, wait_seconds=0).pause()  # the earlier agent died here, mid-reset
    config = load_config(None, env={"NODE_NAME": "n1", "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db")})
    daemon = Daemon(config, rules=RULES, sources=[object()], registry=CollectorRegistry(),  # type: ignore[list-item]
                    cluster_of=partial(build_cluster_side, raw.api_client, config, on_stuck=lambda pod: None))
    side = daemon.cluster
    try:
        assert side is not None and isinstance(side.actuator.reset, ResetProcedure)
        assert side.actuator.reset.operands is side.operands
        daemon._restore_operands()  # what the reconcile loop runs before each pass
        assert labels(cluster) == {PLUGIN: "true", GFD: "true", EXPORTER: "true", DCGM: "false"}
    finally:
        daemon.journal.close()


def test_a_failed_reset_names_the_holders_in_the_nodes_event(node):
    """A GPU with a pending remap whose reset found it held: the Event names the process, and no reboot."""
    from agent.gpu.holders import Holder
    from agent.gpu.reset import ResetOutcome, ResetProcedure
    from agent.model import NodeInventory, Observation, Signal
    from tests.k8s_helpers import make_agent

    cluster, raw = node
    raw.delete(api_path("", "v1", "pods", namespace="ml", name="n1-trainer-6"))  # GPU 6 is idle
    cluster.finish_termination("ml", "n1-trainer-6")
    inventory = gpu_node("n1")
    inventory = NodeInventory("n1", inventory.gpus, tuple(p for p in inventory.pods if not p.holds(
        inventory.gpus[6].uuid)))

    def held(uuid: str) -> ResetOutcome:
        return ResetOutcome(False, "not reset: /dev/nvidia6 still held after 30s by pid 4242 (python)",
                            (Holder(4242, "python"),))

    agent = make_agent(cluster, None, inventory, populate_node=False, api_client=raw.api_client,
                       reset=ResetProcedure(held, operands=pauser(raw, wait_seconds=0)))
    agent.pipeline.handle(Observation(Signal.ROW_REMAP_PENDING, 1, 1.0, "nvml", inventory.gpus[6]), 1.0)
    agent.pipeline.tick(20.0)
    notes = [e["note"] for e in cluster.events() if "gpu-reset-failed" in e["note"] or "reset of" in e["note"]]
    assert any("pid 4242 (python)" in n and "no reboot is requested" in n for n in notes), notes
    assert not agent.pipeline.node.reboot_requested and agent.pipeline.node.tainted
    assert labels(cluster) == {PLUGIN: "true", GFD: "true", EXPORTER: "true", DCGM: "false"}


class Outage(NodeWriter):
    """The agent's Node writer while the API server refuses its writes (`failing` of them), counting reads."""

    def __init__(self, raw, *, failing: int = 0) -> None:
        super().__init__(raw, "n1", taint_key=TAINT)
        self.failing, self.reads = failing, 0

    def read(self):
        self.reads += 1
        return super().read()

    def set_metadata(self, **changes):
        if self.failing and changes.get("annotations", {}).get(PAUSED_ANNOTATION, "") is None:
            self.failing -= 1
            raise ConnectionError("API server unreachable")
        return super().set_metadata(**changes)


def test_restore_if_needed_puts_back_a_pause_a_crashed_agent_left(node):
    """Called every reconcile pass: the Node's record is restored once, and later passes read nothing."""
    from agent.gpu.reset import ResetOutcome, ResetProcedure

    cluster, raw = node
    pauser(raw, wait_seconds=0).pause()  # the earlier agent died here, mid-reset
    writer = Outage(raw)
    procedure = ResetProcedure(lambda uuid: ResetOutcome(True, "reset"),
                               operands=OperandPauser(writer, raw, labels=OPERAND_LABELS))
    assert procedure.restore_if_needed() == "restored 3 operand label(s) and lifted the reset pause taint"
    assert labels(cluster) == {PLUGIN: "true", GFD: "true", EXPORTER: "true", DCGM: "false"}
    reads = writer.reads
    assert [procedure.restore_if_needed() for _ in range(3)] == ["", "", ""]
    assert writer.reads == reads


def test_a_restore_that_failed_after_a_reset_is_done_by_the_next_pass(node):
    """The reset's own restore meets an API outage: the operands stay paused, and the next pass restores them."""
    from agent.gpu.reset import ResetOutcome, ResetProcedure

    cluster, raw = node
    writer = Outage(raw, failing=1)
    procedure = ResetProcedure(lambda uuid: ResetOutcome(True, "reset"),
                               operands=OperandPauser(writer, raw, labels=OPERAND_LABELS, wait_seconds=0))
    ok, message = procedure("GPU-6a6a6a6a-0000-1111-2222-333333333333")
    assert ok and "operands not restored yet" in message
    assert labels(cluster)[PLUGIN] == PAUSED_VALUE
    assert procedure.restore_if_needed() == "restored 3 operand label(s) and lifted the reset pause taint"
    assert labels(cluster) == {PLUGIN: "true", GFD: "true", EXPORTER: "true", DCGM: "false"}
    assert PAUSED_ANNOTATION not in cluster.node("n1")["metadata"]["annotations"]


def taints(cluster) -> dict[str, str]:
    return {t["key"]: t.get("effect", "") for t in cluster.node("n1")["spec"].get("taints") or []}


def test_a_paused_device_plugin_keeps_new_pods_off_the_node_until_the_pause_ends(node):
    """The pause's NoSchedule taint comes in the write that pauses the device plugin and goes in the one that
    restores it: no GPU pod is admitted while the plugin is away (UnexpectedAdmissionError, kubernetes#119248)."""
    cluster, raw = node
    operands = pauser(raw, wait_seconds=0)
    operands.pause()
    assert taints(cluster) == {RESET_PAUSE_TAINT: "NoSchedule"}
    assert labels(cluster)[PLUGIN] == PAUSED_VALUE
    operands.restore()
    assert taints(cluster) == {}
    assert labels(cluster)[PLUGIN] == "true"


def test_the_pause_taint_leaves_the_quarantine_taint_and_others_taints_alone(node):
    """The node's quarantine taint and an operator's taint stay through the pause and its end."""
    cluster, raw = node
    raw.strategic_patch(api_path("", "v1", "nodes", name="n1"), {"spec": {"taints": [
        {"key": "example.com/maintenance", "effect": "NoSchedule"}]}})
    writer = NodeWriter(raw, "n1", taint_key=TAINT)
    writer.set_taint(True)
    operands = OperandPauser(writer, raw, labels=OPERAND_LABELS, wait_seconds=0)
    operands.pause()
    assert taints(cluster) == {"example.com/maintenance": "NoSchedule", TAINT: "NoSchedule",
                               RESET_PAUSE_TAINT: "NoSchedule"}
    operands.restore()
    assert taints(cluster) == {"example.com/maintenance": "NoSchedule", TAINT: "NoSchedule"}


def test_a_pause_without_the_device_plugin_sets_no_taint(node):
    """Only the device plugin's pause fails admissions: pausing the other operands keeps the node schedulable."""
    cluster, raw = node
    raw.strategic_patch(api_path("", "v1", "nodes", name="n1"), {"metadata": {"labels": {PLUGIN: "false"}}})
    pauser(raw, wait_seconds=0).pause()
    assert taints(cluster) == {}


def test_the_pause_taint_a_crashed_agent_left_is_removed_by_the_next_agent(node):
    """A new agent's restore takes off the taint with the operands' labels."""
    cluster, raw = node
    pauser(raw, wait_seconds=0).pause()  # the agent dies here, mid-reset
    pauser(raw).restore()
    assert taints(cluster) == {}

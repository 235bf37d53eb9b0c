"""Per-GPU isolation with DRA against a real control plane: the agent's DeviceTaintRule takes out exactly the
faulty device, the real scheduler allocates around it, a pod holding it through a claim is found, and admission
keeps each agent to its own node's pool."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from agent.cluster_side import build_cluster_side
from agent.config import load_config
from agent.k8s.dra import DeviceRef, DeviceTaintEffect, DeviceTainter, devices_of_gpu, discover_rule_version
from agent.k8s.errors import Forbidden
from agent.k8s.evictions import EvictionOutcome, Evictor
from agent.k8s.raw import RawApi
from agent.model import GpuRef, NodeInventory, Observation, Signal, StepKind, StepResult, frozen_attrs
from agent.pipeline import Actuator, Outcome, Pipeline
from agent.remediation.guard import GuardPolicy, Mode
from agent.remediation.state import DeviceMark
from tests.conftest import FIXTURES
from tests.k8s_helpers import RULES, TAINT
from tests.realcluster.backend import RealServer
from tests.realcluster.controlplane import REPO, ControlPlane, audit_events, wait_until
from tests.realcluster.test_rbac_from_use import granted, used

DRIVER = "gpu.nvidia.com"
SLICE = json.loads((FIXTURES / "dra" / "nvidia-8gpu-2mig.json").read_text())
GPU3 = "GPU-4d3c2b1a-0000-4000-8000-000000000003"
V1 = "/apis/resource.k8s.io/v1"


def publish_gpus(plane: ControlPlane, node: str) -> None:
    """The node's 8 GPUs (two split by MIG) as NVIDIA's DRA driver publishes them, and its DeviceClass."""
    resource_slice = copy.deepcopy(SLICE)
    resource_slice["metadata"] = {"name": f"{node}-{DRIVER}"}
    resource_slice["spec"]["nodeName"] = node
    resource_slice["spec"]["pool"]["name"] = node
    plane.rest("POST", f"{V1}/resourceslices", resource_slice)
    plane.forget("resource.k8s.io", "resourceslices", "", resource_slice["metadata"]["name"])
    try:
        plane.rest("POST", f"{V1}/deviceclasses", {"metadata": {"name": DRIVER}, "spec": {"selectors": [
            {"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}})
    except Exception as exc:  # already there from an earlier test: DeviceClasses are cluster-wide
        if "AlreadyExists" not in str(exc) and "409" not in str(exc):
            raise


def claim_on(plane: ControlPlane, namespace: str, name: str, indexes: list[int], *,
             tolerations: list[dict[str, str]] | None = None) -> None:
    """A claim for one whole GPU among `indexes` (a CEL selector the real scheduler evaluates)."""
    plane.ensure_namespace(namespace)
    allowed = ", ".join(str(i) for i in indexes)
    exactly: dict[str, Any] = {"deviceClassName": DRIVER, "selectors": [{"cel": {"expression":
        f"device.attributes['{DRIVER}'].type == 'gpu' && device.attributes['{DRIVER}'].index in [{allowed}]"}}]}
    if tolerations:
        exactly["tolerations"] = tolerations
    plane.rest("POST", f"{V1}/namespaces/{namespace}/resourceclaims", {
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}})
    plane.forget("resource.k8s.io", "resourceclaims", namespace, name)


def pod_with_claim(plane: ControlPlane, namespace: str, name: str, claim: str) -> None:
    """A pod the real scheduler places (no nodeName), holding its GPU only through the claim."""
    plane.core.create_namespaced_pod(namespace, {
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"terminationGracePeriodSeconds": 1, "tolerations": [{"operator": "Exists"}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                 "containers": [{"name": "main", "image": "example.invalid/trainer:1",
                                 "resources": {"claims": [{"name": "gpu"}]}}]}})
    plane.forget("", "pods", namespace, name)


def allocated_device(plane: ControlPlane, namespace: str, claim: str) -> str:
    def allocation() -> Any:
        status = plane.rest("GET", f"{V1}/namespaces/{namespace}/resourceclaims/{claim}").get("status") or {}
        return ((status.get("allocation") or {}).get("devices") or {}).get("results")
    return str(wait_until(allocation, f"the scheduler to allocate claim {namespace}/{claim}")[0]["device"])


@pytest.fixture
def dra_node(control_plane: ControlPlane) -> str:
    control_plane.apply_dra_manifests()
    node = control_plane.unique("dra")
    control_plane.add_gpu_node(node)
    publish_gpus(control_plane, node)
    return node


def tainter_of(plane: ControlPlane, node: str) -> DeviceTainter:
    """The agent of `node`, on its own token, speaking the version the server serves."""
    raw = RawApi(RealServer(plane).agent_client(node))
    version = discover_rule_version(raw)
    assert version is not None
    for device in range(8):  # whatever rule a test makes for this node is deleted after it
        plane.forget("resource.k8s.io", "devicetaintrules", "", f"gpu-health.{node}.gpu-{device}")
    return DeviceTainter(raw, node_name=node, taint_key=TAINT, version=version)


def test_the_agent_finds_device_taint_rules_served_in_v1(control_plane):
    """Kubernetes 1.37 serves DeviceTaintRules in resource.k8s.io/v1, and the agent picks that version."""
    control_plane.apply_dra_manifests()
    node = control_plane.unique("dra-version")
    control_plane.add_gpu_node(node)
    assert discover_rule_version(RawApi(RealServer(control_plane).agent_client(node))) == "v1"


def test_a_new_claim_is_allocated_around_the_tainted_device(control_plane, dra_node):
    """With gpu-3 tainted NoSchedule, a claim that could take gpu-3 or gpu-4 is given gpu-4 by the scheduler."""
    tainter = tainter_of(control_plane, dra_node)
    [device] = devices_of_gpu(tainter.published(), GPU3)
    assert device == DeviceRef(DRIVER, dra_node, "gpu-3")
    assert tainter.ensure(device, effect=DeviceTaintEffect.NO_SCHEDULE, gpu_uuid=GPU3, reason="Xid 79") == "created"
    claim_on(control_plane, "ml", "after-taint", [3, 4])
    pod_with_claim(control_plane, "ml", "after-taint", "after-taint")
    assert allocated_device(control_plane, "ml", "after-taint") == "gpu-4"


def test_a_pod_holding_the_faulty_device_through_a_claim_is_found_and_evicted(control_plane, dra_node):
    """A pod allocated gpu-3 before the fault is named by its claim and evicted through the Eviction API."""
    claim_on(control_plane, "ml", "on-gpu-3", [3])
    pod_with_claim(control_plane, "ml", "on-gpu-3", "on-gpu-3")
    assert allocated_device(control_plane, "ml", "on-gpu-3") == "gpu-3"
    control_plane.wait_running("ml", "on-gpu-3")
    tainter = tainter_of(control_plane, dra_node)
    faulty = set(devices_of_gpu(tainter.published(), GPU3))
    tainter.ensure(next(iter(faulty)), effect=DeviceTaintEffect.NO_SCHEDULE, gpu_uuid=GPU3, reason="Xid 79")

    holders = [h for h in tainter.claim_holders(["ml"]) if faulty & set(h.devices)]

    assert [(h.namespace, h.name) for h in holders] == [("ml", "on-gpu-3")]
    evictor = Evictor(RawApi(RealServer(control_plane).agent_client(dra_node)))
    assert evictor.evict("ml", "on-gpu-3").outcome is EvictionOutcome.EVICTED


def test_a_restart_converges_on_exactly_one_rule_and_recovery_removes_it(control_plane, dra_node):
    """A second agent process ensures the same rule without adding one; the clear deletes it."""
    device = DeviceRef(DRIVER, dra_node, "gpu-3")
    first = tainter_of(control_plane, dra_node)
    assert first.ensure(device, effect=DeviceTaintEffect.NO_SCHEDULE, gpu_uuid=GPU3, reason="Xid 79") == "created"
    after_restart = tainter_of(control_plane, dra_node)
    assert after_restart.ensure(device, effect=DeviceTaintEffect.NO_SCHEDULE, gpu_uuid=GPU3,
                                reason="Xid 79") == "unchanged"
    assert after_restart.ensure(device, effect=DeviceTaintEffect.NONE, gpu_uuid=GPU3, reason="degraded") == "updated"
    assert len(after_restart.owned()) == 1
    assert after_restart.remove(device) is True
    assert after_restart.owned() == []
    assert after_restart.remove(device) is False


def test_an_agent_may_not_taint_a_device_of_another_nodes_pool(control_plane, dra_node):
    """Admission denies a rule selecting another node's pool, even under the agent's own name and label."""
    other = control_plane.unique("dra-other")
    control_plane.add_gpu_node(other)
    tainter = tainter_of(control_plane, other)

    def denied() -> bool:
        try:
            tainter.ensure(DeviceRef(DRIVER, dra_node, "gpu-3"), effect=DeviceTaintEffect.NO_SCHEDULE,
                           gpu_uuid=GPU3, reason="forged")
        except Forbidden as exc:
            return "own node's pool" in str(exc)
        tainter.remove(DeviceRef(DRIVER, dra_node, "gpu-3"))
        return False

    assert wait_until(denied, "the device admission policy to be enforced", timeout=60)


def test_an_agent_may_not_remove_another_nodes_rule(control_plane, dra_node):
    """A delete of a rule made for another node is denied, whatever RBAC grants."""
    device = DeviceRef(DRIVER, dra_node, "gpu-3")
    owner = tainter_of(control_plane, dra_node)
    other = control_plane.unique("dra-other")
    control_plane.add_gpu_node(other)
    intruder = tainter_of(control_plane, other)
    rules = f"{V1}/devicetaintrules"
    name = f"gpu-health.{dra_node}.gpu-3"
    refusals: list[str] = []

    def denied() -> bool:
        # The policy applied with the DRA manifests may take a moment to be enforced: until then the delete
        # goes through, and the owner makes the rule again for the next try.
        owner.ensure(device, effect=DeviceTaintEffect.NO_SCHEDULE, gpu_uuid=GPU3, reason="Xid 79")
        try:
            intruder.raw.delete(f"{rules}/{name}")
        except Forbidden as exc:
            refusals.append(str(exc))
            return True
        return False

    assert wait_until(denied, "the device admission policy to be enforced", timeout=60)
    assert "DeviceTaintRules of the node it runs on" in refusals[-1]
    assert control_plane.rest("GET", f"{rules}/{name}")["metadata"]["name"] == name


def test_the_dra_grants_are_exactly_what_per_gpu_isolation_uses(control_plane, dra_node):
    """daemonset/dra/rbac.yaml derived from use: publish, taint, re-ensure, soften, list, find holders,
    remove; the audit log shows no 403, nothing used that is not granted, nothing granted that is unused."""
    start = len(audit_events(control_plane.audit_log))
    tainter = tainter_of(control_plane, dra_node)
    [device] = devices_of_gpu(tainter.published(), GPU3)
    tainter.ensure(device, effect=DeviceTaintEffect.NO_SCHEDULE, gpu_uuid=GPU3, reason="Xid 79")
    tainter.ensure(device, effect=DeviceTaintEffect.NONE, gpu_uuid=GPU3, reason="degraded")
    tainter.claim_holders(["ml"])
    assert len(tainter.owned()) == 1
    assert tainter.remove(device) is True
    events = [e for e in audit_events(control_plane.audit_log)[start:]
              if (e.get("objectRef") or {}).get("apiGroup") == "resource.k8s.io"]
    assert [e["requestURI"] for e in events if e["responseStatus"]["code"] == 403] == []
    assert used(events) == granted(REPO / "daemonset" / "dra" / "rbac.yaml")


# ---- the agent's pipeline end to end: fault -> planner -> guard -> DeviceIsolator -> rule, eviction, recovery

def gpu_inventory(node: str) -> NodeInventory:
    """The node's GPUs as NVML names them: the same UUIDs the DRA driver published."""
    return NodeInventory(node, tuple(GpuRef(i, f"GPU-4d3c2b1a-0000-4000-8000-00000000000{i}") for i in range(8)))


def dra_pipeline(plane: ControlPlane, server: RealServer, node: str, tmp_path: Path, *,
                 reset_settle_seconds: float = 600.0, isolation: str = "device", fresh: bool = True) -> Pipeline:
    """The agent of `node` as the daemon assembles it, with `isolation: device` unless told, in remediate mode."""
    for device in range(8 if fresh else 0):
        plane.forget("resource.k8s.io", "devicetaintrules", "", f"gpu-health.{node}.gpu-{device}")
    config = load_config(None, env={"NODE_NAME": node, "GPU_HEALTH_REMEDIATION__ISOLATION": isolation,
                                    "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "journal.db")})
    side = build_cluster_side(server.agent_client(node), config, on_stuck=lambda pod: None)
    side.actuator.reset = lambda uuid: (True, f"reset {uuid}")
    return Pipeline(rules=RULES, inventory=gpu_inventory(node), policy=GuardPolicy(mode=Mode.REMEDIATE),
                    actuator=side.actuator, gate=side.gate, own_pod=side.own_pod, pods=side.pods.pods,
                    reset_settle_seconds=reset_settle_seconds)


def xid48(pipeline: Pipeline, index: int) -> Outcome:
    gpu = pipeline.inventory.gpus[index]
    return pipeline.handle(Observation(Signal.XID, 48, time.time(), "kmsg", gpu), time.time())


def clean_poll(pipeline: Pipeline, index: int) -> Outcome:
    """One complete, clean NVML poll of the GPU after its reset: what verifies the reset."""
    attrs = {"recovery_action": 0, "remap_pending": 0, "retirement_pending": 0, "volatile_dbe": 0, "links_down": 0}
    now = time.time()
    return pipeline.handle(Observation(Signal.GPU_POLLED, 1, now, "nvml", pipeline.inventory.gpus[index],
                                       frozen_attrs(attrs)), now)


def taken(outcome: Outcome) -> dict[tuple[StepKind, str], StepResult]:
    return {(a.step.kind, a.step.target): a.result for a in outcome.actions}


class KilledBeforeMirror:
    """The agent's actuator, in a process killed before the record reached the Node (mirror never lands)."""

    def __init__(self, actuator: Actuator) -> None:
        self.actuator = actuator
        self.apply = actuator.apply
        self.observe = actuator.observe
        self.consume_release = actuator.consume_release
        self.consume_confirm = actuator.consume_confirm
        self.begin_batch = actuator.begin_batch
        self.write_node = actuator.write_node

    def mirror(self, document: Mapping[str, object]) -> None:
        raise RuntimeError("killed before the record reached the Node")


@pytest.fixture
def real_server(control_plane: ControlPlane):
    server = RealServer(control_plane)
    yield server
    server.stop()


def test_the_pipeline_taints_one_device_and_a_later_claim_gets_another(control_plane, dra_node, real_server,
                                                                        tmp_path):
    """Xid 48 on GPU 3: one DeviceTaintRule for gpu-3, no node taint; the scheduler gives a new claim gpu-5."""
    pipeline = dra_pipeline(control_plane, real_server, dra_node, tmp_path)
    assert pipeline.start()
    outcome = xid48(pipeline, 3)
    assert taken(outcome)[(StepKind.TAINT_DEVICE, f"{DRIVER}/{dra_node}/gpu-3")] is StepResult.APPLIED
    assert (StepKind.TAINT, dra_node) not in taken(outcome)
    [rule] = tainter_of(control_plane, dra_node).owned()
    assert rule["spec"]["deviceSelector"]["device"] == "gpu-3"
    assert rule["spec"]["taint"]["effect"] == "NoSchedule"
    assert not [t for t in control_plane.core.read_node(dra_node).spec.taints or [] if t.key == TAINT]
    claim_on(control_plane, "ml", "later", [3, 5])
    pod_with_claim(control_plane, "ml", "later", "later")
    assert allocated_device(control_plane, "ml", "later") == "gpu-5"


def test_a_claim_tolerating_the_agents_taint_is_allocated_the_tainted_device(control_plane, dra_node, real_server,
                                                                             tmp_path):
    """A diagnostics claim with the toleration of docs/remediation.md gets the faulty gpu-3."""
    pipeline = dra_pipeline(control_plane, real_server, dra_node, tmp_path)
    pipeline.start()
    xid48(pipeline, 3)
    toleration = {"key": TAINT, "operator": "Exists", "effect": "NoSchedule"}
    claim_on(control_plane, "ops", "diagnostics", [3], tolerations=[toleration])
    pod_with_claim(control_plane, "ops", "diagnostics", "diagnostics")
    assert allocated_device(control_plane, "ops", "diagnostics") == "gpu-3"


def test_the_pipeline_evicts_only_the_pod_whose_claim_holds_the_faulty_gpu(control_plane, dra_node, real_server,
                                                                             tmp_path):
    """Pods on gpu-3 and gpu-4 through claims: the fault on GPU 3 evicts the first through the Eviction API."""
    for index in (3, 4):
        claim_on(control_plane, "ml", f"holds-{index}", [index])
        pod_with_claim(control_plane, "ml", f"holds-{index}", f"holds-{index}")
        assert allocated_device(control_plane, "ml", f"holds-{index}") == f"gpu-{index}"
        control_plane.wait_running("ml", f"holds-{index}")
    start = len(audit_events(control_plane.audit_log))
    pipeline = dra_pipeline(control_plane, real_server, dra_node, tmp_path)
    pipeline.start()
    outcome = xid48(pipeline, 3)
    assert taken(outcome)[(StepKind.EVICT, "ml/holds-3")] is StepResult.APPLIED
    assert (StepKind.EVICT, "ml/holds-4") not in taken(outcome)
    evictions = [e["objectRef"]["name"] for e in audit_events(control_plane.audit_log)[start:]
                 if (e.get("objectRef") or {}).get("subresource") == "eviction"]
    assert evictions == ["holds-3"]


def test_verified_recovery_removes_the_rule(control_plane, dra_node, real_server, tmp_path):
    """No pod holds GPU 3, so the agent resets it at once; the clean poll after the reset verifies it, the fault
    clears and the rule is deleted."""
    pipeline = dra_pipeline(control_plane, real_server, dra_node, tmp_path, reset_settle_seconds=0.0)
    pipeline.start()
    outcome = taken(xid48(pipeline, 3))
    device = f"{DRIVER}/{dra_node}/gpu-3"
    assert outcome.get((StepKind.TAINT_DEVICE, device)) is StepResult.APPLIED
    assert outcome[(StepKind.RESET_GPU, GPU3)] is StepResult.APPLIED
    assert tainter_of(control_plane, dra_node).owned() != []
    assert taken(clean_poll(pipeline, 3)).get((StepKind.UNTAINT_DEVICE, device)) is StepResult.APPLIED
    assert tainter_of(control_plane, dra_node).owned() == []
    assert pipeline.node.device_taints == {}


def test_a_switch_to_node_isolation_deletes_the_rule_once_the_gpu_recovers(control_plane, dra_node, real_server,
                                                                            tmp_path):
    """The agent restarted with `isolation: node` (Helm switch) keeps the old rule while GPU 3 is faulty, then
    deletes it after the verified recovery: no DeviceTaintRule is left behind."""
    first = dra_pipeline(control_plane, real_server, dra_node, tmp_path, reset_settle_seconds=0.0)
    first.start()
    device = f"{DRIVER}/{dra_node}/gpu-3"
    assert taken(xid48(first, 3))[(StepKind.TAINT_DEVICE, device)] is StepResult.APPLIED
    switched = dra_pipeline(control_plane, real_server, dra_node, tmp_path, reset_settle_seconds=0.0,
                            isolation="node", fresh=False)
    switched.start()
    switched.reconcile()
    assert len(tainter_of(control_plane, dra_node).owned()) == 1
    assert taken(clean_poll(switched, 3)).get((StepKind.UNTAINT_DEVICE, device)) is StepResult.APPLIED
    assert tainter_of(control_plane, dra_node).owned() == []


def test_a_restart_between_the_rule_and_the_record_leaves_exactly_one_rule(control_plane, dra_node, real_server,
                                                                           tmp_path):
    """The first process made the rule but never recorded it; the next one sees the same fault and the rule
    already there: no second rule, and the record names the device."""
    first = dra_pipeline(control_plane, real_server, dra_node, tmp_path / "first")
    first.start()
    first.actuator = KilledBeforeMirror(first.actuator)
    assert taken(xid48(first, 3))[(StepKind.TAINT_DEVICE, f"{DRIVER}/{dra_node}/gpu-3")] is StepResult.APPLIED
    restarted = dra_pipeline(control_plane, real_server, dra_node, tmp_path / "second")
    restarted.start()
    assert (StepKind.TAINT_DEVICE, f"{DRIVER}/{dra_node}/gpu-3") not in taken(xid48(restarted, 3))
    assert len(tainter_of(control_plane, dra_node).owned()) == 1
    assert restarted.node.device_taints == {DeviceRef(DRIVER, dra_node, "gpu-3"): DeviceMark(GPU3, "NoSchedule")}

"""Per-GPU isolation with DRA against a real control plane: the agent's DeviceTaintRule takes out exactly the
faulty device, the real scheduler allocates around it, a pod holding it through a claim is found, and admission
keeps each agent to its own node's pool."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from agent.k8s.dra import DeviceRef, DeviceTaintEffect, DeviceTainter, devices_of_gpu, discover_rule_version
from agent.k8s.errors import Forbidden
from agent.k8s.evictions import EvictionOutcome, Evictor
from agent.k8s.raw import RawApi
from tests.conftest import FIXTURES
from tests.k8s_helpers import TAINT
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


def claim_on(plane: ControlPlane, namespace: str, name: str, indexes: list[int]) -> None:
    """A claim for one whole GPU among `indexes` (a CEL selector the real scheduler evaluates)."""
    plane.ensure_namespace(namespace)
    allowed = ", ".join(str(i) for i in indexes)
    plane.rest("POST", f"{V1}/namespaces/{namespace}/resourceclaims", {
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER, "selectors": [{"cel": {"expression":
                f"device.attributes['{DRIVER}'].type == 'gpu' && device.attributes['{DRIVER}'].index in [{allowed}]"}}],
        }}]}}})
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
    tainter_of(control_plane, dra_node).ensure(device, effect=DeviceTaintEffect.NO_SCHEDULE, gpu_uuid=GPU3,
                                               reason="Xid 79")
    other = control_plane.unique("dra-other")
    control_plane.add_gpu_node(other)
    intruder = tainter_of(control_plane, other)
    rules = f"{V1}/devicetaintrules"
    name = f"gpu-health.{dra_node}.gpu-3"
    with pytest.raises(Forbidden, match="DeviceTaintRules of the node it runs on"):
        intruder.raw.delete(f"{rules}/{name}")
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

"""DRA mapping: a faulty GPU to its devices in NVIDIA-shaped ResourceSlices, claims to the pods that hold them."""

import json

from agent.k8s.dra import (
    DeviceRef,
    DeviceTaintEffect,
    claim_holders,
    desired_rule,
    devices_of_gpu,
    published_gpus,
    rule_device,
    rule_name,
)
from tests.conftest import FIXTURES

NODE = "gpu-node-1"
SLICE = json.loads((FIXTURES / "dra" / "nvidia-8gpu-2mig.json").read_text())
GPU3 = "GPU-4d3c2b1a-0000-4000-8000-000000000003"
GPU6 = "GPU-4d3c2b1a-0000-4000-8000-000000000006"
MIG6_1 = "MIG-9e8f7a6b-0006-4000-8000-000000000001"


def test_a_whole_gpu_maps_to_exactly_its_device():
    """GPU 3's UUID names the one device gpu-3 of the driver's pool for this node."""
    assert devices_of_gpu(published_gpus([SLICE], NODE), GPU3) == [DeviceRef("gpu.nvidia.com", NODE, "gpu-3")]


def test_a_gpu_split_by_mig_maps_to_every_slice_cut_from_it():
    """A fault on a MIG-split GPU takes out each of its MIG devices, and nothing of the other GPUs."""
    devices = devices_of_gpu(published_gpus([SLICE], NODE), GPU6)
    assert [d.device for d in devices] == ["gpu-6-mig-3g40gb-0", "gpu-6-mig-3g40gb-1"]


def test_a_fault_inside_one_mig_instance_maps_to_that_instance_only():
    """A MIG device UUID selects its own device, not its sibling."""
    assert [d.device for d in devices_of_gpu(published_gpus([SLICE], NODE), MIG6_1)] == ["gpu-6-mig-3g40gb-1"]


def test_slices_of_other_nodes_are_never_used():
    """A slice published for another node cannot make this agent taint that node's device."""
    other = json.loads(json.dumps(SLICE))
    other["spec"]["nodeName"] = "gpu-node-2"
    assert published_gpus([other], NODE) == []


def test_an_unpublished_gpu_maps_to_no_device():
    """A GPU the driver did not publish yields nothing (the caller falls back to node isolation)."""
    assert devices_of_gpu(published_gpus([SLICE], NODE), "GPU-not-here") == []


def test_a_rule_selects_driver_pool_and_device_under_the_agents_key():
    """The rule names the device fully and carries the agent's ownership labels and the GPU's UUID."""
    device = DeviceRef("gpu.nvidia.com", NODE, "gpu-3")
    rule = desired_rule(version="v1", node_name=NODE, device=device, key="gpu-health-agent.io/unhealthy",
                        effect=DeviceTaintEffect.NO_SCHEDULE, gpu_uuid=GPU3, reason="Xid 79")
    assert rule["apiVersion"] == "resource.k8s.io/v1"
    assert rule["spec"]["deviceSelector"] == {"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-3"}
    assert rule["spec"]["taint"] == {"key": "gpu-health-agent.io/unhealthy", "value": "true", "effect": "NoSchedule"}
    assert rule["metadata"]["labels"]["gpu-health-agent.io/node"] == NODE
    assert rule_device(rule) == device


def test_rule_names_are_stable_and_valid_dns_subdomains():
    """The same node and device always give the same name, so a restart converges instead of adding a rule."""
    device = DeviceRef("gpu.nvidia.com", "Pool_A", "GPU_6/MIG 1")
    name = rule_name("Node.A", device)
    assert name == rule_name("Node.A", device)
    assert name == "gpu-health.node.a.gpu-6-mig-1"


def test_allocated_claims_name_the_pods_they_are_reserved_for():
    """A pod holding GPU 3 through a ResourceClaim is found from the claim's allocation and reservedFor."""
    claim = {"metadata": {"namespace": "ml", "name": "trainer-gpu"},
             "status": {"allocation": {"devices": {"results": [
                 {"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-3"}]}},
                 "reservedFor": [{"resource": "pods", "name": "trainer-0", "uid": "u-1"}]}}
    pending = {"metadata": {"namespace": "ml", "name": "unallocated"}, "status": {}}
    holders = claim_holders([claim, pending])
    assert [(h.namespace, h.name, h.uid) for h in holders] == [("ml", "trainer-0", "u-1")]
    assert holders[0].devices == (DeviceRef("gpu.nvidia.com", NODE, "gpu-3"),)

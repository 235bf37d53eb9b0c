"""PodResources' dynamic resources, encoded by the real protobuf library from the kubelet's message layout."""

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from agent.k8s.podresources import decode_list_response

_T = descriptor_pb2.FieldDescriptorProto


def _kubelet_messages():
    """ListPodResourcesResponse and friends, declared with the field numbers of k8s.io/kubelet's api.proto."""
    proto = descriptor_pb2.FileDescriptorProto(name="podresources_test.proto", package="v1", syntax="proto3")

    def message(name, *fields):
        m = proto.message_type.add(name=name)
        for number, field_name, kind, repeated, type_name in fields:
            f = m.field.add(name=field_name, number=number, type=kind,
                            label=_T.LABEL_REPEATED if repeated else _T.LABEL_OPTIONAL)
            if type_name:
                f.type_name = f".v1.{type_name}"

    message("ClaimResource", (2, "driver_name", _T.TYPE_STRING, False, None),
            (3, "pool_name", _T.TYPE_STRING, False, None), (4, "device_name", _T.TYPE_STRING, False, None))
    message("DynamicResource", (2, "claim_name", _T.TYPE_STRING, False, None),
            (3, "claim_namespace", _T.TYPE_STRING, False, None),
            (4, "claim_resources", _T.TYPE_MESSAGE, True, "ClaimResource"))
    message("ContainerDevices", (1, "resource_name", _T.TYPE_STRING, False, None),
            (2, "device_ids", _T.TYPE_STRING, True, None))
    message("ContainerResources", (1, "name", _T.TYPE_STRING, False, None),
            (2, "devices", _T.TYPE_MESSAGE, True, "ContainerDevices"),
            (3, "cpu_ids", _T.TYPE_INT64, True, None),
            (5, "dynamic_resources", _T.TYPE_MESSAGE, True, "DynamicResource"))
    message("PodResources", (1, "name", _T.TYPE_STRING, False, None), (2, "namespace", _T.TYPE_STRING, False, None),
            (3, "containers", _T.TYPE_MESSAGE, True, "ContainerResources"))
    message("ListPodResourcesResponse", (1, "pod_resources", _T.TYPE_MESSAGE, True, "PodResources"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("v1.ListPodResourcesResponse"))


def test_a_gpu_held_through_a_resource_claim_is_decoded_with_driver_pool_and_device():
    """A container whose GPU came from a DRA claim lists it under dynamic_resources: the decoder keeps it."""
    response = _kubelet_messages()()
    pod = response.pod_resources.add(name="trainer-0", namespace="ml")
    container = pod.containers.add(name="main")
    container.cpu_ids.extend([2, 3])
    claim = container.dynamic_resources.add(claim_name="trainer-gpu", claim_namespace="ml")
    claim.claim_resources.add(driver_name="gpu.nvidia.com", pool_name="node-1", device_name="gpu-3")
    claim.claim_resources.add(driver_name="gpu.nvidia.com", pool_name="node-1", device_name="gpu-4")
    plain = response.pod_resources.add(name="classic", namespace="ml").containers.add(name="main")
    plain.devices.add(resource_name="nvidia.com/gpu", device_ids=["GPU-aaaa"])

    decoded = {p.name: p for p in decode_list_response(response.SerializeToString())}

    assert decoded["trainer-0"].claimed == [("gpu.nvidia.com", "node-1", "gpu-3"),
                                            ("gpu.nvidia.com", "node-1", "gpu-4")]
    assert decoded["trainer-0"].devices == {}
    assert decoded["classic"].gpu_ids() == ["GPU-aaaa"]
    assert decoded["classic"].claimed == []

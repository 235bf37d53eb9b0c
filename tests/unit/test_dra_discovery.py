"""Which resource.k8s.io version the agent speaks, from recorded and derived discovery documents, and what per-GPU
isolation it then offers the planner on each."""

import json

import pytest

from agent.k8s.dra import discover_rule_version
from agent.k8s.errors import Forbidden, NotFound, Unavailable
from agent.k8s.isolation import NO_RULE_API, DeviceIsolator
from tests.conftest import FIXTURES

DISCOVERY = FIXTURES / "dra" / "discovery"
SLICE = json.loads((FIXTURES / "dra" / "nvidia-8gpu-2mig.json").read_text())


class RecordedServer:
    """Answers GETs from one discovery document; a path it does not hold is a 404, as on the real server."""

    def __init__(self, documents: dict[str, object], *, slices_forbidden: bool = False) -> None:
        self.documents = documents
        self.slices_forbidden = slices_forbidden
        self.paths: list[str] = []

    def get(self, path: str, *, query: dict[str, str] | None = None) -> dict[str, object]:
        self.paths.append(path)
        if path.endswith("/resourceslices"):
            if self.slices_forbidden:
                raise Forbidden("resourceslices is forbidden", status=403)
            return {"items": [SLICE | {"spec": SLICE["spec"] | {"nodeName": "node-1"}}]}
        if path.endswith("/devicetaintrules"):
            return {"items": []}
        if path not in self.documents:
            raise NotFound(f"{path} not found", status=404)
        return self.documents[path]  # type: ignore[return-value]


def server(name: str, **kwargs: bool) -> RecordedServer:
    return RecordedServer(json.loads((DISCOVERY / name).read_text()), **kwargs)


@pytest.mark.parametrize(("document", "version"), [
    ("1.37.2.json", "v1"),
    ("1.36-derived.json", "v1beta2"),
    ("1.35-alpha-derived.json", "v1alpha3"),
    ("rule-api-off-derived.json", None),
])
def test_the_newest_version_serving_device_taint_rules_is_chosen(document, version):
    """GA v1 on 1.37, beta v1beta2 on 1.36, alpha v1alpha3 before; None when the rule API is off."""
    assert discover_rule_version(server(document)) == version  # type: ignore[arg-type]


def test_a_server_without_dra_serves_no_rule_version():
    """No resource.k8s.io group at all (404 on the group) is not an error: node isolation."""
    assert discover_rule_version(RecordedServer({})) is None  # type: ignore[arg-type]


def test_the_isolator_reads_slices_in_the_discovered_version():
    """On a 1.36-like server the slices and rules are read under v1beta2."""
    recorded = server("1.36-derived.json")
    isolation, rules = DeviceIsolator(recorded, node_name="node-1", taint_key="k", setting="device").read()  # type: ignore[arg-type]
    assert isolation is not None and not isolation.unavailable and rules == {}
    assert "/apis/resource.k8s.io/v1beta2/resourceslices" in recorded.paths


def test_device_isolation_without_a_rule_api_says_why():
    """`isolation: device` on a server without DeviceTaintRules: node isolation, with the reason for the Event."""
    isolation, _ = DeviceIsolator(server("rule-api-off-derived.json"), node_name="node-1", taint_key="k",  # type: ignore[arg-type]
                                  setting="device").read()
    assert isolation is not None and isolation.unavailable == NO_RULE_API and not isolation.silent


def test_auto_isolation_without_dra_falls_back_silently():
    """`isolation: auto` on a cluster without DRA: node isolation is the expected choice, no Event."""
    isolation, _ = DeviceIsolator(RecordedServer({}), node_name="node-1", taint_key="k").read()  # type: ignore[arg-type]
    assert isolation is not None and isolation.unavailable and isolation.silent


def test_without_the_dra_grants_the_reason_names_the_manifests():
    """The base grants nothing on resource.k8s.io: the reason points at daemonset/dra."""
    isolation, _ = DeviceIsolator(server("1.37.2.json", slices_forbidden=True), node_name="node-1",  # type: ignore[arg-type]
                                  taint_key="k", setting="device").read()
    assert isolation is not None and "daemonset/dra" in isolation.unavailable


def test_absent_dra_is_discovered_again_only_after_a_while():
    """A node without DRA does not cost a discovery request every pass."""
    recorded, now = RecordedServer({}), [0.0]
    isolator = DeviceIsolator(recorded, node_name="node-1", taint_key="k", clock=lambda: now[0])  # type: ignore[arg-type]
    isolator.read()
    isolator.read()
    assert recorded.paths == ["/apis/resource.k8s.io"]
    now[0] = 301.0
    isolator.read()
    assert recorded.paths == ["/apis/resource.k8s.io"] * 2


def test_a_failed_discovery_is_asked_again_at_the_next_pass():
    """A 503 while discovering is not "no DRA": the next pass asks again instead of waiting minutes."""
    recorded = server("1.37.2.json")
    answers = recorded.get

    def once_unavailable(path: str, *, query: dict[str, str] | None = None) -> dict[str, object]:
        if not recorded.paths:
            recorded.paths.append(path)
            raise Unavailable("the server is currently unable to handle the request", status=503)
        return answers(path, query=query)

    recorded.get = once_unavailable  # type: ignore[method-assign]
    isolator = DeviceIsolator(recorded, node_name="node-1", taint_key="k", setting="device",  # type: ignore[arg-type]
                              clock=lambda: 0.0)
    assert isolator.read() == (None, None)
    isolation, _ = isolator.read()
    assert isolation is not None and not isolation.unavailable


def test_pods_holding_a_gpu_through_a_claim_or_podresources_are_named_by_uuid():
    """An allocated claim reserved for a pod, and PodResources' dynamic resources, both map to GPU UUIDs."""
    recorded = server("1.37.2.json")
    isolator = DeviceIsolator(recorded, node_name="node-1", taint_key="k", setting="device")  # type: ignore[arg-type]
    isolator.read()
    pool = SLICE["spec"]["pool"]["name"]
    claim = {"metadata": {"namespace": "ml", "name": "c"}, "status": {
        "allocation": {"devices": {"results": [{"driver": "gpu.nvidia.com", "pool": pool, "device": "gpu-3"}]}},
        "reservedFor": [{"resource": "pods", "name": "trainer", "uid": "u1"}]}}
    recorded.documents["/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims"] = {"items": [claim]}
    held = isolator.gpus_by_pod({"ml"}, {("ml", "other"): [("gpu.nvidia.com", pool, "gpu-6-mig-3g40gb-0")]})
    assert held == {("ml", "trainer"): {"GPU-4d3c2b1a-0000-4000-8000-000000000003"},
                    ("ml", "other"): {"MIG-9e8f7a6b-0006-4000-8000-000000000000",
                                      "GPU-4d3c2b1a-0000-4000-8000-000000000006"}}


def test_auto_on_a_node_without_published_gpus_lists_slices_again_only_after_a_while():
    """A cluster serving DRA for other devices: `auto` on a GPU node without slices costs no request per pass."""
    recorded, now = server("1.37.2.json"), [0.0]
    isolator = DeviceIsolator(recorded, node_name="node-without-slices", taint_key="k",  # type: ignore[arg-type]
                              clock=lambda: now[0])
    first, _ = isolator.read()
    asked = len(recorded.paths)
    second, rules = isolator.read()
    assert first is not None and first.silent and second == first and rules is None
    assert len(recorded.paths) == asked
    now[0] = 301.0
    isolator.read()
    assert len(recorded.paths) > asked


def test_auto_without_the_dra_grants_asks_again_only_after_a_while():
    """The base manifests grant nothing on resource.k8s.io: `auto` is not refused (403) at every pass."""
    recorded, now = server("1.37.2.json", slices_forbidden=True), [0.0]
    isolator = DeviceIsolator(recorded, node_name="node-1", taint_key="k", clock=lambda: now[0])  # type: ignore[arg-type]
    first, _ = isolator.read()
    asked = len(recorded.paths)
    second, _ = isolator.read()
    assert len(recorded.paths) == asked and second == first
    assert first is not None and first.silent and "daemonset/dra" in first.unavailable
    now[0] = 301.0
    isolator.read()
    assert len(recorded.paths) > asked

"""The fake API server answers as a real kube-apiserver does where the agent could tell the difference."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster, populate
from tests.k8s_helpers import gpu_node

MULTIPLE_PDBS = "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def api():
    clock = Clock()
    cluster = FakeCluster(clock=clock)
    populate(cluster, gpu_node("n1"))
    server = FakeApiServer(cluster).start()
    yield cluster, server, clock
    server.stop()


def request(server: FakeApiServer, method: str, path: str, body: Any = None,
            content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def evict(server: FakeApiServer, pod: str, namespace: str = "ml", **delete_options: Any) -> tuple[int, dict]:
    body: dict[str, Any] = {"apiVersion": "policy/v1", "kind": "Eviction",
                            "metadata": {"name": pod, "namespace": namespace}}
    if delete_options:
        body["deleteOptions"] = delete_options
    return request(server, "POST", f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction", body)


def pod_names(cluster: FakeCluster) -> set[str]:
    return {p["metadata"]["name"] for p in cluster.pods_on("n1")}


def add_pdb(cluster: FakeCluster, name: str, **spec: Any) -> None:
    cluster.add("poddisruptionbudgets", {"metadata": {"name": name},
                                         "spec": {"selector": {"matchLabels": {"app": "n1-trainer"}}, **spec}},
                group="policy", namespace="ml")


def test_an_evicted_pod_terminates_for_its_grace_period_before_it_is_gone(api):
    """Eviction starts a graceful deletion: deletionTimestamp set, the pod still listed, as on a real node."""
    cluster, server, clock = api
    assert evict(server, "n1-trainer-3")[0] == 201
    pod = request(server, "GET", "/api/v1/namespaces/ml/pods/n1-trainer-3")[1]
    assert pod["metadata"]["deletionTimestamp"] and pod["metadata"]["deletionGracePeriodSeconds"] == 30
    assert "n1-trainer-3" in pod_names(cluster)
    clock.now += 29
    assert "n1-trainer-3" in pod_names(cluster)
    clock.now += 1
    assert "n1-trainer-3" not in pod_names(cluster)
    assert request(server, "GET", "/api/v1/namespaces/ml/pods/n1-trainer-3")[0] == 404


def test_an_evicted_pod_carries_the_disruption_target_condition(api):
    """The Eviction API marks the pod DisruptionTarget=True before deleting it."""
    _, server, _ = api
    evict(server, "n1-trainer-3")
    pod = request(server, "GET", "/api/v1/namespaces/ml/pods/n1-trainer-3")[1]
    condition = next(c for c in pod["status"]["conditions"] if c["type"] == "DisruptionTarget")
    assert (condition["status"], condition["reason"]) == ("True", "EvictionByEvictionAPI")


def test_a_delete_honours_the_grace_period_asked_for(api):
    """DeleteOptions.gracePeriodSeconds replaces the pod's own period; zero deletes at once."""
    cluster, server, clock = api
    code, _ = request(server, "DELETE", "/api/v1/namespaces/ml/pods/n1-trainer-1", {"gracePeriodSeconds": 5})
    assert code == 200 and "n1-trainer-1" in pod_names(cluster)
    clock.now += 5
    assert "n1-trainer-1" not in pod_names(cluster)
    request(server, "DELETE", "/api/v1/namespaces/ml/pods/n1-trainer-2", {"gracePeriodSeconds": 0})
    assert "n1-trainer-2" not in pod_names(cluster)


def test_a_second_delete_can_shorten_a_termination_but_never_lengthen_it(api):
    """A later, shorter grace period moves the deadline in; a longer one is ignored."""
    cluster, server, clock = api
    request(server, "DELETE", "/api/v1/namespaces/ml/pods/n1-trainer-1", {"gracePeriodSeconds": 20})
    request(server, "DELETE", "/api/v1/namespaces/ml/pods/n1-trainer-1", {"gracePeriodSeconds": 60})
    clock.now += 20
    assert "n1-trainer-1" not in pod_names(cluster)
    request(server, "DELETE", "/api/v1/namespaces/ml/pods/n1-trainer-2", {"gracePeriodSeconds": 20})
    request(server, "DELETE", "/api/v1/namespaces/ml/pods/n1-trainer-2", {"gracePeriodSeconds": 2})
    clock.now += 2
    assert "n1-trainer-2" not in pod_names(cluster)


def test_a_termination_finishes_early_when_the_containers_exit(api):
    """What a kubelet does when the workload exits on SIGTERM: the pod goes before its grace period ends."""
    cluster, server, _ = api
    evict(server, "n1-trainer-3")
    cluster.finish_termination("ml", "n1-trainer-3")
    assert "n1-trainer-3" not in pod_names(cluster)


def test_evicting_a_terminating_pod_skips_the_budget(api):
    """A pod already being deleted is evicted again without asking its PodDisruptionBudget."""
    cluster, server, _ = api
    evict(server, "n1-trainer-3")
    add_pdb(cluster, "none-may-go", maxUnavailable=0)
    assert evict(server, "n1-trainer-3")[0] == 201


def test_a_terminating_pod_no_longer_counts_as_healthy_for_a_budget(api):
    """minAvailable 7 of 8: one eviction goes through, the next is refused while the first still terminates."""
    cluster, server, _ = api
    add_pdb(cluster, "seven", minAvailable=7)
    assert evict(server, "n1-trainer-1")[0] == 201
    code, body = evict(server, "n1-trainer-2")
    assert code == 429 and body["reason"] == "TooManyRequests"


def test_a_pod_under_two_budgets_is_refused_with_the_real_servers_500(api):
    """Two PodDisruptionBudgets matching one pod: a bare 500 Status, whatever either budget allows."""
    cluster, server, _ = api
    add_pdb(cluster, "team", maxUnavailable=8)
    add_pdb(cluster, "service", maxUnavailable=8)
    code, body = evict(server, "n1-trainer-3")
    assert code == 500
    assert body == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": MULTIPLE_PDBS, "code": 500}
    assert "n1-trainer-3" in pod_names(cluster)


def test_a_taint_with_an_unknown_effect_is_invalid(api):
    """422 Invalid naming the field, and the node unchanged."""
    cluster, server, _ = api
    code, body = request(server, "PATCH", "/api/v1/nodes/n1",
                         {"spec": {"taints": [{"key": "a", "effect": "NoWay"}]}}, "application/merge-patch+json")
    assert code == 422 and body["reason"] == "Invalid"
    assert "spec.taints[0].effect" in body["message"]
    assert body["details"]["causes"][0]["field"] == "spec.taints[0].effect"
    assert not cluster.node("n1")["spec"].get("taints")


def test_annotations_over_256_kib_in_all_are_invalid(api):
    """As apimachinery's ValidateAnnotations: keys and values together past 262,144 bytes are a 422."""
    cluster, server, _ = api
    big = {"metadata": {"annotations": {"example.com/a": "x" * 200_000, "example.com/b": "y" * 70_000}}}
    code, body = request(server, "PATCH", "/api/v1/nodes/n1", big, "application/merge-patch+json")
    assert code == 422 and "metadata.annotations: Too long" in body["message"]
    assert "example.com/a" not in (cluster.node("n1")["metadata"].get("annotations") or {})
    fits = {"metadata": {"annotations": {"example.com/a": "x" * 200_000}}}
    assert request(server, "PATCH", "/api/v1/nodes/n1", fits, "application/merge-patch+json")[0] == 200


def test_two_taints_with_the_same_key_and_effect_are_invalid(api):
    """Taints are unique by key and effect."""
    _, server, _ = api
    taint = {"key": "a", "value": "1", "effect": "NoSchedule"}
    code, body = request(server, "PATCH", "/api/v1/nodes/n1", {"spec": {"taints": [taint, {**taint, "value": "2"}]}},
                         "application/merge-patch+json")
    assert code == 422 and "spec.taints[1]" in body["message"]


def test_a_put_whose_name_differs_from_the_url_is_a_bad_request(api):
    """The object's metadata.name must be the one in the URL."""
    cluster, server, _ = api
    node = cluster.node("n1")
    node["metadata"]["name"] = "n2"
    code, body = request(server, "PUT", "/api/v1/nodes/n1", node)
    assert code == 400 and body["reason"] == "BadRequest"
    assert "does not match the name on the URL" in body["message"]


def test_a_patch_that_renames_the_object_is_invalid(api):
    """metadata.name is immutable."""
    _, server, _ = api
    code, body = request(server, "PATCH", "/api/v1/nodes/n1", {"metadata": {"name": "n2"}},
                         "application/merge-patch+json")
    assert code == 422 and "metadata.name" in body["message"]


def event(**changes: Any) -> dict[str, Any]:
    body = {"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"generateName": "n1."},
            "eventTime": "2026-11-30T00:00:00.000000Z", "reportingController": "gpu-health-agent.io/agent",
            "reportingInstance": "n1/agent", "action": "Taint", "reason": "GpuFatalFault", "type": "Warning",
            "note": "xid 79", "regarding": {"kind": "Node", "name": "n1", "apiVersion": "v1"}}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not None}


@pytest.mark.parametrize("field", ["eventTime", "reportingController", "reportingInstance", "action", "reason"])
def test_an_event_missing_a_required_field_is_invalid(api, field):
    """events.k8s.io/v1 requires eventTime, reportingController, reportingInstance, action and reason."""
    _, server, _ = api
    code, body = request(server, "POST", "/apis/events.k8s.io/v1/namespaces/default/events", event(**{field: None}))
    assert code == 422 and field in body["message"]


def test_an_event_of_an_unknown_type_is_invalid(api):
    """type is Normal or Warning."""
    _, server, _ = api
    code, _ = request(server, "POST", "/apis/events.k8s.io/v1/namespaces/default/events", event(type="Fatal"))
    assert code == 422


def test_a_cluster_scoped_object_event_outside_default_is_invalid(api):
    """An Event about a Node (no namespace) lives in default or kube-system only."""
    _, server, _ = api
    code, body = request(server, "POST", "/apis/events.k8s.io/v1/namespaces/gpu-health/events", event())
    assert code == 422 and "namespace" in body["message"]


def test_a_complete_event_is_created(api):
    """The shape the agent sends is accepted."""
    _, server, _ = api
    code, _ = request(server, "POST", "/apis/events.k8s.io/v1/namespaces/default/events", event())
    assert code == 201


RULES_PATH = "/apis/resource.k8s.io/v1/devicetaintrules"


def device_taint_rule(name: str = "gpu-health.n1.gpu-3", effect: str = "NoSchedule") -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": name},
            "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-3"},
                     "taint": {"key": "gpu-health-agent.io/unhealthy", "value": "true", "effect": effect}}}


def test_resource_k8s_io_is_discovered_with_device_taint_rules_in_v1(api):
    """The group document and v1's resource list, as the agent's version discovery reads them on 1.37."""
    _, server, _ = api
    status, group = request(server, "GET", "/apis/resource.k8s.io")
    assert status == 200 and group["kind"] == "APIGroup" and group["preferredVersion"]["version"] == "v1"
    names = {r["name"] for r in request(server, "GET", "/apis/resource.k8s.io/v1")[1]["resources"]}
    assert {"resourceslices", "resourceclaims", "devicetaintrules"} <= names


def test_a_device_taint_rule_with_an_unknown_effect_is_invalid(api):
    """`PreferNoSchedule` is a node taint effect, not a device one: 422 Invalid naming spec.taint.effect."""
    _, server, _ = api
    status, body = request(server, "POST", RULES_PATH, device_taint_rule(effect="PreferNoSchedule"))
    assert status == 422 and body["details"]["causes"][0]["field"] == "spec.taint.effect"


def test_a_delete_with_a_stale_resource_version_precondition_is_a_conflict(api):
    """A rule changed since it was read is not deleted: 409, and it stays."""
    _, server, _ = api
    created = request(server, "POST", RULES_PATH, device_taint_rule())[1]
    stale = {"preconditions": {"resourceVersion": "1"}}
    assert created["metadata"]["resourceVersion"] != "1"
    assert request(server, "DELETE", f"{RULES_PATH}/gpu-health.n1.gpu-3", stale)[0] == 409
    current = {"preconditions": {"resourceVersion": created["metadata"]["resourceVersion"]}}
    assert request(server, "DELETE", f"{RULES_PATH}/gpu-health.n1.gpu-3", current)[0] == 200


def test_a_node_status_patch_changes_labels_and_conditions_but_never_the_spec(api):
    """As the real server's Node status strategy does (tests/realcluster/test_node_writes.py checks it there)."""
    _, server, _ = api
    patch = {"metadata": {"labels": {"a/b": "c"}, "annotations": {"a/d": "e"}},
             "spec": {"taints": [{"key": "a/t", "effect": "NoSchedule"}]},
             "status": {"conditions": [{"type": "GpuFatalFault", "status": "True", "reason": "R", "message": "m"}]}}
    code, node = request(server, "PATCH", "/api/v1/nodes/n1/status", patch,
                         content_type="application/strategic-merge-patch+json")
    assert code == 200
    assert node["metadata"]["labels"]["a/b"] == "c" and node["metadata"]["annotations"]["a/d"] == "e"
    assert "GpuFatalFault" in {c["type"] for c in node["status"]["conditions"]}
    assert not node["spec"].get("taints")

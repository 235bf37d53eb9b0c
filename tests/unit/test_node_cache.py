"""The agent's last-seen Node: the newest copy wins, a live watch vouches for it within a bound, and only a
change to what a pass reads counts as one."""

from __future__ import annotations

import threading
from typing import Any

from agent.k8s.bodies import Node, as_node
from agent.k8s.node import AGENT_CONDITIONS, RELEASE_ANNOTATION
from agent.k8s.node_cache import NodeCache, inputs_of, newer
from agent.k8s.node_watch import NodeWatch


def node(version: str, **changes: Any) -> Node:
    document: dict[str, Any] = {
        "metadata": {"name": "n1", "resourceVersion": version, "labels": {"a": "1"}, "annotations": {}},
        "spec": {"taints": []},
        "status": {"conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "t0"}]}}
    for part, value in changes.items():
        document[part].update(value)
    return as_node(document)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_resource_versions_compare_as_the_integers_etcd_gives():
    """'10' is newer than '9' (not as strings); equal counts as new enough."""
    assert newer("10", "9") and newer("9", "9") and not newer("9", "10")


def test_a_resource_version_that_is_not_an_integer_is_taken_as_newer():
    """An opaque version is never kept from the agent."""
    assert newer("abc", "10")


def test_an_older_copy_never_replaces_a_newer_one():
    """A watch event that lags a write's answer leaves the answer in place."""
    cache = NodeCache()
    cache.offer(node("12"))
    assert cache.offer(node("11")) == (False, node("12"))
    assert cache.node == node("12")


def test_a_newer_copy_replaces_the_one_kept():
    """And says which it replaced."""
    cache = NodeCache()
    cache.offer(node("11"))
    assert cache.offer(node("12")) == (True, node("11"))


def test_without_a_live_watch_nothing_is_vouched_for():
    """A Node seen by a GET is no reason to skip the next GET."""
    cache = NodeCache()
    cache.offer(node("1"))
    assert cache.current() is None


def heard_ago(seconds: float) -> NodeCache:
    """A cache whose watch was last heard from `seconds` ago, with the 150-s bound."""
    clock = Clock()
    cache = NodeCache(fresh_seconds=150.0, clock=clock)
    cache.offer(node("1"))
    cache.heard()
    clock.now += seconds
    return cache


def test_a_watch_heard_from_within_the_bound_vouches_for_the_node():
    """Heard 150 s ago at most: the pass reads the cache."""
    assert heard_ago(150.0).current() == node("1")


def test_a_watch_silent_past_the_bound_vouches_for_nothing():
    """No event or bookmark for longer than the bound: a GET again."""
    assert heard_ago(150.1).current() is None


def test_a_lost_watch_vouches_for_nothing():
    """An error or a 410: the next pass GETs at once, not after the bound."""
    cache = NodeCache()
    cache.offer(node("1"))
    cache.heard()
    cache.lost()
    assert cache.current() is None


def test_a_forgotten_node_is_read_again():
    """After a 409 the writer reads afresh, whatever the watch vouched for."""
    cache = NodeCache()
    cache.offer(node("1"))
    cache.heard()
    cache.forget()
    assert cache.node is None and cache.current() is None


def test_a_kubelet_heartbeat_is_no_change_to_what_a_pass_reads():
    """Another condition's heartbeat and a new resourceVersion alone wake nothing."""
    later = node("2", status={"conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "t1"}]})
    assert inputs_of(node("1"), AGENT_CONDITIONS) == inputs_of(later, AGENT_CONDITIONS)


def test_a_release_annotation_is_a_change_to_what_a_pass_reads():
    """The operator's release request wakes the reconciler."""
    released = node("2", metadata={"annotations": {RELEASE_ANNOTATION: "all@now"}})
    assert inputs_of(node("1"), AGENT_CONDITIONS) != inputs_of(released, AGENT_CONDITIONS)


def test_an_opt_out_label_is_a_change_to_what_a_pass_reads():
    """A label (the opt-out) wakes the reconciler."""
    opted = node("2", metadata={"labels": {"a": "1", "gpu-health-agent.io/opt-out": "true"}})
    assert inputs_of(node("1"), AGENT_CONDITIONS) != inputs_of(opted, AGENT_CONDITIONS)


def test_a_taint_is_a_change_to_what_a_pass_reads():
    """Someone removing the agent's taint wakes the reconciler to put it back."""
    tainted = node("2", spec={"taints": [{"key": "k", "effect": "NoSchedule"}]})
    assert inputs_of(node("1"), AGENT_CONDITIONS) != inputs_of(tainted, AGENT_CONDITIONS)


def test_an_agent_condition_is_a_change_to_what_a_pass_reads():
    """The agent's own conditions (someone cleared one) wake the reconciler."""
    set_ = node("2", status={"conditions": [{"type": "GpuFatalFault", "status": "True", "reason": "x"}]})
    assert inputs_of(node("1"), AGENT_CONDITIONS) != inputs_of(set_, AGENT_CONDITIONS)


def test_an_event_of_the_agents_own_write_delivered_before_its_answer_wakes_nothing():
    """The watch delivers the write while the writer still waits for its answer: weighed after the answer
    (the same version), it is no change of anyone else's, so no pass is woken for it."""
    cache = NodeCache()
    cache.offer(node("1"))
    wakes: list[int] = []
    watch = NodeWatch(None, "n1", cache)
    watch._wake = lambda: wakes.append(1)  # what run() is handed by the daemon
    written = node("2", spec={"taints": [{"key": "k", "effect": "NoSchedule"}]})
    with cache.writing():
        delivery = threading.Thread(target=watch._event, args=("MODIFIED", written))
        delivery.start()
        delivery.join(0.5)  # it waits for the answer (without that, it is weighed now, against node 1)
        cache.offer(written)  # the write's answer
    delivery.join(5)
    assert wakes == []


def test_a_gpu_the_device_plugin_withholds_is_a_change_to_what_a_pass_reads():
    """Allocatable nvidia.com/gpu dropping below capacity (a GPU reported Unhealthy) wakes the reconciler."""
    counts = {"capacity": {"nvidia.com/gpu": "8", "cpu": "192"}, "allocatable": {"nvidia.com/gpu": "8", "cpu": "190"}}
    full = node("1", status=counts)
    withheld = node("2", status={**counts, "allocatable": {"nvidia.com/gpu": "7", "cpu": "190"}})
    busier = node("3", status={**counts, "allocatable": {"nvidia.com/gpu": "8", "cpu": "189"}})
    assert inputs_of(full, AGENT_CONDITIONS) != inputs_of(withheld, AGENT_CONDITIONS)
    assert inputs_of(full, AGENT_CONDITIONS) == inputs_of(busier, AGENT_CONDITIONS)

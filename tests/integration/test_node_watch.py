"""agent.k8s.node_watch over the fake API server: the watch keeps the writer's Node current, a change to what a
pass reads wakes the reconciler (the agent's own writes do not), a 410 is one list and a new watch."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from agent.k8s.client import client_for
from agent.k8s.node import RELEASE_ANNOTATION, NodeWriter
from agent.k8s.node_cache import NodeCache
from agent.k8s.node_watch import NodeWatch
from agent.k8s.raw import RawApi
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster, populate
from agent.simulation.fake_apiserver.resources import BY_PATH
from tests.integration.test_k8s_watch import wait_for
from tests.k8s_helpers import TAINT, gpu_node

NODES = BY_PATH[("", "v1", "nodes")]


@dataclass
class Watched:
    cluster: FakeCluster
    writer: NodeWriter
    watch: NodeWatch
    wakes: list[int]

    def gets(self) -> int:
        return sum(1 for method, path, _ in self.cluster.log if method == "GET" and path == "/api/v1/nodes/n1")

    def delivered(self, version: str) -> bool:
        return self.watch.lister.resource_version == version and self.writer.seen.current() is not None


@pytest.fixture
def watched() -> Iterator[Watched]:
    cluster = FakeCluster()
    populate(cluster, gpu_node("n1"))
    server = FakeApiServer(cluster).start()
    api = client_for(server.url)
    seen = NodeCache()
    writer = NodeWriter(RawApi(api), "n1", taint_key=TAINT, seen=seen)
    watch = NodeWatch(api, "n1", seen)
    wakes: list[int] = []
    stop = threading.Event()
    thread = threading.Thread(target=watch.run, args=(stop, lambda: wakes.append(1)), daemon=True)
    thread.start()
    state = Watched(cluster, writer, watch, wakes)
    wait_for(lambda: seen.current() is not None and wakes, "the watch to list the node (one wake)")
    yield state
    stop.set()
    watch.close()
    thread.join(5)
    server.stop()


def admin_annotate(cluster: FakeCluster, key: str, value: str) -> str:
    """An operator's change to the Node; its new resourceVersion."""
    with cluster.lock:
        node = copy.deepcopy(cluster.node("n1"))
        node["metadata"].setdefault("annotations", {})[key] = value
        return str(cluster.replace(NODES, "", "n1", node)["metadata"]["resourceVersion"])


def test_an_operators_change_reaches_the_writer_by_the_watch_without_a_get(watched):
    """The release annotation is in the writer's read, and the fake saw no GET of the Node."""
    gets = watched.gets()
    version = admin_annotate(watched.cluster, RELEASE_ANNOTATION, "all@now")
    wait_for(lambda: watched.delivered(version), "the watch to deliver the change")
    assert watched.writer.read().annotations[RELEASE_ANNOTATION] == "all@now"
    assert watched.gets() == gets


def test_a_change_to_what_a_pass_reads_wakes_the_reconciler(watched):
    """An operator's annotation: one wake."""
    wakes = len(watched.wakes)
    version = admin_annotate(watched.cluster, RELEASE_ANNOTATION, "all@now")
    wait_for(lambda: watched.delivered(version), "the watch to deliver the change")
    assert len(watched.wakes) == wakes + 1


def test_the_agents_own_write_wakes_nothing(watched):
    """The writer's answer is the watch's event: nothing new to wake a pass for."""
    wakes = len(watched.wakes)
    assert watched.writer.set_taint(True)
    version = str(watched.cluster.node("n1")["metadata"]["resourceVersion"])
    wait_for(lambda: watched.delivered(version), "the watch to deliver the write")
    assert len(watched.wakes) == wakes


def test_a_410_is_answered_by_one_list_and_a_new_watch(watched):
    """The resumed version compacted away: the watch lists the Node once and watches from the list."""
    lists, watches = watched.watch.lister.lists, watched.watch.lister.watches
    version = admin_annotate(watched.cluster, "x", "1")
    wait_for(lambda: watched.delivered(version), "the watch to deliver the change")
    watched.cluster.history.compact(int(version))
    watched.watch.close()  # the connection breaks
    wait_for(lambda: watched.writer.seen.current() is None, "the agent to see its watch broken")
    watched.watch.lister.resource_version = str(int(version) - 1)  # resumes from what was compacted away
    wait_for(lambda: watched.watch.lister.lists == lists + 1 and watched.writer.seen.current() is not None,
             "the watch to relist after its 410")
    wait_for(lambda: watched.watch.lister.watches >= watches + 2, "the new watch after the list")
    assert watched.writer.read().annotations["x"] == "1"


def test_a_deleted_node_is_read_with_a_get(watched):
    """The watch says the Node is gone: the cache vouches for nothing and a pass asks the server."""
    with watched.cluster.lock:
        watched.cluster.delete(NODES, "", "n1")
    wait_for(lambda: watched.writer.seen.current() is None, "the watch to deliver the deletion")


class Idle:
    """A source that sees nothing."""

    name = "idle"

    def run(self, emit: object, stop: threading.Event) -> None:
        stop.wait()


def test_a_change_to_the_node_wakes_the_daemons_reconciler_long_before_its_next_pass(tmp_path):
    """node_sync_seconds an hour: an operator's release annotation still brings a pass at once (the daemon
    runs the watch and hands it the reconciler's wake)."""
    from prometheus_client import CollectorRegistry

    from agent.cluster_side import build_cluster_side
    from agent.config import load_config
    from agent.daemon import Daemon
    from tests.k8s_helpers import RULES

    cluster = FakeCluster()
    populate(cluster, gpu_node("n1"))
    server = FakeApiServer(cluster).start()
    config = load_config(None, env={"NODE_NAME": "n1", "GPU_HEALTH_JOURNAL_PATH": str(tmp_path / "j.db"),
                                    "GPU_HEALTH_REMEDIATION__NODE_SYNC_SECONDS": "3600"})
    side = build_cluster_side(client_for(server.url), config, on_stuck=lambda pod: None)
    daemon = Daemon(config, rules=RULES, sources=[Idle()], registry=CollectorRegistry(), cluster=side)
    stop = threading.Event()
    thread = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: side.writer.seen.current() is not None, "the daemon's node watch to list the node")
        wait_for(lambda: daemon.pipeline.due_at > 0, "the first pass")
        due = daemon.pipeline.due_at
        admin_annotate(cluster, RELEASE_ANNOTATION, "all@now")
        wait_for(lambda: daemon.pipeline.due_at != due, "a pass woken by the watch")
        assert RELEASE_ANNOTATION not in cluster.node("n1")["metadata"].get("annotations", {})
    finally:
        stop.set()
        thread.join(15)
        server.stop()

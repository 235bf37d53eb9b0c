"""agent.k8s.watch over the fake API server's watches: resume, bookmarks, 410 and metadata-only."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agent.k8s.client import client_for
from agent.k8s.watch import Expired, ListWatch, WatchOptions
from agent.simulation.fake_apiserver import FakeApiServer, FakeCluster


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    """Polls until `predicate` holds (a hang guard, not a timing assertion)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    fake = FakeApiServer(FakeCluster()).start()
    yield fake
    fake.stop()


class Recorder:
    def __init__(self, lw: ListWatch) -> None:
        self.lw = lw
        self.syncs: list[list[str]] = []
        self.events: list[tuple[str, str, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lw.run, daemon=True, kwargs={
            "stop": self.stop, "on_sync": lambda items: self.syncs.append([_name(i) for i in items]),
            "on_event": lambda kind, obj: self.events.append(
                (kind, _name(obj), str((obj.get("metadata") or {}).get("annotations", {}).get("a", ""))))})

    def __enter__(self) -> Recorder:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.lw.close()
        self.thread.join(timeout=10)


def _name(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name"))


def node(name: str, value: str = "1") -> dict[str, Any]:
    return {"metadata": {"name": name, "annotations": {"a": value}}}


def test_a_watch_delivers_each_change_after_the_list_once(server):
    """The list's objects go to on_sync, then every add, change and delete after it, each once, in order."""
    server.cluster.add("nodes", node("n1"))
    with Recorder(ListWatch(client_for(server.url), "/api/v1/nodes")) as rec:
        wait_for(lambda: rec.syncs, "the first list")
        server.cluster.add("nodes", node("n2"))
        server.cluster.patch(_nodes(), "", "n1", "application/merge-patch+json",
                             {"metadata": {"annotations": {"a": "2"}}})
        server.cluster.delete(_nodes(), "", "n2")
        wait_for(lambda: len(rec.events) >= 3, "three events")
    assert rec.syncs == [["n1"]]
    assert rec.events == [("ADDED", "n2", "1"), ("MODIFIED", "n1", "2"), ("DELETED", "n2", "1")]


def _nodes() -> Any:
    from agent.simulation.fake_apiserver.resources import RESOURCES

    return next(r for r in RESOURCES if r.plural == "nodes")


def test_a_watch_the_server_ends_resumes_from_the_last_version_without_a_relist(server):
    """When the server ends a watch (timeoutSeconds), the next one resumes where it stopped: no relist, and a
    change made in between is delivered once."""
    lw = ListWatch(client_for(server.url), "/api/v1/nodes", WatchOptions(watch_seconds=1))
    with Recorder(lw) as rec:
        wait_for(lambda: rec.syncs, "the first list")
        server.cluster.add("nodes", node("n1"))
        wait_for(lambda: lw.watches >= 2, "a second watch")
        server.cluster.add("nodes", node("n2"))
        wait_for(lambda: len(rec.events) >= 2, "both adds")
        wait_for(lambda: lw.watches >= 3, "a third watch")
    assert lw.lists == 1
    assert rec.events == [("ADDED", "n1", "1"), ("ADDED", "n2", "1")]


def test_an_expired_resource_version_relists(server):
    """A resume point older than the server keeps (410 Expired, after a compaction) leads to a fresh list,
    which has what changed meanwhile."""
    server.cluster.add("nodes", node("n1"))
    lw = ListWatch(client_for(server.url), "/api/v1/nodes")
    lw.resource_version = str(server.cluster.revision)  # where an earlier watch stopped
    server.cluster.add("nodes", node("n2"))
    server.cluster.history.compact(server.cluster.revision)
    with Recorder(lw) as rec:
        wait_for(lambda: rec.syncs, "a relist")
    assert rec.syncs == [["n1", "n2"]]
    assert lw.lists == 1


def test_bookmarks_move_the_resume_point_past_other_resources_changes(server):
    """A watch that asked for bookmarks keeps its resume point current while other objects change, so a
    later resume is not answered 410 for a version the history has long dropped."""
    server.cluster.history.bookmark_seconds = 0.05
    lw = ListWatch(client_for(server.url), "/api/v1/nodes")
    with Recorder(lw) as rec:
        wait_for(lambda: rec.syncs, "the first list")
        server.cluster.add("namespaces", {"metadata": {"name": "other"}})
        wait_for(lambda: lw.resource_version == str(server.cluster.revision), "a bookmark at the newest version")
    assert rec.events == []


def test_a_metadata_only_watch_gets_partial_object_metadata(server):
    """metadata_only lists and watches PartialObjectMetadata: names, labels, annotations, no spec or status."""
    server.cluster.add("nodes", {**node("n1"), "spec": {"taints": []}, "status": {"capacity": {"cpu": "8"}}})
    kinds: list[str] = []
    lw = ListWatch(client_for(server.url), "/api/v1/nodes", WatchOptions(metadata_only=True))
    items, _ = lw.list_all()
    stop = threading.Event()

    def watch() -> None:
        for _, obj in lw.watch(lw.resource_version or str(server.cluster.revision), stop):
            kinds.append(str(obj.get("kind")))
            assert "spec" not in obj and "status" not in obj
            stop.set()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    time.sleep(0.1)
    server.cluster.add("nodes", {**node("n2"), "spec": {"taints": []}})
    thread.join(timeout=10)
    assert [i["kind"] for i in items] == ["PartialObjectMetadata"]
    assert "spec" not in items[0] and items[0]["metadata"]["annotations"] == {"a": "1"}
    assert kinds == ["PartialObjectMetadata"]


def test_a_label_selected_watch_sees_only_matching_objects(server):
    """labelSelector applies to the list and the watch alike."""
    lw = ListWatch(client_for(server.url), "/api/v1/nodes", WatchOptions(label_selector="gpu=yes"))
    with Recorder(lw) as rec:
        wait_for(lambda: rec.syncs, "the first list")
        server.cluster.add("nodes", {"metadata": {"name": "cpu", "labels": {"gpu": "no"}}})
        server.cluster.add("nodes", {"metadata": {"name": "gpu", "labels": {"gpu": "yes"}}})
        wait_for(lambda: rec.events, "the matching add")
    assert [e[1] for e in rec.events] == ["gpu"]


def test_close_ends_a_quiet_watch_without_waiting_for_its_timeout(server):
    """stop + close end a watch that has nothing to deliver (a controller shutting down)."""
    server.cluster.history.bookmark_seconds = 600.0  # nothing arrives that would let it see `stop`
    lw = ListWatch(client_for(server.url), "/api/v1/nodes", WatchOptions(watch_seconds=600))
    rec = Recorder(lw).__enter__()
    wait_for(lambda: lw.watches, "the watch")
    rec.__exit__()
    assert not rec.thread.is_alive()


def test_a_failing_server_is_retried_with_backoff_and_reported(server):
    """An API outage is an on_error call and a bounded wait, then a new list once the server is back."""
    errors: list[str] = []
    waits: list[float] = []
    lw = ListWatch(client_for(server.url), "/api/v1/nodes")
    stop = threading.Event()
    server.cluster.faults.down = True

    def sleep(seconds: float) -> bool:
        waits.append(seconds)
        server.cluster.faults.down = len(waits) < 3
        return False

    synced: list[int] = []
    thread = threading.Thread(target=lw.run, daemon=True, kwargs={
        "stop": stop, "on_sync": lambda items: (synced.append(len(items)), stop.set()),
        "on_event": lambda kind, obj: None, "on_error": lambda exc: errors.append(str(exc)), "sleep": sleep})
    thread.start()
    thread.join(timeout=20)
    assert synced == [0]
    assert len(errors) == 3 and all("503" in e for e in errors)
    assert all(0 < w <= lw.options.max_backoff_seconds for w in waits)


def test_a_list_asked_for_as_single_object_metadata_is_refused_as_a_real_server_does(server):
    """A list with Accept as=PartialObjectMetadata (not ...List) is a 406, as kube-apiserver answers it."""
    from agent.k8s.errors import K8sError
    from agent.k8s.watch import METADATA_ONLY

    with pytest.raises(K8sError) as raised:
        client_for(server.url).stream("/api/v1/nodes", accept=METADATA_ONLY)
    assert raised.value.status == 406


def test_repeated_410s_relist_at_once_then_back_off(server):
    """A server that answers every watch 410 (too little history kept to resume): the first relist is at
    once, each further one waits longer, bounded, so the list is not asked for in a loop."""
    server.cluster.add("nodes", node("n1"))
    waits: list[float] = []
    lw = ListWatch(client_for(server.url), "/api/v1/nodes")
    stop = threading.Event()

    def compacted(resource_version: str, stop: threading.Event) -> Iterator[tuple[str, dict[str, Any]]]:
        raise Expired("watch /api/v1/nodes: too old resource version", status=410, reason="Expired")
        yield  # a generator, as ListWatch.watch is

    lw.watch = compacted  # type: ignore[method-assign]

    def sleep(seconds: float) -> bool:
        waits.append(seconds)
        if len(waits) == 5:
            stop.set()
        return stop.is_set()

    thread = threading.Thread(target=lw.run, daemon=True, kwargs={
        "stop": stop, "on_sync": lambda items: None, "on_event": lambda kind, obj: None, "sleep": sleep})
    thread.start()
    thread.join(timeout=20)
    assert lw.lists == 6  # the first list, the relist at once, then one after each of the five waits
    assert all(0 < w <= lw.options.max_backoff_seconds for w in waits)
    assert waits[-1] > waits[0]

"""A watch of the agent's own Node (fieldSelector metadata.name, bookmarks, resumed from its resourceVersion,
re-opened about once every 45 minutes) keeping the writer's last-seen Node current; a change to what a pass
reads wakes the reconciler."""

from __future__ import annotations

import threading
from collections.abc import Callable

from agent.k8s.bodies import as_node
from agent.k8s.errors import K8sError
from agent.k8s.node import AGENT_CONDITIONS
from agent.k8s.node_cache import NodeCache, inputs_of
from agent.k8s.raw import JsonDocument, api_path
from agent.k8s.watch import ListWatch, WatchOptions
from agent.logs import get_logger

log = get_logger("agent.k8s.node_watch")
#: The server ends each watch after this many seconds plus up to as many again (jitter): a healthy node
#: re-opens it one to two times an hour.
WATCH_SECONDS = 1800.0


class NodeWatch:
    """Lists the one Node (at start and after a 410), then watches it; `cache` is the writer's `seen`."""

    def __init__(self, api_client: object, node_name: str, cache: NodeCache, *,
                 watch_seconds: float = WATCH_SECONDS, max_backoff_seconds: float = 30.0) -> None:
        self.cache = cache
        self.node_name = node_name
        self.lister = ListWatch(api_client, api_path("", "v1", "nodes"), WatchOptions(
            field_selector=f"metadata.name={node_name}", watch_seconds=watch_seconds,
            max_backoff_seconds=max_backoff_seconds))
        self._wake: Callable[[], None] = lambda: None

    def run(self, stop: threading.Event, wake: Callable[[], None] = lambda: None) -> None:
        """Until `stop`: every event keeps the cache current; one that changes what a pass reads calls `wake`."""
        self._wake = wake
        self.lister.run(stop, on_sync=self._synced, on_event=self._event, on_error=self._failed,
                        on_bookmark=self.cache.heard, on_expired=self.cache.lost)
        self.cache.lost()

    def close(self) -> None:
        """Ends the open watch now (a stop), from another thread."""
        self.lister.close()

    def _synced(self, items: list[JsonDocument]) -> None:
        node = next((i for i in items if (i.get("metadata") or {}).get("name") == self.node_name), None)
        if node is None:
            self.cache.lost()  # no such Node: a pass reads it with a GET and says what it got
            return
        self._keep(node)

    def _event(self, kind: str, obj: JsonDocument) -> None:
        if kind == "DELETED":
            self.cache.lost()
            return
        self._keep(obj)

    def _keep(self, obj: JsonDocument) -> None:
        node = as_node(obj)
        self.cache.settle()  # the agent's own write, delivered before its answer, is weighed after it
        kept, previous = self.cache.offer(node)
        self.cache.heard()
        if kept and inputs_of(previous, AGENT_CONDITIONS) != inputs_of(node, AGENT_CONDITIONS):
            self._wake()

    def _failed(self, exc: K8sError) -> None:
        self.cache.lost()
        log.warning("node_watch_failed", error=str(exc), fallback="a GET each pass until it is back")

"""Watches on the fake API server: an event history per resourceVersion, streamed as a real server does.

A watch from a resourceVersion older than the history keeps is answered, as by a real server after etcd
compacted, with an ERROR event carrying a 410 Expired Status; bookmarks (allowWatchBookmarks) carry the
current resourceVersion; `timeoutSeconds` ends the stream; a metadata-only request
(`Accept: ...;as=PartialObjectMetadata;g=meta.k8s.io;v=v1`) gets PartialObjectMetadata objects.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

#: Events kept for watches to resume from (a real server keeps the watch cache's window, then etcd's).
HISTORY = 4096
#: How often an idle watch that asked for bookmarks gets one.
BOOKMARK_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class Change:
    revision: int
    type: str
    group: str
    plural: str
    namespace: str
    obj: dict[str, Any]


class WatchHistory:
    """The recent changes of a FakeCluster, in resourceVersion order; watchers wait on it."""

    def __init__(self, size: int = HISTORY) -> None:
        self._changes: deque[Change] = deque(maxlen=size)
        self._cond = threading.Condition()
        self._oldest = 1  # the oldest resourceVersion a watch may resume after
        self._closed = False
        self.bookmark_seconds = BOOKMARK_SECONDS

    def record(self, revision: int, type_: str, group: str, plural: str, namespace: str,
               obj: dict[str, Any]) -> None:
        with self._cond:
            if len(self._changes) == self._changes.maxlen:
                self._oldest = self._changes[0].revision
            self._changes.append(Change(revision, type_, group, plural, namespace, copy.deepcopy(obj)))
            self._cond.notify_all()

    def compact(self, revision: int) -> None:
        """Forget the changes up to `revision`, as etcd's compaction does: older watches get 410."""
        with self._cond:
            while self._changes and self._changes[0].revision <= revision:
                self._changes.popleft()
            self._oldest = max(self._oldest, revision)

    def close(self) -> None:
        """The server stops: every open watch ends."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stream(self, *, group: str, plural: str, namespace: str, since: int,
               matches: Callable[[dict[str, Any]], bool], timeout: float, bookmarks: bool,
               ) -> Iterator[dict[str, Any]]:
        """The watch events after `since` for one resource (a namespace, or all when empty), then new ones as
        they come, until `timeout` seconds have passed or the server stops."""
        deadline = time.monotonic() + timeout
        last_bookmark = time.monotonic()
        with self._cond:
            if since < self._oldest:
                yield {"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 410,
                    "reason": "Expired", "message": f"too old resource version: {since} ({self._oldest})"}}
                return
        seen = since
        while True:
            with self._cond:
                pending = [c for c in self._changes if c.revision > seen]
                if not pending and not self._closed:
                    wait = min(deadline, last_bookmark + self.bookmark_seconds if bookmarks else deadline)
                    self._cond.wait(max(0.0, wait - time.monotonic()))
                    pending = [c for c in self._changes if c.revision > seen]
                closed = self._closed
            for change in pending:
                seen = change.revision
                if (change.group, change.plural) == (group, plural) and namespace in ("", change.namespace) \
                        and matches(change.obj):
                    yield {"type": change.type, "object": change.obj}
            now = time.monotonic()
            if closed or now >= deadline:
                return
            if bookmarks and not pending and now >= last_bookmark + self.bookmark_seconds:
                last_bookmark = now
                yield {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": str(seen)}}}


def metadata_only(accept: str, *, listing: bool) -> bool:
    """Whether the client asked for metadata only, as client-go's metadata informers do: a list as
    PartialObjectMetadataList, a watch as PartialObjectMetadata. The other way round is a 406, as on a real
    server (which does not fall back to another type the Accept header offers)."""
    asked = {part.split("=", 1)[1] for part in accept.replace(" ", "").replace(",", ";").split(";")
             if part.startswith("as=")}
    wanted = "PartialObjectMetadataList" if listing else "PartialObjectMetadata"
    if asked - {wanted}:
        kind = "a list" if listing else "a single object"
        raise NotAcceptable(f"you requested {', '.join(sorted(asked - {wanted}))}, but the requested object is "
                            f"{kind}")
    return wanted in asked


class NotAcceptable(Exception):
    """406: the Accept header asks for a type the server cannot give for this request."""


def partial(obj: dict[str, Any]) -> dict[str, Any]:
    """An object as PartialObjectMetadata: its metadata only."""
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
            "metadata": copy.deepcopy(obj.get("metadata", {}))}

"""List and watch one resource as client-go's reflector does: a paginated list, then a watch resumed from
the last resourceVersion seen (events and bookmarks), a relist when the server answers 410 Gone, and every
connect and read bounded in time."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import urllib3.exceptions

from agent.k8s.errors import K8sError, status_error, translate
from agent.k8s.raw import JsonDocument

#: Accept headers of a metadata-only watch and list (as client-go's metadata client sends them; the API server
#: answers 406 to a list asked for as PartialObjectMetadata): the objects come as PartialObjectMetadata
#: (labels, annotations, names), a tenth of a GPU Node's size.
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"
METADATA_ONLY_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
#: A list is read in pages of this many objects (the API server's continue tokens).
PAGE = 500


class Expired(K8sError):
    """410 Gone: the resourceVersion asked for is older than the server keeps; list again."""


@dataclass(frozen=True, slots=True)
class WatchOptions:
    """What to watch and how long each part may take: the server ends a watch after `watch_seconds`
    (jittered, as client-go does, so many watchers do not reconnect at once); a read that waits longer than
    that plus `read_slack_seconds` is a dead connection."""

    label_selector: str = ""
    field_selector: str = ""
    metadata_only: bool = False
    watch_seconds: float = 300.0
    read_slack_seconds: float = 30.0
    backoff_seconds: float = 1.0
    max_backoff_seconds: float = 30.0


class ListWatch:
    """One resource's path (`/api/v1/nodes`, a namespaced collection), listed and watched."""

    def __init__(self, api_client: Any, path: str, options: WatchOptions = WatchOptions()) -> None:
        self.api_client = api_client
        self.path = path
        self.options = options
        self.resource_version = ""
        self.lists = 0
        self.watches = 0
        self._open: Any = None

    def close(self) -> None:
        """Ends a watch in progress from another thread (a stop), without waiting for its next read."""
        response = self._open
        if response is not None and hasattr(response, "shutdown"):
            response.shutdown()

    def _query(self) -> dict[str, str]:
        query = {}
        if self.options.label_selector:
            query["labelSelector"] = self.options.label_selector
        if self.options.field_selector:
            query["fieldSelector"] = self.options.field_selector
        return query

    def _accept(self, *, listing: bool = False) -> str:
        if not self.options.metadata_only:
            return "application/json"
        return METADATA_ONLY_LIST if listing else METADATA_ONLY

    def list_all(self) -> tuple[list[JsonDocument], str]:
        """Every object, page by page, and the list's resourceVersion (where a watch resumes)."""
        items: list[JsonDocument] = []
        token = ""
        self.lists += 1
        while True:
            query = {**self._query(), "limit": str(PAGE)}
            if token:
                query["continue"] = token
            document = _json(self._read(query, self.api_client.timeouts.read))
            items.extend(i for i in document.get("items") or [] if isinstance(i, dict))
            metadata = document.get("metadata") or {}
            token = str(metadata.get("continue") or "")
            if not token:
                return items, str(metadata.get("resourceVersion") or "")

    def _read(self, query: dict[str, str], read_timeout: float) -> bytes:
        response = self.api_client.stream(self.path, query=query, accept=self._accept(listing=True),
                                          read_timeout=read_timeout)
        try:
            return bytes(response.read())
        finally:
            response.release_conn()

    def watch(self, resource_version: str, stop: threading.Event) -> Iterator[tuple[str, JsonDocument]]:
        """(type, object) for each change after `resource_version`, BOOKMARKs included, until the server ends
        the watch or `stop` is set (seen at the next event or read timeout); Expired on 410."""
        seconds = max(1, int(self.options.watch_seconds * (1.0 + random.random())))  # noqa: S311 - jitter
        query = {**self._query(), "watch": "true", "allowWatchBookmarks": "true",
                 "resourceVersion": resource_version, "timeoutSeconds": str(seconds)}
        self.watches += 1
        response = self.api_client.stream(self.path, query=query, accept=self._accept(),
                                          read_timeout=seconds + self.options.read_slack_seconds)
        self._open = response
        try:
            for line in _lines(response):
                if stop.is_set():
                    return
                event = json.loads(line)
                kind, obj = str(event.get("type") or ""), event.get("object")
                if not isinstance(obj, dict):
                    continue
                if kind == "ERROR":
                    code = int(obj.get("code") or 0)
                    if code == 410:
                        raise Expired(f"watch {self.path}: {obj.get('message') or 'resourceVersion too old'}",
                                      status=410, reason="Expired")
                    raise status_error(code, str(obj.get("reason") or ""), json.dumps(obj))
                yield kind, obj
        except (OSError, ValueError, urllib3.exceptions.HTTPError) as exc:
            if stop.is_set():
                return  # closed by `close` on the way out
            raise translate(exc, request=f"WATCH {self.path}") from None
        finally:
            self._open = None
            response.release_conn()

    def run(self, stop: threading.Event, *, on_sync: Callable[[list[JsonDocument]], None],
            on_event: Callable[[str, JsonDocument], None], on_error: Callable[[K8sError], None] = lambda e: None,
            sleep: Callable[[float], bool] | None = None, on_bookmark: Callable[[], None] = lambda: None,
            on_expired: Callable[[], None] = lambda: None) -> None:
        """List, hand the whole set to `on_sync`, then watch and hand each change to `on_event` (and say each
        bookmark to `on_bookmark`), resuming from the last resourceVersion seen; relist on 410 (`on_expired`
        first; at once the first time, backing off when 410s come again with no event between: a server that
        keeps too little history must not be relisted in a loop); back off (bounded, jittered) on failures."""
        wait = sleep or stop.wait
        failures = expired = 0
        while not stop.is_set():
            try:
                if not self.resource_version:
                    items, self.resource_version = self.list_all()
                    on_sync(items)
                for kind, obj in self.watch(self.resource_version, stop):
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
                    if kind != "BOOKMARK":
                        on_event(kind, obj)
                    else:
                        on_bookmark()
                    if version:
                        self.resource_version = version
                    failures = expired = 0
            except Expired:
                self.resource_version = ""  # relist: what changed meanwhile is in the new list
                on_expired()
                expired += 1
                if expired > 1:
                    wait(self._backoff(expired - 1))
            except K8sError as exc:
                on_error(exc)
                failures += 1
                wait(self._backoff(failures))

    def _backoff(self, attempts: int) -> float:
        """The wait after `attempts` failures in a row: doubling from backoff_seconds, bounded, jittered."""
        bound = min(self.options.max_backoff_seconds, self.options.backoff_seconds * 2.0 ** min(attempts, 8))
        return bound * (0.5 + random.random() / 2)  # noqa: S311 - jitter


def _lines(response: Any) -> Iterator[bytes]:
    """The JSON lines of a watch answer as they arrive (a chunk may hold several, or part of one)."""
    buffer = b""
    for chunk in response.stream(amt=65536, decode_content=True):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


def _json(data: bytes) -> JsonDocument:
    try:
        document = json.loads(data) if data else {}
    except ValueError:
        raise K8sError("the API server's answer is not JSON") from None
    return document if isinstance(document, dict) else {}

"""The holds ConfigMap, read and written: every write is read-compare-write under the resourceVersion it
read, so the controller and an operator's `fleet hold|release` never overwrite each other's change."""

from __future__ import annotations

import time
from collections.abc import Callable

from agent.fleet import Hold
from agent.fleet.published import HOLDS_CONFIGMAP, decode, encode, same_holds
from agent.k8s.errors import NotFound
from agent.k8s.raw import JsonDocument, RawApi, api_path
from agent.k8s.retry import on_conflict, with_retries


class HoldsStore:
    """One namespace's holds object; holds come and go on this process's monotonic clock (`clock`)."""

    def __init__(self, raw: RawApi, namespace: str, *, writer: str, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.raw = raw
        self.namespace = namespace
        self.writer = writer
        self.clock = clock
        self.wall = wall
        self.path = api_path("", "v1", "configmaps", namespace=namespace, name=HOLDS_CONFIGMAP)
        self._placed: tuple[str, list[Hold]] | None = None
        self.writes = 0

    @property
    def source(self) -> str:
        return f"configmap {self.namespace}/{HOLDS_CONFIGMAP}"

    def read(self) -> tuple[list[Hold], str]:
        """The published holds and the object's resourceVersion ("" when there is none yet). A version seen
        before keeps the placement it got then, so re-reading never moves an expiry."""
        try:
            obj = with_retries(lambda: self.raw.get(self.path))
        except NotFound:
            return [], ""
        version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if self._placed is not None and self._placed[0] == version:
            return list(self._placed[1]), version
        holds = decode(obj.get("data"), observed_at=self.clock(), wall=self.wall(), source=self.source)
        self._placed = (version, holds)
        return list(holds), version

    def write(self, holds: list[Hold], version: str) -> str:
        """Publish `holds` over the version read (create it when there was none); Conflict when it moved."""
        body: JsonDocument = {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": HOLDS_CONFIGMAP, "namespace": self.namespace,
                         "labels": {"app.kubernetes.io/name": "gpu-health-agent",
                                    "app.kubernetes.io/component": "fleet"}},
            "data": encode(holds, now=self.clock(), wall=self.wall(), writer=self.writer)}
        if version:
            body["metadata"]["resourceVersion"] = version
            written = self.raw.request("PUT", self.path, body=body)
        else:
            written = self.raw.create(api_path("", "v1", "configmaps", namespace=self.namespace), body)
        self.writes += 1
        new_version = str((written.get("metadata") or {}).get("resourceVersion") or "")
        self._placed = (new_version, list(holds))
        return new_version

    def update(self, change: Callable[[list[Hold]], list[Hold]], *,
               read: tuple[list[Hold], str] | None = None) -> tuple[list[Hold], list[Hold]]:
        """(before, after): read (or start from `read`, what the caller just read), apply `change`, write only
        when it changed something; a 409 reads again and re-applies the change (so an operator's edit in
        between is kept)."""
        first = [read]

        def attempt() -> tuple[list[Hold], list[Hold]]:
            given = first.pop() if first else None
            before, version = given if given is not None else self.read()
            after = change(list(before))
            # The leader's first pass creates the object, holds or none: that it exists tells every agent a
            # controller publishes here, so a node waits the settle for its word (agent.fleet.node_side).
            changed = not version or not same_holds(before, after)
            if changed:
                with_retries(lambda: self.write(after, version))
            return before, after

        return on_conflict(attempt)

"""Kubernetes Events (events.k8s.io/v1) regarding the Node or a Pod; repeats are folded into a series."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

from agent.k8s.bodies import Event, EventPatch, ObjectMeta, ObjectReference
from agent.k8s.errors import Conflict
from agent.k8s.raw import RawApi, api_path
from agent.k8s.retry import with_retries
from agent.timefmt import rfc3339_micro

CONTROLLER = "gpu-health-agent.io/agent"
NOTE_LIMIT = 1024


def micro_time() -> str:
    return rfc3339_micro()


@dataclass(slots=True)
class _Series:
    namespace: str
    name: str
    count: int
    first: float


class EventRecorder:
    """Creates Events; the same (object, reason, note) within `fold_seconds` patches the series count.

    An Event owed in the durable record carries an id: it is created under a name made from it, so sending
    it again after a crash finds the first one (409 AlreadyExists) and creates no second."""

    def __init__(self, raw: RawApi, *, instance: str, namespace: str = "default",
                 fold_seconds: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.raw = raw
        self.instance = instance
        self.namespace = namespace
        self.fold_seconds = fold_seconds
        self.clock = clock
        self._series: dict[tuple[str, str, str, str, str], _Series] = {}

    def record(self, *, regarding: ObjectReference | Mapping[str, str], reason: str, action: str, note: str,
               type_: str = "Warning", event_id: str = "") -> str:
        """Post (or fold) one Event; returns its name."""
        note = note if len(note) <= NOTE_LIMIT else note[: NOTE_LIMIT - 4] + " ..."
        namespace = regarding.get("namespace") or self.namespace
        key = (regarding.get("kind", ""), namespace, regarding.get("name", ""), reason, note)
        series = self._series.get(key)
        now = self.clock()
        if series is not None and now - series.first < self.fold_seconds:
            series.count += 1
            body: EventPatch = {"series": {"count": series.count, "lastObservedTime": micro_time()}}
            path = api_path("events.k8s.io", "v1", "events", namespace=series.namespace, name=series.name)
            with_retries(lambda: self.raw.merge_patch(path, body))
            return series.name
        metadata: ObjectMeta = {"name": f"{regarding.get('name', 'gpu')}.{event_id}"[:253]} if event_id else \
            {"generateName": f"{regarding.get('name', 'gpu')}-"}  # a '.' at the end is refused (422)
        event: Event = {
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {**metadata, "namespace": namespace},
            "eventTime": micro_time(), "reportingController": CONTROLLER, "reportingInstance": self.instance,
            "action": action, "reason": reason, "type": type_, "note": note,
            "regarding": cast(ObjectReference, dict(regarding)),  # the fleet controller's is a plain dict
        }
        try:
            created = with_retries(lambda: self.raw.create(api_path("events.k8s.io", "v1", "events",
                                                                    namespace=namespace), event))
            name = str(created["metadata"]["name"])
        except Conflict:
            name = str(metadata["name"])  # sent before the crash that kept it owed: delivered once
            if not event_id:
                raise
        self._series[key] = _Series(namespace, name, 1, now)
        if len(self._series) > 2048:
            oldest = min(self._series, key=lambda k: self._series[k].first)
            del self._series[oldest]
        return name

"""The holds ConfigMap, read and written: every write is read-compare-write under the resourceVersion it
read, so the controller and an operator's `fleet hold|release` never overwrite each other's change. The
controller's word (what it heard, and its promise to write again) goes with its writes; an operator's write
carries the last word it read over unchanged."""

from __future__ import annotations

import time
from collections.abc import Callable

from agent.errors import AgentError, InputError
from agent.fleet import Hold
from agent.fleet.hold import Unread
from agent.fleet.published import (
    ALIVE_KEY,
    CENSUS_KEY,
    HEARD_KEY,
    HOLDS_CONFIGMAP,
    SEEN_KEY,
    WRITTEN_KEY,
    decode_all,
    decode_census,
    decode_seen,
    encode,
    encode_heard,
    same_holds,
    still_written,
)
from agent.k8s.bodies import ConfigMap
from agent.k8s.errors import NotFound
from agent.k8s.raw import RawApi, api_path
from agent.k8s.retry import on_conflict, with_retries


class Deposed(AgentError):
    """A write refused because this controller no longer leads (its Lease not renewed within the deadline)."""


class HoldsStore:
    """One namespace's holds object; holds come and go on this process's monotonic clock (`clock`). Every write
    is fenced by `fence` (the controller: whether it still holds its Lease), checked just before it is sent, so
    a deposed leader's pass that was under way writes nothing after a new leader may have taken over."""

    def __init__(self, raw: RawApi, namespace: str, *, writer: str, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, fence: Callable[[], bool] = lambda: True,
                 own_clock: bool = True) -> None:
        self.raw = raw
        self.fence = fence
        #: False for an operator's store (a laptop's clock may be far off): it places what it reads as just
        #: written (no correction by its own wall clock) and writes on the timeline of the version it read
        #: (`written` plus the time since, on its monotonic clock), so its clock moves no one else's hold.
        self.own_clock = own_clock
        #: The `written` of the version last read, and when this process read it (its monotonic clock).
        self._timeline: tuple[float, float] | None = None
        self.namespace = namespace
        self.writer = writer
        self.clock = clock
        self.wall = wall
        self.path = api_path("", "v1", "configmaps", namespace=namespace, name=HOLDS_CONFIGMAP)
        self._placed: tuple[str, list[Hold]] | None = None
        #: The entries of the object last read that this version cannot read (a newer writer's), carried over
        #: unchanged by its writes until their own expiry; each reason logged once by the caller.
        self.unread: list[Unread] = []
        #: The first sightings the object last read publishes ((node, rule) -> this process's clock).
        self.seen: dict[tuple[str, str], float] = {}
        #: The controller's word in the object last read (HEARD_KEY, ALIVE_KEY, CENSUS_KEY), as text.
        self._word: dict[str, str] = {}
        #: When this process last wrote (its monotonic clock); None before its first write.
        self.written_at: float | None = None
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
        data = obj.get("data") or {}
        self._word = {key: str(data[key]) for key in (HEARD_KEY, ALIVE_KEY, CENSUS_KEY, SEEN_KEY) if key in data}
        if self._placed is not None and self._placed[0] == version:
            return list(self._placed[1]), version
        reader_wall = self.wall() if self.own_clock else None
        holds, self.unread = decode_all(obj.get("data"), observed_at=self.clock(), wall=reader_wall,
                                        source=self.source)
        self.seen = decode_seen(obj.get("data"), observed_at=self.clock(), wall=reader_wall)
        try:
            self._timeline = (float(data.get(WRITTEN_KEY, "")), self.clock())
        except ValueError:
            self._timeline = None
        self._placed = (version, holds)
        return list(holds), version

    def _census_moved(self, census: dict[str, str] | None) -> bool:
        """Whether `census` says other than the object last read in its selector or unlabelled quarantines."""
        if not census:
            return False
        new = decode_census(census, source="census")
        try:
            old = decode_census(self._word, source=self.source)
        except InputError:
            return True  # someone broke it: this write mends it
        if new is None or old is None:
            return True
        return (new.selector, dict(new.unlabelled)) != (old.selector, dict(old.unlabelled))

    def write_wall(self) -> float:
        """The wall time a write is stamped with: this process's clock, or (own_clock False) the timeline of the
        version read, where there is one."""
        if self.own_clock or self._timeline is None:
            return self.wall()
        written, read_at = self._timeline
        return written + (self.clock() - read_at)

    def heard_text(self) -> str:
        """What the object last read says the controller heard (its text; "" for none)."""
        return self._word.get(HEARD_KEY, "")

    def write(self, holds: list[Hold], version: str, *, word: dict[str, str] | None = None) -> str:
        """Publish `holds` over the version read (create it when there was none), with the controller's `word`
        (agent.fleet.published.encode_heard), or without one the word last read; Conflict when it moved,
        Deposed when the fence says this writer no longer leads."""
        if not self.fence():
            raise Deposed(f"{self.writer} no longer holds the fleet controller's Lease: {self.source} not written")
        wall = self.write_wall()
        data = encode(holds, now=self.clock(), wall=wall, writer=self.writer,
                      unread=still_written(self.unread, wall=wall))
        data.update(self._word if word is None else word)
        body: ConfigMap = {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": HOLDS_CONFIGMAP, "namespace": self.namespace,
                         "labels": {"app.kubernetes.io/name": "gpu-health-agent",
                                    "app.kubernetes.io/component": "fleet"}},
            "data": data}
        if version:
            body["metadata"]["resourceVersion"] = version
            written = self.raw.request("PUT", self.path, body=body)
        else:
            written = self.raw.create(api_path("", "v1", "configmaps", namespace=self.namespace), body)
        self.writes += 1
        self.written_at = self.clock()
        if word is not None:
            self._word = dict(word)
        new_version = str((written.get("metadata") or {}).get("resourceVersion") or "")
        self._placed = (new_version, list(holds))
        return new_version

    def update(self, change: Callable[[list[Hold]], list[Hold]], *,
               read: tuple[list[Hold], str] | None = None, heard: dict[str, set[str]] | None = None,
               alive_seconds: float = 0.0, census: dict[str, str] | None = None,
               seen: Callable[[float, float], dict[str, str]] | None = None) -> tuple[list[Hold], list[Hold]]:
        """(before, after): read (or start from `read`, what the caller just read), apply `change`, write only
        when it changed something; a 409 reads again and re-applies the change (so an operator's edit in
        between is kept). The controller passes what it `heard`: a change in it is a change too, and so is
        its promise to write again within `alive_seconds` coming due (a write at least every third of it). The
        brake's `census` (agent.fleet.published.encode_census) goes with the word; it forces a write when its
        selector or its unlabelled quarantines moved (what the brake must see at once), not for the count of
        GPU nodes alone (it may be a tick old). `seen` gives the first sightings' data key for a write's
        clocks (monotonic, wall): what a new leader takes over."""
        first = [read]

        def attempt() -> tuple[list[Hold], list[Hold]]:
            given = first.pop() if first else None
            before, version = given if given is not None else self.read()
            after = change(list(before))
            # The leader's first pass creates the object, holds or none: that it exists tells every agent a
            # controller publishes here, so a node waits the settle for its word (agent.fleet.node_side).
            word = None
            if heard is not None:
                word = encode_heard(heard, alive_until=self.wall() + alive_seconds) | (census or {})
                if seen is not None:  # the first sightings, on this write's clocks
                    word |= seen(self.clock(), self.wall())
            changed = not version or not same_holds(before, after) or (word is not None and (
                word[HEARD_KEY] != self.heard_text() or self.written_at is None or self._census_moved(census)
                or self.clock() - self.written_at >= alive_seconds / 3))
            if changed:
                with_retries(lambda: self.write(after, version, word=word))
            return before, after

        return on_conflict(attempt)

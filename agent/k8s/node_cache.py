"""The agent's Node as last seen (a GET, a write's answer, a watch event; the newest wins), and whether a live
watch vouches that it is current: a pass reads it from here instead of with a GET."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from agent.k8s.bodies import Node, NodeStatus

#: How long a watch that has said nothing (no event, no bookmark: the API server sends a bookmark about every
#: minute, and one just before it ends a watch) still vouches for the Node: past this a pass reads with a GET.
FRESH_SECONDS = 150.0


def newer(candidate: str, current: str) -> bool:
    """Whether resourceVersion `candidate` is at least as new as `current`: the API server's are etcd
    revisions (integers, growing); one that is not an integer is taken as newer (never kept from the agent)."""
    if candidate.isdigit() and current.isdigit():
        return int(candidate) >= int(current)
    return True


def version_of(node: Node | None) -> str:
    return str(((node or {}).get("metadata") or {}).get("resourceVersion") or "")


def inputs_of(node: Node | None, conditions: tuple[str, ...]) -> tuple[object, ...]:
    """What a pass reads off its Node (labels, annotations, taints, the agent's own conditions): a change
    here wakes the reconciler; one elsewhere (the kubelet's heartbeats, images) does not."""
    if node is None:
        return ()
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    own = sorted((str(c.get("type")), str(c.get("status")), str(c.get("reason")), str(c.get("message")))
                 for c in status.get("conditions") or [] if c.get("type") in conditions)
    taints = sorted((str(t.get("key")), str(t.get("value")), str(t.get("effect"))) for t in spec.get("taints") or [])
    return (sorted((meta.get("labels") or {}).items()), sorted((meta.get("annotations") or {}).items()), taints,
            bool(spec.get("unschedulable")), own, _gpu_resources(status))


def _gpu_resources(status: NodeStatus) -> tuple[object, ...]:
    """The GPU devices the kubelet offers: a device plugin withholding one (Unhealthy) changes what a pass plans."""
    counts = [("capacity", status.get("capacity") or {}), ("allocatable", status.get("allocatable") or {})]
    return tuple(sorted((part, k, str(v)) for part, of in counts for k, v in of.items() if k.startswith("nvidia.com/")))


class NodeCache:
    """One Node, shared by the reconciler (reads, writes' answers) and the watch thread (events)."""

    def __init__(self, *, fresh_seconds: float = FRESH_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.fresh_seconds = fresh_seconds
        self.clock = clock
        self._lock = threading.Condition()
        self._writes = 0  # the agent's writes in flight (their answers not yet offered)
        self._node: Node | None = None
        #: When the watch was last heard from; None: no live watch (not started, failed, 410, stopped).
        self._heard_at: float | None = None

    @property
    def node(self) -> Node | None:
        """The Node as last seen, fresh or not (what a write is compared and patched against)."""
        return self._node

    def offer(self, node: Node) -> tuple[bool, Node | None]:
        """Keep `node` unless the one kept is newer: (whether it was kept, the one kept before)."""
        with self._lock:
            previous = self._node
            if previous is not None and not newer(version_of(node), version_of(previous)):
                return False, previous
            self._node = node
            return True, previous

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Around one of the agent's writes, until its answer is offered (see `settle`)."""
        with self._lock:
            self._writes += 1
        try:
            yield
        finally:
            with self._lock:
                self._writes -= 1
                self._lock.notify_all()

    def settle(self, timeout: float = 15.0) -> None:
        """Wait (bounded) until no write of the agent's is in flight: the watch often delivers a write before
        the writer has its answer, and that event, weighed after the answer, is no change of anyone else's."""
        with self._lock:
            self._lock.wait_for(lambda: self._writes == 0, timeout=timeout)

    def forget(self) -> None:
        """A write found the Node changed (409): the next read or write reads it again."""
        with self._lock:
            self._node = None

    def heard(self) -> None:
        with self._lock:
            self._heard_at = self.clock()

    def lost(self) -> None:
        with self._lock:
            self._heard_at = None

    def current(self) -> Node | None:
        """The Node, where a live watch heard from within `fresh_seconds` vouches for it; else None (GET it)."""
        with self._lock:
            heard = self._heard_at
            if self._node is None or heard is None or self.clock() - heard > self.fresh_seconds:
                return None
            return self._node

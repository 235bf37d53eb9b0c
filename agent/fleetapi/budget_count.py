"""The disruption budget's limit: the GPU nodes counted (a fleet census, else a metadata-only list) and bounded."""

from __future__ import annotations

import random
from collections.abc import Callable

from agent.fleetapi.budget_slots import budget_limit
from agent.k8s.raw import RawApi, api_path
from agent.k8s.retry import with_retries
from agent.k8s.watch import ListWatch, WatchOptions


class GpuNodeCount:
    """The most nodes that may be disrupted at once (`limit`, 0 until counted), from the GPU nodes: a live
    fleet controller's census for the selector where there is one (read with the fleet view, no request of its
    own), else a metadata-only list of them (names and labels, not whole Nodes) made at most every
    `count_seconds`, so a blocked node stays cheap for the API server. At fleet scale the list is most of a
    disrupting agent's cost: every node's metadata, once per agent."""

    def __init__(self, raw: RawApi, *, selector: str, max_nodes: int, max_percent: float, count_seconds: float,
                 monotonic: Callable[[], float], deadline_seconds: float | None, rng: random.Random) -> None:
        self.raw = raw
        self.deadline = deadline_seconds
        self.rng = rng
        self.selector = selector
        self.max_nodes = max_nodes
        self.max_percent = max_percent
        self.count_seconds = count_seconds
        self.monotonic = monotonic
        self.limit = 0
        self._counted_at: float | None = None

    def refresh(self, census: Callable[[str], int | None] | None) -> int:
        """The limit now, by `census` (None, or a census of none: this agent lists the nodes itself; the list
        retried on transient errors like every budget request)."""
        counted = census(self.selector) if census is not None else None
        if counted:  # a census of none is no census: this node is one
            self.limit = self._bounded(counted)
            return self.limit
        now = self.monotonic()
        if self._counted_at is not None and now - self._counted_at < self.count_seconds and self.limit:
            return self.limit
        listing = ListWatch(self.raw.api_client, api_path("", "v1", "nodes"),
                            WatchOptions(label_selector=self.selector, metadata_only=True))
        items, _ = with_retries(listing.list_all, deadline_seconds=self.deadline, rng=self.rng)
        self.limit = self._bounded(len(items))
        self._counted_at = now
        return self.limit

    def _bounded(self, gpu_nodes: int) -> int:
        return budget_limit(gpu_nodes=gpu_nodes, max_nodes=self.max_nodes, max_percent=self.max_percent)

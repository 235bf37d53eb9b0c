"""The cluster-wide disruption budget: one Lease in the agent's namespace is a semaphore over nodes.

A node must hold a slot before a disruptive step (eviction, GPU reset, reboot request), and renews it
while it stays disrupted. The slots live in the Lease's annotation and every change is an optimistic
update (resourceVersion), so two agents racing for the last slot cannot both win. A slot not renewed
for `ttl_seconds` lapses (its agent died). A second Lease, when present, pauses all disruption
cluster-wide. Asked only after the guard let a step past: quarantine mode and dry-run write no Lease.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

from agent.k8s.errors import Conflict, NotFound
from agent.k8s.node import DISRUPTION_LABEL
from agent.k8s.raw import JsonDocument, RawApi, api_path
from agent.k8s.retry import on_conflict, with_retries

BUDGET_LEASE = "gpu-health-disruption-budget"
PAUSE_LEASE = "gpu-health-pause"
HOLDERS_ANNOTATION = "gpu-health-agent.io/holders"


def budget_limit(*, gpu_nodes: int, max_nodes: int, max_percent: float) -> int:
    """The most nodes that may be disrupted at once: the tighter of N nodes and P % of GPU nodes (at least 1
    while there is any GPU node, so a single broken node can always be handled)."""
    bounds = []
    if max_nodes > 0:
        bounds.append(max_nodes)
    if max_percent > 0:
        bounds.append(max(1, math.floor(gpu_nodes * max_percent / 100)))
    return min(bounds) if bounds and gpu_nodes > 0 else 0


class LeaseBudget:
    """ClusterGate for the pipeline: the pause Lease and the budget Lease."""

    def __init__(self, raw: RawApi, *, node_name: str, namespace: str, max_nodes: int, max_percent: float,
                 gpu_node_selector: str = "nvidia.com/gpu.present=true", ttl_seconds: float = 7200.0,
                 count_seconds: float = 300.0, clock: Callable[[], float] = time.time,
                 on_usage: Callable[[int, int], None] = lambda in_use, limit: None) -> None:
        self.raw = raw
        self.leases = api_path("coordination.k8s.io", "v1", "leases", namespace=namespace)
        self.node = node_name
        self.namespace = namespace
        self.max_nodes = max_nodes
        self.max_percent = max_percent
        self.selector = gpu_node_selector
        self.ttl = ttl_seconds
        self.count_seconds = count_seconds
        self.clock = clock
        self.on_usage = on_usage
        self._limit = 0
        self._counted_at: float | None = None

    def paused(self) -> bool:
        try:
            self.raw.get(f"{self.leases}/{PAUSE_LEASE}")
        except NotFound:
            return False
        return True

    def holders(self) -> dict[str, float]:
        lease = self._read_or_create()
        return self._live(lease)

    def acquire(self) -> bool:
        """Hold (or renew) this node's slot; False when the budget is spent."""

        def attempt() -> bool:
            lease = self._read_or_create()
            holders = self._live(lease)
            if self.node not in holders:
                self._count_gpu_nodes()
                if len(holders) >= self._limit:
                    self.on_usage(len(holders), self._limit)
                    return False
            holders[self.node] = self.clock()
            self._write(lease, holders)
            self.on_usage(len(holders), self._limit)
            return True

        granted = bool(on_conflict(attempt))
        if granted:
            self._label(True)
        return granted

    def _count_gpu_nodes(self) -> None:
        """A list call: made only when a slot is to be taken (not on renewals), at most every few minutes,
        so a blocked node stays cheap for the API server."""
        now = self.clock()
        if self._counted_at is not None and now - self._counted_at < self.count_seconds and self._limit:
            return
        nodes = with_retries(lambda: self.raw.get(api_path("", "v1", "nodes"),
                                                  query={"labelSelector": self.selector}))
        self._limit = budget_limit(gpu_nodes=len(nodes.get("items") or []), max_nodes=self.max_nodes,
                                   max_percent=self.max_percent)
        self._counted_at = now

    def release(self) -> None:
        """Give the slot back (clearing is never blocked, and a healthy node holds nothing)."""

        def attempt() -> None:
            try:
                lease = self.raw.get(f"{self.leases}/{BUDGET_LEASE}")
            except NotFound:
                return
            holders = self._live(lease)
            if self.node in holders:
                del holders[self.node]
                self._write(lease, holders)
                if self._limit:
                    self.on_usage(len(holders), self._limit)

        on_conflict(attempt)
        self._label(False)

    def _read_or_create(self) -> JsonDocument:
        try:
            return self.raw.get(f"{self.leases}/{BUDGET_LEASE}")
        except NotFound:
            body = {"metadata": {"name": BUDGET_LEASE, "namespace": self.namespace,
                                 "annotations": {HOLDERS_ANNOTATION: "{}"}},
                    "spec": {"holderIdentity": "gpu-health-agent", "leaseDurationSeconds": int(self.ttl)}}
            try:
                return self.raw.create(self.leases, body)
            except Conflict:
                return self.raw.get(f"{self.leases}/{BUDGET_LEASE}")

    def _live(self, lease: JsonDocument) -> dict[str, float]:
        annotations = lease.get("metadata", {}).get("annotations") or {}
        try:
            raw = json.loads(annotations.get(HOLDERS_ANNOTATION, "{}"))
        except ValueError:
            raw = {}
        now = self.clock()
        return {str(k): float(v) for k, v in raw.items() if isinstance(v, int | float) and now - float(v) < self.ttl}

    def _write(self, lease: JsonDocument, holders: dict[str, float]) -> None:
        body = {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"],
                             "annotations": {HOLDERS_ANNOTATION: json.dumps(holders, sort_keys=True)}},
                "spec": {"renewTime": _micro(self.clock())}}
        self.raw.merge_patch(f"{self.leases}/{BUDGET_LEASE}", body)

    def _label(self, holding: bool) -> None:
        labels = {DISRUPTION_LABEL: "active" if holding else None}
        path = api_path("", "v1", "nodes", name=self.node)
        node = self.raw.get(path)
        current = (node.get("metadata", {}).get("labels") or {}).get(DISRUPTION_LABEL)
        if current != labels[DISRUPTION_LABEL]:
            self.raw.strategic_patch(path, {"metadata": {"labels": labels}})


def _micro(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(at))


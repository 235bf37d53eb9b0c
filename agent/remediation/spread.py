"""Which GPUs each workload's application Xids hit: a workload that faults on several GPUs is the application's."""

from __future__ import annotations

from collections import OrderedDict

#: The Xids whose repeat on one GPU may be the GPU's (NVIDIA's WORKFLOW_XID_13 / WORKFLOW_XID_31).
APPLICATION_XIDS = frozenset({13, 31})


class WorkloadSpread:
    """For each workload, the GPUs its application Xids hit within the window (bounded: oldest forgotten)."""

    def __init__(self, *, window_seconds: float = 3600.0, max_workloads: int = 4096) -> None:
        self.window_seconds = window_seconds
        self.max_workloads = max_workloads
        self._seen: OrderedDict[str, dict[str, float]] = OrderedDict()

    def note(self, workload: str, gpu_key: str, at: float) -> set[str]:
        """Record a fault of the workload on the GPU; return the other GPUs it faulted on within the window."""
        gpus = self._seen.pop(workload, {})
        gpus = {g: t for g, t in gpus.items() if at - t <= self.window_seconds}
        gpus[gpu_key] = at
        self._seen[workload] = gpus
        while len(self._seen) > self.max_workloads:
            self._seen.popitem(last=False)
        return set(gpus) - {gpu_key}

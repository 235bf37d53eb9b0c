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


#: How long Xid 13s at one GPC/TPC of a GPU count towards NVIDIA's "repeat TPC and GPC" pattern.
LOCATION_WINDOW_SECONDS = 86400.0


class LocationRepeats:
    """For each GPU and GPC/TPC location, the distinct workloads (owners) whose Xid 13 hit it within the window.

    NVIDIA's WORKFLOW_XID_13 asks whether faults repeat on the same GPC and TPC: one owner's crash-looping job
    is one workload however many processes it starts, and a process nobody could attribute counts for nothing
    (without the host's pid namespace every process looks new). Bounded: the least recently hit locations and,
    per location, the oldest owners are forgotten."""

    def __init__(self, *, window_seconds: float = LOCATION_WINDOW_SECONDS, max_locations: int = 1024,
                 max_workloads: int = 16) -> None:
        self.window_seconds = window_seconds
        self.max_locations = max_locations
        self.max_workloads = max_workloads
        self._seen: OrderedDict[tuple[str, str], OrderedDict[str, float]] = OrderedDict()

    def note(self, gpu_key: str, location: str, workload: str, at: float) -> int:
        """Record the workload's fault at the location; how many distinct workloads hit it within the window."""
        key = (gpu_key, location)
        owners = self._seen.pop(key, None) or OrderedDict()
        owners.pop(workload, None)
        owners[workload] = at
        while owners and at - next(iter(owners.values())) > self.window_seconds:
            owners.popitem(last=False)
        while len(owners) > self.max_workloads:
            owners.popitem(last=False)
        self._seen[key] = owners
        while len(self._seen) > self.max_locations:
            self._seen.popitem(last=False)
        return len(owners)

    def forget(self, workload: str) -> None:
        """The workload faulted on another GPU: it is the application's, at every location it counted at."""
        for owners in self._seen.values():
            owners.pop(workload, None)

    def locations(self) -> int:
        return len(self._seen)

"""Verified recoveries per GPU and fault family, within a window: how many before a returning fault needs replacing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.model import NODE_KEY, FaultClass

#: Faults whose recoveries say nothing about the GPU's hardware: an application's bug, a driver problem, or
#: the agent not being able to read the GPU. They never count toward a replacement.
NOT_COUNTED = frozenset({FaultClass.APPLICATION, FaultClass.DRIVER, FaultClass.TELEMETRY, FaultClass.NONE})

#: The date of a recovery read from the old record shape (a bare count, no dates): it is dated the first
#: time the window is applied, so an upgrade keeps the count for one window and then lets it age out.
UNDATED = -1.0


def family_of(fault_class: FaultClass) -> str:
    """The fault family a recovery counts in ("" for one that never counts)."""
    return "" if fault_class in NOT_COUNTED else str(fault_class)


@dataclass(slots=True)
class Recoveries:
    """When each GPU recovered (verified reset or new boot) from a fault of each family."""

    by_gpu: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def add(self, gpu_key: str, fault_class: FaultClass, at: float) -> None:
        family = family_of(fault_class)
        if not family or gpu_key == NODE_KEY:
            return
        dates = self.by_gpu.setdefault(gpu_key, {}).setdefault(family, [])
        if not dates or dates[-1] != at:  # one reset or boot that clears several faults of a family is one recovery
            dates.append(at)

    def count(self, gpu_key: str, fault_class: FaultClass, *, now: float, window_seconds: float) -> int:
        """Recoveries of this GPU from this family within the window before now (older ones are dropped)."""
        family = family_of(fault_class)
        dates = self.by_gpu.get(gpu_key, {}).get(family)
        if not family or not dates:
            return 0
        kept = [now if at == UNDATED else at for at in dates if at == UNDATED or now - at <= window_seconds]
        self.by_gpu[gpu_key][family] = kept
        return len(kept)

    def release(self, gpu_key: str) -> None:
        """An operator released the GPU (NODE_KEY: every GPU): its history starts again."""
        if gpu_key == NODE_KEY:
            self.by_gpu.clear()
        else:
            self.by_gpu.pop(gpu_key, None)

    def to_json(self) -> dict[str, object]:
        return {gpu: {family: list(dates) for family, dates in sorted(families.items()) if dates}
                for gpu, families in sorted(self.by_gpu.items()) if any(families.values())}

    @classmethod
    def from_json(cls, data: object) -> Recoveries:
        """The record's shape ({gpu: {family: [dates]}}), or the old one ({gpu: count}: hardware, undated)."""
        recoveries = cls()
        if not isinstance(data, Mapping):
            return recoveries
        for gpu, value in data.items():
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                recoveries.by_gpu[str(gpu)] = {str(FaultClass.HARDWARE): [UNDATED] * min(value, 1000)}
            elif isinstance(value, Mapping):
                families = {str(f): [float(d) for d in dates if isinstance(d, int | float) and not isinstance(d, bool)]
                            for f, dates in value.items() if isinstance(dates, list)}
                recoveries.by_gpu[str(gpu)] = {f: d for f, d in families.items() if d}
        return recoveries

    def copy(self) -> Recoveries:
        return Recoveries({g: {f: list(d) for f, d in fs.items()} for g, fs in self.by_gpu.items()})

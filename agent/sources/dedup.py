"""Collapses storms of identical records before the engine: the first passes at once, repeats are counted."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from agent.model import Observation


@dataclass(slots=True)
class _Burst:
    started: float
    last: Observation
    pending: int = 0


class Deduplicator:
    """Per key, one observation per window plus one with the count of the repeats it swallowed."""

    def __init__(self, *, window_seconds: float = 1.0, max_keys: int = 4096) -> None:
        self.window = window_seconds
        self.max_keys = max_keys
        self._bursts: OrderedDict[Hashable, _Burst] = OrderedDict()

    @property
    def idle(self) -> bool:
        """True when no burst is open (nothing waits to be flushed)."""
        return not self._bursts

    def repeat(self, key: Hashable, now: float) -> bool:
        """Count a repeat of an open burst without building its observation; False if it is not one."""
        burst = self._bursts.get(key)
        if burst is None or now - burst.started >= self.window:
            return False
        burst.pending += 1
        return True

    def offer(self, key: Hashable, observation: Observation, now: float) -> list[Observation]:
        """What to emit now for this observation (plus any bursts whose window has closed)."""
        out = self.flush(now)
        burst = self._bursts.get(key)
        if burst is None:
            self._bursts[key] = _Burst(now, observation)
            out.append(observation)
            while len(self._bursts) > self.max_keys:
                _, oldest = self._bursts.popitem(last=False)
                out.extend(_aggregate(oldest))
            return out
        burst.pending += observation.count
        burst.last = observation
        return out

    def flush(self, now: float, *, force: bool = False) -> list[Observation]:
        """Emit the counts of bursts whose window has closed (all of them with force)."""
        out: list[Observation] = []
        while self._bursts:
            key, burst = next(iter(self._bursts.items()))
            if not force and now - burst.started < self.window:
                break
            del self._bursts[key]
            out.extend(_aggregate(burst))
        return out


def _aggregate(burst: _Burst) -> list[Observation]:
    if burst.pending == 0:
        return []
    return [dataclasses.replace(burst.last, count=burst.pending)]

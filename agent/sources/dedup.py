"""Collapses storms of identical records before the engine: the first passes at once, repeats are counted.

O(1) per line: a repeat is one dictionary lookup; bursts are kept in the order they started (which is the
order their windows close), so expiry only ever looks at the oldest one, and a line that closes nothing
costs one comparison with the time the oldest window closes.
"""

from __future__ import annotations

import dataclasses
import math
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
        self._next_due = math.inf

    @property
    def idle(self) -> bool:
        """True when no burst is open (nothing waits to be flushed)."""
        return not self._bursts

    @property
    def open_bursts(self) -> int:
        return len(self._bursts)

    def repeat(self, key: Hashable, now: float) -> bool:
        """Count a repeat of an open burst without building its observation; False if it is not one."""
        burst = self._bursts.get(key)
        if burst is None or now - burst.started >= self.window:
            return False
        burst.pending += 1
        return True

    def offer(self, key: Hashable, observation: Observation, now: float) -> list[Observation]:
        """What to emit now for this observation (plus any bursts whose window has closed)."""
        out = self.flush(now) if now >= self._next_due else []
        bursts = self._bursts
        burst = bursts.get(key)
        if burst is not None:
            burst.pending += observation.count
            burst.last = observation
            return out
        bursts[key] = _Burst(now, observation)
        out.append(observation)
        if len(bursts) == 1:  # the only burst, so the oldest: its window closes next
            self._next_due = now + self.window
        while len(bursts) > self.max_keys:
            # Evicting the oldest leaves _next_due early, never late: flush() then finds nothing closed yet
            # and moves it on, which is cheaper than looking at the new oldest on every line of a storm.
            _, oldest = bursts.popitem(last=False)
            if oldest.pending:
                out.extend(_aggregate(oldest))
        return out

    def flush(self, now: float, *, force: bool = False) -> list[Observation]:
        """Emit the counts of bursts whose window has closed (all of them with force)."""
        if not force and now < self._next_due:
            return []
        out: list[Observation] = []
        bursts = self._bursts
        while bursts:
            key, burst = next(iter(bursts.items()))
            if not force and now - burst.started < self.window:
                break
            del bursts[key]
            out.extend(_aggregate(burst))
        self._due_from_oldest()
        return out

    def _due_from_oldest(self) -> None:
        oldest = next(iter(self._bursts.values()), None)
        self._next_due = math.inf if oldest is None else oldest.started + self.window


def _aggregate(burst: _Burst) -> list[Observation]:
    if burst.pending == 0:
        return []
    return [dataclasses.replace(burst.last, count=burst.pending)]

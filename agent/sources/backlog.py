"""The bounded queue between the sources and the engine: in a storm it coalesces repeats so the agent stays
current, and never drops a new kind of fault.

Below the high-water mark it is a plain FIFO. From the high-water mark on, an event observation whose kind
(signal, GPU, code) already waits in the queue is folded into the waiting one: its count is added there, so
the engine still sees how many occurred, in one observation. A level reading (temperature, power, ...) of
a kind that waits replaces the waiting reading's value with the newer one. Lifecycle facts (boot, reset,
release) are never folded. A new kind is always admitted, past the capacity too, up to a hard limit of twice
the capacity, which only as many distinct kinds as that could reach; only then is one refused (counted).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from agent.model import LIFECYCLE_SIGNALS, Observation


@dataclass(slots=True)
class _Entry:
    observation: Observation
    key: Hashable | None
    extra: int = 0


def kind_of(observation: Observation) -> Hashable | None:
    """What makes two observations the same kind of fault (None: never folded)."""
    signal = observation.signal
    if signal in LIFECYCLE_SIGNALS:
        return None
    if signal.is_event:
        value = observation.value
        code = int(value) if math.isfinite(value) else None
        return signal, observation.source, observation.gpu_key, code
    return signal, observation.source, observation.gpu_key


class Backlog:
    """Thread-safe: any number of sources put, one engine loop gets."""

    def __init__(self, *, capacity: int = 10_000, high_water: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 2:
            raise ValueError("a backlog needs a capacity of at least 2")
        self.capacity = capacity
        self.high_water = capacity // 2 if high_water is None else min(high_water, capacity)
        self.hard_limit = 2 * capacity
        self._clock = clock
        self._entries: deque[_Entry] = deque()
        self._waiting: dict[Hashable, _Entry] = {}
        self._ready = threading.Condition(threading.Lock())
        self._coalesced = 0
        self._dropped = 0

    @property
    def depth(self) -> int:
        """Observations waiting now (folded repeats count once)."""
        return len(self._entries)

    @property
    def coalesced_total(self) -> int:
        """Observations folded into a waiting one of the same kind since the start."""
        return self._coalesced

    @property
    def dropped_total(self) -> int:
        """New kinds refused at the hard limit since the start (expected to stay 0)."""
        return self._dropped

    def put(self, observation: Observation) -> bool:
        """Queue one observation, never blocking; False only when it was refused at the hard limit."""
        key = kind_of(observation)
        with self._ready:
            if key is not None and len(self._entries) >= self.high_water:
                waiting = self._waiting.get(key)
                if waiting is not None:
                    self._fold(waiting, observation)
                    return True
            if len(self._entries) >= self.hard_limit:
                self._dropped += 1
                return False
            entry = _Entry(observation, key)
            self._entries.append(entry)
            if key is not None:
                self._waiting[key] = entry
            self._ready.notify()
            return True

    def get(self, timeout: float | None = None) -> Observation | None:
        """The oldest waiting observation (with its folded count), or None when none came within `timeout`."""
        with self._ready:
            if not self._entries:
                if timeout is not None and timeout <= 0:
                    return None
                deadline = None if timeout is None else self._clock() + timeout
                while not self._entries:
                    remaining = None if deadline is None else deadline - self._clock()
                    if remaining is not None and remaining <= 0:
                        return None
                    self._ready.wait(remaining)
            return self._take_oldest()

    def get_many(self, limit: int, timeout: float | None = None) -> list[Observation]:
        """The oldest waiting observations (each with its folded count), at most `limit`, taken under one lock:
        in a storm the engine handles a run of them instead of taking the lock and waking once each. Empty
        when none came within `timeout`."""
        first = self.get(timeout)
        if first is None:
            return []
        taken = [first]
        with self._ready:
            while self._entries and len(taken) < limit:
                taken.append(self._take_oldest())
        return taken

    def _take_oldest(self) -> Observation:
        """Under the lock: the oldest entry out of the queue and out of the fold index (a repeat of its kind
        then waits anew), with the count folded into it."""
        entry = self._entries.popleft()
        if entry.key is not None and self._waiting.get(entry.key) is entry:
            del self._waiting[entry.key]
        return _with_folded(entry)

    def _fold(self, waiting: _Entry, observation: Observation) -> None:
        self._coalesced += 1
        if observation.signal.is_event:
            waiting.extra += observation.count
        else:
            waiting.observation = observation  # a level: the newer reading is the truth


def _with_folded(entry: _Entry) -> Observation:
    """The waiting observation with the count of the repeats folded into it."""
    if entry.extra:
        return dataclasses.replace(entry.observation, count=entry.observation.count + entry.extra)
    return entry.observation

"""The DCGM source: DCGM's bindings when they import, a dcgm-exporter endpoint (URL or file) otherwise."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from agent.model import Observation
from agent.sources.base import Emit
from agent.sources.bounded import BoundedCaller, CallTimeout, TooManyHungCalls
from agent.sources.dcgm_exporter import DcgmTranslator


class DcgmReader(Protocol):
    translator: DcgmTranslator

    def read(self, now: float) -> list[Observation]: ...


class DcgmSource:
    """Reads DCGM every `poll_seconds`; a DCGM that is down reads as Unknown, never as a broken GPU."""

    name = "dcgm"

    def __init__(self, reader: DcgmReader, *, poll_seconds: float = 30.0, timeout_seconds: float = 10.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.reader = reader
        self.poll_seconds = poll_seconds
        self.caller = BoundedCaller(timeout_seconds=timeout_seconds)
        self.clock = clock

    def read(self, now: float) -> list[Observation]:
        """One read under a deadline: a DCGM call that hangs reads as Unknown, never as a GPU fault."""
        try:
            result: list[Observation] = self.caller.call("dcgm read", self.reader.read, now)
        except (CallTimeout, TooManyHungCalls) as exc:
            return self.reader.translator.unreadable(now, f"DCGM: {exc}")
        return result

    def run(self, emit: Emit, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                started = self.clock()
                for observation in self.read(started):
                    emit(observation)
                stop.wait(max(0.0, self.poll_seconds - (self.clock() - started)))
        finally:
            self.caller.close()

"""The contract every source keeps: run until stopped, emit observations, never raise out of run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from agent.model import Observation

Emit = Callable[[Observation], None]


class Source(Protocol):
    """A source of observations; `run` blocks until `stop` is set."""

    name: str

    def run(self, emit: Emit, stop: threading.Event) -> None: ...

"""Runs driver calls with a deadline: a call that hangs is abandoned on its thread, never waited on.

Hung calls are bounded per key (one GPU) and in all: a GPU with a call still stuck in the driver is not
called again until that call returns, so one wedged GPU costs at most `max_hung_per_key` threads and the
other GPUs keep being read; past `max_hung` in all, nothing more is called.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any


class CallTimeout(Exception):
    """A driver call did not return within its deadline (the driver may be wedged)."""

    def __init__(self, name: str, seconds: float) -> None:
        super().__init__(f"{name} timed out after {seconds:g}s")
        self.name = name
        self.seconds = seconds


class TooManyHungCalls(Exception):
    """So many calls are stuck in the driver (for this key, or in all) that no further thread is spent."""


_Job = tuple[Callable[..., Any], tuple[Any, ...], "Future[Any]"]


class _Worker:
    def __init__(self) -> None:
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="driver-call", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            func, args, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(func(*args))
            except BaseException as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
                future.set_exception(exc)


class BoundedCaller:
    """One worker thread for driver calls; a hung call costs that thread, and a fresh one takes over."""

    def __init__(self, *, timeout_seconds: float, max_hung: int = 8, max_hung_per_key: int = 1) -> None:
        self.timeout = timeout_seconds
        self.max_hung = max_hung
        self.max_hung_per_key = max_hung_per_key
        self.hung = 0
        #: Hung calls by key: the key -> how many of its calls are still stuck in the driver.
        self.hung_by_key: dict[Hashable, int] = {}
        self._worker = _Worker()
        self._lock = threading.Lock()

    def call(self, name: str, func: Callable[..., Any], *args: Any, key: Hashable = None) -> Any:
        """func(*args), or CallTimeout after the deadline; exceptions of func propagate. A call with a key
        is refused while that key has `max_hung_per_key` calls hung; any call while `max_hung` are."""
        with self._lock:
            if self.hung >= self.max_hung:
                raise TooManyHungCalls(f"{self.hung} driver calls are hung; not calling {name}")
            if key is not None and self.hung_by_key.get(key, 0) >= self.max_hung_per_key:
                raise TooManyHungCalls(f"{self.hung_by_key[key]} driver call(s) of this GPU still hung; "
                                       f"not calling {name}")
            worker = self._worker
        future: Future[Any] = Future()
        worker.jobs.put((func, args, future))
        try:
            return future.result(timeout=self.timeout)
        except FutureTimeout:
            with self._lock:
                if self._worker is worker:
                    self.hung += 1
                    if key is not None:
                        self.hung_by_key[key] = self.hung_by_key.get(key, 0) + 1
                    self._worker = _Worker()
                    worker.jobs.put(None)  # the abandoned thread ends once the driver lets go of it
                    future.add_done_callback(lambda _: self._released(key))
            raise CallTimeout(name, self.timeout) from None

    def _released(self, key: Hashable) -> None:
        with self._lock:
            self.hung = max(0, self.hung - 1)
            if key is not None:
                left = self.hung_by_key.get(key, 0) - 1
                if left > 0:
                    self.hung_by_key[key] = left
                else:
                    self.hung_by_key.pop(key, None)

    def hung_for(self, key: Hashable) -> int:
        """How many calls of this key are still stuck in the driver."""
        with self._lock:
            return self.hung_by_key.get(key, 0)

    def close(self) -> None:
        self._worker.jobs.put(None)

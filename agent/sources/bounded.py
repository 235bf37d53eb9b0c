"""Runs driver calls with a deadline: a call that hangs is abandoned on its thread, never waited on."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
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
    """So many calls are stuck in the driver that no further thread is spent on it."""


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

    def __init__(self, *, timeout_seconds: float, max_hung: int = 8) -> None:
        self.timeout = timeout_seconds
        self.max_hung = max_hung
        self.hung = 0
        self._worker = _Worker()
        self._lock = threading.Lock()

    def call(self, name: str, func: Callable[..., Any], *args: Any) -> Any:
        """func(*args), or CallTimeout after the deadline; exceptions of func propagate."""
        with self._lock:
            if self.hung >= self.max_hung:
                raise TooManyHungCalls(f"{self.hung} driver calls are hung; not calling {name}")
            worker = self._worker
        future: Future[Any] = Future()
        worker.jobs.put((func, args, future))
        try:
            return future.result(timeout=self.timeout)
        except FutureTimeout:
            with self._lock:
                if self._worker is worker:
                    self.hung += 1
                    self._worker = _Worker()
                    worker.jobs.put(None)  # the abandoned thread ends once the driver lets go of it
                    future.add_done_callback(self._released)
            raise CallTimeout(name, self.timeout) from None

    def _released(self, _: Future[Any]) -> None:
        with self._lock:
            self.hung = max(0, self.hung - 1)

    def close(self) -> None:
        self._worker.jobs.put(None)

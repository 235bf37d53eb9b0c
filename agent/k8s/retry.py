"""Retries at the I/O edge: transient API errors only, jittered backoff, always under a deadline."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    stop_before_delay,
    wait_exponential,
    wait_none,
)
from tenacity.wait import wait_base

from agent.k8s.errors import Conflict, K8sError, TooManyRequests

T = TypeVar("T")

#: Tests set this to False so retries do not sleep.
WAIT = True
#: How long one API call may be retried. Short on purpose: the pipeline must not stall on an API outage;
#: a step that still fails is retried by the pipeline itself on its next pass.
DEFAULT_DEADLINE_SECONDS = 5.0
#: The jitter's own random state for callers that bring none: never the process-global one, so a seeded run
#: (scripts/fault_injection.py, tests) draws the same waits whatever ran before it.
JITTER = random.Random()  # noqa: S311 - jitter, not cryptography

#: The monotonic time by which the innermost `with_retries` in progress must be done; the client cuts each
#: request's timeouts to it, so a retried call never outlives its deadline by a whole read timeout.
_deadline: ContextVar[float | None] = ContextVar("k8s_retry_deadline", default=None)


def remaining_seconds() -> float | None:
    """Seconds left before the deadline of the retries in progress, or None outside any."""
    deadline = _deadline.get()
    return None if deadline is None else deadline - time.monotonic()


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, K8sError) and exc.transient


def _transient_or_throttled(exc: BaseException) -> bool:
    return _transient(exc) or isinstance(exc, TooManyRequests)


class _Jittered(wait_exponential):
    """Full jitter (a uniform wait up to the exponential bound), drawn from the given random state."""

    def __init__(self, rng: random.Random, *, multiplier: float, maximum: float) -> None:
        super().__init__(multiplier=multiplier, max=maximum)
        self.rng = rng

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.rng.uniform(0, super().__call__(retry_state))


def _wait(rng: random.Random | None, multiplier: float, maximum: float) -> wait_base:
    return _Jittered(rng or JITTER, multiplier=multiplier, maximum=maximum) if WAIT else wait_none()


def with_retries(func: Callable[[], T], *, deadline_seconds: float | None = None, wait_multiplier: float = 0.05,
                 wait_max: float = 1.0, rng: random.Random | None = None, throttled: bool = False) -> T:
    """func(), retried on transient errors (5xx, unreachable, timed out) until the deadline.

    No attempt starts, and no backoff sleeps, past the deadline; requests sent meanwhile have their
    timeouts cut to what is left of it (see `remaining_seconds`). The waits are jittered and grow
    exponentially from `wait_multiplier` up to `wait_max` seconds: short, so a call gets about fifteen tries
    within the default 5 s (with waits up to 5 s it got six, and one server answering half its requests with
    503 failed one call in 64: a fatal step blocked for the pipeline's 30-s back-off). The jitter comes from
    `rng` (default `JITTER`). With `throttled`, a 429 is transient too: for a read, it is the API server's
    priority and fairness asking to come back (for an eviction it is a PodDisruptionBudget's no, so never
    there).
    """
    seconds = DEFAULT_DEADLINE_SECONDS if deadline_seconds is None else deadline_seconds
    outer = _deadline.get()
    deadline = time.monotonic() + seconds
    token = _deadline.set(deadline if outer is None else min(outer, deadline))
    try:
        retrying = Retrying(
            retry=retry_if_exception(_transient_or_throttled if throttled else _transient),
            stop=stop_after_delay(seconds) | stop_before_delay(seconds),
            wait=_wait(rng, wait_multiplier, wait_max),
            reraise=True,
        )
        return retrying(func)
    finally:
        _deadline.reset(token)


def on_conflict(func: Callable[[], T], *, attempts: int = 8, rng: random.Random | None = None) -> T:
    """func() re-run on 409: each run reads the object again and re-applies the change (read-compare-patch)."""
    retrying = Retrying(
        retry=retry_if_exception(lambda exc: isinstance(exc, Conflict)),
        stop=stop_after_attempt(attempts),
        wait=_wait(rng, 0.05, 1.0),
        reraise=True,
    )
    return retrying(func)

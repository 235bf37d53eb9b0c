"""Retries at the I/O edge: transient API errors only, jittered backoff, always under a deadline."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tenacity import Retrying, retry_if_exception, stop_after_attempt, stop_after_delay, wait_random_exponential

from agent.k8s.errors import Conflict, K8sError

T = TypeVar("T")

#: Tests set this to False so retries do not sleep.
WAIT = True
#: How long one API call may be retried. Short on purpose: the pipeline must not stall on an API outage;
#: a step that still fails is retried by the pipeline itself on its next pass.
DEFAULT_DEADLINE_SECONDS = 5.0


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, K8sError) and exc.transient


def with_retries(func: Callable[[], T], *, deadline_seconds: float | None = None) -> T:
    """func(), retried on transient errors (5xx, unreachable) until the deadline."""
    retrying = Retrying(
        retry=retry_if_exception(_transient),
        stop=stop_after_delay(DEFAULT_DEADLINE_SECONDS if deadline_seconds is None else deadline_seconds),
        wait=wait_random_exponential(multiplier=0.2, max=5) if WAIT else wait_random_exponential(max=0),
        reraise=True,
    )
    return retrying(func)


def on_conflict(func: Callable[[], T], *, attempts: int = 8) -> T:
    """func() re-run on 409: each run reads the object again and re-applies the change (read-compare-patch)."""
    retrying = Retrying(
        retry=retry_if_exception(lambda exc: isinstance(exc, Conflict)),
        stop=stop_after_attempt(attempts),
        wait=wait_random_exponential(multiplier=0.05, max=1) if WAIT else wait_random_exponential(max=0),
        reraise=True,
    )
    return retrying(func)

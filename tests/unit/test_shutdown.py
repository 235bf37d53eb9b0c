"""The stop event `run`, `reset-helper` and `fleet run` share: SIGTERM, SIGINT or a duration set it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from agent.shutdown import stop_event


@pytest.fixture(autouse=True)
def _restore_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_sets_the_event(sig: signal.Signals) -> None:
    """The signal sets the event instead of ending the process."""
    stop = stop_event()
    os.kill(os.getpid(), sig)
    assert stop.wait(5)


def test_a_duration_sets_the_event_when_it_has_passed() -> None:
    """Without a signal, the event is set once the duration has passed, and not before."""
    stop = stop_event(0.2)
    assert not stop.is_set()
    assert stop.wait(5)


def test_without_a_duration_nothing_but_a_signal_sets_it() -> None:
    """No timer runs when no duration is given."""
    assert not stop_event().wait(0.3)

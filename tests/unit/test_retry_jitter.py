"""The API retries' jitter comes from a random state of its own (seedable), never the process-global one."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
import tenacity
import tenacity.nap

from agent.k8s import retry
from agent.k8s.errors import status_error


class VirtualTime:
    """Tenacity's clock and sleep, virtual: `waits` are the sleeps the retries asked for."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


@pytest.fixture
def virtual(monkeypatch: pytest.MonkeyPatch) -> Iterator[VirtualTime]:
    clock = VirtualTime()
    monkeypatch.setattr(retry, "WAIT", True)
    monkeypatch.setattr(tenacity, "time", clock)
    monkeypatch.setattr(tenacity.nap, "time", clock)
    yield clock


def failing(times: int) -> Callable[[], str]:
    left = [times]

    def call() -> str:
        if left[0]:
            left[0] -= 1
            raise status_error(503, "Service Unavailable", "")
        return "ok"

    return call


def test_retries_leave_the_process_global_random_state_alone(virtual):
    """Five jittered waits draw nothing from `random`: the global sequence goes on as if they had not run."""
    random.seed(7)
    expected = random.random()
    random.seed(7)
    assert retry.with_retries(failing(5)) == "ok"
    assert len(virtual.waits) == 5
    assert random.random() == expected


def test_equally_seeded_random_states_give_the_same_waits(virtual):
    """The waits are drawn from the random state passed in: the same seed, the same waits."""
    retry.with_retries(failing(6), rng=random.Random(3))
    first, virtual.waits = virtual.waits, []
    retry.with_retries(failing(6), rng=random.Random(3))
    assert virtual.waits == first
    assert len(set(first)) > 1

"""The bounded driver caller: hung calls cost bounded threads, per GPU (key) and in all."""

import threading

import pytest

from agent.sources.bounded import BoundedCaller, CallTimeout, TooManyHungCalls
from tests.conftest import wait_for


def hang_on(gate: threading.Event) -> None:
    gate.wait()


def test_a_key_with_a_hung_call_is_not_called_again_until_it_returns():
    """GPU 5 hung once: its next call is refused at once (no second thread), and allowed once it returned."""
    caller, gate, calls = BoundedCaller(timeout_seconds=0.05), threading.Event(), []
    try:
        with pytest.raises(CallTimeout):
            caller.call("first", hang_on, gate, key="gpu5")
        with pytest.raises(TooManyHungCalls, match="of this GPU still hung"):
            caller.call("second", calls.append, 1, key="gpu5")
        assert (calls, caller.hung, caller.hung_for("gpu5")) == ([], 1, 1)
        gate.set()
        assert wait_for(lambda: caller.hung_for("gpu5") == 0, timeout=5)
        caller.call("third", calls.append, 3, key="gpu5")
        assert calls == [3]
    finally:
        gate.set()
        caller.close()


def test_other_keys_are_still_called_while_one_is_hung():
    """One wedged GPU does not stop the calls of the others."""
    caller, gate = BoundedCaller(timeout_seconds=0.05), threading.Event()
    try:
        with pytest.raises(CallTimeout):
            caller.call("hangs", hang_on, gate, key="gpu5")
        assert [caller.call("reads", lambda i=i: i, key=f"gpu{i}") for i in (0, 1, 2, 3, 4, 6, 7)] == [
            0, 1, 2, 3, 4, 6, 7]
    finally:
        gate.set()
        caller.close()


def test_hung_calls_are_bounded_in_all():
    """Past max_hung hung calls nothing more is called, whichever key."""
    caller, gate = BoundedCaller(timeout_seconds=0.05, max_hung=2), threading.Event()
    try:
        for key in ("gpu0", "gpu1"):
            with pytest.raises(CallTimeout):
                caller.call("hangs", hang_on, gate, key=key)
        with pytest.raises(TooManyHungCalls, match="2 driver calls are hung"):
            caller.call("reads", lambda: 1, key="gpu2")
    finally:
        gate.set()
        caller.close()

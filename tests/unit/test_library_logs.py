"""One log stream: stdlib logging records, warnings and threads' uncaught exceptions go through the agent's logger."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator

import pytest

from agent import logs
from agent.logs import capture_logs
from tests.conftest import REPO


@pytest.fixture(autouse=True)
def _restore(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What configure_logging changes in the process, put back after each test."""
    root = logging.getLogger()
    saved = (logs._settings.threshold, logs._settings.fmt, list(root.handlers), root.level)
    # Python's own hook before ours, so ours does not hand the thread's exception on to the test runner's.
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    yield
    logs._settings.threshold, logs._settings.fmt = saved[0], saved[1]
    root.handlers[:] = saved[2]
    root.setLevel(saved[3])


def test_a_library_record_is_an_event_with_its_logger_level_and_message():
    """urllib3's retry warning, as urllib3 logs it, comes out as `library_log`."""
    logs.configure_logging("info", "json")
    with capture_logs() as captured:
        logging.getLogger("urllib3.connectionpool").warning(
            "Retrying (%r) after connection broken by '%r': %s", "Retry(total=2)", "NewConnectionError", "/api")
    assert captured == [{"event": "library_log", "log_level": "warning", "logger": "urllib3.connectionpool",
                         "message": "Retrying ('Retry(total=2)') after connection broken by "
                                    "''NewConnectionError'': /api"}]


def test_library_records_below_the_configured_level_are_dropped():
    """At `warning`, a library's info and debug records are not even made."""
    logs.configure_logging("warning", "json")
    with capture_logs() as captured:
        logging.getLogger("urllib3.connectionpool").info("Starting new HTTPS connection (1): %s", "10.0.0.1")
        logging.getLogger("urllib3.connectionpool").debug("details")
        logging.getLogger("some.library").error("broken")
    assert [(e["log_level"], e["message"]) for e in captured] == [("error", "broken")]


def test_a_library_records_exception_is_one_field():
    """logger.exception in a library: `exception` is `Type: message`, as the agent's own events have it."""
    logs.configure_logging("info", "json")
    with capture_logs() as captured:
        try:
            raise ConnectionResetError("peer closed")
        except ConnectionResetError:
            logging.getLogger("some.library").exception("request failed")
    assert captured[0]["exception"] == "ConnectionResetError: peer closed"
    assert captured[0]["log_level"] == "error"


def test_a_record_whose_arguments_do_not_fit_its_format_is_still_logged():
    """A library's bad format string never makes its log call fail, nor loses the record."""
    logs.configure_logging("info", "json")
    root = logging.getLogger()  # only ours: the test runner's own capturing handler raises on such a record
    root.handlers[:] = [h for h in root.handlers if isinstance(h, logs._StdlibHandler)]
    with capture_logs() as captured:
        logging.getLogger("some.library").warning("%d items", "many")
    assert captured[0]["message"] == "%d items ('many',)"


def test_a_warning_is_an_event_with_its_category_message_and_source():
    """A warning (here pydantic's, for a field shadowing a BaseModel attribute) comes out as `python_warning`."""
    import pydantic

    logs.configure_logging("info", "json")
    with capture_logs() as captured, warnings.catch_warnings():
        warnings.simplefilter("always")
        logs.configure_logging("info", "json")  # catch_warnings put back the showwarning it found
        type("Shadowing", (pydantic.BaseModel,), {"__annotations__": {"json": int}, "json": 0})
    [entry] = captured
    assert (entry["event"], entry["log_level"], entry["category"]) == ("python_warning", "warning", "UserWarning")
    assert entry["message"] == 'Field name "json" in "Shadowing" shadows an attribute in parent "BaseModel"'
    assert "test_library_logs.py:" in str(entry["source"])


def test_an_exception_that_ends_a_thread_is_one_event():
    """A thread dying of an exception: `thread_failed` with the thread's name, not Python's plain traceback."""
    logs.configure_logging("info", "json")

    def crash() -> None:
        raise RuntimeError("watch stream gone")

    with capture_logs() as captured:
        thread = threading.Thread(target=crash, name="fleet-watch")
        thread.start()
        thread.join()
    assert captured == [{"event": "thread_failed", "log_level": "error", "thread": "fleet-watch",
                         "exception": "RuntimeError: watch stream gone"}]


def test_configuring_twice_adds_one_handler():
    """Every command configures the logger again; a library record is still one event."""
    logs.configure_logging("info", "json")
    logs.configure_logging("info", "json")
    with capture_logs() as captured:
        logging.getLogger("some.library").warning("once")
    assert len(captured) == 1


#: A fresh process, as the agent runs: its logger configured for JSON, then real libraries speak.
PROCESS = """
import logging, socket, threading, warnings
import pydantic, urllib3
from agent.logs import configure_logging, get_logger
configure_logging("info", "json")
get_logger("agent.test").info("agent_starting")
with socket.socket() as probe:  # a port nothing listens on: urllib3 retries, and says so
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
try:
    urllib3.PoolManager().request("GET", f"http://127.0.0.1:{port}/", retries=urllib3.Retry(1, backoff_factor=0))
except urllib3.exceptions.MaxRetryError:
    pass
warnings.warn("the old knob is deprecated", DeprecationWarning)
class Shadowing(pydantic.BaseModel):
    json: int = 0
thread = threading.Thread(target=lambda: 1 / 0, name="fleet-correlate")
thread.start()
thread.join()
"""


def test_a_process_writes_one_stream_of_json_lines_whatever_speaks():
    """The agent's events, urllib3's retry warning, a deprecation, pydantic's warning and a dying thread: every
    line on stderr is one JSON object, none is plain text or a traceback."""
    result = subprocess.run([sys.executable, "-W", "default", "-c", PROCESS], capture_output=True, text=True,
                            cwd=REPO, timeout=60, check=True)
    lines = result.stderr.splitlines()
    records = [json.loads(line) for line in lines]  # raises on a plain-text line
    events = [(r["event"], r.get("logger") or r.get("category") or r.get("thread")) for r in records]
    assert events == [("agent_starting", None), ("library_log", "urllib3.connectionpool"),
                      ("python_warning", "DeprecationWarning"), ("python_warning", "UserWarning"),
                      ("thread_failed", "fleet-correlate")], result.stderr
    assert str(records[1]["message"]).startswith("Retrying (Retry(total=0")
    assert records[4]["exception"] == "ZeroDivisionError: division by zero"

"""The agent's own structured logger: JSON lines or console lines on stderr, levels, bound context, no dev tool."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import logs


@pytest.fixture(autouse=True)
def _restore_settings() -> Iterator[None]:
    saved = (logs._settings.threshold, logs._settings.fmt)
    yield
    logs._settings.threshold, logs._settings.fmt = saved


def _json_lines(err: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in err.splitlines()]


def test_a_json_line_is_event_level_utc_timestamp_then_the_keys(capsys: pytest.CaptureFixture[str]) -> None:
    """One JSON object per line on stderr, its keys in order: event, level, timestamp, then the event's own."""
    logs.configure_logging("info", "json")
    logs.get_logger("agent.test").info("agent_started", node="n1", gpus=8)
    out, err = capsys.readouterr()
    assert out == ""
    [record] = _json_lines(err)
    assert list(record) == ["event", "level", "timestamp", "node", "gpus"]
    assert (record["event"], record["level"], record["node"], record["gpus"]) == ("agent_started", "info", "n1", 8)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", str(record["timestamp"]))


def test_events_below_the_configured_level_are_not_written(capsys: pytest.CaptureFixture[str]) -> None:
    """At `warning`, debug and info are dropped; warning and error are written."""
    logs.configure_logging("warning", "json")
    log = logs.get_logger("agent.test")
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    assert [record["event"] for record in _json_lines(capsys.readouterr().err)] == ["w", "e"]


def test_bind_adds_its_context_to_every_event_and_leaves_the_original_unchanged(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A bound logger carries its keys (the call's own keys after them); the logger it came from carries none."""
    logs.configure_logging("info", "json")
    base = logs.get_logger("agent.test")
    bound = base.bind(node="n1").bind(gpu="GPU-0")
    bound.info("seen", rule_id="xid-79")
    base.info("plain")
    first, second = _json_lines(capsys.readouterr().err)
    assert {key: first[key] for key in list(first)[3:]} == {"node": "n1", "gpu": "GPU-0", "rule_id": "xid-79"}
    assert list(second) == ["event", "level", "timestamp"]


def test_a_value_json_cannot_hold_is_written_as_its_str(capsys: pytest.CaptureFixture[str]) -> None:
    """A path or any other object becomes str(value) in the JSON line, not an error."""
    logs.configure_logging("info", "json")
    logs.get_logger("agent.test").info("rules_reloaded", directory=Path("/etc/rules"), kinds={"xid"})
    [record] = _json_lines(capsys.readouterr().err)
    assert (record["directory"], record["kinds"]) == ("/etc/rules", "{'xid'}")


def test_an_exception_is_one_line_naming_its_type_and_message(capsys: pytest.CaptureFixture[str]) -> None:
    """`exception` writes the error as `Type: message` on the event's own line, no traceback (console and JSON)."""
    log = logs.get_logger("agent.test")
    for fmt in ("json", "console"):
        logs.configure_logging("info", fmt)  # type: ignore[arg-type]
        try:
            raise ValueError("bad value")
        except ValueError:
            log.exception("source_failed", source="nvml")
    json_line, console_line = capsys.readouterr().err.splitlines()
    assert json.loads(json_line)["exception"] == "ValueError: bad value"
    assert console_line.endswith("source=nvml exception='ValueError: bad value'")
    assert "Traceback" not in json_line + console_line


def test_under_debug_an_exception_carries_its_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    """At `debug` the JSON line's exception is the whole traceback, still one line."""
    logs.configure_logging("debug", "json")
    try:
        raise ValueError("bad value")
    except ValueError:
        logs.get_logger("agent.test").exception("source_failed")
    [record] = _json_lines(capsys.readouterr().err)
    assert str(record["exception"]).startswith("Traceback (most recent call last):")
    assert str(record["exception"]).endswith("ValueError: bad value")


def test_the_console_line_keeps_the_layout_the_agent_printed_before(capsys: pytest.CaptureFixture[str]) -> None:
    """Timestamp, level padded in brackets, event padded to 30, keys sorted; strings with spaces quoted."""
    logs.configure_logging("info", "console")
    logs.get_logger("agent.test").bind(node="n1").warning("gpu_missing", reason="not on the bus", count=2)
    line = capsys.readouterr().err.rstrip("\n")
    stamp, rest = line.split(" ", 1)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", stamp)
    assert rest == "[warning  ] gpu_missing                    count=2 node=n1 reason='not on the bus'"


def test_auto_format_writes_json_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    """`auto` (the default) gives JSON lines to a pipe or file."""
    logs.configure_logging("info", "auto")
    logs.get_logger("agent.test").info("agent_stopped")
    assert _json_lines(capsys.readouterr().err)[0]["event"] == "agent_stopped"


def test_each_line_is_one_write_even_from_many_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent events reach stderr as whole lines, one write each, so they never interleave."""

    class Recorder:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return False

    stream = Recorder()
    monkeypatch.setattr(sys, "stderr", stream)
    logs.configure_logging("info", "json")
    log = logs.get_logger("agent.test")
    threads = [threading.Thread(target=lambda n=n: [log.info("tick", thread=n, i=i) for i in range(200)])
               for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(stream.writes) == 8 * 200
    assert all(text.endswith("\n") and text.count("\n") == 1 for text in stream.writes)
    assert all(json.loads(text)["event"] == "tick" for text in stream.writes)


@pytest.mark.parametrize("module", ["rich", "pygments", "structlog", "asyncio"])
def test_the_agent_runtime_loads_no_dev_tool(module: str) -> None:
    """Run in a fresh interpreter: this test process may have loaded them for its own reasons."""
    code = ("import sys, agent.cli, agent.logs\n"
            "agent.logs.configure_logging(fmt='console')\n"
            f"print(sys.modules.get({module!r}) is not None)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "False"


def test_a_field_that_cannot_be_shown_never_makes_the_log_call_fail(capsys: pytest.CaptureFixture[str]) -> None:
    """A value whose str() raises, a tuple-keyed dict, a circular list: the line is still written, nothing raises."""

    class Broken:
        def __str__(self) -> str:
            raise RuntimeError("boom")

    circular: list[object] = []
    circular.append(circular)
    logs.configure_logging("info", "json")
    log = logs.get_logger("agent.test")
    for value in (Broken(), {("a", 1): 2}, circular):
        log.warning("odd_field", value=value)
    records = _json_lines(capsys.readouterr().err)
    assert [r["event"] for r in records] == ["odd_field"] * 3
    assert records[0]["value"] == "<unprintable Broken>"


def test_a_closed_stderr_loses_the_line_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """stderr closed or gone (a broken pipe, a daemonised process): the log call returns, nothing raises."""
    import io

    closed = io.StringIO()
    closed.close()
    logs.configure_logging("info", "json")
    for stream in (closed, None):
        monkeypatch.setattr(sys, "stderr", stream)
        logs.get_logger("agent.test").error("source_failed", source="kmsg")

"""Structured logging on the stdlib: one JSON line per event, or a readable console line on a terminal; the stdlib
logging module's records (urllib3's, any library's), warnings and threads' uncaught exceptions as events too."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, TextIO

from agent.timefmt import rfc3339_micro

#: The thresholds `configure_logging` accepts; "critical" is above every level the agent logs at (silence).
LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}

#: Console layout (as structlog's ConsoleRenderer without colours, which the agent used before).
LEVEL_WIDTH = 9
EVENT_WIDTH = 30

#: Characters that make a console value quoted (repr), so a line still splits into key=value pairs.
_QUOTED = frozenset(" \t=\r\n\"'")


@dataclass
class _Settings:
    """What `configure_logging` chose; read on every call so a reconfiguration applies to bound loggers too."""

    threshold: int = LEVELS["info"]
    fmt: Literal["auto", "json", "console"] = "auto"


_settings = _Settings()
_write_lock = threading.Lock()
#: The lists of the capture_logs() blocks under way (innermost last), which take events instead of stderr.
_captures: list[list[dict[str, object]]] = []


def configure_logging(level: str = "info", fmt: Literal["auto", "json", "console"] = "auto") -> None:
    """Set the process's threshold and format; logs go to stderr so stdout stays for command output. Everything
    else that would write to stderr goes through the same logger, so the process writes one stream in one format:
    stdlib logging records (event `library_log`), warnings (`python_warning`) and exceptions that end a thread
    (`thread_failed`)."""
    _settings.threshold = LEVELS.get(level, LEVELS["info"])
    _settings.fmt = fmt
    root = logging.getLogger()
    if not any(isinstance(handler, _StdlibHandler) for handler in root.handlers):
        root.addHandler(_StdlibHandler())
    root.setLevel(_settings.threshold)
    warnings.showwarning = _show_warning
    if threading.excepthook is not _thread_failed:
        _previous_thread_hook[0] = threading.excepthook
        threading.excepthook = _thread_failed


@contextlib.contextmanager
def capture_logs() -> Iterator[list[dict[str, object]]]:
    """Every event logged (from any thread) while the block runs, at every level, as a dict instead of a
    line, as structlog.testing.capture_logs gives it: `event`, `log_level`, the bound context and the
    fields (`exception` as `Type: message`); no timestamp. What a test asserts an operator can grep for."""
    captured: list[dict[str, object]] = []
    with _write_lock:
        _captures.append(captured)
    try:
        yield captured
    finally:
        with _write_lock:
            _captures.remove(captured)


def get_logger(name: str) -> BoundLogger:
    """A logger for module `name` (not printed: the event names are unique across the agent)."""
    return BoundLogger(name, {})


class BoundLogger:
    """Logs events with the key/value context it was bound with; `bind` returns a new one, this one is unchanged."""

    __slots__ = ("context", "name")

    def __init__(self, name: str, context: dict[str, object]) -> None:
        self.name = name
        self.context = context

    def bind(self, **context: object) -> BoundLogger:
        """A logger that adds `context` to every event (on top of this one's)."""
        return BoundLogger(self.name, {**self.context, **context})

    def debug(self, event: str, /, **fields: object) -> None:
        """Log at debug level."""
        self._log("debug", event, fields, None)

    def info(self, event: str, /, **fields: object) -> None:
        """Log at info level."""
        self._log("info", event, fields, None)

    def warning(self, event: str, /, **fields: object) -> None:
        """Log at warning level."""
        self._log("warning", event, fields, None)

    def error(self, event: str, /, **fields: object) -> None:
        """Log at error level."""
        self._log("error", event, fields, None)

    def exception(self, event: str, /, **fields: object) -> None:
        """Log at error level with the exception being handled, as one line (its traceback too under debug)."""
        self._log("error", event, fields, sys.exc_info()[1])

    def _log(self, level: str, event: str, fields: dict[str, object], exc: BaseException | None) -> None:
        if _captures:
            _capture(level, event, {**self.context, **fields}, exc)
            return
        if LEVELS[level] < _settings.threshold:
            return
        record: dict[str, object] = {"event": event, "level": level, "timestamp": _now()}
        for key, value in (*self.context.items(), *fields.items()):
            if key not in ("event", "level", "timestamp"):
                record[key] = value
        try:
            if exc is not None:
                record["exception"] = describe(exc, with_traceback=_settings.threshold <= LEVELS["debug"])
            line = render(record, _use_json())
        except Exception:  # noqa: BLE001 - a field that cannot be shown never turns a log call into a failure
            line = json.dumps({key: _safe_text(value) for key, value in record.items()})
        # stderr closed, a broken pipe, or none at all: the line is lost, the agent goes on.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            write(line)


_library = BoundLogger("stdlib", {})
#: The threading.excepthook before ours: called after ours unless it is Python's default (which would print the
#: traceback as plain text); a test runner's hook still sees a thread's exception.
_previous_thread_hook = [threading.__excepthook__]


class _StdlibHandler(logging.Handler):
    """A stdlib logging record as the event `library_log`: the record's logger, its level, its message."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not fit its format is still shown
            message = f"{_safe_text(record.msg)} {_safe_text(record.args)}"
        exc = record.exc_info[1] if record.exc_info else None
        _library._log(_level_of(record.levelno), "library_log", {"logger": record.name, "message": message}, exc)


def _level_of(levelno: int) -> str:
    for name in ("debug", "info", "warning"):
        if levelno <= LEVELS[name]:
            return name
    return "error"


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    """warnings.showwarning: a warning (a library's, a deprecation) as the event `python_warning`."""
    _library.warning("python_warning", category=category.__name__, message=_safe_text(message),
                     source=f"{filename}:{lineno}")


def _thread_failed(args: threading.ExceptHookArgs) -> None:
    """threading.excepthook: an exception that ended a thread as the event `thread_failed` (its traceback under
    debug, as every logged exception)."""
    if args.exc_type is SystemExit:
        return
    exc = args.exc_value if args.exc_value is not None else args.exc_type()
    name = args.thread.name if args.thread is not None else "unknown"
    _library._log("error", "thread_failed", {"thread": name}, _with_traceback(exc, args.exc_traceback))
    if _previous_thread_hook[0] is not threading.__excepthook__:
        _previous_thread_hook[0](args)


def _with_traceback(exc: BaseException, tb: TracebackType | None) -> BaseException:
    return exc if exc.__traceback__ is not None or tb is None else exc.with_traceback(tb)


def _capture(level: str, event: str, fields: dict[str, object], exc: BaseException | None) -> None:
    entry: dict[str, object] = {"event": event, "log_level": level}
    entry.update((key, value) for key, value in fields.items() if key not in ("event", "log_level"))
    if exc is not None:
        entry["exception"] = describe(exc, with_traceback=False)
    with _write_lock:
        if _captures:
            _captures[-1].append(entry)


def describe(exc: BaseException, with_traceback: bool) -> str:
    """`Type: message`, or the whole traceback (for debug: JSON escapes its newlines, the console prints it)."""
    if with_traceback:
        return "".join(traceback.format_exception(exc)).rstrip("\n")
    return f"{type(exc).__name__}: {exc}"


def render(record: dict[str, object], as_json: bool) -> str:
    """One event as its line (no newline): JSON with str() for what JSON cannot hold, or the console layout."""
    if as_json:
        return json.dumps(record, default=str)
    head = (f"{record['timestamp']} [{str(record['level']).ljust(LEVEL_WIDTH)}] "
            f"{str(record['event']).ljust(EVENT_WIDTH)}")
    extra = {key: value for key, value in record.items() if key not in ("event", "level", "timestamp")}
    exception = extra.pop("exception", None)
    pairs = " ".join(f"{key}={_console_value(extra[key])}" for key in sorted(extra))
    line = f"{head} {pairs}".rstrip(" ")
    if exception is None:
        return line
    text = str(exception)
    return f"{line}\n{text}" if "\n" in text else f"{line} exception={_console_value(text)}"


def write(line: str) -> None:
    """Append `line` to stderr as one write under a lock, so lines of concurrent threads never interleave."""
    with _write_lock:
        stream = sys.stderr
        stream.write(line + "\n")
        stream.flush()


def _safe_text(value: object) -> str:
    """A field as text however broken its __str__ is."""
    try:
        return str(value)
    except Exception:  # noqa: BLE001 - see _log
        return f"<unprintable {type(value).__name__}>"


def _console_value(value: object) -> str:
    if isinstance(value, str):
        return repr(value) if _QUOTED.intersection(value) else value
    return repr(value)


def _use_json() -> bool:
    return _settings.fmt == "json" or (_settings.fmt == "auto" and not sys.stderr.isatty())


def _now() -> str:
    return rfc3339_micro()

"""Structured logging: JSON when not on a terminal, readable console output on one; no dev tool loaded."""

from __future__ import annotations

import logging
import sys
from typing import Literal

#: structlog imports these when they are installed (dev tools such as import-linter bring rich, which
#: brings pygments: ~4 MiB): the agent renders with neither, so they are kept out of its process.
DEV_TOOLS = ("rich", "better_exceptions")


def keep_dev_tools_out() -> None:
    """Mark the dev tools absent unless something already loaded them; must run before structlog is imported."""
    for name in DEV_TOOLS:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]  # a None entry makes `import name` fail


keep_dev_tools_out()

import structlog  # noqa: E402 - only once the dev tools are kept out

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(level: str = "info", fmt: Literal["auto", "json", "console"] = "auto") -> None:
    """Configure structlog once for the process; logs go to stderr so stdout stays for command output."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json
        else structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )

"""What every command shares: exit codes, one-line failures for bad input, the config and the journal."""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from agent.config import Config, load_config
from agent.errors import AgentError, InputError, InputErrors
from agent.journal import Journal
from agent.remediation import Mode

F = TypeVar("F", bound=Callable[..., Any])
# Exit codes (README "Exit codes"): 0 done, 1 could not do it (runtime failure, no cluster, no journal),
# 2 bad input or usage; `check` follows the monitoring-plugin convention instead (agent.check.CheckStatus).
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


POSITIVE = click.FloatRange(min=0, min_open=True)


def fail(lines: list[str], code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Each line on stderr, then exit with `code` (2: bad input, by default)."""
    for line in lines:
        click.echo(line, err=True)
    sys.exit(code)


def reporting_bad_input(func: F) -> F:
    """Bad input becomes one line per problem on stderr and exit code 2, never a traceback."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except InputErrors as exc:
            fail([p.line() for p in exc.problems])
        except InputError as exc:
            fail([exc.line()])
        except AgentError as exc:
            fail([f"gpu-health-agent: {exc}"], code=EXIT_FAILED)
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename else ""
            fail([f"gpu-health-agent {func.__name__.removesuffix('_command')}: "
                   f"{exc.strerror or exc}{where}"], code=EXIT_FAILED)

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper  # type: ignore[return-value]


def config_of(path: str | None, *, mode: Mode | None = None) -> Config:
    """The configuration, with a command's `--mode` in place of the configured mode where given."""
    return load_config(Path(path) if path else None, mode=mode)


def open_journal(path: str | Path) -> Journal:
    """The journal a command was given, or one line saying why it cannot be opened (unwritable place, not a
    SQLite file); unlike the agent's own start, a command never moves a damaged file aside."""
    try:
        return Journal(path, recover=False)
    except sqlite3.DatabaseError as exc:
        problem = "not a journal (not a SQLite database)" if "not a database" in str(exc) else f"cannot open: {exc}"
        raise InputError(problem, file=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot create the journal: {exc.strerror or exc}", file=str(path)) from None

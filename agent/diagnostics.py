"""GPU diagnostics: run the configured command (e.g. `dcgmi diag -r 2 -i {uuid}`) bounded in time, parse its verdict."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterator
from enum import StrEnum


class DiagnosticOutcome(StrEnum):
    """What a diagnostic said about the GPU: passed, failed, or nothing usable (not run, timed out, unreadable)."""

    PASS = "pass"  # noqa: S105 - a test verdict, not a password
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


#: A runner takes the GPU UUID and returns the outcome with a one-line summary.
DiagnosticRunner = Callable[[str], tuple[DiagnosticOutcome, str]]

_ROW = re.compile(r"^\|\s*(?P<name>[^|]+?)\s*\|\s*(?P<result>Pass|Fail|Skip|Warn)\b(?P<rest>[^|]*)", re.IGNORECASE)


def parse(returncode: int, output: str) -> tuple[DiagnosticOutcome, str]:
    """dcgmi diag's table or its JSON (-j): any test Fail fails the GPU; only Passes (and a zero exit) pass it.
    A non-zero exit with no failed test (dcgmi missing, no permission, GPU busy) decides nothing."""
    statuses = _json_statuses(output) or _table_statuses(output)
    failed = [name for name, status in statuses if status == "fail"]
    if failed:
        return DiagnosticOutcome.FAIL, f"failed: {', '.join(failed[:5])}"
    passed = [name for name, status in statuses if status == "pass"]
    if passed and returncode == 0:
        return DiagnosticOutcome.PASS, f"passed {len(passed)} test(s)"
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
    return DiagnosticOutcome.INCONCLUSIVE, f"exit {returncode}, no test result: {last[:200]}"


def _table_statuses(output: str) -> list[tuple[str, str]]:
    rows = (_ROW.match(line.strip()) for line in output.splitlines())
    return [(m.group("name"), m.group("result").lower()) for m in rows if m]


def _json_statuses(output: str) -> list[tuple[str, str]]:
    start = output.find("{")
    if start < 0:
        return []
    try:
        document = json.loads(output[start:])
    except ValueError:
        return []
    return list(_walk(document, ""))


def _walk(node: object, name: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        here = str(node.get("name") or node.get("test_name") or name)
        status = node.get("status")
        if isinstance(status, str) and status.lower() in {"pass", "fail", "skip", "warn"}:
            yield here, status.lower()
        for value in node.values():
            yield from _walk(value, here)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item, name)


def command_runner(command: list[str], *, timeout_seconds: float, hostengine: str = "") -> DiagnosticRunner:
    """Runs the configured command with {uuid} (the GPU) and {hostengine} (sources.dcgm.hostengine: the DCGM host
    engine to ask, e.g. the GPU Operator's) filled in, killed after timeout_seconds (inconclusive then)."""

    def run(uuid: str) -> tuple[DiagnosticOutcome, str]:
        argv = [part.replace("{uuid}", uuid).replace("{hostengine}", hostengine) for part in command]
        try:
            done = subprocess.run(  # noqa: S603 - the operator's configured command
                argv, capture_output=True, text=True, timeout=timeout_seconds, check=False)
        except subprocess.TimeoutExpired:
            return DiagnosticOutcome.INCONCLUSIVE, f"{argv[0]} did not finish within {timeout_seconds:g}s"
        except OSError as exc:
            return DiagnosticOutcome.INCONCLUSIVE, f"{argv[0]}: {exc}"
        return parse(done.returncode, done.stdout + "\n" + done.stderr)

    return run


def outcome_of(message: str) -> DiagnosticOutcome:
    """The outcome a RUN_DIAGNOSTIC step's message carries (`pass: ...`, `fail: ...`); inconclusive otherwise."""
    head = message.split(":", 1)[0]
    decided = {DiagnosticOutcome.PASS, DiagnosticOutcome.FAIL}
    return DiagnosticOutcome(head) if head in decided else DiagnosticOutcome.INCONCLUSIVE

"""GPU diagnostics: run the configured command (e.g. `dcgmi diag -r 3 -i {uuid}`) bounded in time, parse its
verdict, and say how deep it went: only NVIDIA's RUN_DCGMEUD (the Xid 13/31 workflow) may release a GPU."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum


class DiagnosticOutcome(StrEnum):
    """What a diagnostic said about the GPU: passed, failed, or nothing usable (not run, timed out, unreadable)."""

    PASS = "pass"  # noqa: S105 - a test verdict, not a password
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


#: dcgmi diag's names for its suite levels 1 to 4 (`-r quick` is `-r 1`, ... `-r xlong` is `-r 4`).
_LEVEL_NAMES = {"quick": "1", "short": "1", "medium": "2", "long": "3", "xlong": "4"}
#: The suites of DCGM's long hardware diagnostics (level 2 is the medium check an epilogue runs).
DEEP_LEVELS = frozenset({"3", "4"})
#: The Extended Utility Diagnostics test as dcgmi names it (its canonical test name; the table's row).
EUD_NAMES = frozenset({"eud", "extended utility diagnostics"})
_DEPTH = re.compile(r" \[level (?P<level>[^\]]*?), eud (?P<eud>[^\],]*)\]$")


@dataclass(frozen=True, slots=True)
class DiagnosticResult:
    """One diagnostic's verdict, a one-line summary, and its depth: the level the command asked for (`-r`: a suite
    "1".."4", the test names as given, "" where the command does not say) and the eud test's status ("" not run)."""

    outcome: DiagnosticOutcome
    summary: str
    level: str = ""
    eud: str = ""

    def message(self) -> str:
        """The RUN_DIAGNOSTIC step's message: `pass: passed 12 test(s) [level 3, eud pass]`."""
        return f"{self.outcome}: {self.summary} [level {self.level or '?'}, eud {self.eud or 'not run'}]"

    @classmethod
    def of_message(cls, message: str) -> DiagnosticResult:
        """The result a step's message carries; depth unknown ("") where it does not say (an older message)."""
        depth = _DEPTH.search(message)
        level, eud = (depth.group("level"), depth.group("eud")) if depth else ("?", "not run")
        body = message[:depth.start()] if depth else message
        return cls(outcome_of(message), body.split(":", 1)[-1].strip(), "" if level == "?" else level,
                   "" if eud == "not run" else eud)


#: A runner takes the GPU UUID and returns the result.
DiagnosticRunner = Callable[[str], DiagnosticResult]

_ROW = re.compile(r"^\|\s*(?P<name>[^|]+?)\s*\|\s*(?P<result>Pass|Fail|Skip|Warn)\b(?P<rest>[^|]*)", re.IGNORECASE)


def parse(returncode: int, output: str) -> tuple[DiagnosticOutcome, str]:
    """dcgmi diag's table or its JSON (-j): any test Fail fails the GPU; only Passes (and a zero exit) pass it.
    A non-zero exit with no failed test (dcgmi missing, no permission, GPU busy) decides nothing."""
    statuses = _statuses(output)
    failed = [name for name, status in statuses if status == "fail"]
    if failed:
        return DiagnosticOutcome.FAIL, f"failed: {', '.join(failed[:5])}"
    passed = [name for name, status in statuses if status == "pass"]
    if passed and returncode == 0:
        return DiagnosticOutcome.PASS, f"passed {len(passed)} test(s)"
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
    return DiagnosticOutcome.INCONCLUSIVE, f"exit {returncode}, no test result: {last[:200]}"


def eud_status(output: str) -> str:
    """The eud test's status in dcgmi diag's output (fail where any GPU's result failed), "" where it did not run."""
    seen = {status for name, status in _statuses(output) if name.strip().lower() in EUD_NAMES}
    return next((s for s in ("fail", "warn", "pass", "skip") if s in seen), "")


def level_of(command: Sequence[str]) -> str:
    """What a dcgmi diag command asks to run (`-r`/`--run`): its suite level "1".."4" (names mapped), the test
    names as given (`eud`), or "" where the command does not say (not dcgmi diag, a wrapper script)."""
    for i, part in enumerate(command):
        value = None
        if part in {"-r", "--run"} and i + 1 < len(command):
            value = command[i + 1]
        elif part.startswith("--run="):
            value = part.removeprefix("--run=")
        if value is not None:
            value = value.strip().lower()
            return _LEVEL_NAMES.get(value, value)
    return ""


def shortfall(level: str, eud: str) -> str:
    """Why a passing diagnostic is not NVIDIA's RUN_DCGMEUD (WORKFLOW_XID_13/31), "" when it is: a level 3 or 4
    run, or the eud test by name, in which the eud test passed. A level 1 or 2 pass is an epilogue's check; a
    long run without EUD (its plugin not installed, the test skipped) did not run the test NVIDIA names."""
    reasons = []
    if level not in DEEP_LEVELS and "eud" not in level.split(","):
        reasons.append(f"level {level}, below 3" if level.isdigit() else
                       f"tests {level}" if level else "its level unknown (not a dcgmi diag -r command)")
    if eud != "pass":
        reasons.append(f"eud {eud}" if eud else "no eud test")
    return "; ".join(reasons)


def _statuses(output: str) -> list[tuple[str, str]]:
    return _json_statuses(output) or _table_statuses(output)


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
    engine to ask, e.g. the GPU Operator's) filled in, killed after timeout_seconds (inconclusive then); the
    result carries the level the command asks for and the eud test's status in its output."""
    level = level_of(command)

    def run(uuid: str) -> DiagnosticResult:
        argv = [part.replace("{uuid}", uuid).replace("{hostengine}", hostengine) for part in command]
        try:
            done = subprocess.run(  # noqa: S603 - the operator's configured command
                argv, capture_output=True, text=True, timeout=timeout_seconds, check=False)
        except subprocess.TimeoutExpired:
            return DiagnosticResult(DiagnosticOutcome.INCONCLUSIVE,
                                    f"{argv[0]} did not finish within {timeout_seconds:g}s", level)
        except OSError as exc:
            return DiagnosticResult(DiagnosticOutcome.INCONCLUSIVE, f"{argv[0]}: {exc}", level)
        output = done.stdout + "\n" + done.stderr
        return DiagnosticResult(*parse(done.returncode, output), level, eud_status(output))

    return run


def outcome_of(message: str) -> DiagnosticOutcome:
    """The outcome a RUN_DIAGNOSTIC step's message carries (`pass: ...`, `fail: ...`); inconclusive otherwise."""
    head = message.split(":", 1)[0]
    decided = {DiagnosticOutcome.PASS, DiagnosticOutcome.FAIL}
    return DiagnosticOutcome(head) if head in decided else DiagnosticOutcome.INCONCLUSIVE

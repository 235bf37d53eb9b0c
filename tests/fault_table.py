"""The fleet tier's fault-injection table (issue 38): each case is a test that measures what went wrong and
asserts every figure zero; `pytest --fault-table` (scripts/fleet-fault-table) prints them as one table."""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import pytest

ROWS = pytest.StashKey[list["FaultRow"]]()


@dataclass(frozen=True, slots=True)
class FaultRow:
    """One case's outcome: broken nodes left or put back in service, nodes a standing hold covers that were
    tainted anyway, nodes taken out beyond the brake's bound, FleetCorrelation Events naming a false cause."""

    case: str
    backend: str
    wrongly_untainted: int = 0
    held_tainted: int = 0
    over_brake_bound: int = 0
    wrong_events: int = 0

    @property
    def clean(self) -> bool:
        return not any(astuple(self)[2:])


class RowRecorder:
    """What a test calls with its measured figures: recorded for the table, then asserted zero."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.request = request

    def __call__(self, case: str, **figures: int) -> None:
        spec = getattr(self.request.node, "callspec", None)
        real = "realcluster" in str(self.request.node.path)
        row = FaultRow(case, "real" if real else str(spec.id) if spec is not None else "fake", **figures)
        self.request.config.stash.setdefault(ROWS, []).append(row)
        assert row.clean, f"{case}: {row}"


@pytest.fixture
def fault_row(request: pytest.FixtureRequest) -> RowRecorder:
    return RowRecorder(request)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fault-table", action="store_true", help="print the fleet fault-injection table")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    rows = sorted(config.stash.get(ROWS, []), key=lambda r: (r.case, r.backend))
    if not config.getoption("--fault-table") or not rows:
        return
    names = [f.name for f in fields(FaultRow)]
    width = max(len(r.case) for r in rows)
    terminalreporter.write_line("")
    terminalreporter.write_line(f"{'case':<{width}}  {'backend':<8}  " + "  ".join(n.replace('_', ' ')
                                                                              for n in names[2:]))
    for row in rows:
        values = astuple(row)
        terminalreporter.write_line(f"{row.case:<{width}}  {row.backend:<8}  " + "  ".join(
            f"{v:>{len(n)}}" for v, n in zip(values[2:], names[2:], strict=True)))
    dirty = sum(not r.clean for r in rows)
    terminalreporter.write_line(f"{len(rows)} rows, {dirty} with a figure above zero")

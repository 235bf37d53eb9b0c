"""The journal's defences: the integrity check, a damaged file moved aside whole, acknowledgement order."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

import agent.control.classifier
from agent.journal import _SCHEMA, Journal
from agent.model import Action, Observation, Severity, Signal, Verdict, VerdictKind
from agent.pipeline import Pipeline
from agent.remediation import GuardPolicy
from agent.sources.kmsg import KernelLogCheckpoint
from tests.conftest import gpu, obs
from tests.unit.test_pipeline import NODE, _booted, _kmsg_xid

PAGE = 4096


def _verdict(at: float) -> Verdict:
    return Verdict(VerdictKind.FAULT, "xid-79", gpu(0).key, Severity.FATAL, Action.REBOOT_NODE, "hardware", at,
                   "s" * 200, gpu(0))


def _journal_with_a_damaged_table(path: Path) -> None:
    """A journal whose schema reads but one of its table pages is garbage: it opens, its data does not."""
    journal = Journal(path)
    for n in range(200):
        journal.record_verdict("n1", _verdict(float(n)))
    journal.close()  # the last connection checkpoints the WAL into the file
    pages = path.stat().st_size // PAGE
    assert pages > 6
    with path.open("r+b") as f:
        f.seek((pages - 2) * PAGE)
        f.write(b"\x0d" + b"\xff" * 64)  # a leaf page whose header points past its end


def test_a_journal_that_fails_its_integrity_check_is_moved_aside_and_recreated(tmp_path: Path):
    """A file SQLite opens but whose pages are damaged is caught by the check at open, not by a later read."""
    path = tmp_path / "j.db"
    _journal_with_a_damaged_table(path)
    copy = tmp_path / "copy.db"
    shutil.copyfile(path, copy)
    sqlite3.connect(copy).executescript(_SCHEMA)  # the damage does not stop SQLite opening it and its schema
    journal = Journal(path)
    assert journal.recreated
    assert journal.history() == []
    assert list(tmp_path.glob("j.db.damaged-*"))


def test_a_damaged_journal_takes_its_wal_and_shm_files_with_it(tmp_path: Path):
    """The damaged file's -wal (as it was) and -shm go aside with it: neither is left next to the new journal."""
    path = tmp_path / "j.db"
    path.write_bytes(b"garbage" * 100)
    Path(f"{path}-wal").write_bytes(b"old wal" * 50)
    Path(f"{path}-shm").write_bytes(b"old shm" * 50)
    journal = Journal(path)
    assert journal.recreated
    (moved,) = [p for p in tmp_path.glob("j.db.damaged-*") if not p.name.endswith(("-wal", "-shm"))]
    assert Path(f"{moved}-wal").read_bytes() == b"old wal" * 50
    assert Path(f"{moved}-shm").exists()  # SQLite rebuilds the index on open: its bytes are not the old ones
    for suffix in ("-wal", "-shm"):
        beside = Path(f"{path}{suffix}")
        assert not beside.exists() or b"old" not in beside.read_bytes()


class _Killed(BaseException):
    """The agent dies here (nothing in it catches a BaseException, as nothing survives SIGKILL)."""


def test_a_kernel_log_record_is_not_acknowledged_before_it_is_classified(shipped_rules, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    """Killed while classifying a record, the agent leaves the kernel-log cursor before it: it is read again."""
    journal = Journal(tmp_path / "j.db")
    first = _booted(shipped_rules, journal)
    first.handle(_kmsg_xid(31, 1, 1.0), 1.0)
    assert journal.cursor("kmsg") == "boot-a:1"

    def killed(*args: object, **kwargs: object) -> list[Verdict]:
        raise _Killed

    monkeypatch.setattr(agent.control.classifier, "evaluate", killed)
    with pytest.raises(_Killed):
        first.handle(_kmsg_xid(48, 2, 2.0), 2.0)
    assert journal.cursor("kmsg") == "boot-a:1"


def _failing_when(path: Path, table: str, condition: str) -> None:
    """A second connection adds a trigger that fails a write to `table` (as a full disk or an I/O error
    would fail it) once `condition` holds for the new row."""
    other = sqlite3.connect(path)
    other.execute(f"CREATE TRIGGER fail BEFORE INSERT ON {table} WHEN {condition} "
                  "BEGIN SELECT RAISE(ABORT, 'disk I/O error'); END")
    other.commit()
    other.close()


def test_a_failing_journal_write_leaves_neither_the_record_nor_the_cursor_half_written(shipped_rules,
                                                                                       tmp_path: Path):
    """The record is written first and the kernel-log cursor second, in one transaction: the cursor's write
    fails, and the record's stays unwritten too."""
    path = tmp_path / "j.db"
    journal = Journal(path)
    first = _booted(shipped_rules, journal)
    first.handle(_kmsg_xid(31, 1, 1.0), 1.0)
    before = journal.record("node-1")
    _failing_when(path, "cursors", "NEW.name = 'kmsg'")
    assert first.handle(_kmsg_xid(48, 2, 2.0), 2.0).verdicts  # a new fault: the record and the cursor change
    reopened = Journal(path)
    assert reopened.record("node-1") == before
    assert reopened.cursor("kmsg") == "boot-a:1"


def test_a_verdict_whose_active_fault_cannot_be_written_leaves_no_history_row(tmp_path: Path):
    """record_verdict's two inserts are one transaction: the second fails, the first is not kept."""
    path = tmp_path / "j.db"
    journal = Journal(path)
    _failing_when(path, "active_faults", "1")
    with pytest.raises(sqlite3.DatabaseError):
        journal.record_verdict("n1", _verdict(1.0))
    assert journal.history() == [] and journal.active_faults("n1") == []
    journal.set_cursor("x", "1")
    assert Journal(path).cursor("x") == "1"


class _PollCheckpoint:
    """A second source's checkpoint, opaque to the pipeline: the poll number its observations carry."""

    name = "probe"

    def position(self, observation: Observation, boot_id: str) -> str | None:
        number = observation.attrs.get("poll")
        return f"poll-{number}" if observation.source == "probe" and isinstance(number, int) else None

    def newer(self, value: str, than: str | None) -> bool:
        return than is None or int(value.removeprefix("poll-")) > int(than.removeprefix("poll-"))


def test_any_sources_checkpoint_is_committed_with_the_record_it_changed(shipped_rules, tmp_path: Path):
    """A source hands the pipeline an opaque checkpoint: it is stored with the record of the fault its
    observation raised, and an older one never moves it back."""
    journal = Journal(tmp_path / "j.db")
    p = Pipeline(rules=shipped_rules, inventory=NODE, policy=GuardPolicy(), journal=journal, clock=lambda: 1.0,
                 checkpoints=[KernelLogCheckpoint(), _PollCheckpoint()])
    assert p.handle(obs(Signal.XID, 79, 1.0, source="probe", poll=7), 1.0).verdicts
    assert journal.cursor("probe") == "poll-7"
    assert journal.record("node-1")["cursors"]["probe"] == "poll-7"
    p.handle(obs(Signal.TEMPERATURE, 40, 2.0, source="probe", poll=3), 2.0)
    assert journal.cursor("probe") == "poll-7"


def test_the_record_is_committed_with_synchronous_full_and_history_rows_are_not(tmp_path: Path):
    """The record (saved before and after each disruptive step) commits under synchronous=FULL, set back to
    NORMAL after; a verdict row commits under NORMAL."""
    journal = Journal(tmp_path / "j.db")
    statements: list[str] = []
    journal._db.set_trace_callback(statements.append)
    journal.save_record("n1", {"generation": 1})
    assert statements[0] == "PRAGMA synchronous=FULL"
    assert statements.index("COMMIT") < statements.index("PRAGMA synchronous=NORMAL")
    statements.clear()
    journal.record_verdict("n1", _verdict(1.0))
    assert not any(s.startswith("PRAGMA synchronous") for s in statements)
    assert journal._db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL

from pathlib import Path

from agent.journal import Journal
from agent.model import Action, ActionRecord, Severity, Step, StepKind, StepResult, Verdict, VerdictKind
from tests.conftest import gpu


def verdict(kind=VerdictKind.FAULT, rule="xid-79", at=1.0):
    return Verdict(kind, rule, gpu(0).key, Severity.FATAL, Action.REBOOT_NODE, "hardware", at, "s", gpu(0))


def test_verdicts_and_actions_survive_a_restart(tmp_path: Path):
    path = tmp_path / "j.db"
    journal = Journal(path)
    journal.record_verdict("n1", verdict())
    journal.record_action("n1", ActionRecord(Step(StepKind.TAINT, "n1", "why"), StepResult.APPLIED, 2.0))
    journal.close()
    reopened = Journal(path)
    entries = reopened.history()
    assert [(e["type"], e.get("rule_id")) for e in entries] == [("verdict", "xid-79"), ("action", "")]
    assert reopened.active_faults("n1")[0].gpu == gpu(0)


def test_a_cleared_fault_is_no_longer_active(tmp_path: Path):
    journal = Journal(tmp_path / "j.db")
    journal.record_verdict("n1", verdict())
    journal.record_verdict("n1", verdict(VerdictKind.CLEARED, at=5.0))
    assert journal.active_faults("n1") == []


def test_the_journal_uses_wal(tmp_path: Path):
    journal = Journal(tmp_path / "j.db")
    assert journal._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_cursors_persist(tmp_path: Path):
    journal = Journal(tmp_path / "j.db")
    journal.set_cursor("kmsg", "boot-1:42")
    journal.close()
    assert Journal(tmp_path / "j.db").cursor("kmsg") == "boot-1:42"


def test_pruning_keeps_the_newest_rows(tmp_path: Path):
    journal = Journal(tmp_path / "j.db", keep_rows=3)
    for n in range(10):
        journal.record_verdict("n1", verdict(at=float(n)))
    journal.prune()
    assert [e["at"] for e in journal.history()] == [7.0, 8.0, 9.0]

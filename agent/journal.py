"""The local journal: the node's durable record, input checkpoints, and every verdict and action (SQLite, WAL).

Every write is one explicit transaction (BEGIN IMMEDIATE ... COMMIT, rolled back on any failure): what a
write changes is all there or none of it. A journal that cannot be opened or fails its integrity check is
moved aside and recreated (`recreated` says why), so a damaged file never stops the agent; the record is
then rebuilt from the Node.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agent.model import ActionRecord, Verdict, VerdictKind
from agent.model_json import action_to_dict, verdict_from_dict, verdict_to_dict

_SCHEMA = """
CREATE TABLE IF NOT EXISTS verdicts (
    id INTEGER PRIMARY KEY, at REAL NOT NULL, node TEXT NOT NULL, gpu TEXT NOT NULL, rule_id TEXT NOT NULL,
    kind TEXT NOT NULL, severity TEXT NOT NULL, action TEXT NOT NULL, summary TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS actions (
    id INTEGER PRIMARY KEY, at REAL NOT NULL, node TEXT NOT NULL, gpu TEXT NOT NULL, rule_id TEXT NOT NULL,
    kind TEXT NOT NULL, target TEXT NOT NULL, result TEXT NOT NULL, message TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS active_faults (
    node TEXT NOT NULL, gpu TEXT NOT NULL, rule_id TEXT NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (node, gpu, rule_id));
CREATE TABLE IF NOT EXISTS cursors (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS verdicts_at ON verdicts(at);
CREATE INDEX IF NOT EXISTS actions_at ON actions(at);
"""


class _Damaged(Exception):
    """A journal that failed to open or its check, with the connection SQLite opened on it."""

    def __init__(self, db: sqlite3.Connection, error: sqlite3.DatabaseError) -> None:
        super().__init__(str(error))
        self.db = db
        self.error = error


class Journal:
    """A durable, thread-safe record of verdicts and actions, with the active faults kept apart."""

    def __init__(self, path: str | Path, *, keep_rows: int = 100_000, recover: bool = True) -> None:
        """recover=False (a command reading a file it was given) raises on damage and leaves the file as it is."""
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._keep_rows = keep_rows
        #: Why the journal was recreated at start ("" when it opened cleanly).
        self.recreated = ""
        try:
            self._db = self._open()
        except _Damaged as damaged:
            if not recover:
                damaged.db.close()
                raise damaged.error from None
            moved = self._move_aside(damaged.db)
            self.recreated = f"journal {self.path} was damaged ({damaged.error}); moved to {moved} and recreated"
            self._db = self._open_or_raise()

    def _open_or_raise(self) -> sqlite3.Connection:
        try:
            return self._open()
        except _Damaged as damaged:
            damaged.db.close()
            raise damaged.error from None

    def _open(self) -> sqlite3.Connection:
        """A checked connection; on damage, _Damaged with the connection still open (see _move_aside)."""
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            verdict = db.execute("PRAGMA quick_check").fetchone()
            if verdict is None or verdict[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check: {verdict[0] if verdict else 'no answer'}")
        except sqlite3.DatabaseError as exc:
            raise _Damaged(db, exc) from exc
        return db

    def _move_aside(self, failed: sqlite3.Connection) -> str:
        """The damaged file and its -wal and -shm, as they were, to `<path>.damaged-<time>`: copied while the
        failed connection is still open, since closing it checkpoints the WAL into the file and deletes the
        -wal and -shm; then whatever is left of them goes, so none is next to the new journal."""
        target = f"{self.path}.damaged-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
        kept = []
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                try:
                    shutil.copyfile(self.path + suffix, target + suffix)
                    kept.append(suffix)
                except OSError:
                    pass  # no room for a copy: the file itself is moved below
        failed.close()
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                if suffix in kept:
                    os.remove(self.path + suffix)
                else:
                    os.replace(self.path + suffix, target + suffix)
        return target

    def record(self, node: str) -> dict[str, Any] | None:
        """The node's durable record as last saved (None when there is none, or it is unreadable)."""
        saved = self.cursor(f"record:{node}")
        try:
            document = json.loads(saved) if saved else None
        except ValueError:
            return None
        return document if isinstance(document, dict) else None

    @contextmanager
    def _transaction(self, *, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """One write transaction: BEGIN IMMEDIATE (the write lock taken at once), COMMIT when the block ends,
        ROLLBACK when anything in it (or the COMMIT itself) fails, a kill included. `durable`: synchronous=FULL
        for this one, so the WAL is on disk when COMMIT returns (NORMAL may lose the last commits to a power
        cut, never to a crash)."""
        with self._lock:
            if durable:
                self._db.execute("PRAGMA synchronous=FULL")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
            finally:
                if durable:
                    self._db.execute("PRAGMA synchronous=NORMAL")

    def save_record(self, node: str, document: Mapping[str, Any], *, cursors: Mapping[str, str] = {}) -> None:
        """The record and the input checkpoints it covers, in one transaction: an input is acknowledged only
        together with what it changed. Durable (synchronous=FULL): the record is saved before every
        disruptive step and right after it, and a power cut must not take back a step the node then takes (a
        reboot request) or let a restarted agent repeat one; history rows and checkpoints alone stay NORMAL."""
        body = json.dumps(document, sort_keys=True, separators=(",", ":"))
        with self._transaction(durable=True) as db:
            db.execute("INSERT OR REPLACE INTO cursors (name, value) VALUES (?, ?)", (f"record:{node}", body))
            for name, value in cursors.items():
                db.execute("INSERT OR REPLACE INTO cursors (name, value) VALUES (?, ?)", (name, value))

    def record_verdict(self, node: str, verdict: Verdict) -> None:
        """The verdict in the history and the active faults it changes, in one transaction."""
        body = json.dumps(verdict_to_dict(verdict), sort_keys=True, default=str)
        with self._transaction() as db:
            db.execute(
                "INSERT INTO verdicts (at, node, gpu, rule_id, kind, severity, action, summary, body)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (verdict.at, node, verdict.gpu_key, verdict.rule_id, str(verdict.kind), str(verdict.severity),
                 str(verdict.action), verdict.summary, body),
            )
            if verdict.kind is VerdictKind.FAULT:
                db.execute(
                    "INSERT OR REPLACE INTO active_faults (node, gpu, rule_id, body) VALUES (?, ?, ?, ?)",
                    (node, verdict.gpu_key, verdict.rule_id, body),
                )
            else:
                db.execute(
                    "DELETE FROM active_faults WHERE node = ? AND gpu = ? AND rule_id = ?",
                    (node, verdict.gpu_key, verdict.rule_id),
                )

    def record_action(self, node: str, record: ActionRecord) -> None:
        body = json.dumps(action_to_dict(record), sort_keys=True, default=str)
        step = record.step
        with self._transaction() as db:
            db.execute(
                "INSERT INTO actions (at, node, gpu, rule_id, kind, target, result, message, body)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (record.at, node, step.gpu_key, step.rule_id, str(step.kind), step.target, str(record.result),
                 record.message or step.reason, body),
            )

    def active_faults(self, node: str) -> list[Verdict]:
        with self._lock:
            rows = self._db.execute(
                "SELECT body FROM active_faults WHERE node = ? ORDER BY gpu, rule_id", (node,)
            ).fetchall()
        return [verdict_from_dict(json.loads(row[0])) for row in rows]

    def history(self, *, limit: int = 100) -> list[dict[str, Any]]:
        """The newest entries (verdicts and actions together), oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT at, 'verdict', body FROM verdicts UNION ALL SELECT at, 'action', body FROM actions"
                " ORDER BY 1 DESC LIMIT ?",
                (limit,),
            ).fetchall()
        entries = []
        for at, kind, body in reversed(rows):
            entry: dict[str, Any] = {"type": kind, "at": at}
            entry.update(json.loads(body))
            entries.append(entry)
        return entries

    def cursor(self, name: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM cursors WHERE name = ?", (name,)).fetchone()
        return str(row[0]) if row else None

    def set_cursor(self, name: str, value: str) -> None:
        self.set_cursors({name: value})

    def set_cursors(self, cursors: Mapping[str, str]) -> None:
        """Input checkpoints acknowledged alone (their input changed nothing else), in one transaction."""
        with self._transaction() as db:
            for name, value in cursors.items():
                db.execute("INSERT OR REPLACE INTO cursors (name, value) VALUES (?, ?)", (name, value))

    def prune(self) -> None:
        """Keep the newest `keep_rows` rows of each history table; active faults are never pruned."""
        with self._transaction() as db:
            for table in ("verdicts", "actions"):
                db.execute(
                    f"DELETE FROM {table} WHERE id <= (SELECT MAX(id) FROM {table}) - ?",  # noqa: S608 - the table name is one of two constants
                    (self._keep_rows,),
                )

    def close(self) -> None:
        with self._lock:
            self._db.close()

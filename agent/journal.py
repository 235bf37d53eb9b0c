"""The local journal: every verdict and action in SQLite (WAL), read back after a restart."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

from agent.model import ActionRecord, Verdict, VerdictKind, action_to_dict, verdict_from_dict, verdict_to_dict

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


class Journal:
    """A durable, thread-safe record of verdicts and actions, with the active faults kept apart."""

    def __init__(self, path: str | Path, *, keep_rows: int = 100_000) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._keep_rows = keep_rows
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def record_verdict(self, node: str, verdict: Verdict) -> None:
        body = json.dumps(verdict_to_dict(verdict), sort_keys=True, default=str)
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO verdicts (at, node, gpu, rule_id, kind, severity, action, summary, body)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (verdict.at, node, verdict.gpu_key, verdict.rule_id, str(verdict.kind), str(verdict.severity),
                 str(verdict.action), verdict.summary, body),
            )
            if verdict.kind is VerdictKind.FAULT:
                self._db.execute(
                    "INSERT OR REPLACE INTO active_faults (node, gpu, rule_id, body) VALUES (?, ?, ?, ?)",
                    (node, verdict.gpu_key, verdict.rule_id, body),
                )
            else:
                self._db.execute(
                    "DELETE FROM active_faults WHERE node = ? AND gpu = ? AND rule_id = ?",
                    (node, verdict.gpu_key, verdict.rule_id),
                )

    def record_action(self, node: str, record: ActionRecord) -> None:
        body = json.dumps(action_to_dict(record), sort_keys=True, default=str)
        step = record.step
        with self._lock, self._db:
            self._db.execute(
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
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO cursors (name, value) VALUES (?, ?)", (name, value))

    def prune(self) -> None:
        """Keep the newest `keep_rows` rows of each history table; active faults are never pruned."""
        with self._lock, self._db:
            for table in ("verdicts", "actions"):
                self._db.execute(
                    f"DELETE FROM {table} WHERE id <= (SELECT MAX(id) FROM {table}) - ?",  # noqa: S608 - the table name is one of two constants
                    (self._keep_rows,),
                )

    def close(self) -> None:
        with self._lock:
            self._db.close()

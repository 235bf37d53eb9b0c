"""The record's store: load it from the journal, adopt the Node's newer copy, save it with the input checkpoints."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.journal import Journal
from agent.logs import BoundLogger
from agent.metrics import Metrics
from agent.model import GpuRef, Verdict
from agent.remediation import ActiveFault, NodeState
from agent.remediation.record import NodeRecord, is_truncated
from agent.sources.checkpoint import InputCheckpoint

BOOT_CURSOR = "boot_id"
NODE_STATE_CURSOR = "node_state"


@dataclass(frozen=True, slots=True)
class Adopted:
    """What adopting the Node's copy changed: the faults it brought and the ones it ended."""

    brought: list[ActiveFault]
    ended: set[tuple[str, str]]
    generation: int


class RecordStore:
    """The durable record of one node and the journal that keeps it; every journal write goes through here."""

    def __init__(self, *, journal: Journal | None, node_name: str, checkpoints: Sequence[InputCheckpoint],
                 metrics: Metrics | None, log: BoundLogger) -> None:
        self.journal = journal
        self.node_name = node_name
        self.checkpoints = tuple(checkpoints)
        self.metrics = metrics
        self._log = log
        #: Journal writes failing now, by kind, with the last error (empty when every kind's last write worked).
        self.journal_failing: Mapping[str, str] = {}
        self._journal_state = threading.Lock()
        self.record = NodeRecord()
        self.fresh = True

    def load(self, fault_of: Callable[[Verdict], ActiveFault]) -> None:
        """The journal's record; an older journal's active faults and node state; else a fresh record."""
        self.record, self.fresh = self._load(fault_of)

    def _load(self, fault_of: Callable[[Verdict], ActiveFault]) -> tuple[NodeRecord, bool]:
        journal = self.journal
        if journal is None:
            return NodeRecord(), True
        document = self.safely("journal_read_failed", journal.record, self.node_name)
        if isinstance(document, dict):
            record = NodeRecord.from_json(document)
            for checkpoint in self.checkpoints:
                written = self.safely("journal_read_failed", journal.cursor, checkpoint.name)
                if isinstance(written, str) and checkpoint.newer(written, record.cursors.get(checkpoint.name)):
                    record.cursors[checkpoint.name] = written  # acknowledged alone, after the record's last write
            return record, False
        record = NodeRecord()
        legacy = self.safely("journal_read_failed", journal.active_faults, self.node_name) or []
        for verdict in legacy:
            record.faults[(verdict.gpu_key, verdict.rule_id)] = fault_of(verdict)
        saved = self.safely("journal_read_failed", journal.cursor, NODE_STATE_CURSOR)
        try:
            state = json.loads(saved) if saved else {}
        except ValueError:
            state = {}
        record.node = NodeState.from_json(state if isinstance(state, dict) else {})
        for name in (BOOT_CURSOR, *(checkpoint.name for checkpoint in self.checkpoints)):
            value = self.safely("journal_read_failed", journal.cursor, name)
            if value:
                record.cursors[name] = str(value)
        return record, not (legacy or saved)

    def adopt(self, document: Mapping[str, object] | None) -> Adopted | None:
        """The Node's copy of the record wins when it is newer, or when this process started without one."""
        if document is None:
            self.fresh = False
            return None
        theirs = NodeRecord.from_json(document)
        if not (theirs.generation > self.record.generation or (self.fresh and (theirs.faults or theirs.generation))):
            self.fresh = False
            return None
        mine = self.record
        truncated = is_truncated(document)  # the Node kept only part: what this process holds stays
        merged = NodeRecord(generation=max(theirs.generation, mine.generation), faults=dict(theirs.faults),
                            node=theirs.node, owed=list(theirs.owed), gpus=theirs.gpus,
                            cursors={**mine.cursors, **theirs.cursors} if truncated else dict(theirs.cursors))
        if self.fresh or truncated:
            for key, fault in mine.faults.items():
                merged.faults.setdefault(key, fault)
            for event in mine.owed:
                merged.owe(event)
        self.record = merged
        self.fresh = False
        return Adopted([f for k, f in merged.faults.items() if k not in mine.faults],
                       set(mine.faults) - set(merged.faults), theirs.generation)

    def save(self, gpus: tuple[GpuRef, ...]) -> None:
        """The record (and with it the input cursors) to the journal: before acknowledging, before acting."""
        self.record.generation += 1
        self.record.gpus = gpus
        if self.journal is not None:
            self.journaled("record", "journal_record_failed", self.journal.save_record, self.node_name,
                           self.record.to_json(), cursors=self.record.cursors)

    def save_checkpoints(self, names: list[str]) -> None:
        """An input that changed nothing else is acknowledged by writing its checkpoint alone: one small
        transaction, not the whole record (a storm of distinct kernel-log lines wrote the whole record once a
        line)."""
        if self.journal is not None:
            self.journaled("record", "journal_record_failed", self.journal.set_cursors,
                           {name: self.record.cursors[name] for name in names})

    def journaled(self, kind: str, event: str, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """One journal write; what failed is kept by kind (record, verdict, action) until that kind is written
        again: /readyz fails meanwhile (a full disk must not read ready; liveness stays up)."""
        try:
            func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - isolation: a failed write is reported, detection goes on
            error = f"{type(exc).__name__}: {exc}"
            self._log.error(event, error=error)
            with self._journal_state:  # replaced whole, never changed in place: /readyz reads it unlocked
                self.journal_failing = {**self.journal_failing, kind: error}
            if self.metrics:
                self.metrics.journal_write_failures.labels(kind).inc()
            return
        if kind in self.journal_failing:
            with self._journal_state:
                self.journal_failing = {k: v for k, v in self.journal_failing.items() if k != kind}
            self._log.info("journal_writes_recovered", kind=kind)

    def safely(self, event: str, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """func(...), or False (logged) when it raised."""
        try:
            return func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
            self._log.error(event, error=f"{type(exc).__name__}: {exc}")
            return False

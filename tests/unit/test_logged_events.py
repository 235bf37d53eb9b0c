"""The events an operator greps the agent's log for, captured with agent.logs.capture_logs()."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent import logs
from agent.journal import Journal
from agent.logs import capture_logs, get_logger
from agent.model import Signal, StepKind
from agent.pipeline import LocalActuator
from agent.remediation.record import NodeObservation
from tests.conftest import gpu, obs
from tests.unit.test_journal_durability import _booted, _failing_when, _kmsg_xid
from tests.unit.test_pipeline import pipeline


def _named(captured: list[dict[str, object]], event: str) -> list[dict[str, object]]:
    return [entry for entry in captured if entry["event"] == event]


def test_capture_logs_takes_every_event_with_its_level_and_fields_and_writes_no_line(
        capsys: pytest.CaptureFixture[str]):
    """Inside the block events are dicts (bound context included, debug too) and stderr stays empty."""
    saved = logs._settings.threshold
    logs.configure_logging("info", "json")
    try:
        with capture_logs() as captured:
            log = get_logger("agent.test").bind(node="n1")
            log.debug("probe_sent", attempt=2)
            log.info("probe_answered", attempt=2)
    finally:
        logs._settings.threshold = saved
    assert captured == [{"event": "probe_sent", "log_level": "debug", "node": "n1", "attempt": 2},
                        {"event": "probe_answered", "log_level": "info", "node": "n1", "attempt": 2}]
    assert capsys.readouterr().err == ""


def test_a_fault_is_logged_as_a_verdict_naming_the_gpu_and_the_rule(shipped_rules):
    """`verdict` at warning, with the GPU, the rule, the severity and the action."""
    with capture_logs() as captured:
        pipeline(shipped_rules).handle(obs(Signal.XID, 79, 1.0), 1.0)
    [verdict] = _named(captured, "verdict")
    assert verdict["log_level"] == "warning"
    assert (verdict["gpu"], verdict["rule_id"], verdict["severity"], verdict["kind"]) == \
        (gpu(0).key, "xid-79", "fatal", "fault")


def test_every_step_is_logged_with_its_kind_target_and_result(shipped_rules):
    """`step` for each step taken: the taint of a fatal fault is there with its result (local mode plans)."""
    with capture_logs() as captured:
        pipeline(shipped_rules).handle(obs(Signal.XID, 79, 1.0), 1.0)
    steps = {(e["kind"], e["target"]): e["result"] for e in _named(captured, "step")}
    assert steps[(str(StepKind.TAINT), "node-1")] == "planned"


def test_a_failing_journal_write_is_logged_as_journal_record_failed(shipped_rules, tmp_path: Path):
    """A write the journal refuses is an error line naming the error (one per write), and the agent goes on."""
    journal = Journal(tmp_path / "j.db")
    first = _booted(shipped_rules, journal)
    _failing_when(tmp_path / "j.db", "cursors", "NEW.name = 'kmsg'")
    with capture_logs() as captured:
        assert first.handle(_kmsg_xid(48, 2, 2.0), 2.0).verdicts
    failed = _named(captured, "journal_record_failed")
    assert failed and all(e["log_level"] == "error" and "disk I/O error" in str(e["error"]) for e in failed)


def test_a_restart_with_known_faults_logs_faults_restored(shipped_rules, tmp_path: Path):
    """The new process says how many faults it took back from the journal."""
    pipeline(shipped_rules, Journal(tmp_path / "j.db")).handle(obs(Signal.XID, 79, 1.0), 1.0)
    with capture_logs() as captured:
        pipeline(shipped_rules, Journal(tmp_path / "j.db"))
    assert [e["count"] for e in _named(captured, "faults_restored")] == [1]


class _NodeUnreadable(LocalActuator):
    def observe(self, devices: bool = True) -> NodeObservation | None:
        raise ConnectionError("api server unreachable")


def test_a_node_the_pass_cannot_read_is_logged_as_node_unreadable(shipped_rules):
    """The reconcile pass goes on without the Node and says why, once a pass."""
    p = pipeline(shipped_rules)
    p.actuator = _NodeUnreadable()
    with capture_logs() as captured:
        p.reconcile(1.0)
    [unreadable] = _named(captured, "node_unreadable")
    assert "ConnectionError: api server unreachable" in str(unreadable["error"])

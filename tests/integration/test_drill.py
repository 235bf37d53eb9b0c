"""Fire drills: a drill record is admitted once, only with its root-only request; forged records stay ignored."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from agent.cli import main
from agent.drill import DrillBox, drill_id_of, new_request, write_kmsg
from agent.model import Action, Severity, Signal
from agent.sources.kernel_log import KERNEL_FACILITY, KernelLogParser
from agent.sources.kmsg_records import RecordReader
from tests.conftest import wait_for
from tests.integration.test_kmsg_source import needs_root_kmsg

NODE = "gpu-node-1"


def request(box: DrillBox, *, node: str = NODE, now: float = 1000.0, full: bool = False):
    return box.file(new_request(node=node, pci="0000:3b:00", xid=79, full=full, requested_by="oncall", now=now))


def message_of(line: str) -> str:
    record = KernelLogParser().feed(line)
    assert record is not None
    return record.message


def test_a_drill_record_with_its_request_is_admitted_once_and_marked(tmp_path: Path):
    """The request is consumed: the same record again is forged."""
    box = DrillBox(tmp_path / "drills")
    filed = request(box)
    message = message_of(filed.kmsg_line(pid=7))
    admitted = box.admit(message, node=NODE, now=1001.0)
    assert admitted == filed
    assert admitted.attrs() == {"drill": filed.drill_id, "drill_full": False}
    assert box.admit(message, node=NODE, now=1002.0) is None


def test_a_drill_record_without_a_request_stays_forged(tmp_path: Path):
    """Anyone can write a line with a made-up id to /dev/kmsg: without the root-only file it counts for nothing."""
    box = DrillBox(tmp_path / "drills")
    request(box)
    forged = message_of(new_request(node=NODE, pci="0000:3b:00", xid=79, full=True, requested_by="x",
                                    now=1000.0).kmsg_line(pid=1))
    assert box.admit(forged, node=NODE, now=1001.0) is None


def test_an_expired_or_foreign_request_is_not_admitted(tmp_path: Path):
    """A request past its time, or for another node, is consumed and refused."""
    box = DrillBox(tmp_path / "drills")
    late = request(box, now=0.0)
    assert box.admit(message_of(late.kmsg_line(pid=1)), node=NODE, now=10_000.0) is None
    elsewhere = request(box, node="other-node")
    assert box.admit(message_of(elsewhere.kmsg_line(pid=1)), node=NODE, now=1001.0) is None
    assert not box.pending(elsewhere.drill_id)


def test_a_request_file_others_could_write_is_not_trusted(tmp_path: Path):
    """A request that is group- or world-writable may not be the operator's: refused."""
    box = DrillBox(tmp_path / "drills")
    filed = request(box)
    (tmp_path / "drills" / f"{filed.drill_id}.json").chmod(0o666)
    assert box.admit(message_of(filed.kmsg_line(pid=1)), node=NODE, now=1001.0) is None


def test_the_drill_directory_must_be_private(tmp_path: Path):
    """Filing refuses a directory others can write: they could plant requests."""
    from agent.drill import DrillError

    shared = tmp_path / "drills"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(DrillError, match="mode 0700"):
        request(DrillBox(shared))


def test_the_drill_command_reports_each_stage_and_what_to_expect(tmp_path: Path):
    """drill files the request, writes the record, waits for the agent to admit it, then names alert and runbook."""
    kmsg, journal = tmp_path / "kmsg", tmp_path / "state" / "journal.db"
    kmsg.write_text("")
    box = DrillBox(journal.parent / "drills")
    agent_saw: list[str] = []
    stop = threading.Event()

    def agent() -> None:  # stands in for the agent's kmsg hook: reads what was written, admits it
        while not stop.is_set():
            for line in kmsg.read_text().splitlines():
                if drill_id_of(line) and line not in agent_saw and box.admit(line, node=NODE, now=time.time()):
                    agent_saw.append(line)
            time.sleep(0.01)

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    try:
        result = CliRunner().invoke(main, ["drill", "--pci", "0000:3b:00", "--wait", "10"],
                                    env={"NODE_NAME": NODE, "GPU_HEALTH_SOURCES__KMSG__PATH": str(kmsg),
                                         "GPU_HEALTH_JOURNAL_PATH": str(journal)})
    finally:
        stop.set()
        thread.join(5)
    assert result.exit_code == 0, result.output
    assert [line.split(":")[0] for line in result.stderr.splitlines()] == ["drill 1/3", "drill 2/3", "drill 3/3"]
    assert "fire drill by" in agent_saw[0]
    assert "then:     alert GpuHealthFatalFault (runbook docs/runbooks/GpuHealthFatalFault.md)" in result.stdout


def test_a_drill_nobody_admits_is_withdrawn_and_fails(tmp_path: Path):
    """No agent on the node: exit 1 after the wait, and the request does not linger for a later forger."""
    kmsg, journal = tmp_path / "kmsg", tmp_path / "state" / "journal.db"
    kmsg.write_text("")
    result = CliRunner().invoke(main, ["drill", "--pci", "0000:3b:00", "--wait", "0.2"],
                                env={"NODE_NAME": NODE, "GPU_HEALTH_SOURCES__KMSG__PATH": str(kmsg),
                                     "GPU_HEALTH_JOURNAL_PATH": str(journal)})
    assert result.exit_code == 1
    assert "did not admit drill" in result.stderr
    assert list((journal.parent / "drills").iterdir()) == []


def test_a_full_drill_must_name_the_node():
    """Acting for real needs the operator to name the node they mean."""
    result = CliRunner().invoke(main, ["drill", "--full", "--pci", "0000:3b:00"], env={"NODE_NAME": NODE})
    assert result.exit_code == 2
    assert "name this node with --node" in result.stderr


@pytest.mark.root
@needs_root_kmsg
def test_a_drill_through_the_real_dev_kmsg_comes_back_forged_and_is_admitted_by_its_request(tmp_path: Path):
    """The real kernel log stamps the record user-facility (the agent's forgery check sees it), and its drill
    id with the root-only request is what admits it."""
    box = DrillBox(tmp_path / "drills")
    filed = request(box, now=time.time())
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.lseek(fd, 0, os.SEEK_END)
        write_kmsg(filed.kmsg_line(pid=os.getpid()))
        reader, found = RecordReader(fd, lambda: None), []

        def read() -> bool:
            found.extend(line for line in reader.available() if filed.drill_id in line)
            return bool(found)

        assert wait_for(read)
    finally:
        os.close(fd)
    record = KernelLogParser().feed(found[0])
    assert record is not None and (record.kind, record.code, record.pci) == ("xid", 79, "0000:3b:00")
    assert record.prefix.facility != KERNEL_FACILITY
    assert box.admit(record.message, node=NODE, now=time.time()) == filed


def test_a_drill_verdict_is_held_at_notify_and_says_drill(tmp_path: Path, shipped_rules):
    """Xid 79 from a drill record: still fatal (the alert fires), but only notify, and marked DRILL."""
    from agent.drill import contain, marked
    from agent.engine import EngineState, evaluate
    from tests.conftest import obs

    filed = request(DrillBox(tmp_path / "drills"))
    [verdict] = evaluate(marked(obs(Signal.XID, 79), filed), EngineState(), 0.0, rules=shipped_rules)
    held = contain(verdict)
    assert (held.severity, held.action) == (Severity.FATAL, Action.NOTIFY)
    assert held.summary.startswith(f"DRILL {filed.drill_id} (not a fault): ")
    assert held.evidence["drill"] == filed.drill_id


def test_a_full_drill_keeps_the_rules_action(tmp_path: Path, shipped_rules):
    """--full: the rule's own action stands (the guard's budget, pause and opt-out still apply)."""
    from agent.drill import contain, marked
    from agent.engine import EngineState, evaluate
    from tests.conftest import obs

    filed = request(DrillBox(tmp_path / "drills"), full=True)
    [verdict] = evaluate(marked(obs(Signal.XID, 79), filed), EngineState(), 0.0, rules=shipped_rules)
    assert contain(verdict).action is Action.REBOOT_NODE


def test_a_verdict_without_drill_marks_passes_unchanged(shipped_rules):
    """Real faults are never touched by the drill containment."""
    from agent.drill import contain
    from agent.engine import EngineState, evaluate
    from tests.conftest import obs

    [verdict] = evaluate(obs(Signal.XID, 79), EngineState(), 0.0, rules=shipped_rules)
    assert contain(verdict) is verdict


@pytest.mark.root
@needs_root_kmsg
def test_kmsg_parse_of_dev_kmsg_reads_the_buffer_and_stops():
    """On the live device, kmsg parse dumps what the ring buffer holds now and exits: it never follows."""
    import uuid

    from agent.drill import mark_test_record

    nonce = uuid.uuid4().hex
    write_kmsg(f"NVRM: Xid (PCI:0000:ee:00): 31, pid=1, name=gha-test, {mark_test_record(nonce)}")
    result = CliRunner().invoke(main, ["kmsg", "parse", "/dev/kmsg", "--json"])
    assert result.exit_code == 0
    assert nonce in result.stdout
    assert "stopped at the end of the buffer (not following)" in result.stderr


@pytest.mark.root
@needs_root_kmsg
def test_a_drill_goes_end_to_end_through_the_real_kernel_log_and_ends_by_itself(tmp_path: Path):
    """`gpu-health-agent drill` against a running agent on the real /dev/kmsg: the agent admits it, the
    verdict is fatal but held at notify and says DRILL, nothing is tainted, and the fault ends by itself."""
    from prometheus_client import CollectorRegistry

    from agent.config import load_config
    from agent.daemon import Daemon
    from agent.drill import DRILL_SECONDS
    from agent.engine import builtin_rules_dir, load_rules
    from agent.model import StepKind

    settings = tmp_path / "config.yaml"
    settings.write_text(f"node_name: {NODE}\njournal_path: {tmp_path / 'j.db'}\n"
                        "sources: {kmsg: {enabled: 'on'}, nvml: {enabled: 'off'}, dcgm: {enabled: 'off'}}\n")
    config = load_config(settings, env={})
    daemon = Daemon(config, rules=load_rules(builtin_rules_dir()), registry=CollectorRegistry())
    stop = threading.Event()
    runner = threading.Thread(target=daemon.run, args=(stop,))
    runner.start()
    try:
        assert wait_for(daemon.sources[0].ready.is_set)
        result = CliRunner().invoke(main, ["drill", "--pci", "0000:3b:00", "--xid", "79", "--wait", "10",
                                           "--config", str(settings)])
        assert result.exit_code == 0, result.output
        assert "admitted: drill" in result.stdout
        assert wait_for(lambda: "fatal" in daemon.pipeline.gpu_statuses().values())
        [fault] = daemon.pipeline.record.faults.values()
        assert fault.summary.startswith("DRILL ") and fault.action is Action.NOTIFY
        assert daemon.metrics.registry.get_sample_value("gpu_health_verdicts_total", {
            "kind": "fault", "severity": "fatal", "fault_class": "hardware", "rule_id": "xid-79", "drill": "true"}) == 1
        daemon.pipeline.reconcile(fault.since + 1)
        kinds = {entry.get("step", {}).get("kind") for entry in daemon.journal.history() if entry["type"] == "action"}
        assert kinds.isdisjoint({str(StepKind.TAINT), str(StepKind.EVICT), str(StepKind.REBOOT_REQUEST)})
        ended = daemon.pipeline.tick(fault.since + DRILL_SECONDS)
        assert [str(v.kind) for v in ended.verdicts] == ["cleared"]
        assert daemon.pipeline.record.faults == {}
    finally:
        stop.set()
        runner.join(10)

"""The kernel-log source on real files: a pipe standing in for /dev/kmsg, a followed text log, and the
real /dev/kmsg when running as root."""

import os
import threading
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from agent.cli import main
from agent.drill import mark_test_record
from agent.journal import Journal
from agent.model import Signal
from agent.sources.kmsg import KmsgSource
from tests.conftest import FIXTURES, wait_for

RECORD = "4,{seq},{ts},-;NVRM: Xid (PCI:0000:3b:00): {code}, pid=1, name=python3, {msg}\n"


class Collector:
    def __init__(self):
        self.items = []
        self.lock = threading.Lock()

    def __call__(self, observation):
        with self.lock:
            self.items.append(observation)

    def xids(self):
        with self.lock:
            return [o for o in self.items if o.signal is Signal.XID]


@pytest.fixture
def boot_id(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text("boot-aaaa\n")
    return path


def start(source):
    collected, stop = Collector(), threading.Event()
    thread = threading.Thread(target=source.run, args=(collected, stop), daemon=True)
    thread.start()
    assert source.ready.wait(5)
    return collected, stop, thread


def fifo(tmp_path: Path) -> tuple[Path, int]:
    path = tmp_path / "kmsg"
    os.mkfifo(path)
    writer = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    return path, writer


def test_records_are_read_as_they_arrive(tmp_path: Path, boot_id: Path):
    path, writer = fifo(tmp_path)
    collected, stop, thread = start(KmsgSource(path=path, boot_id_path=boot_id))
    try:
        os.write(writer, RECORD.format(seq=1, ts=10, code=79, msg="off the bus").encode())
        assert wait_for(lambda: len(collected.xids()) == 1)
        assert collected.items[0].signal is Signal.BOOT
        assert collected.items[0].attrs["boot_id"] == "boot-aaaa"
        assert collected.xids()[0].attrs["kmsg_seq"] == 1
    finally:
        stop.set()
        thread.join(5)
        os.close(writer)


def test_gaps_in_the_sequence_are_counted_as_lost(tmp_path: Path, boot_id: Path):
    path, writer = fifo(tmp_path)
    counted = []
    source = KmsgSource(path=path, boot_id_path=boot_id, count=lambda name, n: counted.append((name, n)))
    collected, stop, thread = start(source)
    try:
        for seq in (1, 2, 6):
            os.write(writer, RECORD.format(seq=seq, ts=seq, code=13, msg=f"m{seq}").encode())
        assert wait_for(lambda: len(collected.xids()) == 3)
        assert source.stats.lost == 3
        assert ("lost", 3) in counted
    finally:
        stop.set()
        thread.join(5)
        os.close(writer)


def test_after_a_restart_nothing_is_handled_twice(tmp_path: Path, boot_id: Path, shipped_rules):
    from agent.model import NodeInventory
    from agent.pipeline import Pipeline
    from agent.remediation import GuardPolicy

    journal = Journal(tmp_path / "j.db")
    backlog = "".join(RECORD.format(seq=n, ts=n, code=13, msg=f"m{n}") for n in range(1, 6))
    path, writer = fifo(tmp_path)
    os.write(writer, backlog.encode())
    collected, stop, thread = start(KmsgSource(path=path, boot_id_path=boot_id, cursor=journal))
    assert wait_for(lambda: len(collected.xids()) == 5)
    stop.set()
    thread.join(5)
    assert journal.cursor("kmsg") is None  # read, not yet classified
    pipeline = Pipeline(rules=shipped_rules, inventory=NodeInventory("n1"), policy=GuardPolicy(), journal=journal)
    for observation in collected.items:
        pipeline.handle(observation)  # classified and durable: acknowledged
    assert journal.cursor("kmsg") == "boot-aaaa:5"
    # The ring buffer still holds 1..5 when the agent comes back; 6 arrived meanwhile.
    os.write(writer, (backlog + RECORD.format(seq=6, ts=6, code=13, msg="m6")).encode())
    collected, stop, thread = start(KmsgSource(path=path, boot_id_path=boot_id, cursor=journal))
    try:
        assert wait_for(lambda: len(collected.xids()) == 1)
        time.sleep(0.2)
        assert [o.attrs["message"] for o in collected.xids()] == ["m6"]
    finally:
        stop.set()
        thread.join(5)
        os.close(writer)


def test_a_new_boot_starts_from_the_beginning(tmp_path: Path, boot_id: Path):
    journal = Journal(tmp_path / "j.db")
    journal.set_cursor("kmsg", "boot-old:900")
    path, writer = fifo(tmp_path)
    os.write(writer, RECORD.format(seq=1, ts=1, code=79, msg="x").encode())
    collected, stop, thread = start(KmsgSource(path=path, boot_id_path=boot_id, cursor=journal))
    try:
        assert wait_for(lambda: len(collected.xids()) == 1)
    finally:
        stop.set()
        thread.join(5)
        os.close(writer)


def test_a_text_log_is_followed_as_it_grows(tmp_path: Path):
    log = tmp_path / "syslog"
    log.write_text((FIXTURES / "kmsg" / "dmesg.log").read_text())
    collected, stop, thread = start(KmsgSource(path=log, wake_seconds=0.05))
    try:
        assert wait_for(lambda: len(collected.xids()) == 7)
        with log.open("a") as handle:
            handle.write("[ 999.0] NVRM: Xid (PCI:0000:3b:00): 62, pid=0, PMU halt\n")
        assert wait_for(lambda: [o.value for o in collected.xids()][-1:] == [62])
    finally:
        stop.set()
        thread.join(5)


def stop_text_follower(log: Path, stop: threading.Event, thread: threading.Thread) -> None:
    """Stop a follower that waits on a long wake timer: the write after the stop wakes it at once."""
    stop.set()
    with log.open("a") as handle:
        handle.write("\n")
    thread.join(5)


def test_a_text_log_is_read_the_moment_it_is_written_not_when_the_wake_timer_fires(tmp_path: Path):
    """The write itself wakes the follower (inotify): with a wake timer of an hour, a new line is read at once."""
    log = tmp_path / "syslog"
    log.write_text("")
    collected, stop, thread = start(KmsgSource(path=log, wake_seconds=3600))
    try:
        with log.open("a") as handle:
            handle.write("Nov 30 12:00:00 node kernel: [ 1.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, off bus\n")
        assert wait_for(lambda: [o.value for o in collected.xids()] == [79])
    finally:
        stop_text_follower(log, stop, thread)


def test_a_line_written_in_two_parts_is_read_as_one_record(tmp_path: Path):
    """A writer's unfinished line waits for its end: the two parts make one Xid, on its GPU."""
    log = tmp_path / "syslog"
    log.write_text("")
    source = KmsgSource(path=log, wake_seconds=3600)
    collected, stop, thread = start(source)
    try:
        with log.open("a") as handle:
            handle.write("Nov 30 12:00:00 node kernel: [ 1.0] usb 1-1: new device\n"
                         "Nov 30 12:00:01 node kernel: [ 2.0] NVRM: Xid (PCI:0000:3b")
        assert wait_for(lambda: source.stats.lines == 1)  # the read that took the first part has happened
        with log.open("a") as handle:
            handle.write(":00): 48, pid=1, name=x, DBE\n")
        assert wait_for(lambda: bool(collected.xids()))  # emitted after the line is counted: wait for it
        assert [(o.value, o.gpu.pci_bus_id) for o in collected.xids()] == [(48, "0000:3b:00")]
        assert source.stats.lines == 2
    finally:
        stop_text_follower(log, stop, thread)


def test_a_last_line_without_a_newline_is_read_once_the_log_stays_quiet(tmp_path: Path):
    """A log whose last line never gets its newline loses nothing: after a quiet wake period it is read as it is."""
    log = tmp_path / "syslog"
    log.write_text("Nov 30 12:00:01 node kernel: [ 2.0] NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, DBE")
    collected, stop, thread = start(KmsgSource(path=log, wake_seconds=0.05))
    try:
        assert wait_for(lambda: [o.value for o in collected.xids()] == [48])
    finally:
        stop.set()
        thread.join(5)


def test_kmsg_parse_json_prints_one_object_per_xid_or_sxid_line():
    result = CliRunner().invoke(main, ["kmsg", "parse", str(FIXTURES / "kmsg" / "nvswitch.log"), "--json"])
    assert result.exit_code == 0
    import json
    documents = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(d["line"], d["kind"], d["code"]) for d in documents] == [
        (1, "sxid", 20034), (2, "sxid", 20034), (3, "sxid", 20034), (4, "sxid", 12028), (5, "sxid", 12028)]
    assert set(documents[0]) >= {"line", "kind", "code", "pci", "pid", "process", "message"}


def test_kmsg_parse_of_a_missing_file_is_one_line():
    result = CliRunner().invoke(main, ["kmsg", "parse", "/nonexistent/kern.log"])
    assert result.exit_code == 2
    assert "cannot read" in result.output


needs_root_kmsg = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access("/dev/kmsg", os.W_OK), reason="needs root and a writable /dev/kmsg")


@pytest.mark.root
@needs_root_kmsg
def test_a_real_round_trip_through_dev_kmsg(tmp_path: Path):
    nonce = uuid.uuid4().hex
    counted = []
    admitted = KmsgSource(path=Path("/dev/kmsg"), admit_user_records=True, wake_seconds=0.05)
    strict = KmsgSource(path=Path("/dev/kmsg"), wake_seconds=0.05, count=lambda n, k: counted.append(n))
    got_admitted, stop_a, thread_a = start(admitted)
    got_strict, stop_s, thread_s = start(strict)
    try:
        with open("/dev/kmsg", "w") as kmsg:
            # Marked as a test record: it stays in the host's dmesg, where nobody should take it for a fault.
            message = mark_test_record(f"round trip {nonce}")
            kmsg.write(f"<4>NVRM: Xid (PCI:0000:ee:00): 79, pid=1, name=gha-test, {message}\n")
        assert wait_for(lambda: any(nonce in str(o.attrs.get("message")) for o in got_admitted.xids()))
        ours = [o for o in got_admitted.xids() if nonce in str(o.attrs.get("message"))]
        assert (ours[0].value, ours[0].gpu.pci_bus_id) == (79, "0000:ee:00")
        assert wait_for(lambda: "forged" in counted)
        assert not any(nonce in str(o.attrs.get("message")) for o in got_strict.xids())
    finally:
        stop_a.set()
        stop_s.set()
        thread_a.join(5)
        thread_s.join(5)

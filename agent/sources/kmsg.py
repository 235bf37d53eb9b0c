"""The kernel-log source: tails /dev/kmsg (or follows a text log) and emits Xid, SXid and GPU-loss observations.

Event-driven: it waits in poll() on the device and wakes the moment the kernel writes a record; a followed
text log wakes it through inotify the moment the file is written (a timer only where inotify is not to be had).
Records overwritten before they were read (EPIPE) are counted and skipped; after a restart it resumes
after the last record the pipeline acknowledged in the same boot (acknowledged = classified and in the
durable record), so nothing is handled twice and nothing read but not yet classified is lost.
"""

from __future__ import annotations

import math
import os
import select
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

from agent.drill import DrillBox, DrillRequest, marked
from agent.model import AttrValue, GpuRef, Observation, Signal, frozen_attrs, new_observation, normalise_pci
from agent.sources.attribution import PodAttribution, parse_cgroup, workload_key
from agent.sources.base import Emit
from agent.sources.dedup import Deduplicator
from agent.sources.kernel_log import KERNEL_FACILITY, KMSG_XID, KernelLogParser, KernelRecord
from agent.sources.kmsg_records import RecordReader, watch_writes

CURSOR_NAME = "kmsg"
_POD_CACHE_SECONDS = 5.0
_POD_CACHE_SIZE = 4096
#: At most this many /proc/<pid>/cgroup reads a second (each costs ~5 us even for an exited process): in a
#: storm of records from ever-new pids the rest are charged to their process name instead of stalling the source.
ATTRIBUTIONS_PER_SECOND = 1000
_GPU_CACHE_SIZE = 256
_ATTR_TYPES = (str, int, float, bool)
_RECORD_SIGNALS = {"xid": Signal.XID, "sxid": Signal.SXID, "gpu_lost": Signal.GPU_LOST}
#: A followed text log is read this much at a time (a storm's 10 ms of lines is ~15 KB).
_TEXT_CHUNK = 65536
#: A text log's line with no end in sight is read as it is past this length (a kernel record is 1-2 KB).
_MAX_PENDING_LINE = 65536


class CursorStore(Protocol):
    """Where the last acknowledged kmsg position is kept across restarts (the journal). The source only
    reads it: the pipeline moves it, in the same write as the durable record a record changed."""

    def cursor(self, name: str) -> str | None: ...


def cursor_value(boot_id: str, seq: int) -> str:
    """The saved position: the boot it belongs to and the last acknowledged sequence number."""
    return f"{boot_id}:{seq}"


def _parse_cursor(value: str | None) -> tuple[str, int] | None:
    if not value or ":" not in value:
        return None
    boot, _, seq = value.rpartition(":")
    return (boot, int(seq)) if seq.isdigit() else None


def newer_cursor(value: str, than: str | None) -> bool:
    """True when `value` moves the position on: another boot, or a later record of the same boot."""
    new, old = _parse_cursor(value), _parse_cursor(than)
    return new is not None and (old is None or new[0] != old[0] or new[1] > old[1])


class KernelLogCheckpoint:
    """The kernel-log source's checkpoint (agent.sources.checkpoint.InputCheckpoint): the boot and the last
    record handled, read off the `kmsg_seq` each observation of a record carries."""

    @property
    def name(self) -> str:
        return CURSOR_NAME

    def position(self, observation: Observation, boot_id: str) -> str | None:
        seq = observation.attrs.get("kmsg_seq")
        if observation.source != CURSOR_NAME or not isinstance(seq, int) or not boot_id:
            return None
        return cursor_value(boot_id, seq)

    def newer(self, value: str, than: str | None) -> bool:
        return newer_cursor(value, than)


Count = Callable[[str, int], None]


#: pod UID -> workload (agent.workloads.owner_key) of the pods on this node, as the pod listing last saw them.
Owners = Callable[[], Mapping[str, str]]


_NO_OWNERS: Mapping[str, str] = MappingProxyType({})


def _no_owners() -> Mapping[str, str]:
    return _NO_OWNERS


def _no_count(name: str, amount: int) -> None:
    return None


#: After this many kernel-log records in a row that could not be handled, the source counts as failing.
FAILING_AFTER = 20


@dataclass(slots=True)
class KmsgStats:
    lines: int = 0
    records: int = 0
    lost: int = 0
    forged: int = 0
    skipped_after_restart: int = 0
    unreadable: int = 0
    unattributed: int = 0
    failing_streak: int = 0


class KernelLogProcessor:
    """Line -> observations, with attribution, forgery filtering and storm deduplication. No device I/O.

    Records written from user space are dropped before the parser reads them (a forged GPU banner must not
    teach it a PCI -> UUID pair); a record whose handling raises is skipped and counted, never fatal.
    """

    def __init__(self, *, admit_user_records: bool = False, proc_root: Path = Path("/proc"),
                 dedup_seconds: float = 1.0, count: Count = _no_count, source: str = "kmsg",
                 parser: KernelLogParser | None = None, owners: Owners = _no_owners,
                 drills: DrillBox | None = None, node_name: str = "") -> None:
        self.parser = parser or KernelLogParser()
        self.dedup = Deduplicator(window_seconds=dedup_seconds)
        self.admit_user_records = admit_user_records
        self.proc_root = proc_root
        self._proc = str(proc_root)
        self.count = count
        self.source = source
        self.owners = owners
        #: Fire drills (agent.drill): the one kind of user-space record admitted, with a root-owned request.
        self.drills = drills
        self.node_name = node_name
        self.stats = KmsgStats()
        self._pods: dict[int, tuple[float, PodAttribution | None]] = {}
        self._gpus: dict[str, GpuRef] = {}
        #: /proc reads in the second that began at _lookups_since (ATTRIBUTIONS_PER_SECOND at most).
        self._lookups = 0
        self._lookups_since = -math.inf

    @property
    def failing(self) -> bool:
        """True while every one of the last FAILING_AFTER driver records failed to be handled."""
        return self.stats.failing_streak >= FAILING_AFTER

    def handle(self, line: str, now: float, line_no: int = 0) -> list[Observation]:
        """The observations this line completes (often none). Never raises: a bad record is skipped."""
        self.stats.lines += 1
        if "NVRM" not in line and "SXid" not in line:
            return self.dedup.flush(now)
        try:
            fast = KMSG_XID.match(line)  # the driver's own Xid form, from the kernel: a storm's lines
            observations = self._record(self.parser.kmsg_xid(fast, line, line_no), now) if fast is not None \
                else self._driver_line(line, now, line_no)
        except Exception:  # noqa: BLE001 - one kernel-log line must never stop the source; it is counted
            self.stats.unreadable += 1
            self.stats.failing_streak += 1
            self.count("unreadable", 1)
            return []
        self.stats.failing_streak = 0
        return observations

    def _driver_line(self, line: str, now: float, line_no: int) -> list[Observation]:
        if not self.admit_user_records and _from_user_space(line):
            request = self.drills.admit(line, node=self.node_name, now=time.time()) if self.drills else None
            if request is None:
                self.stats.forged += 1
                self.count("forged", 1)
                return self.dedup.flush(now)
            return self._drill(line, request, now, line_no)
        record = self.parser.feed(line, line_no)
        if record is None or record.kind not in _RECORD_SIGNALS:
            return self.dedup.flush(now)
        if record.extras.get("continuation"):
            return []
        return self._record(record, now)

    def _record(self, record: KernelRecord, now: float) -> list[Observation]:
        """A driver record: counted once per storm window (a repeat costs one lookup), else observed."""
        self.stats.records += 1
        key = (record.kind, record.code, record.pci, record.pid, record.message)
        if self.dedup.repeat(key, now):
            return []
        return self.dedup.offer(key, self.observation_of(record, now), now)

    def _drill(self, line: str, request: DrillRequest, now: float, line_no: int) -> list[Observation]:
        """An admitted drill record: parsed like the driver's, marked as a drill, never deduplicated away."""
        record = self.parser.feed(line, line_no)
        if record is None or record.kind != "xid":
            return self.dedup.flush(now)
        self.stats.records += 1
        return [*self.dedup.flush(now), marked(self.observation_of(record, now), request)]

    def flush(self, now: float, *, force: bool = False) -> list[Observation]:
        return self.dedup.flush(now, force=force)

    def _pod_of(self, pid: int, now: float) -> PodAttribution | None:
        """Reads /proc/<pid>/cgroup at most once per pid every few seconds: storms stay cheap."""
        cached = self._pods.get(pid)
        if cached is not None and now - cached[0] < _POD_CACHE_SECONDS:
            return cached[1]
        if now - self._lookups_since >= 1.0 or now < self._lookups_since:  # a new second (or the clock went back)
            self._lookups_since, self._lookups = now, 0
        if self._lookups >= ATTRIBUTIONS_PER_SECOND:
            self.stats.unattributed += 1
            return None
        self._lookups += 1
        pod = _read_pod(self._proc, pid)
        if len(self._pods) >= _POD_CACHE_SIZE:
            self._pods.clear()
        self._pods[pid] = (now, pod)
        return pod

    def _gpu_at(self, pci: str) -> GpuRef:
        """The GPU at a PCI address, named by the UUID the driver's banner gave it (cached per address)."""
        known = self.parser.pci_to_uuid
        uuid = known.get(pci, "")
        if not uuid and known:
            wanted = normalise_pci(pci)
            uuid = next((u for p, u in known.items() if normalise_pci(p) == wanted), "")
        cached = self._gpus.get(pci)
        if cached is None or cached.uuid != uuid:
            if len(self._gpus) >= _GPU_CACHE_SIZE:
                self._gpus.clear()
            cached = self._gpus[pci] = GpuRef(pci_bus_id=pci, uuid=uuid)
        return cached

    def observation_of(self, record: KernelRecord, now: float) -> Observation:
        attrs: dict[str, AttrValue] = {"message": record.message}
        pid, process = record.pid, record.process
        if pid is not None:
            attrs["pid"] = pid
            pod = self._pod_of(pid, now)
            if pod is None:
                attrs["workload"] = workload_key(pod=None, owners=_NO_OWNERS, process=process)
            else:
                attrs["pod_uid"] = pod.pod_uid
                if pod.container_id:
                    attrs["container_id"] = pod.container_id
                attrs["workload"] = workload_key(pod=pod, owners=self.owners(), process=process)
        if process is not None:
            attrs["process"] = process
        seq = record.prefix.seq
        if seq is not None:
            attrs["kmsg_seq"] = seq
        if record.extras:
            for key, value in record.extras.items():
                if isinstance(value, _ATTR_TYPES):
                    attrs[key] = value
        signal = _RECORD_SIGNALS[record.kind]
        if signal is Signal.SXID:
            attrs["pci"] = record.pci
            return new_observation(signal, float(record.code or 0), now, self.source, None, MappingProxyType(attrs))
        value = float(record.code) if record.code is not None else 1.0
        return new_observation(signal, value, now, self.source, self._gpu_at(record.pci), MappingProxyType(attrs))


def _from_user_space(line: str) -> bool:
    """True when the record's own prefix (raw /dev/kmsg `PRI,seq,...;` or `<PRI>`) names a facility other
    than the kernel's; a line without either (a plain text log) cannot tell and is admitted."""
    if line[:1].isdigit():
        end = line.find(";")  # found without copying the rest of the line: this runs for every driver line
        if end < 0:
            return False
        comma = line.find(",", 0, end)
        priority = line[:comma if comma >= 0 else end]
        return priority.isdigit() and int(priority) >> 3 != KERNEL_FACILITY
    if line.startswith("<"):
        end = line.find(">", 1, 5)
        priority = line[1:end] if end > 0 else ""
        return priority.isdigit() and int(priority) >> 3 != KERNEL_FACILITY
    return False


def _read_pod(proc: str, pid: int) -> PodAttribution | None:
    """The pod of a process, read straight from /proc/<pid>/cgroup (no pathlib on the storm path)."""
    if pid <= 0:
        return None
    try:
        with open(f"{proc}/{pid}/cgroup", encoding="utf-8", errors="replace") as handle:
            return parse_cgroup(handle.read())
    except OSError:
        return None


def read_boot_id(path: Path = Path("/proc/sys/kernel/random/boot_id")) -> str:
    try:
        return path.read_text(encoding="ascii").strip()
    except OSError:
        return ""


class KmsgSource:
    """Tails /dev/kmsg, or follows a plain text log when `path` is a regular file."""

    name = "kmsg"

    def __init__(
        self,
        *,
        path: Path = Path("/dev/kmsg"),
        admit_user_records: bool = False,
        cursor: CursorStore | None = None,
        boot_id_path: Path = Path("/proc/sys/kernel/random/boot_id"),
        proc_root: Path = Path("/proc"),
        owners: Owners = _no_owners,
        drills: DrillBox | None = None,
        node_name: str = "",
        count: Count = _no_count,
        clock: Callable[[], float] = time.time,
        dedup_seconds: float = 1.0,
        wake_seconds: float = 0.5,
    ) -> None:
        self.path = path
        self.cursor = cursor
        self.boot_id_path = boot_id_path
        self.count = count
        self.clock = clock
        self.wake_seconds = wake_seconds
        self.processor = KernelLogProcessor(admit_user_records=admit_user_records, proc_root=proc_root,
                                            dedup_seconds=dedup_seconds, count=count, source=self.name,
                                            owners=owners, drills=drills, node_name=node_name)
        self.ready = threading.Event()

    @property
    def stats(self) -> KmsgStats:
        return self.processor.stats

    @property
    def failing(self) -> bool:
        """True while the kernel log's driver records keep failing to be handled (for /healthz)."""
        return self.processor.failing

    def run(self, emit: Emit, stop: threading.Event) -> None:
        if stat.S_ISREG(os.stat(self.path).st_mode):
            self._follow_text(emit, stop)
        else:
            self._tail_device(emit, stop)

    def _tail_device(self, emit: Emit, stop: threading.Event) -> None:
        boot_id = read_boot_id(self.boot_id_path)
        emit(Observation(Signal.BOOT, 0, self.clock(), self.name, attrs=frozen_attrs({"boot_id": boot_id})))
        resume_after = self._resume_point(boot_id)
        last_seq: int | None = None
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        reader = RecordReader(fd, self._lost)
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            self.ready.set()
            while not stop.is_set():
                if not poller.poll(self.wake_seconds * 1000):
                    self._emit_all(emit, self.processor.flush(self.clock()))
                    continue
                for line in reader.available():
                    last_seq = self._handle_record(line, emit, boot_id, last_seq, resume_after)
                    if stop.is_set():
                        break
        finally:
            os.close(fd)
            self._emit_all(emit, self.processor.flush(self.clock(), force=True))

    def _lost(self) -> None:
        self.count("lost", 1)
        self.stats.lost += 1

    def _handle_record(self, line: str, emit: Emit, boot_id: str, last_seq: int | None,
                       resume_after: int | None) -> int | None:
        seq = _seq_of(line)
        if seq is not None:
            if last_seq is not None and seq > last_seq + 1:
                gap = seq - last_seq - 1
                self.stats.lost += gap
                self.count("lost", gap)
            last_seq = seq
            if resume_after is not None and seq <= resume_after:
                self.stats.skipped_after_restart += 1
                return last_seq
        self._emit_all(emit, self.processor.handle(line, self.clock(), seq or 0))
        return last_seq

    def _resume_point(self, boot_id: str) -> int | None:
        if self.cursor is None or not boot_id:
            return None
        saved = _parse_cursor(self.cursor.cursor(CURSOR_NAME))
        return saved[1] if saved is not None and saved[0] == boot_id else None

    def _emit_all(self, emit: Emit, observations: list[Observation]) -> None:
        """Hand observations on; each carries its record's `kmsg_seq`, which the pipeline acknowledges."""
        for observation in observations:
            emit(observation)

    def _follow_text(self, emit: Emit, stop: threading.Event) -> None:
        """Follows a text log: reads what it holds, then waits for the next write (inotify) or the wake timer.

        Only whole lines are handled; a writer's unfinished line waits for its end, and is handled as it is
        once a whole wake period passed with nothing more written (a log whose last line has no newline)."""
        line_no = 0
        pending = ""
        quiet = False  # True after a wait in which nothing was written
        watch = watch_writes(self.path)
        try:
            with self.path.open(encoding="utf-8", errors="replace") as handle:
                self.ready.set()
                while not stop.is_set():
                    chunk = handle.read(_TEXT_CHUNK)
                    if chunk:
                        quiet = False
                        lines = (pending + chunk).split("\n")
                        pending = lines.pop()
                        for line in lines:
                            line_no = self._text_line(emit, line + "\n", line_no)
                        if len(pending) > _MAX_PENDING_LINE:  # no line ends: read it as it is, bounded
                            line_no, pending = self._text_line(emit, pending, line_no), ""
                        continue
                    if pending and quiet:
                        line_no, pending = self._text_line(emit, pending, line_no), ""
                    self._emit_all(emit, self.processor.flush(self.clock()))
                    if watch is not None:
                        quiet = not watch.wait(self.wake_seconds)
                    else:
                        stop.wait(self.wake_seconds)
                        quiet = True
                if pending:
                    self._text_line(emit, pending, line_no)
        finally:
            if watch is not None:
                watch.close()
        self._emit_all(emit, self.processor.flush(self.clock(), force=True))

    def _text_line(self, emit: Emit, line: str, line_no: int) -> int:
        """Handle the text log's next line; its number."""
        self._emit_all(emit, self.processor.handle(line, self.clock(), line_no + 1))
        return line_no + 1


def _seq_of(line: str) -> int | None:
    head = line.split(";", 1)[0]
    parts = head.split(",")
    if len(parts) >= 3 and parts[1].isdigit():
        return int(parts[1])
    return None

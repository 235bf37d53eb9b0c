"""Fire drills: a marked Xid record through the real kernel log that only a root-owned request makes count.

A user-space write to /dev/kmsg comes back with the user facility, and the agent ignores those as forged.
A drill is the one exception, and it needs two things nobody else has together: a request file in the
agent's state directory (root only, mode 0600, on the node's hostPath) and a kernel-log line carrying the
request's random id. The agent admits such a line once (the request is consumed), marks the observation
as a drill, and never lets it taint, evict, reset or reboot unless the request is a full drill that names
this node. A record with a drill id but no matching request stays what it is: forged, and ignored.

Test and benchmark records written to /dev/kmsg carry TEST_MARK so that nobody reading `dmesg` mistakes
them for a fault.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from agent.model import Action, AttrValue, Observation, Verdict, frozen_attrs

DRILL_MARK = "gpu-health-agent drill"
TEST_MARK = "gpu-health-agent test record, not a fault"
_DRILL_ID = re.compile(r"\[gpu-health-agent drill id=([0-9a-f]{32})\]")
DEFAULT_TTL_SECONDS = 120.0
#: How a drill's verdict summary starts (it is kept in the durable record, so a restarted agent knows it).
DRILL_PREFIX = "DRILL "
#: A drill's fault ends by itself after this long: time enough for its alert (for: 1m) to fire and be seen.
DRILL_SECONDS = 600.0


class DrillError(Exception):
    """A drill request that cannot be filed (no state directory, unsafe permissions)."""


@dataclass(frozen=True, slots=True)
class DrillRequest:
    """What the operator asked for: which node and GPU, which Xid, and whether to act on it for real."""

    drill_id: str
    node: str
    pci: str
    xid: int
    full: bool
    requested_by: str
    created: float
    expires: float

    def kmsg_line(self, *, pid: int) -> str:
        """The kernel-log record: an NVRM Xid line the parser reads, with the drill's id for the agent and
        plain words for a human reading dmesg."""
        return (f"NVRM: Xid (PCI:{self.pci}): {self.xid}, pid={pid}, name=gpu-health-drill, "
                f"[gpu-health-agent drill id={self.drill_id}] fire drill by {self.requested_by}, not a fault")

    def attrs(self) -> dict[str, AttrValue]:
        """What marks the observation (and so the verdict, its Event and its metrics) as a drill."""
        return {"drill": self.drill_id, "drill_full": self.full}


def marked(observation: Observation, request: DrillRequest) -> Observation:
    """The observation of an admitted drill record, carrying the drill's marks (the verdict's evidence gets them)."""
    return dataclasses.replace(observation, attrs=frozen_attrs({**dict(observation.attrs), **request.attrs()}))


def contain(verdict: Verdict) -> Verdict:
    """A drill's verdict as the planner must see it: notify only (condition, Event, metrics; no taint, eviction,
    reset or reboot) unless the request was a full drill; its summary says DRILL. Other verdicts pass as they are."""
    drill = verdict.evidence.get("drill")
    if not drill:
        return verdict
    summary = f"{DRILL_PREFIX}{drill} (not a fault): {verdict.summary}"
    if verdict.evidence.get("drill_full") is True:
        return dataclasses.replace(verdict, summary=summary)
    action = verdict.action if verdict.action.rank <= Action.NOTIFY.rank else Action.NOTIFY
    return dataclasses.replace(verdict, action=action, summary=summary)


def drill_id_of(message: str) -> str | None:
    """The drill id a kernel-log message carries, if any."""
    match = _DRILL_ID.search(message)
    return match.group(1) if match else None


def is_test_record(message: str) -> bool:
    return TEST_MARK in message


def mark_test_record(message: str) -> str:
    """A message for a test or benchmark record written to the host's /dev/kmsg, marked as not a fault."""
    return f"{message} [{TEST_MARK}]"


class DrillBox:
    """The request directory shared by `gpu-health-agent drill` (files) and the agent (admits, consumes)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def file(self, request: DrillRequest) -> DrillRequest:
        """Writes the request where only root (the agent's user) can: directory 0700, file 0600, new file only."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = self.directory.lstat()
        except OSError as exc:
            raise DrillError(f"{self.directory}: cannot create the drill directory: {exc.strerror}") from None
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise DrillError(f"{self.directory}: must be a directory owned by uid {os.geteuid()} with mode 0700")
        path = self._path(request.drill_id)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise DrillError(f"{path}: cannot file the drill request: {exc.strerror}") from None
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(asdict(request), handle)
        return request

    def withdraw(self, drill_id: str) -> bool:
        try:
            self._path(drill_id).unlink()
        except FileNotFoundError:
            return False
        return True

    def pending(self, drill_id: str) -> bool:
        return self._path(drill_id).exists()

    def admit(self, message: str, *, node: str, now: float) -> DrillRequest | None:
        """The request a user-space kernel-log message proves, consumed; None leaves the record forged.

        Admitted only when: the message carries a drill id, a request file with that id exists, is a
        regular file owned by this process's user and writable by nobody else, is for this node and has
        not expired. Each request is admitted once.
        """
        drill_id = drill_id_of(message)
        if drill_id is None:
            return None
        path = self._path(drill_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                return None
            with os.fdopen(os.dup(fd), encoding="utf-8") as handle:
                request = DrillRequest(**json.load(handle))
        except (OSError, ValueError, TypeError):
            return None
        finally:
            os.close(fd)
        self.withdraw(drill_id)
        if request.drill_id != drill_id or request.node != node or now > request.expires:
            return None
        return request

    def _path(self, drill_id: str) -> Path:
        return self.directory / f"{drill_id}.json"


def new_request(*, node: str, pci: str, xid: int, full: bool, requested_by: str, now: float,
                ttl_seconds: float = DEFAULT_TTL_SECONDS) -> DrillRequest:
    return DrillRequest(secrets.token_hex(16), node, pci, xid, full, requested_by, now, now + ttl_seconds)


def write_kmsg(line: str, path: Path = Path("/dev/kmsg")) -> None:
    """One record into the kernel log (level warning); the kernel stamps it with the user facility."""
    with open(path, "w", encoding="utf-8") as kmsg:
        kmsg.write(f"<4>{line}\n")


def drills_dir(journal_path: str) -> Path:
    """Requests live next to the journal: the node's hostPath state directory, root only."""
    return Path(journal_path).parent / "drills"

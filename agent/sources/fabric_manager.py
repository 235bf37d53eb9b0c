"""Fabric Manager liveness on an NVSwitch node: the host's nv-fabricmanager process, read through the host's
/proc, and whether each GPU registered with the instance that runs now (NVML keeps reading Completed after
Fabric Manager died or restarted, and after a restart NVLink SHARP fails until the GPUs are reset)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from agent.logs import get_logger

log = get_logger("agent.sources.fabric_manager")

#: The process name: /proc/PID/comm holds at most 15 characters of it.
FM_NAME = "nv-fabricmanager"
_COMM = FM_NAME[:15]
#: What PID 1 of the host is called: a /proc whose PID 1 is anything else is a container's (the host's /proc is
#: not mounted there), where no Fabric Manager can be seen, so its absence says nothing.
HOST_INITS = frozenset({"systemd", "init"})
#: A GPU that registered while no Fabric Manager instance could be seen: any instance later is another one.
UNSEEN = "unseen"
RUNNING, DOWN, RESTARTED = "running", "down", "restarted"


@dataclass(frozen=True, slots=True)
class FmInstance:
    """One run of nv-fabricmanager: its host PID and its start time (clock ticks after boot, /proc/PID/stat)."""

    pid: int
    started: int

    @property
    def key(self) -> str:
        return f"{self.pid}@{self.started}"


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _started(stat: str) -> int | None:
    """Field 22 of /proc/PID/stat (starttime), counted after the command name's closing parenthesis."""
    fields = stat[stat.rfind(")") + 1:].split()
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


class FabricManagerWatch:
    """Finds the host's nv-fabricmanager in `proc_root` (the host's /proc, mounted read-only). The instance last
    seen is checked first (its stat), so a running Fabric Manager costs two reads a poll; only when it is gone
    is /proc scanned."""

    def __init__(self, proc_root: Path) -> None:
        self.proc_root = proc_root
        self._last: FmInstance | None = None
        self._host: bool | None = None

    def sees_host(self) -> bool:
        """Whether `proc_root` is the host's /proc (PID 1 is systemd or init), read once; where it is not, one
        warning says so and Fabric Manager is not judged (a container's own /proc never shows it)."""
        if self._host is None:
            init = _read(self.proc_root / "1" / "comm").strip()
            self._host = init in HOST_INITS
            if not self._host:
                log.warning("fabric_manager_unwatched", proc_root=str(self.proc_root), pid1=init or "unreadable",
                            fix="mount the host's /proc (the DaemonSet's /host/proc) and set sources.kmsg.proc_root")
        return self._host

    def boot_id(self) -> str:
        return _read(self.proc_root / "sys" / "kernel" / "random" / "boot_id").strip()

    def instance(self) -> FmInstance | None:
        """The running nv-fabricmanager, None when no process of that name runs (or /proc cannot be read)."""
        last = self._last
        if last is not None and self._instance_at(last.pid) == last:
            return last
        self._last = None
        try:
            names = os.listdir(self.proc_root)
        except OSError:
            return None
        for name in names:
            if name.isdigit() and (found := self._instance_at(int(name))) is not None:
                self._last = found
                return found
        return None

    def _instance_at(self, pid: int) -> FmInstance | None:
        process = self.proc_root / str(pid)
        if _read(process / "comm").strip() != _COMM:
            return None
        argv0 = _read(process / "cmdline").split("\0", 1)[0]
        if os.path.basename(argv0) != FM_NAME:
            return None
        started = _started(_read(process / "stat"))
        return FmInstance(pid, started) if started is not None else None


def status(current: FmInstance | None, registered_under: str | None, *, expected: bool) -> str | None:
    """Fabric Manager as it stands for one GPU: `down` (none runs where one must: NVSwitches on the host's bus,
    or one was seen since the start), `restarted` (one runs, not the one the GPU registered with), `running`;
    None where nothing says this node runs one (a GB200 compute tray's fabric is managed off the host)."""
    if current is None:
        return DOWN if expected else None
    if registered_under is not None and registered_under != current.key:
        return RESTARTED
    return RUNNING

"""Which processes hold a GPU's device file open: /proc/<pid>/fd links to /dev/nvidiaN (N: the GPU's minor).

The driver's own table (/proc/driver/nvidia/gpus/<bus>/information) names each GPU's UUID and device minor;
no NVML call is needed, so this works while NVML is shut down for a reset. The scan reads the host's /proc
where one is given; reading another user's fd links needs CAP_SYS_PTRACE. The scan fails closed: a process
whose open files it cannot read may hold the GPU. The shipped reset container has no host /proc (its own
/proc shows only itself): there the driver's own refusal is the check (agent/gpu/reset.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True, order=True)
class Holder:
    """One process with the GPU's device file open."""

    pid: int
    name: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.name})"


@dataclass(frozen=True, slots=True)
class HolderScan:
    """What a scan of /proc found: who holds the device, who may (open files unreadable), or why it failed."""

    holders: tuple[Holder, ...]
    unreadable: tuple[Holder, ...] = ()
    failure: str = ""

    def without(self, names: frozenset[str]) -> HolderScan:
        """The scan less processes by these names (those the driver does not count against a reset)."""
        return HolderScan(tuple(h for h in self.holders if h.name not in names),
                          tuple(h for h in self.unreadable if h.name not in names), self.failure)

    @property
    def clear(self) -> bool:
        """Nobody holds the device, and nobody could: every process was read."""
        return not (self.holders or self.unreadable or self.failure)

    def describe(self, limit: int = 5) -> str:
        """One line: the holders by name, then those that may hold it, then a scan that failed."""
        parts = []
        if self.holders:
            parts.append(", ".join(str(h) for h in self.holders))
        if self.unreadable:
            shown = ", ".join(str(h) for h in self.unreadable[:limit])
            more = f" and {len(self.unreadable) - limit} more" if len(self.unreadable) > limit else ""
            parts.append(f"maybe {shown}{more} (open files unreadable: may hold it)")
        if self.failure:
            parts.append(f"unknown ({self.failure})")
        return "; ".join(parts)


def device_minor(uuid: str, *, driver_root: Path = Path("/proc/driver/nvidia/gpus")) -> int | None:
    """The device minor of the GPU with this UUID, from the driver's per-GPU information files."""
    try:
        entries = sorted(driver_root.iterdir())
    except OSError:
        return None
    for entry in entries:
        fields = _fields(entry / "information")
        if fields.get("GPU UUID") == uuid:
            minor = fields.get("Device Minor", "")
            return int(minor) if minor.isdigit() else None
    return None


def _fields(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def holders_of(device: Path, *, proc_root: Path = Path("/proc")) -> HolderScan:
    """Who has `device` open, by PID. Fails closed: a process whose open files cannot be read (no
    CAP_SYS_PTRACE for another user's process, or any read error but its exit) may hold it, and is listed so."""
    wanted = str(device)
    found: list[Holder] = []
    unreadable: list[Holder] = []
    try:
        pids = [name for name in os.listdir(proc_root) if name.isdigit()]
    except OSError as exc:
        return HolderScan((), (), f"{proc_root} unreadable: {exc.strerror or exc}")
    for pid in pids:
        match _holds(proc_root / pid / "fd", wanted):
            case True:
                found.append(Holder(int(pid), _comm(proc_root / pid)))
            case None:
                unreadable.append(Holder(int(pid), _comm(proc_root / pid)))
    return HolderScan(tuple(sorted(found)), tuple(sorted(unreadable)))


def _holds(fd_dir: Path, wanted: str) -> bool | None:
    """Whether one process has `wanted` open: None where its open files cannot be read (it may)."""
    try:
        fds = os.listdir(fd_dir)
    except FileNotFoundError:
        return False  # it exited
    except OSError:
        return None
    unread = False
    for fd in fds:
        try:
            if os.readlink(fd_dir / fd) == wanted:
                return True
        except FileNotFoundError:
            continue  # that file was closed meanwhile
        except OSError:
            unread = True
    return None if unread else False


def _comm(process: Path) -> str:
    try:
        return (process / "comm").read_text(encoding="utf-8", errors="replace").strip() or "?"
    except OSError:
        return "?"

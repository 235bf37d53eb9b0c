"""Which processes hold a GPU's device file open: /proc/<pid>/fd links to /dev/nvidiaN (N: the GPU's minor).

The driver's own table (/proc/driver/nvidia/gpus/<bus>/information) names each GPU's UUID and device minor;
no NVML call is needed, so this works while NVML is shut down for a reset. The scan reads the host's /proc
(mounted at /host/proc in the DaemonSet); reading another user's fd links needs CAP_SYS_PTRACE.
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


def holders_of(device: Path, *, proc_root: Path = Path("/proc")) -> list[Holder]:
    """The processes with `device` open, by PID. A process that exits or cannot be read is skipped."""
    wanted = str(device)
    found: list[Holder] = []
    try:
        pids = [name for name in os.listdir(proc_root) if name.isdigit()]
    except OSError:
        return found
    for pid in pids:
        fd_dir = proc_root / pid / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target == wanted:
                found.append(Holder(int(pid), _comm(proc_root / pid)))
                break
    return sorted(found)


def _comm(process: Path) -> str:
    try:
        return (process / "comm").read_text(encoding="utf-8", errors="replace").strip() or "?"
    except OSError:
        return "?"

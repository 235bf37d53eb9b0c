"""Finds the host driver's nvidia-smi and libnvidia-ml under a mounted driver root and copies them for the agent's
containers, so they need neither the NVIDIA container runtime's injection nor a host path of their own."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: Where a driver root keeps its files, in the order tried: the GPU Operator's containerized driver (its rootfs at
#: /run/nvidia/driver on the host), a driver installed on the host, and GKE's driver installer.
PREFIXES = ("run/nvidia/driver", "", "home/kubernetes/bin/nvidia")
LIBRARY_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "usr/lib", "lib64", "lib")
BINARY_DIRS = ("usr/bin", "bin")
LIBRARY = "libnvidia-ml.so.1"
BINARY = "nvidia-smi"


@dataclass(frozen=True, slots=True)
class DriverFiles:
    """The NVML library and nvidia-smi of one driver installation."""

    library: Path
    binary: Path | None


def locate(root: Path) -> DriverFiles | None:
    """The first installation under `root` that has the NVML library (nvidia-smi beside it where there is one)."""
    for prefix in PREFIXES:
        base = root / prefix if prefix else root
        library = next((base / d / LIBRARY for d in LIBRARY_DIRS if (base / d / LIBRARY).is_file()), None)
        if library is None:
            continue
        binary = next((base / d / BINARY for d in BINARY_DIRS if (base / d / BINARY).is_file()), None)
        return DriverFiles(library, binary)
    return None


def copy_driver_files(root: Path, target: Path, *, wait_seconds: float = 0.0,
                      clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> str:
    """Copies the library to target/lib and nvidia-smi to target/bin (links followed); one line saying what. A
    driver not there yet where the GPU Operator installs one (its /run/nvidia/driver mount point made, the driver
    pod still installing) is waited for up to `wait_seconds`; a node with no sign of a driver is not waited for."""
    deadline = clock() + wait_seconds
    found = locate(root)
    while found is None and (root / PREFIXES[0]).is_dir() and clock() < deadline:
        sleep(2.0)
        found = locate(root)
    if found is None:
        return (f"no {LIBRARY} under {root} (tried {', '.join('/' + p if p else '/' for p in PREFIXES)}): "
                "NVML will read the GPUs Unknown until the driver is there and the pod restarts")
    (target / "lib").mkdir(parents=True, exist_ok=True)
    shutil.copy2(found.library, target / "lib" / LIBRARY)
    copied = [str(found.library)]
    if found.binary is not None:
        (target / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(found.binary, target / "bin" / BINARY)
        copied.append(str(found.binary))
    missing = "" if found.binary is not None else f"; no {BINARY} beside it (resets will fail)"
    return f"copied {' and '.join(copied)} to {target}{missing}"

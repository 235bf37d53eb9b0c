"""Charges a process to its pod: /proc/<pid>/cgroup names the pod UID and container of a Kubernetes pod."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CONTAINER = re.compile(r"(?:cri-containerd-|crio-|docker-|containerd-)?([0-9a-f]{64})(?:\.scope)?\s*$")


@dataclass(frozen=True, slots=True)
class PodAttribution:
    pod_uid: str
    container_id: str = ""


def parse_cgroup(text: str) -> PodAttribution | None:
    """The pod (and container) in a /proc/<pid>/cgroup file, cgroup v1 or v2, cgroupfs or systemd driver."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        pod = _POD.search(path)
        if pod is None:
            continue
        container = _CONTAINER.search(path)
        return PodAttribution(pod.group(1).replace("_", "-"), container.group(1) if container else "")
    return None


def pod_of_pid(pid: int, proc_root: Path = Path("/proc")) -> PodAttribution | None:
    """The pod running `pid`, or None when it is not in a pod, has exited, or cannot be read."""
    if pid <= 0:
        return None
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return parse_cgroup(text)

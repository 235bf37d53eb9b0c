"""Charges a process to its pod and its workload: /proc/<pid>/cgroup names the pod UID and container; the
pod's owner (its controller, else its image) names the workload, so one job's many processes and pods are
one workload, never one each.

In the DaemonSet the host's /proc is mounted read-only at /host/proc (no host PID namespace): the kernel
log prints host PIDs and /proc/<pid>/cgroup is world-readable, so that is all attribution needs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.workloads import owner_key

__all__ = ["PodAttribution", "gpus_by_pod_uid", "owner_key", "parse_cgroup", "pod_of_pid", "workload_key"]

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


def gpus_by_pod_uid(pids_by_gpu: Mapping[str, list[int]], proc_root: Path = Path("/proc")) -> dict[str, list[str]]:
    """The GPUs' processes charged to their pods through /proc/<pid>/cgroup: pod UID -> GPU UUIDs."""
    mapping: dict[str, list[str]] = {}
    for uuid, pids in pids_by_gpu.items():
        for pid in pids:
            pod = pod_of_pid(pid, proc_root)
            if pod is not None and uuid not in mapping.setdefault(pod.pod_uid, []):
                mapping[pod.pod_uid].append(uuid)
    return mapping


def workload_key(*, pod: PodAttribution | None, owners: Mapping[str, str], process: str | None) -> str:
    """The workload an Xid is charged to: the pod's owner, else the pod, else the process name; never a PID.

    `owners` maps pod UID -> owner_key(...) for the pods on this node. "" means nothing identifies the
    workload, and such a fault counts towards no distinct-workload window.
    """
    if pod is not None:
        return owners.get(pod.pod_uid) or f"pod/{pod.pod_uid}"
    name = (process or "").strip()
    return f"process/{name}" if name else ""

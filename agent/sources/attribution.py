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

_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
# A ReplicaSet is named <deployment>-<pod-template-hash>; a CronJob's Job is <cronjob>-<scheduled minute>.
_TEMPLATE_HASH = re.compile(r"^(?P<base>.+)-[bcdfghjklmnpqrstvwxz2456789]{6,10}$")
_SCHEDULED = re.compile(r"^(?P<base>.+)-\d{8,10}$")
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


def owner_key(namespace: str, *, owner_kind: str = "", owner_name: str = "", image: str = "") -> str:
    """The workload a pod belongs to: `namespace/Kind/name` of its top controller, else its image.

    A ReplicaSet is charged to its Deployment and a CronJob's Job to its CronJob, so every pod a controller
    makes, and every restart, is the same workload.
    """
    kind, name = owner_kind, owner_name
    if kind == "ReplicaSet" and (match := _TEMPLATE_HASH.match(name)):
        kind, name = "Deployment", match.group("base")
    elif kind == "Job" and (match := _SCHEDULED.match(name)):
        kind, name = "CronJob", match.group("base")
    if kind and name:
        return f"{namespace}/{kind}/{name}"
    if image:
        return f"image/{_image_name(image)}"
    return ""


def _image_name(image: str) -> str:
    """The image without digest or tag: every version of one program is one workload."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


def workload_key(*, pod: PodAttribution | None, owners: Mapping[str, str], process: str | None) -> str:
    """The workload an Xid is charged to: the pod's owner, else the pod, else the process name; never a PID.

    `owners` maps pod UID -> owner_key(...) for the pods on this node. "" means nothing identifies the
    workload, and such a fault counts towards no distinct-workload window.
    """
    if pod is not None:
        return owners.get(pod.pod_uid) or f"pod/{pod.pod_uid}"
    name = (process or "").strip()
    return f"process/{name}" if name else ""

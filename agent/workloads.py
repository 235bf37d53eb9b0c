"""Names a pod's workload (its top controller, else its image), so that one job's many pods are one workload.

Pure: the pod listing (agent.k8s.pods) and the kernel-log attribution (agent.sources.attribution) share it.
"""

from __future__ import annotations

import re

# A ReplicaSet is named <deployment>-<pod-template-hash>; a CronJob's Job is <cronjob>-<scheduled minute>.
_TEMPLATE_HASH = re.compile(r"^(?P<base>.+)-[bcdfghjklmnpqrstvwxz2456789]{6,10}$")
_SCHEDULED = re.compile(r"^(?P<base>.+)-\d{8,10}$")


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

"""Which resources the fake serves, at which paths, and its discovery documents."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from agent.timefmt import rfc3339


@dataclass(frozen=True, slots=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: tuple[str, ...] = ()
    short_names: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


RESOURCES = [
    Resource("", "v1", "nodes", "Node", False, ("status",), ("no",)),
    Resource("", "v1", "pods", "Pod", True, ("status", "eviction"), ("po",)),
    Resource("", "v1", "namespaces", "Namespace", False, (), ("ns",)),
    Resource("", "v1", "events", "Event", True, (), ("ev",)),
    Resource("", "v1", "configmaps", "ConfigMap", True, (), ("cm",)),
    Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ("status",), ("pdb",)),
    Resource("events.k8s.io", "v1", "events", "Event", True, (), ("ev",)),
    Resource("coordination.k8s.io", "v1", "leases", "Lease", True),
    Resource("apps", "v1", "daemonsets", "DaemonSet", True, ("status",), ("ds",)),
    Resource("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", False),
    Resource("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", False),
    Resource("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", True, ("status",)),
    Resource("resource.k8s.io", "v1", "devicetaintrules", "DeviceTaintRule", False, ("status",)),
]


BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}


def now_rfc3339(at: float | None = None) -> str:
    return rfc3339(at)


def discovery(path: str) -> dict[str, Any] | None:
    if path == "/version":
        return {"major": "1", "minor": "32", "gitVersion": "v1.32.0-fake", "platform": "linux/amd64"}
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}
    if path == "/apis":
        groups = sorted({(r.group, r.version) for r in RESOURCES if r.group})
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
             "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v}} for g, v in groups]}
    group_only = re.match(r"^/apis/([^/]+)$", path)
    if group_only:
        versions = sorted({r.version for r in RESOURCES if r.group == group_only.group(1)})
        if not versions:
            return None
        served = [{"groupVersion": f"{group_only.group(1)}/{v}", "version": v} for v in versions]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": group_only.group(1), "versions": served,
                "preferredVersion": served[0]}
    match = re.match(r"^/(?:api/(v1)|apis/([^/]+)/([^/]+))$", path)
    if not match:
        return None
    group, version = ("", "v1") if match.group(1) else (match.group(2), match.group(3))
    resources = []
    for r in RESOURCES:
        if (r.group, r.version) != (group, version):
            continue
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        resources.append({"name": r.plural, "singularName": r.kind.lower(), "namespaced": r.namespaced,
                          "kind": r.kind, "verbs": verbs, "shortNames": list(r.short_names)})
        for sub in r.subresources:
            sub_kind = "Eviction" if sub == "eviction" else r.kind
            sub_verbs = ["create"] if sub == "eviction" else ["get", "patch", "update"]
            entry: dict[str, Any] = {"name": f"{r.plural}/{sub}", "singularName": "", "namespaced": r.namespaced,
                                     "kind": sub_kind, "verbs": sub_verbs}
            if sub == "eviction":
                entry.update(group="policy", version="v1")
            resources.append(entry)
    if not resources:
        return None
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}".strip("/"),
            "resources": resources}

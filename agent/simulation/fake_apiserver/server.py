"""A faithful fake Kubernetes API server over real HTTP, for tests and `simulate`.

It serves what the agent and `kubectl` use: discovery; nodes (get, list with label selectors, the three
patch types, resourceVersion preconditions answered with 409, the status subresource, taint validation);
pods (list with field selectors, graceful deletion: a deleted or evicted pod keeps a deletionTimestamp
until its grace period has passed on the cluster's clock, or `finish_termination`); pods/eviction with
PodDisruptionBudget semantics (429 when no disruption is allowed, the bare 500 for a pod under two
budgets); events.k8s.io/v1 events (validated as on creation); coordination.k8s.io/v1 leases; apps/v1
daemonsets; ConfigMaps; watches with bookmarks and 410 (watch.py); resource.k8s.io/v1 DeviceClasses,
ResourceSlices, ResourceClaims and DeviceTaintRules (stored and listed, rules validated, deletion
preconditions honoured; no scheduler allocates claims); and injected faults (5xx, latency, downtime,
conflicts). Objects live in memory. What still differs from a real server is listed in docs/testing.md.
"""

from __future__ import annotations

import copy
import json
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from agent.simulation.fake_apiserver.patch import PatchError, json_merge_patch, json_patch, strategic_merge_patch
from agent.simulation.fake_apiserver.validation import (
    FieldError,
    validate_device_taint_rule,
    validate_event,
    validate_node,
)
from agent.simulation.fake_apiserver.watch import NotAcceptable, WatchHistory, metadata_only, partial
from agent.timefmt import rfc3339

#: A pod's terminationGracePeriodSeconds when its spec gives none (the API server's default).
DEFAULT_GRACE_SECONDS = 30
MULTIPLE_PDBS = "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."


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
_BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}


def now_rfc3339(at: float | None = None) -> str:
    return rfc3339(at)


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                "message": self.message, "code": self.code}
        if self.reason:
            body["reason"] = self.reason
        if self.details:
            body["details"] = self.details
        return body


@dataclass(slots=True)
class Faults:
    """What to break: every request answered 503 while down, extra latency, the next writes failed."""

    down: bool = False
    latency_seconds: float = 0.0
    fail_next_writes: list[int] = field(default_factory=list)
    conflict_first_write: bool = False
    requests: int = 0
    writes: int = 0
    _conflicted: set[str] = field(default_factory=set)


def invalid_object(kind: str, name: str, errors: list[FieldError]) -> ApiError:
    """422 Invalid as the API server words it: every field error in the message and as a cause."""
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: '
                    + ", ".join(f"{e.field}: {e.message}" for e in errors),
                    {"name": name, "kind": kind, "causes": [e.cause() for e in errors]})


class FakeCluster:
    """The objects, with a cluster-wide resourceVersion counter; thread-safe.

    `clock` (seconds since the epoch) is the cluster's own time: deletionTimestamps are set from it, and a
    terminating pod is gone once it passes its deadline, as a kubelet (or kwok) would finish it.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._terminating: dict[tuple[str, str, str, str], float] = {}
        self.lock = threading.RLock()
        self.revision = 1
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.faults = Faults()
        self.log: list[tuple[str, str, int]] = []
        self.history = WatchHistory()

    def _changed(self, type_: str, key: tuple[str, str, str, str], obj: dict[str, Any]) -> None:
        """Every write lands in the watch history under the revision it made."""
        self.history.record(self.revision, type_, key[0], key[1], key[2], obj)

    # ---- storage ----
    def _key(self, resource: Resource, namespace: str, name: str) -> tuple[str, str, str, str]:
        return (resource.group, resource.plural, namespace if resource.namespaced else "", name)

    def _stamp(self, resource: Resource, obj: dict[str, Any]) -> dict[str, Any]:
        self.revision += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self.revision)
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        return obj

    def create(self, resource: Resource, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            obj = copy.deepcopy(obj)
            meta = obj.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            name = meta.get("name")
            if not name:
                raise ApiError(422, "Invalid", f"{resource.kind} without metadata.name")
            if resource.namespaced:
                meta["namespace"] = namespace
            key = self._key(resource, namespace, name)
            if key in self.objects:
                raise ApiError(409, "AlreadyExists", f'{resource.plural} "{name}" already exists')
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now_rfc3339(self.clock()))
            if resource.kind == "Pod":
                obj.setdefault("spec", {}).setdefault("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
            _validate(resource, namespace, obj)
            self.objects[key] = self._stamp(resource, obj)
            self._changed("ADDED", key, self.objects[key])
            return copy.deepcopy(self.objects[key])

    def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        with self.lock:
            obj = self.objects.get(self._key(resource, namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{resource.plural} "{name}" not found',
                               {"name": name, "kind": resource.plural})
            return copy.deepcopy(obj)

    def list_objects(self, resource: Resource, namespace: str | None, label_selector: str = "",
             field_selector: str = "") -> list[dict[str, Any]]:
        with self.lock:
            items = [copy.deepcopy(o) for (g, p, ns, _), o in sorted(self.objects.items())
                     if (g, p) == (resource.group, resource.plural) and (namespace in (None, "") or ns == namespace)]
        return [o for o in items if _labels_match(o, label_selector) and _fields_match(o, field_selector)]

    def replace(self, resource: Resource, namespace: str, name: str, obj: dict[str, Any],
                subresource: str = "") -> dict[str, Any]:
        """PUT: the body names the object of the URL; resourceVersion, when given, must be current."""
        given = obj.get("metadata", {})
        if given.get("name") and given["name"] != name:
            raise ApiError(400, "BadRequest", f"the name of the object ({given['name']}) does not match the name "
                                              f"on the URL ({name})")
        if resource.namespaced and given.get("namespace") and given["namespace"] != namespace:
            raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace "
                                              "sent on the request")
        return self._update(resource, namespace, name, obj, subresource)

    def _update(self, resource: Resource, namespace: str, name: str, obj: dict[str, Any],
                subresource: str = "") -> dict[str, Any]:
        with self.lock:
            current = self.get(resource, namespace, name)
            wanted = obj.get("metadata", {}).get("resourceVersion")
            if wanted and wanted != current["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", _conflict_message(resource, name))
            updated = _keep_parts(resource, current, copy.deepcopy(obj), subresource)
            updated["metadata"]["uid"] = current["metadata"]["uid"]
            updated["metadata"]["creationTimestamp"] = current["metadata"].get("creationTimestamp")
            if resource.namespaced:
                updated["metadata"]["namespace"] = namespace
            updated["metadata"]["name"] = name
            for kept in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                if kept in current["metadata"]:
                    updated["metadata"][kept] = current["metadata"][kept]
            _validate(resource, namespace, updated)
            self.objects[self._key(resource, namespace, name)] = self._stamp(resource, updated)
            self._changed("MODIFIED", self._key(resource, namespace, name), updated)
            return copy.deepcopy(self.objects[self._key(resource, namespace, name)])

    def patch(self, resource: Resource, namespace: str, name: str, content_type: str, body: Any,
              subresource: str = "") -> dict[str, Any]:
        with self.lock:
            current = self.get(resource, namespace, name)
            try:
                if content_type.startswith("application/json-patch+json"):
                    patched = json_patch(current, body)
                elif content_type.startswith("application/merge-patch+json"):
                    patched = json_merge_patch(current, body)
                elif content_type.startswith("application/strategic-merge-patch+json"):
                    patched = strategic_merge_patch(current, body)
                else:
                    raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown "
                                   f"format - accepted media types include: application/json-patch+json, "
                                   f"application/merge-patch+json, application/strategic-merge-patch+json "
                                   f"(got {content_type})")
            except PatchError as exc:
                raise ApiError(422, "Invalid", str(exc)) from None
            if not isinstance(patched, dict):
                raise ApiError(422, "Invalid", "the patch does not give an object")
            wanted = patched.get("metadata", {}).get("resourceVersion")
            if wanted and wanted != current["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", _conflict_message(resource, name))
            renamed = patched.get("metadata", {}).get("name")
            if renamed != name:
                raise invalid_object(resource.kind, name, [FieldError(
                    "metadata.name", "FieldValueInvalid", f'Invalid value: "{renamed}": field is immutable')])
            patched.setdefault("metadata", {})["resourceVersion"] = current["metadata"]["resourceVersion"]
            return self._update(resource, namespace, name, patched, subresource)

    def delete(self, resource: Resource, namespace: str, name: str, *,
               grace_seconds: int | None = None) -> dict[str, Any]:
        """Delete, gracefully for a pod bound to a node: it gets a deletionTimestamp and stays (Terminating)
        until its grace period (the pod's own, or `grace_seconds`) passes; a later, shorter grace period
        moves the deadline in, a longer one never out. Zero, an unbound or a finished pod: gone at once."""
        with self.lock:
            obj = self.get(resource, namespace, name)
            key = self._key(resource, namespace, name)
            if resource.kind == "Pod":
                period = _grace_period(obj, grace_seconds)
                if period > 0:
                    return self._terminate(resource, key, obj, period)
            del self.objects[key]
            self._terminating.pop(key, None)
            self.revision += 1
            self._changed("DELETED", key, obj)
            return obj

    def _terminate(self, resource: Resource, key: tuple[str, str, str, str], pod: dict[str, Any],
                   period: int) -> dict[str, Any]:
        deadline = self.clock() + period
        if key in self._terminating and self._terminating[key] <= deadline:
            return pod
        self._terminating[key] = deadline
        pod["metadata"]["deletionTimestamp"] = now_rfc3339(deadline)
        pod["metadata"]["deletionGracePeriodSeconds"] = period
        self.objects[key] = self._stamp(resource, pod)
        self._changed("MODIFIED", key, pod)
        return copy.deepcopy(pod)

    def finish_terminations(self) -> None:
        """Remove the terminating pods whose grace period has passed on the cluster's clock."""
        with self.lock:
            now = self.clock()
            for key in [k for k, deadline in self._terminating.items() if deadline <= now]:
                self._finish(key)

    def finish_termination(self, namespace: str, name: str) -> None:
        """A terminating pod's containers have exited: the kubelet removes it now (grace period 0)."""
        with self.lock:
            key = self._key(_BY_PATH[("", "v1", "pods")], namespace, name)
            if key not in self._terminating:
                raise ValueError(f"pod {namespace}/{name} is not terminating")
            self._finish(key)

    def _finish(self, key: tuple[str, str, str, str]) -> None:
        self._terminating.pop(key, None)
        gone = self.objects.pop(key, None)
        if gone is not None:
            self.revision += 1
            self._changed("DELETED", key, gone)

    # ---- eviction ----
    def evict(self, namespace: str, name: str, *, grace_seconds: int | None = None) -> None:
        """Evict a pod as the Eviction API does: a pod already terminating, finished or pending goes without
        asking; a pod under two or more PodDisruptionBudgets is refused with a bare 500; one budget that
        allows no disruption refuses with 429; otherwise the pod is marked DisruptionTarget and deleted
        (gracefully)."""
        pods = _BY_PATH[("", "v1", "pods")]
        pdbs = _BY_PATH[("policy", "v1", "poddisruptionbudgets")]
        with self.lock:
            pod = self.get(pods, namespace, name)
            if _budget_ignored(pod):
                self.delete(pods, namespace, name, grace_seconds=grace_seconds)
                return
            covering = [pdb for pdb in self.list_objects(pdbs, namespace)
                        if _selector_matches(pdb.get("spec", {}).get("selector", {}), pod)]
            if len(covering) > 1:
                raise ApiError(500, "", MULTIPLE_PDBS)
            for pdb in covering:
                selector = pdb.get("spec", {}).get("selector", {})
                matching = [p for p in self.list_objects(pods, namespace) if _selector_matches(selector, p)]
                healthy = [p for p in matching if _pod_ready(p)]
                allowed = _disruptions_allowed(pdb, len(matching), len(healthy))
                if allowed <= 0 and _pod_ready(pod):
                    raise ApiError(429, "TooManyRequests",
                                   "Cannot evict pod as it would violate the pod's disruption budget.",
                                   {"causes": [{"reason": "DisruptionBudget", "message":
                                                f"The disruption budget {pdb['metadata']['name']} needs "
                                                f"{len(healthy) - allowed} healthy pods and has {len(healthy)} "
                                                f"currently"}]})
            conditions = [c for c in pod.get("status", {}).get("conditions", []) if c.get("type") != "DisruptionTarget"]
            conditions.append({"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                               "message": "Eviction API: evicting", "lastTransitionTime": now_rfc3339(self.clock())})
            pod.setdefault("status", {})["conditions"] = conditions
            self.objects[self._key(pods, namespace, name)] = self._stamp(pods, pod)
            self._changed("MODIFIED", self._key(pods, namespace, name), pod)
            self.delete(pods, namespace, name, grace_seconds=grace_seconds)

    # ---- helpers for tests and simulate ----
    def add(self, kind_plural: str, obj: dict[str, Any], *, group: str = "", namespace: str = "") -> dict[str, Any]:
        resource = next(r for r in RESOURCES if r.plural == kind_plural and r.group == group)
        return self.create(resource, namespace or obj.get("metadata", {}).get("namespace", ""), obj)

    def node(self, name: str) -> dict[str, Any]:
        return self.get(_BY_PATH[("", "v1", "nodes")], "", name)

    def pods_on(self, node: str) -> list[dict[str, Any]]:
        self.finish_terminations()
        return self.list_objects(_BY_PATH[("", "v1", "pods")], None, field_selector=f"spec.nodeName={node}")

    def device_taint_rules(self) -> list[dict[str, Any]]:
        return self.list_objects(next(r for r in RESOURCES if r.plural == "devicetaintrules"), None)

    def events(self) -> list[dict[str, Any]]:
        return self.list_objects(_BY_PATH[("events.k8s.io", "v1", "events")], None)


def _conflict_message(resource: Resource, name: str) -> str:
    return (f'Operation cannot be fulfilled on {resource.plural} "{name}": the object has been modified; '
            "please apply your changes to the latest version and try again")


def _keep_parts(resource: Resource, current: dict[str, Any], updated: dict[str, Any],
                subresource: str) -> dict[str, Any]:
    """The main resource ignores status; the status subresource changes only status."""
    if "status" not in resource.subresources:
        return updated
    if subresource == "status":
        kept = copy.deepcopy(current)
        kept["status"] = updated.get("status", {})
        kept["metadata"]["resourceVersion"] = updated.get("metadata", {}).get("resourceVersion")
        return kept
    updated["status"] = copy.deepcopy(current.get("status", {}))
    return updated


def _validate(resource: Resource, namespace: str, obj: dict[str, Any]) -> None:
    name = obj.get("metadata", {}).get("name", "")
    if resource.kind == "Node":
        errors = validate_node(obj)
    elif resource.kind == "Event" and resource.group == "events.k8s.io":
        errors = validate_event(obj, namespace)
    elif resource.kind == "DeviceTaintRule":
        errors = validate_device_taint_rule(obj)
    else:
        return
    if errors:
        raise invalid_object(resource.kind, name, errors)


def _check_preconditions(current: dict[str, Any], options: Any) -> None:
    """DeleteOptions.preconditions: a resourceVersion or uid that no longer matches is a 409, as on a real server."""
    wanted = (options or {}).get("preconditions") if isinstance(options, dict) else None
    for field_name in ("resourceVersion", "uid"):
        value = (wanted or {}).get(field_name)
        if value and value != (current.get("metadata") or {}).get(field_name):
            raise ApiError(409, "Conflict", f"Precondition failed: {field_name} in precondition: {value}, "
                                            f"{field_name} in object meta: {current['metadata'].get(field_name)}")


def _grace_period(pod: dict[str, Any], asked: int | None) -> int:
    """The grace period a delete gives a pod: none for an unbound or finished one (nothing runs it)."""
    if not pod.get("spec", {}).get("nodeName") or pod.get("status", {}).get("phase") in {"Succeeded", "Failed"}:
        return 0
    if asked is not None:
        return max(int(asked), 0)
    return int(pod.get("spec", {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS))


def _budget_ignored(pod: dict[str, Any]) -> bool:
    """Pods an eviction deletes without asking a budget: terminating, finished or not yet running."""
    phase = pod.get("status", {}).get("phase")
    return bool(pod["metadata"].get("deletionTimestamp")) or phase in {"Succeeded", "Failed", "Pending"}


def _pod_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status", {})
    if status.get("phase") != "Running" or pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))


def _disruptions_allowed(pdb: dict[str, Any], expected: int, healthy: int) -> int:
    spec = pdb.get("spec", {})
    if "minAvailable" in spec:
        return healthy - _scaled(spec["minAvailable"], expected, round_up=True)
    if "maxUnavailable" in spec:
        return _scaled(spec["maxUnavailable"], expected, round_up=True) - (expected - healthy)
    return 1


def _scaled(value: Any, total: int, *, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        share = int(value[:-1]) * total
        return -(-share // 100) if round_up else share // 100
    return int(value)


def _selector_matches(selector: dict[str, Any], obj: dict[str, Any]) -> bool:
    labels = obj.get("metadata", {}).get("labels", {}) or {}
    if not selector:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, op, values = expression["key"], expression["operator"], expression.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


_LABEL_TERM = re.compile(r"^\s*([\w./-]+)\s*(==|=|!=)\s*([\w./-]*)\s*$")


def _labels_match(obj: dict[str, Any], selector: str) -> bool:
    if not selector:
        return True
    labels = obj.get("metadata", {}).get("labels", {}) or {}
    for term in _split_selector(selector):
        match = _LABEL_TERM.match(term)
        if match:
            key, op, value = match.groups()
            if (labels.get(key) == value) != (op in {"=", "=="}):
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif " in " in term or " notin " in term:
            key, op, rest = re.split(r"\s+(in|notin)\s+", term.strip(), maxsplit=1)
            values = {v.strip() for v in rest.strip("() ").split(",")}
            if (labels.get(key) in values) != (op == "in"):
                return False
        elif term.strip() not in labels:
            return False
    return True


def _split_selector(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    return [t for t in [*terms, current] if t.strip()]


def _fields_match(obj: dict[str, Any], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        key, value = re.split(r"==|!=|=", term, maxsplit=1)
        actual: Any = obj
        for part in key.strip().split("."):
            actual = actual.get(part, "") if isinstance(actual, dict) else ""
        if (str(actual) == value.strip()) == negate:
            return False
    return True


def _asked_grace(options: dict[str, Any] | None, query: dict[str, str]) -> int | None:
    """gracePeriodSeconds from DeleteOptions (the body, or an Eviction's deleteOptions) or the query."""
    value = (options or {}).get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        raise ApiError(400, "BadRequest", f"gracePeriodSeconds {value!r} is not a number") from None


# ---- HTTP ----
_PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                   r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$")


class _QuietServer(ThreadingHTTPServer):
    """A client that went away mid-request (a killed agent) is routine here, not a traceback on stderr."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeApiServer:
    """Serves a FakeCluster on 127.0.0.1 until `stop`."""

    def __init__(self, cluster: FakeCluster | None = None, *, port: int = 0) -> None:
        self.cluster = cluster or FakeCluster()
        self._server = _QuietServer(("127.0.0.1", port), _handler(self.cluster))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-apiserver", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.cluster.history.close()
        self._server.shutdown()
        self._server.server_close()

    def kubeconfig(self) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                "users": [{"name": "fake", "user": {"token": "fake-token"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}


def _discovery(path: str) -> dict[str, Any] | None:
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


def _handler(cluster: FakeCluster) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Headers and body go out as separate writes: without this, Nagle's algorithm and the client's
            # delayed ACK add 40 ms to every response, which no real API server does.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if not raw:
                return None
            try:
                return json.loads(raw)
            except json.JSONDecodeError:
                raise ApiError(400, "BadRequest", "the request body is not JSON") from None

        def _serve(self, method: str) -> None:
            url = urlparse(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            faults = cluster.faults
            cluster.finish_terminations()
            with cluster.lock:
                faults.requests += 1
                writing = method in {"POST", "PUT", "PATCH", "DELETE"}
                forced = faults.fail_next_writes.pop(0) if writing and faults.fail_next_writes else None
                if writing and method in {"PUT", "PATCH"} and faults.conflict_first_write and forced is None:
                    # every first write to an object is answered 409; the retry (after a fresh read) goes through
                    if url.path in faults._conflicted:
                        faults._conflicted.discard(url.path)
                    else:
                        faults._conflicted.add(url.path)
                        forced = 409
                if writing:
                    faults.writes += 1
            if method == "GET" and query.get("watch") in {"1", "true"}:
                self._watch(url.path, query)
                return
            try:
                body = self._body()
                if faults.latency_seconds:
                    time.sleep(faults.latency_seconds)
                if faults.down:
                    raise ApiError(503, "ServiceUnavailable", "the server is currently unable to handle the request")
                if forced is not None:
                    reason = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError"}.get(forced, "Error")
                    raise ApiError(forced, reason, f"injected {forced}")
                code, result = self._route(method, url.path, query, body)
                cluster.log.append((method, url.path, code))
                self._send(code, result)
            except ApiError as exc:
                cluster.log.append((method, url.path, exc.code))
                self._send(exc.code, exc.status())

        def _watch(self, path: str, query: dict[str, str]) -> None:
            """A watch: the events after the asked resourceVersion as JSON lines over a chunked answer."""
            match = _PATH.match(path)
            resource = _BY_PATH.get((match.group("group") or "", match.group("core") or match.group("version"),
                                     match.group("plural"))) if match else None
            if match is None or resource is None or match.group("name"):
                cluster.log.append(("WATCH", path, 404))
                self._send(404, ApiError(404, "NotFound", "the server could not find the requested resource").status())
                return
            cluster.log.append(("WATCH", path, 200))
            labels, fields = query.get("labelSelector", ""), query.get("fieldSelector", "")
            try:
                partial_only = metadata_only(self.headers.get("Accept", ""), listing=False)
            except NotAcceptable as exc:
                self._send(406, ApiError(406, "NotAcceptable", str(exc)).status())
                return
            with cluster.lock:
                since = int(query.get("resourceVersion") or cluster.revision)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            events = cluster.history.stream(
                group=resource.group, plural=resource.plural, namespace=unquote(match.group("ns") or ""),
                since=since,
                matches=lambda o: _labels_match(o, labels) and _fields_match(o, fields),
                timeout=float(query.get("timeoutSeconds") or 1800),
                bookmarks=query.get("allowWatchBookmarks") == "true")
            try:
                for event in events:
                    shown = {"type": event["type"], "object": partial(event["object"])} \
                        if partial_only and event["type"] in {"ADDED", "MODIFIED", "DELETED"} else event
                    line = json.dumps(shown).encode() + b"\n"
                    self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                self.close_connection = True

        def _route(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, dict[str, Any]]:
            if method == "GET":
                document = _discovery(path.rstrip("/") or "/")
                if document is not None:
                    return 200, document
            match = _PATH.match(path)
            if not match:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
            group = match.group("group") or ""
            version = match.group("core") or match.group("version")
            resource = _BY_PATH.get((group, version, match.group("plural")))
            if resource is None:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            namespace = unquote(match.group("ns") or "")
            name = unquote(match.group("name") or "")
            sub = match.group("sub") or ""
            if sub and sub not in resource.subresources:
                raise ApiError(404, "NotFound", f"no subresource {sub}")
            if resource.namespaced and name and not namespace:
                raise ApiError(404, "NotFound", "namespaced resource without a namespace")
            return self._act(method, resource, namespace, name, sub, query, body)

        def _act(self, method: str, resource: Resource, namespace: str, name: str, sub: str,
                 query: dict[str, str], body: Any) -> tuple[int, dict[str, Any]]:
            if sub == "eviction":
                if method != "POST":
                    raise ApiError(405, "MethodNotAllowed", "eviction takes POST")
                cluster.evict(namespace, name, grace_seconds=_asked_grace(
                    (body or {}).get("deleteOptions") if isinstance(body, dict) else None, query))
                return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                             "code": 201}
            if method == "GET" and not name:
                with cluster.lock:  # the items and the list's resourceVersion are one snapshot
                    revision = cluster.revision
                    items = cluster.list_objects(resource, namespace or None, query.get("labelSelector", ""),
                                                 query.get("fieldSelector", ""))
                try:
                    partial_only = metadata_only(self.headers.get("Accept", ""), listing=True)
                except NotAcceptable as exc:
                    raise ApiError(406, "NotAcceptable", str(exc)) from None
                if partial_only:
                    return 200, {"kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1",
                                 "metadata": {"resourceVersion": str(revision)},
                                 "items": [partial(o) for o in items]}
                return 200, {"kind": f"{resource.kind}List", "apiVersion": resource.api_version,
                             "metadata": {"resourceVersion": str(revision)}, "items": items}
            if method == "GET":
                return 200, cluster.get(resource, namespace, name)
            if method == "POST" and not name:
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "expected an object")
                return 201, cluster.create(resource, namespace, body)
            if method == "PUT" and name:
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "expected an object")
                return 200, cluster.replace(resource, namespace, name, body, sub)
            if method == "PATCH" and name:
                content_type = self.headers.get("Content-Type", "")
                return 200, cluster.patch(resource, namespace, name, content_type, body, sub)
            if method == "DELETE" and name:
                _check_preconditions(cluster.get(resource, namespace, name), body)
                deleted = cluster.delete(resource, namespace, name,
                                         grace_seconds=_asked_grace(body if isinstance(body, dict) else None, query))
                if resource.kind == "Pod":
                    return 200, deleted
                return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 200}
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_PATCH(self) -> None:
            self._serve("PATCH")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

    return Handler

"""A faithful fake Kubernetes API server over real HTTP, for tests and `simulate`.

It serves what the agent and `kubectl` use: discovery; nodes (get, list with label selectors, the three
patch types, resourceVersion preconditions answered with 409, the status subresource); pods (list
with field selectors); pods/eviction with PodDisruptionBudget semantics (429 when no disruption is
allowed); events.k8s.io/v1 events; coordination.k8s.io/v1 leases; apps/v1 daemonsets; and injected
faults (5xx, latency, downtime, conflicts). Objects live in memory.
"""

from __future__ import annotations

import copy
import json
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from agent.simulation.fake_apiserver.patch import PatchError, json_merge_patch, json_patch, strategic_merge_patch


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
    Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ("status",), ("pdb",)),
    Resource("events.k8s.io", "v1", "events", "Event", True, (), ("ev",)),
    Resource("coordination.k8s.io", "v1", "leases", "Lease", True),
    Resource("apps", "v1", "daemonsets", "DaemonSet", True, ("status",), ("ds",)),
]
_BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                "message": self.message, "reason": self.reason, "code": self.code}
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


class FakeCluster:
    """The objects, with a cluster-wide resourceVersion counter; thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.revision = 1
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.faults = Faults()
        self.log: list[tuple[str, str, int]] = []

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
            meta.setdefault("creationTimestamp", now_rfc3339())
            self.objects[key] = self._stamp(resource, obj)
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
            self.objects[self._key(resource, namespace, name)] = self._stamp(resource, updated)
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
            patched.setdefault("metadata", {})["resourceVersion"] = current["metadata"]["resourceVersion"]
            return self.replace(resource, namespace, name, patched, subresource)

    def delete(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        with self.lock:
            obj = self.get(resource, namespace, name)
            del self.objects[self._key(resource, namespace, name)]
            self.revision += 1
            return obj

    # ---- eviction ----
    def evict(self, namespace: str, name: str) -> None:
        """Evict a pod unless a PodDisruptionBudget forbids it (429), as the Eviction API does."""
        pods = _BY_PATH[("", "v1", "pods")]
        pdbs = _BY_PATH[("policy", "v1", "poddisruptionbudgets")]
        with self.lock:
            pod = self.get(pods, namespace, name)
            for pdb in self.list_objects(pdbs, namespace):
                selector = pdb.get("spec", {}).get("selector", {})
                if not _selector_matches(selector, pod):
                    continue
                matching = [p for p in self.list_objects(pods, namespace) if _selector_matches(selector, p)]
                healthy = [p for p in matching if _pod_ready(p)]
                allowed = _disruptions_allowed(pdb, len(matching), len(healthy))
                if allowed <= 0:
                    raise ApiError(429, "TooManyRequests",
                                   "Cannot evict pod as it would violate the pod's disruption budget.",
                                   {"causes": [{"reason": "DisruptionBudget", "message":
                                                f"The disruption budget {pdb['metadata']['name']} needs "
                                                f"{len(healthy) - allowed} healthy pods and has {len(healthy)} "
                                                f"currently"}]})
            self.delete(pods, namespace, name)

    # ---- helpers for tests and simulate ----
    def add(self, kind_plural: str, obj: dict[str, Any], *, group: str = "", namespace: str = "") -> dict[str, Any]:
        resource = next(r for r in RESOURCES if r.plural == kind_plural and r.group == group)
        return self.create(resource, namespace or obj.get("metadata", {}).get("namespace", ""), obj)

    def node(self, name: str) -> dict[str, Any]:
        return self.get(_BY_PATH[("", "v1", "nodes")], "", name)

    def pods_on(self, node: str) -> list[dict[str, Any]]:
        return self.list_objects(_BY_PATH[("", "v1", "pods")], None, field_selector=f"spec.nodeName={node}")

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


def _pod_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status", {})
    if status.get("phase") != "Running":
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


# ---- HTTP ----
_PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                   r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$")


class FakeApiServer:
    """Serves a FakeCluster on 127.0.0.1 until `stop`."""

    def __init__(self, cluster: FakeCluster | None = None, *, port: int = 0) -> None:
        self.cluster = cluster or FakeCluster()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self.cluster))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-apiserver", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
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
                cluster.evict(namespace, name)
                return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                             "code": 201}
            if method == "GET" and not name:
                items = cluster.list_objects(resource, namespace or None, query.get("labelSelector", ""),
                                     query.get("fieldSelector", ""))
                return 200, {"kind": f"{resource.kind}List", "apiVersion": resource.api_version,
                             "metadata": {"resourceVersion": str(cluster.revision)}, "items": items}
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
                cluster.delete(resource, namespace, name)
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

"""The fake API server over real HTTP: routing, injected faults, lists, watches and the eviction subresource."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from agent.simulation.fake_apiserver.errors import ApiError
from agent.simulation.fake_apiserver.resources import BY_PATH, Resource, discovery
from agent.simulation.fake_apiserver.selectors import fields_match, labels_match
from agent.simulation.fake_apiserver.store import FakeCluster
from agent.simulation.fake_apiserver.watch import NotAcceptable, metadata_only, partial

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
                if method == "GET" and query.get("watch") not in {"1", "true"}:
                    reads = faults.fail_next_reads.get(url.path)
                    forced = reads.pop(0) if reads else faults.fail_reads.get(url.path, forced)
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
                    reason = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError",
                              503: "ServiceUnavailable"}.get(forced, "Error")
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
            resource = BY_PATH.get((match.group("group") or "", match.group("core") or match.group("version"),
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
                matches=lambda o: labels_match(o, labels) and fields_match(o, fields),
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
                document = discovery(path.rstrip("/") or "/")
                if document is not None:
                    return 200, document
            match = _PATH.match(path)
            if not match:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
            group = match.group("group") or ""
            version = match.group("core") or match.group("version")
            resource = BY_PATH.get((group, version, match.group("plural")))
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
                options = (body or {}).get("deleteOptions") if isinstance(body, dict) else None
                with cluster.lock:
                    _check_preconditions(cluster.get(resource, namespace, name), options)
                    cluster.evict(namespace, name, grace_seconds=_asked_grace(options, query))
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


def _check_preconditions(current: dict[str, Any], options: Any) -> None:
    """DeleteOptions.preconditions: a resourceVersion or uid that no longer matches is a 409, as on a real server."""
    wanted = (options or {}).get("preconditions") if isinstance(options, dict) else None
    for field_name in ("resourceVersion", "uid"):
        value = (wanted or {}).get(field_name)
        if value and value != (current.get("metadata") or {}).get(field_name):
            raise ApiError(409, "Conflict", f"Precondition failed: {field_name} in precondition: {value}, "
                                            f"{field_name} in object meta: {current['metadata'].get(field_name)}")


def _asked_grace(options: dict[str, Any] | None, query: dict[str, str]) -> int | None:
    """gracePeriodSeconds from DeleteOptions (the body, or an Eviction's deleteOptions) or the query."""
    value = (options or {}).get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        raise ApiError(400, "BadRequest", f"gracePeriodSeconds {value!r} is not a number") from None

"""An HTTP-aware TLS proxy in front of the real kube-apiserver, for fault injection (issue 38).

Clients talk to it as to the API server (its serving certificate is the API server's own, from the suite's CA,
so a kubeconfig only changes the address); it forwards every request unchanged (the client's own bearer
token: real RBAC, real admission) and streams the answer back, watches included. A rule matches requests by
method and path and answers them itself with a status (503, 429, ...) in the API's own Status form, a given
number of times or while it stands, or holds them for a while before forwarding (a slow or stuck server).
Every request is counted by rule, so a test can say which ones it failed.
"""

from __future__ import annotations

import http.client
import json
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

#: Request headers the proxy passes on (hop-by-hop ones are its own).
_PASSED = {"authorization", "content-type", "accept", "user-agent", "accept-encoding"}
_REASONS = {429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}


@dataclass
class Rule:
    """Requests of `method` ("" any) whose path (with its query) matches `path`: answered `status` (0: not
    answered, forwarded after `hold_seconds`), `times` times (None: while the rule stands)."""

    method: str
    path: str
    status: int = 0
    times: int | None = None
    hold_seconds: float = 0.0
    matched: int = 0
    _pattern: re.Pattern[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._pattern = re.compile(self.path)

    def matches(self, method: str, path: str) -> bool:
        return (not self.method or self.method == method) and bool(self._pattern.search(path)) and \
            (self.times is None or self.matched < self.times)


class FaultProxy:
    """The proxy on 127.0.0.1 (a free port), forwarding to `upstream` (https://host:port)."""

    def __init__(self, upstream: str, *, ca_file: Path, cert_file: Path, key_file: Path) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 443)
        self.client_context = ssl.create_default_context(cafile=str(ca_file))
        self.rules: list[Rule] = []
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, int]] = []
        server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_context.load_cert_chain(str(cert_file), str(key_file))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return

            def do_GET(self) -> None:
                proxy._handle(self)

            do_POST = do_PUT = do_PATCH = do_DELETE = do_GET  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.socket = server_context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, rule: Rule) -> Rule:
        with self.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()

    def _rule_for(self, method: str, path: str) -> Rule | None:
        with self.lock:
            for rule in self.rules:
                if rule.matches(method, path):
                    rule.matched += 1
                    return rule
        return None

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        method, path = request.command, request.path
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else None
        rule = self._rule_for(method, path)
        if rule is not None and rule.hold_seconds:
            time.sleep(rule.hold_seconds)
        if rule is not None and rule.status:
            self._answer(request, rule.status, method, path)
            return
        self._forward(request, method, path, body)

    def _answer(self, request: BaseHTTPRequestHandler, status: int, method: str, path: str) -> None:
        reason = _REASONS.get(status, "InternalError")
        data = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": status,
                           "reason": reason, "message": f"injected {status} by the fault proxy"}).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        if status == 429:
            request.send_header("Retry-After", "1")
        request.end_headers()
        request.wfile.write(data)
        with self.lock:
            self.requests.append((method, path, status))

    def _forward(self, request: BaseHTTPRequestHandler, method: str, path: str, body: bytes | None) -> None:
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED}
        connection = http.client.HTTPSConnection(*self.upstream, context=self.client_context, timeout=300)
        try:
            connection.request(method, path, body=body, headers=headers)
            answer = connection.getresponse()
            request.send_response(answer.status, answer.reason)
            for key, value in answer.getheaders():
                if key.lower() not in {"transfer-encoding", "connection", "content-length"}:
                    request.send_header(key, value)
            request.send_header("Transfer-Encoding", "chunked")
            request.end_headers()
            with self.lock:
                self.requests.append((method, path, answer.status))
            while True:  # streamed as it comes: a watch's events one by one
                chunk = answer.read1(65536)
                if not chunk:
                    break
                request.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                request.wfile.flush()
            request.wfile.write(b"0\r\n\r\n")
        except (TimeoutError, OSError, http.client.HTTPException):
            request.close_connection = True
        finally:
            connection.close()

"""The agent's HTTP endpoints: /metrics for Prometheus, /healthz (liveness) and /readyz for the kubelet's probes.

The health check answers (live, details); /readyz is also 503 when details says `"ready": False` (a fault
a restart cannot mend, such as a full disk under the journal: the pod reads unready, it is not restarted).

Bounded: each connection has a socket timeout (an idle or trickling client is dropped), and at most
`max_connections` are served at once; one past that is answered 503 and closed at once, so idle
connections can never cost more than that many threads.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HealthCheck = Callable[[], tuple[bool, dict[str, object]]]
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: What a connection past the cap gets (written without a thread, so it never waits on the client).
REFUSED = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 20\r\n"
           b"Connection: close\r\n\r\ntoo many connections")


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, up to a cap; past it, a 503 from the accepting thread and the socket closed."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *, max_connections: int,
                 on_refused: Callable[[], None]) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self._active = 0
        self._count_lock = threading.Lock()
        self._on_refused = on_refused
        super().__init__(address, handler)

    @property
    def active(self) -> int:
        return self._active

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        with self._count_lock:
            self._active += 1
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done()

    def _done(self) -> None:
        with self._count_lock:
            self._active -= 1
        self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        with contextlib.suppress(Exception):  # counted before the answer, so whoever reads the 503 sees the count;
            self._on_refused()                # counting a refusal never stops the server
        try:
            request.setblocking(False)
            request.send(REFUSED)
        except OSError:
            pass  # the client is gone or its buffer is full: closing is the answer
        finally:
            self.shutdown_request(request)


class AgentHttpServer:
    """Serves /metrics and /healthz on a background thread until `close`."""

    def __init__(self, host: str, port: int, *, metrics: Callable[[], bytes], health: HealthCheck,
                 timeout_seconds: float = 10.0, max_connections: int = 16,
                 on_refused: Callable[[], None] = lambda: None) -> None:
        handler = _handler(metrics, health, timeout_seconds)
        self._server = _BoundedServer((host, port), handler, max_connections=max_connections, on_refused=on_refused)
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def connections(self) -> int:
        """Connections being served now (each holds one thread)."""
        return self._server.active

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(metrics: Callable[[], bytes], health: HealthCheck, timeout_seconds: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        #: The socket timeout of each connection (StreamRequestHandler applies it): a client that sends
        #: nothing, or stops halfway, is dropped after this long.
        timeout = timeout_seconds

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, METRICS_CONTENT_TYPE, metrics())
            elif path in {"/healthz", "/readyz"}:
                live, details = health()
                ok = live and (path == "/healthz" or details.get("ready", True) is not False)
                body = json.dumps({"ok": ok, **details}, default=str).encode()
                self._send(200 if ok else 503, "application/json", body)
            else:
                self._send(404, "text/plain", b"not found\n")

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return

    return Handler

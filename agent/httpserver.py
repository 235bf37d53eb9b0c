"""The agent's HTTP endpoints: /metrics for Prometheus and /healthz for the kubelet's probes."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HealthCheck = Callable[[], tuple[bool, dict[str, object]]]
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class AgentHttpServer:
    """Serves /metrics and /healthz on a background thread until `close`."""

    def __init__(self, host: str, port: int, *, metrics: Callable[[], bytes], health: HealthCheck) -> None:
        handler = _handler(metrics, health)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(metrics: Callable[[], bytes], health: HealthCheck) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, METRICS_CONTENT_TYPE, metrics())
            elif path in {"/healthz", "/readyz"}:
                ok, details = health()
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

"""The reset container's side: a Unix socket on a volume shared with the agent's container, one JSON request
(the GPU UUID) and one JSON answer per connection. Only this container has the privileges a reset needs;
the agent's container asks it, and keeps none of them."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from agent.gpu.holders import Holder
from agent.gpu.reset import UUID_PATTERN, ResetExecutor, ResetOutcome

_MAX_REQUEST = 4096


@dataclass(slots=True)
class HelperClient:
    """Asks the reset container to reset one GPU; an unreachable helper fails the reset, saying so."""

    socket_path: str
    timeout_seconds: float = 300.0

    def __call__(self, uuid: str) -> ResetOutcome:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(self.timeout_seconds)
                conn.connect(self.socket_path)
                conn.sendall(json.dumps({"uuid": uuid}).encode() + b"\n")
                answer = _read_line(conn, limit=1 << 20)
        except OSError as exc:
            return ResetOutcome(False, f"reset helper at {self.socket_path} unreachable: {exc.strerror or exc}")
        try:
            data = json.loads(answer)
            holders = tuple(Holder(int(pid), str(name)) for pid, name in data.get("holders", []))
            return ResetOutcome(bool(data["ok"]), str(data["message"]), holders, bool(data.get("held", False)))
        except (ValueError, KeyError, TypeError):
            return ResetOutcome(False, f"reset helper answered something unreadable: {answer[:120]!r}")


def serve(socket_path: str, execute: ResetExecutor, *, stop: threading.Event) -> None:
    """Answer reset requests one at a time until `stop` is set (one reset at a time is what the driver allows)."""
    path = Path(socket_path)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        old = os.umask(0o177)  # the socket: owner only (both containers run as root)
        try:
            server.bind(socket_path)
        finally:
            os.umask(old)
        server.listen(4)
        server.settimeout(0.5)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                answer(conn, execute)


def answer(conn: socket.socket, execute: ResetExecutor) -> None:
    """One request, one answer; a malformed request is answered, never raised."""
    conn.settimeout(10.0)
    try:
        request = json.loads(_read_line(conn, limit=_MAX_REQUEST))
        uuid = str(request.get("uuid", "")) if isinstance(request, dict) else ""
    except (OSError, ValueError):
        uuid = ""
    if not UUID_PATTERN.match(uuid):
        outcome = ResetOutcome(False, "bad request: expected {\"uuid\": \"GPU-...\"}")
    else:
        try:
            outcome = execute(uuid)
        except Exception as exc:  # noqa: BLE001 - the agent gets an answer whatever happened
            outcome = ResetOutcome(False, f"{type(exc).__name__}: {exc}")
    body = {"ok": outcome.ok, "message": outcome.message, "holders": [[h.pid, h.name] for h in outcome.holders],
            "held": outcome.held}
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(body).encode() + b"\n")


def _read_line(conn: socket.socket, *, limit: int) -> str:
    data = b""
    while b"\n" not in data and len(data) < limit:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode("utf-8", errors="replace")

"""Network stand-ins for an API server gone wrong, shared by tests and benchmarks."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def silent_server() -> Iterator[str]:
    """A server (its URL) that accepts every connection and never answers a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        listener.settimeout(0.05)
        while not done.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        done.set()
        thread.join()
        for connection in held:
            connection.close()
        listener.close()


def refused_url() -> str:
    """A URL on a local port nobody listens on: every connection is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"

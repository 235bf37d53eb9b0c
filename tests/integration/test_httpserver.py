"""The agent's HTTP server over real sockets: idle connections time out, connections past the cap are refused."""

from __future__ import annotations

import select
import socket
import urllib.request
from collections.abc import Iterator

import pytest

from agent.httpserver import AgentHttpServer
from tests.conftest import wait_for


@pytest.fixture
def refused() -> list[int]:
    return []


def _server(refused: list[int], **options: float) -> AgentHttpServer:
    server = AgentHttpServer("127.0.0.1", 0, metrics=lambda: b"m 1\n", health=lambda: (True, {}),
                             on_refused=lambda: refused.append(1), **options)  # type: ignore[arg-type]
    server.start()
    return server


@pytest.fixture
def served(refused: list[int], request: pytest.FixtureRequest) -> Iterator[AgentHttpServer]:
    server = _server(refused, **request.param)
    yield server
    server.close()


def _connect(server: AgentHttpServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _closed_by_server(sock: socket.socket) -> bool:
    """The server closed its end: the socket reads as ready and returns end of file."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable) and sock.recv(4096, socket.MSG_PEEK) == b""


def _get(server: AgentHttpServer, path: str = "/metrics") -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10) as response:
        return int(response.status)


@pytest.mark.parametrize("served", [{"timeout_seconds": 0.2}], indirect=True)
def test_an_idle_connection_is_closed_after_the_timeout(served: AgentHttpServer):
    """A client that connects and sends nothing is dropped after the configured timeout, its thread freed."""
    idle = _connect(served)
    try:
        assert wait_for(lambda: _closed_by_server(idle))
        assert wait_for(lambda: served.connections == 0)
    finally:
        idle.close()


@pytest.mark.parametrize("served", [{"timeout_seconds": 30.0, "max_connections": 2}], indirect=True)
def test_connections_past_the_cap_are_refused_with_503(served: AgentHttpServer, refused: list[int]):
    """Two idle connections hold the two slots: a third is answered 503 and closed, and counted."""
    held = [_connect(served), _connect(served)]
    try:
        assert wait_for(lambda: served.connections == 2)
        extra = _connect(served)
        with extra:
            extra.settimeout(10)
            answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.0 503 ")
        assert refused == [1]
        assert served.connections == 2
    finally:
        for sock in held:
            sock.close()


@pytest.mark.parametrize("served", [{"timeout_seconds": 30.0, "max_connections": 2}], indirect=True)
def test_a_slot_freed_by_a_closed_connection_serves_again(served: AgentHttpServer):
    """The cap counts connections being served, not ever served: after the idle ones go, requests pass."""
    held = [_connect(served), _connect(served)]
    assert wait_for(lambda: served.connections == 2)
    for sock in held:
        sock.close()
    assert wait_for(lambda: served.connections == 0)
    assert [_get(served) for _ in range(5)] == [200] * 5

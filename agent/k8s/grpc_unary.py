"""One gRPC unary call over HTTP/2 cleartext on a unix socket, without grpcio: python-hyper's `h2` keeps the
connection's state (framing, HPACK with its dynamic table and Huffman codes, flow control, SETTINGS and PING
acknowledgements); this module does the socket, the deadline, the size bound and gRPC's own framing and status.
"""

from __future__ import annotations

import socket
import struct
import time
import urllib.parse
from collections.abc import Iterable

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

#: What the answer's frames and header blocks may be: the protocol's least frame size (never advertising
#: more), and 64 KiB of headers.
MAX_FRAME = 16384
MAX_HEADER_BLOCK = 64 * 1024
STATUS_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
                "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")


class CallFailed(OSError):
    """The call gave no answer; `code` is the gRPC status when the server sent one. The message is one line."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


def status_name(code: int) -> str:
    return STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else "UNKNOWN"


def _h2_error(code: int) -> str:
    try:
        return h2.errors.ErrorCodes(code).name
    except ValueError:
        return f"error {code}"


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."


def _timeout(seconds: float) -> str:
    """The grpc-timeout header: at most 8 digits, in milliseconds while they fit, else in seconds."""
    millis = max(1, int(seconds * 1000))
    return f"{millis}m" if millis <= 99_999_999 else f"{min(int(seconds), 99_999_999)}S"


def unary_call(socket_path: str, method: str, request: bytes, *, timeout_seconds: float,
               max_response_bytes: int = 16 * 1024 * 1024) -> bytes:
    """The response message of `method` called with `request` (raises CallFailed, an OSError, on any failure)."""
    call = _Call(socket_path, time.monotonic() + timeout_seconds, max_response_bytes)
    try:
        call.connect()
        call.send_request(method, request, timeout_seconds)
        return call.read_answer()
    except TimeoutError:
        raise CallFailed(f"timed out after {timeout_seconds:g} s") from None
    except (ConnectionError, BrokenPipeError):
        raise CallFailed(f"connection closed before the answer{call.goaway}") from None
    finally:
        call.sock.close()


class _Call:
    def __init__(self, socket_path: str, deadline: float, max_response_bytes: int) -> None:
        self.path = socket_path
        self.deadline = deadline
        self.limit = max_response_bytes
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.goaway = ""
        self.connection = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.connection.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_BLOCK})
        self.stream = 0
        self.head: dict[str, str] | None = None
        self.body = bytearray()

    def _time_left(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)

    def connect(self) -> None:
        self._time_left()
        try:
            self.sock.connect(self.path)
        except FileNotFoundError:
            raise CallFailed("cannot connect: no such socket") from None
        except ConnectionRefusedError:
            raise CallFailed("cannot connect: connection refused (nothing listens on the socket)") from None
        except TimeoutError:
            raise
        except OSError as exc:
            raise CallFailed(f"cannot connect: {exc.strerror or exc}") from None

    def _flush(self) -> None:
        """What the connection has to send: our frames, and its acknowledgements of the server's."""
        data = self.connection.data_to_send()
        if data:
            self._time_left()
            self.sock.sendall(data)

    def send_request(self, method: str, request: bytes, timeout_seconds: float) -> None:
        message = b"\x00" + struct.pack(">I", len(request)) + request
        if len(message) > 65535:
            raise ValueError("the request must fit the initial window")
        connection = self.connection
        connection.initiate_connection()
        self.stream = connection.get_next_available_stream_id()
        connection.send_headers(self.stream, [
            (":method", "POST"), (":scheme", "http"), (":path", method), (":authority", "localhost"),
            ("content-type", "application/grpc"), ("te", "trailers"),
            ("grpc-timeout", _timeout(timeout_seconds)), ("user-agent", "gpu-health-agent")])
        for start in range(0, len(message), MAX_FRAME):
            connection.send_data(self.stream, message[start:start + MAX_FRAME],
                                 end_stream=start + MAX_FRAME >= len(message))
        self._flush()

    def read_answer(self) -> bytes:
        while True:
            self._time_left()
            chunk = self.sock.recv(65536)
            if not chunk:
                raise CallFailed(f"connection closed before the answer{self.goaway}")
            try:
                events = self.connection.receive_data(chunk)
            except h2.exceptions.FrameTooLargeError as exc:
                raise CallFailed(f"not an HTTP/2 gRPC answer ({_one_line(str(exc), 100)})") from None
            except h2.exceptions.DenialOfServiceError:
                raise CallFailed(f"the answer's headers are over {MAX_HEADER_BLOCK} bytes") from None
            except h2.exceptions.ProtocolError as exc:
                raise CallFailed(f"protocol error: {_one_line(str(exc), 200)}") from None
            self._flush()  # the connection's acknowledgements of the server's SETTINGS and PINGs, at once
            for event in events:
                answer = self._take(event)
                if answer is not None:
                    return answer
            self._flush()  # the window updates for the data taken

    def _take(self, event: h2.events.Event) -> bytes | None:
        """One event of the connection; the answer's message once its trailers (or trailers only) arrived."""
        if isinstance(event, h2.events.ConnectionTerminated):
            debug = (event.additional_data or b"").decode("utf-8", errors="replace")
            self.goaway = f" (GOAWAY {_h2_error(int(event.error_code or 0))}" \
                          f"{': ' + _one_line(debug, 100) if debug else ''})"
            if (event.last_stream_id or 0) < self.stream:
                raise CallFailed(f"the server refused the call{self.goaway}")
        elif isinstance(event, h2.events.StreamReset):
            raise CallFailed(f"the server reset the call ({_h2_error(int(event.error_code or 0))}){self.goaway}")
        elif isinstance(event, h2.events.ResponseReceived):
            self.head = _fields(event.headers)
        elif isinstance(event, h2.events.DataReceived):
            self.body += event.data or b""
            if len(self.body) > self.limit + 5:
                raise CallFailed(f"the answer is over {self.limit} bytes")
            self.connection.acknowledge_received_data(event.flow_controlled_length or 0, self.stream)
        elif isinstance(event, h2.events.TrailersReceived):
            return _answer(self.head or {}, _fields(event.headers), bytes(self.body))
        elif isinstance(event, h2.events.StreamEnded):
            head = self.head or {}
            if self.body or "grpc-status" not in head:
                raise CallFailed(f"the answer ended without trailers (HTTP status {head.get(':status')})")
            return _answer(head, head, b"")  # trailers only: the status is in the headers
        return None


def _fields(headers: Iterable[tuple[str | bytes, str | bytes]] | None) -> dict[str, str]:
    """A header block (decoded as UTF-8 by the connection) as names to values, the first of repeated names
    winning."""
    pairs = [(_text(name), _text(value)) for name, value in headers or ()]
    return dict(reversed(pairs))


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode("utf-8", errors="replace")


def _answer(head: dict[str, str], trailers: dict[str, str], body: bytes) -> bytes:
    """The one message of a finished call, or CallFailed naming its gRPC status."""
    status = trailers.get("grpc-status")
    if status is None:
        raise CallFailed(f"the answer has no grpc-status (HTTP status {head.get(':status')}, "
                         f"content-type {head.get('content-type')!r})")
    try:
        code = int(status)
    except ValueError:
        raise CallFailed(f"the answer's grpc-status {status!r} is not a number") from None
    if code:
        message = _one_line(urllib.parse.unquote(trailers.get("grpc-message", ""), errors="replace"))
        raise CallFailed(f"grpc-status {code} ({status_name(code)}){': ' + message if message else ''}", code)
    if head.get(":status") != "200" or not head.get("content-type", "").startswith("application/grpc"):
        raise CallFailed(f"not a gRPC answer (HTTP status {head.get(':status')}, "
                         f"content-type {head.get('content-type')!r})")
    if len(body) < 5:
        raise CallFailed("the answer holds no message")
    compressed, length = body[0], int.from_bytes(body[1:5], "big")
    if compressed:
        raise CallFailed("the answer is compressed (none was asked for)")
    if len(body) != 5 + length:
        raise CallFailed(f"the answer's message is {len(body) - 5} bytes, its prefix says {length}")
    return body[5:]

"""One gRPC unary call over HTTP/2 cleartext on a unix socket, with the standard library only (no grpcio).

The response's headers and trailers are decoded with a full HPACK decoder (agent.k8s.hpack: static and
dynamic tables, Huffman), not by skipping what we do not need: grpc-go and grpcio index fields into the
dynamic table and Huffman-code grpc-status and grpc-message, and a later block may refer to an earlier
one's entries, so only a decoder that keeps the connection's table reads them reliably.
"""

from __future__ import annotations

import socket
import struct
import time
import urllib.parse

from agent.k8s import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY = 0x4, 0x8, 0x20
STREAM = 1  # the one stream a unary call needs
MAX_FRAME = 16384  # the protocol's default and least frame size: what we accept (never advertising more) and send
MAX_HEADER_BLOCK = 64 * 1024
ENABLE_PUSH = 0x2
STATUS_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
                "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")
H2_ERRORS = ("NO_ERROR", "PROTOCOL_ERROR", "INTERNAL_ERROR", "FLOW_CONTROL_ERROR", "SETTINGS_TIMEOUT",
             "STREAM_CLOSED", "FRAME_SIZE_ERROR", "REFUSED_STREAM", "CANCEL", "COMPRESSION_ERROR",
             "CONNECT_ERROR", "ENHANCE_YOUR_CALM", "INADEQUATE_SECURITY", "HTTP_1_1_REQUIRED")


class CallFailed(OSError):
    """The call gave no answer; `code` is the gRPC status when the server sent one. The message is one line."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


def status_name(code: int) -> str:
    return STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else "UNKNOWN"


def _h2_error(code: int) -> str:
    return H2_ERRORS[code] if 0 <= code < len(H2_ERRORS) else f"error {code}"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


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
        self.buffer = bytearray()
        self.goaway = ""
        self.decoder = hpack.Decoder()

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

    def _send(self, data: bytes) -> None:
        self._time_left()
        self.sock.sendall(data)

    def _read(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._time_left()
            chunk = self.sock.recv(65536)
            if not chunk:
                raise CallFailed(f"connection closed before the answer{self.goaway}")
            self.buffer += chunk
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def _frame(self) -> tuple[int, int, int, bytes]:
        head = self._read(9)
        length = int.from_bytes(head[:3], "big")
        kind, flags, stream = struct.unpack(">BBI", head[3:])
        if length > MAX_FRAME:
            raise CallFailed(f"not an HTTP/2 gRPC answer (a frame of {length} bytes, over {MAX_FRAME})")
        return kind, flags, stream & 0x7FFFFFFF, self._read(length)

    def send_request(self, method: str, request: bytes, timeout_seconds: float) -> None:
        settings = struct.pack(">HI", ENABLE_PUSH, 0)
        headers = hpack.encode([
            (":method", "POST"), (":scheme", "http"), (":path", method), (":authority", "localhost"),
            ("content-type", "application/grpc"), ("te", "trailers"),
            ("grpc-timeout", _timeout(timeout_seconds)), ("user-agent", "gpu-health-agent")])
        message = b"\x00" + struct.pack(">I", len(request)) + request
        if len(headers) > MAX_FRAME or len(message) > 65535:
            raise ValueError("the request must fit one header frame and the initial window")
        out = PREFACE + frame(SETTINGS, 0, 0, settings) + frame(HEADERS, END_HEADERS, STREAM, headers)
        for start in range(0, len(message), MAX_FRAME):
            last = start + MAX_FRAME >= len(message)
            out += frame(DATA, END_STREAM if last else 0, STREAM, message[start:start + MAX_FRAME])
        self._send(out)

    def read_answer(self) -> bytes:
        body = bytearray()
        block = bytearray()
        block_ends_stream = continuing = False
        head: dict[str, str] | None = None
        while True:
            kind, flags, stream, payload = self._frame()
            if continuing and kind != CONTINUATION:
                raise CallFailed("protocol error: a header block cut by another frame")
            if kind == SETTINGS and not flags & ACK:
                self._send(frame(SETTINGS, ACK, 0))  # nothing in them changes what this client sends
            elif kind == PING and not flags & ACK:
                self._send(frame(PING, ACK, 0, payload))
            elif kind == GOAWAY:
                self._goaway(payload)
            elif kind == RST_STREAM and stream == STREAM:
                code = int.from_bytes(payload[:4], "big")
                raise CallFailed(f"the server reset the call ({_h2_error(code)}){self.goaway}")
            elif kind in (HEADERS, CONTINUATION, DATA) and stream != STREAM:
                raise CallFailed(f"protocol error: frame type {kind} on stream {stream}")
            elif kind in (HEADERS, CONTINUATION):
                if kind == HEADERS:
                    payload = _unpad(payload, flags, priority=True)
                    block_ends_stream = bool(flags & END_STREAM)
                block += payload
                if len(block) > MAX_HEADER_BLOCK:
                    raise CallFailed(f"the answer's headers are over {MAX_HEADER_BLOCK} bytes")
                continuing = not flags & END_HEADERS
                if continuing:
                    continue
                fields = self._decode(bytes(block))
                block.clear()
                if head is None:
                    head = fields
                    if not block_ends_stream:
                        continue  # trailers follow the message
                return _answer(head, fields, bytes(body))
            elif kind == DATA:
                if head is None:
                    raise CallFailed("protocol error: data before the answer's headers")
                body += _unpad(payload, flags)
                if len(body) > self.limit + 5:
                    raise CallFailed(f"the answer is over {self.limit} bytes")
                if flags & END_STREAM:
                    raise CallFailed(f"the answer ended without trailers (HTTP status {head.get(':status')})")
                if payload:
                    increment = struct.pack(">I", len(payload))
                    self._send(frame(WINDOW_UPDATE, 0, 0, increment) + frame(WINDOW_UPDATE, 0, STREAM, increment))

    def _goaway(self, payload: bytes) -> None:
        last_stream = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
        code = int.from_bytes(payload[4:8], "big")
        debug = payload[8:].decode("utf-8", errors="replace")
        self.goaway = f" (GOAWAY {_h2_error(code)}{': ' + _one_line(debug, 100) if debug else ''})"
        if last_stream < STREAM:
            raise CallFailed(f"the server refused the call{self.goaway}")

    def _decode(self, block: bytes) -> dict[str, str]:
        try:
            fields = self.decoder.decode(block)
        except hpack.HpackError as exc:
            raise CallFailed(f"undecodable answer headers ({exc})") from None
        return {name: value for name, value in reversed(fields)}  # the first of repeated names wins


def _unpad(payload: bytes, flags: int, *, priority: bool = False) -> bytes:
    start, end = 0, len(payload)
    if flags & PADDED:
        if not payload or payload[0] >= len(payload):
            raise CallFailed("protocol error: bad padding")
        start, end = 1, len(payload) - payload[0]
    if priority and flags & PRIORITY:
        start += 5
    if start > end:
        raise CallFailed("protocol error: frame too short")
    return payload[start:end]


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

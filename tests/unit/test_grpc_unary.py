"""The gRPC unary client over h2 (agent.k8s.grpc_unary) against a real grpcio server, grpc-go's bytes, bad servers."""

import base64
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import hpack
import pytest
from hyperframe.frame import PingFrame, SettingsFrame

from agent.k8s import grpc_unary
from agent.k8s.podresources import LIST_METHOD, PodDevices, encode_list_response, list_pod_devices

# What a grpc-go v1.82.1 server wrote back (SETTINGS, SETTINGS ACK, WINDOW_UPDATE, PING, HEADERS with Huffman-coded
# and dynamic-table-indexed fields, DATA, trailers), captured once over a unix socket answering GRPC_GO_PODS.
GRPC_GO_OK = bytes.fromhex(
    "0000060400000000000005000040000000000401000000000000040800000000000000000500000806000000000002041010090e070700"
    "000e010400000001885f8b1d75d0620d263d4c4d656400007d00000000000100000000780a3d0a09747261696e65722d3012026d6c1a2c"
    "0a046d61696e12240a0e6e76696469612e636f6d2f67707512084750552d6161616112084750552d626262620a370a056d69672d301202"
    "6d6c1a2a0a046d61696e12220a166e76696469612e636f6d2f6d69672d31672e3130676212084d49472d6464646400002d010500000001"
    "40889acac8b21234da8f013040899acac8b5254207317f004087f2b26c19a82d9f8b41e92a9dc745a55272d85f")
# grpc-go refusing with status.Error(codes.PermissionDenied, "caller is not allowed: ünïcode & 100% sure"): one
# HEADERS frame (trailers only), the message Huffman-coded and percent-encoded.
GRPC_GO_DENIED = bytes.fromhex(
    "0000060400000000000005000040000000000401000000000000040800000000000000000500000806000000000002041010090e070700"
    "004e010500000001885f8b1d75d0620d263d4c4d656440889acac8b21234da8f013740899acac8b5254207317fa820e8a0b628642951d2"
    "a0e8a0fe0b25c515bccab76f54ade65587090f2154f8502002a26d445b617f")
GRPC_GO_PODS = [PodDevices("ml", "trainer-0", {"nvidia.com/gpu": ["GPU-aaaa", "GPU-bbbb"]}),
                PodDevices("ml", "mig-0", {"nvidia.com/mig-1g.10gb": ["MIG-dddd"]})]


@pytest.fixture
def grpcio_server(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Starts a real grpcio server on a unix socket with the given PodResourcesLister/List handler."""
    servers = []

    def start(handler: Callable[[bytes, grpc.ServicerContext], bytes] | None) -> str:
        path = str(tmp_path / "k.sock")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        if handler is not None:
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
                "List": grpc.unary_unary_rpc_method_handler(handler)}),))
        server.add_insecure_port(f"unix://{path}")
        server.start()
        servers.append(server)
        return path

    yield start
    for server in servers:
        server.stop(0)


@pytest.fixture
def raw_server(tmp_path: Path) -> Iterator[Callable[[Callable[[socket.socket], None]], str]]:
    """Starts a plain unix socket server that hands each connection to `serve` on its own thread."""
    listeners: list[socket.socket] = []

    def start(serve: Callable[[socket.socket], None]) -> str:
        path = str(tmp_path / "raw.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(4)
        listeners.append(listener)

        def accept() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                threading.Thread(target=_serve_then_close, args=(serve, conn), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return path

    yield start
    for listener in listeners:
        listener.close()


def _serve_then_close(serve: Callable[[socket.socket], None], conn: socket.socket) -> None:
    with conn:
        conn.settimeout(10)
        with contextlib.suppress(OSError):
            serve(conn)


def _drain(conn: socket.socket) -> None:
    """Reads until the client hangs up."""
    while conn.recv(65536):
        pass


def _replay(answer: bytes) -> Callable[[socket.socket], None]:
    def serve(conn: socket.socket) -> None:
        conn.recv(65536)  # the client's preface, SETTINGS, HEADERS and DATA
        conn.sendall(answer)
        _drain(conn)
    return serve


def _pods(count: int) -> list[PodDevices]:
    return [PodDevices(f"ns-{i % 50}", f"pod-{i:05d}", {"nvidia.com/gpu": [f"GPU-{i:032x}", f"GPU-{i + 1:032x}::3"]})
            for i in range(count)]


def _as_tuples(pods: list[PodDevices]) -> list[tuple[str, str, dict[str, list[str]]]]:
    return [(p.namespace, p.name, p.devices) for p in pods]


def test_a_grpcio_kubelet_answer_decodes(grpcio_server):
    """A small answer from a real grpcio server comes back as the pods it encoded."""
    path = grpcio_server(lambda _request, _context: encode_list_response(GRPC_GO_PODS))
    assert _as_tuples(list_pod_devices(path)) == _as_tuples(GRPC_GO_PODS)


@pytest.mark.parametrize("pods", [700, 9000], ids=["about-85KiB", "about-1.1MiB"])
def test_an_answer_larger_than_the_initial_window_arrives_in_many_frames(grpcio_server, pods):
    """Over 64 KiB (one window) and ~1 MiB: the client's WINDOW_UPDATEs let every DATA frame through."""
    expected = _pods(pods)
    answer = encode_list_response(expected)
    assert len(answer) > 65535
    path = grpcio_server(lambda _request, _context: answer)
    assert _as_tuples(list_pod_devices(path, timeout_seconds=10)) == _as_tuples(expected)


def test_an_answer_over_the_bound_is_refused(grpcio_server):
    """The response size bound holds: a 1 MiB answer with a 100 kB bound is an error, not a 1 MiB buffer."""
    path = grpcio_server(lambda _request, _context: encode_list_response(_pods(9000)))
    with pytest.raises(OSError, match=r"^the answer is over 100000 bytes$"):
        grpc_unary.unary_call(path, LIST_METHOD, b"", timeout_seconds=10, max_response_bytes=100_000)


def test_a_server_without_the_service_is_named_unimplemented(grpcio_server):
    """A server that does not serve PodResourcesLister gives one line with grpc-status 12 and its message."""
    path = grpcio_server(None)
    with pytest.raises(OSError) as raised:
        list_pod_devices(path)
    assert str(raised.value) == f"kubelet PodResources at {path}: grpc-status 12 (UNIMPLEMENTED): Method not found!"


def test_a_refusal_carries_its_status_and_percent_decoded_message(grpcio_server):
    """PERMISSION_DENIED with a non-ASCII, multi-line message: one line, the code's name and the message."""
    def deny(_request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "caller is not allowed:\nünïcode & 100% sure")
        return b""

    path = grpcio_server(deny)
    with pytest.raises(grpc_unary.CallFailed) as raised:
        grpc_unary.unary_call(path, LIST_METHOD, b"", timeout_seconds=5)
    assert str(raised.value) == "grpc-status 7 (PERMISSION_DENIED): caller is not allowed: ünïcode & 100% sure"
    assert raised.value.code == 7


def test_huffman_coded_trailers_from_grpcio_are_decoded(grpcio_server, monkeypatch):
    """grpcio Huffman-codes binary (-bin) trailer values: the connection's decoder reads them back exactly."""
    blocks: list[list[tuple[bytes, bytes]]] = []
    decode = hpack.Decoder.decode

    def recording(self: hpack.Decoder, block: bytes, raw: bool = False) -> list[tuple[bytes, bytes]]:
        blocks.append(list(decode(self, block, raw=raw)))
        return blocks[-1]

    monkeypatch.setattr(hpack.Decoder, "decode", recording)

    def answer(_request: bytes, context: grpc.ServicerContext) -> bytes:
        context.set_trailing_metadata((("detail-bin", b"\x00\x01binary trailer \xff"),))
        return b"ok"

    path = grpcio_server(answer)
    assert grpc_unary.unary_call(path, LIST_METHOD, b"", timeout_seconds=5) == b"ok"
    sent = base64.b64encode(b"\x00\x01binary trailer \xff").decode().rstrip("=")
    fields = [(bytes(name), bytes(value)) for name, value in blocks[-1]]
    assert (b"detail-bin", sent.encode()) in fields and (b"grpc-status", b"0") in fields


def test_a_grpc_go_answer_with_huffman_and_indexed_fields_decodes(raw_server):
    """The bytes a grpc-go server wrote (Huffman-coded names and values, incremental indexing) decode."""
    path = raw_server(_replay(GRPC_GO_OK))
    assert _as_tuples(list_pod_devices(path)) == _as_tuples(GRPC_GO_PODS)


def test_a_grpc_go_refusal_in_trailers_only_is_named(raw_server):
    """grpc-go's trailers-only refusal (Huffman-coded grpc-message) gives its status and message."""
    path = raw_server(_replay(GRPC_GO_DENIED))
    with pytest.raises(OSError) as raised:
        list_pod_devices(path)
    assert str(raised.value).endswith(": grpc-status 7 (PERMISSION_DENIED): caller is not allowed: ünïcode & 100% sure")


def test_a_server_that_never_answers_times_out_within_the_bound(raw_server):
    """A server that accepts and reads but never writes: the call ends at its timeout, not later."""
    path = raw_server(_drain)
    started = time.monotonic()
    with pytest.raises(OSError, match=r": timed out after 0.4 s$"):
        list_pod_devices(path, timeout_seconds=0.4)
    assert time.monotonic() - started < 1.5


def test_a_socket_that_does_not_exist_is_one_line(tmp_path: Path):
    """No kubelet socket: an OSError saying so, no traceback of grpc or errno."""
    path = str(tmp_path / "none.sock")
    with pytest.raises(OSError) as raised:
        list_pod_devices(path, timeout_seconds=0.5)
    assert str(raised.value) == f"kubelet PodResources at {path}: cannot connect: no such socket"


@pytest.mark.parametrize("hang_up", ["end-of-file", "reset"])
def test_a_server_that_closes_mid_answer_is_named(raw_server, hang_up):
    """The connection ends in the middle of the DATA frame (EOF, or a reset): 'connection closed before the answer'."""
    def cut(conn: socket.socket) -> None:
        conn.recv(65536)
        conn.sendall(GRPC_GO_OK[:len(GRPC_GO_OK) - 90])
        if hang_up == "end-of-file":
            conn.shutdown(socket.SHUT_WR)
            _drain(conn)  # nothing left unread: the client sees a clean end of file, not a reset

    path = raw_server(cut)
    with pytest.raises(OSError, match=r": connection closed before the answer$"):
        list_pod_devices(path)


def test_pings_are_answered_and_settings_acknowledged(raw_server):
    """The client acknowledges the server's SETTINGS and answers a PING with its payload."""
    received, done = bytearray(), threading.Event()

    def serve(conn: socket.socket) -> None:
        received.extend(conn.recv(65536))
        conn.sendall(GRPC_GO_OK)
        while chunk := conn.recv(65536):
            received.extend(chunk)
        done.set()

    list_pod_devices(raw_server(serve))
    assert done.wait(5)
    assert SettingsFrame(0, flags=["ACK"]).serialize() in received
    assert PingFrame(0, flags=["ACK"], opaque_data=bytes.fromhex("02041010090e0707")).serialize() in received


def test_the_deadline_sent_to_the_server_fits_grpc_timeouts_eight_digits():
    """grpc-timeout is milliseconds while they fit 8 digits, then seconds (grpc-go refuses a longer one)."""
    assert grpc_unary._timeout(5) == "5000m"
    assert grpc_unary._timeout(0.0001) == "1m"
    assert grpc_unary._timeout(200_000) == "200000S"

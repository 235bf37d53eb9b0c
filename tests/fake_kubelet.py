"""A fake kubelet's PodResources service on a real gRPC unix socket: the pods' devices and the allocatable ones."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc

from agent.k8s.podresources import PodDevices, encode_allocatable_response, encode_list_response


@contextmanager
def serving_kubelet(socket: Path, pods: list[PodDevices],
                    allocatable: dict[str, list[str]]) -> Iterator[list[str]]:
    """Serves List and GetAllocatableResources on `socket` while the block runs; yields the methods asked, in
    order, as they are called."""
    asked: list[str] = []

    def answer(method: str, value: object):  # type: ignore[no-untyped-def]
        def handle(request: bytes, context: object) -> object:
            asked.append(method)
            return value
        return handle

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
        "List": grpc.unary_unary_rpc_method_handler(answer("List", pods), request_deserializer=lambda data: data,
                                                    response_serializer=encode_list_response),
        "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
            answer("GetAllocatableResources", allocatable), request_deserializer=lambda data: data,
            response_serializer=encode_allocatable_response)})
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    try:
        yield asked
    finally:
        server.stop(0)

"""A real gRPC server implementing the kubelet's PodResources v1 `List` on a unix socket, serving fixture pods.

The exporter's pod attribution (stepscope.exporter.collectors.pods) talks to it exactly as it talks to a
kubelet: grpcio over `unix://`, the v1 wire messages. The server counts the calls it answers, so a test can
tell how many List calls the exporter makes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from stepscope.exporter.collectors.pods import LIST_METHOD, MESSAGES


@dataclass(frozen=True)
class FixtureContainer:
    name: str
    devices: dict[str, tuple[str, ...]] = field(default_factory=dict)  # resource name -> device ids


@dataclass(frozen=True)
class FixturePod:
    namespace: str
    name: str
    containers: tuple[FixtureContainer, ...]


def list_response(pods: Sequence[FixturePod]) -> object:
    """The ListPodResourcesResponse a kubelet with these pods answers."""
    container_devices, container, pod = (MESSAGES[name] for name in
                                         ("ContainerDevices", "ContainerResources", "PodResources"))
    return MESSAGES["ListPodResourcesResponse"](pod_resources=[
        pod(name=p.name, namespace=p.namespace, containers=[
            container(name=c.name, devices=[container_devices(resource_name=resource, device_ids=list(ids))
                                            for resource, ids in c.devices.items()])
            for c in p.containers])
        for p in pods])


@dataclass
class PodResourcesServer:
    socket: Path
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answered(self) -> int:
        with self.lock:
            return self.calls


@contextmanager
def serving(socket: Path, pods: Sequence[FixturePod]) -> Iterator[PodResourcesServer]:
    """Serves `pods` on `socket` until the block ends."""
    with serving_bytes(socket, list_response(pods).SerializeToString()) as state:
        yield state


@contextmanager
def serving_bytes(socket: Path, answer: bytes) -> Iterator[PodResourcesServer]:
    """Answers every List on `socket` with `answer` as it is on the wire: a kubelet's message, or garbage."""
    state = PodResourcesServer(socket)

    def list_pods(request: object, context: grpc.ServicerContext) -> bytes:
        with state.lock:
            state.calls += 1
        return answer

    service, method = LIST_METHOD.strip("/").split("/")
    handler = grpc.method_handlers_generic_handler(service, {method: grpc.unary_unary_rpc_method_handler(
        list_pods, request_deserializer=MESSAGES["ListPodResourcesRequest"].FromString)})
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    try:
        yield state
    finally:
        server.stop(grace=None)

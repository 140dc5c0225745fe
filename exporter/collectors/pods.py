"""Pod attribution on Kubernetes: the pod, namespace and container of each GPU and training process.

The kubelet's PodResources API (gRPC `v1.PodResourcesLister/List` on the node's pod-resources socket, the
call dcgm-exporter makes) says which device ids the device plugin gave to which container of which pod:
for NVIDIA's device plugin, GPU UUIDs (`GPU-...`, `MIG-...`). A training process finds its container
through the GPUs it was given: the device plugin hands them to the container in NVIDIA_VISIBLE_DEVICES,
which /proc/<pid>/environ shows. (The process's cgroup names only its pod's UID and its container's runtime
id, neither of which the List answer carries, so it cannot name the pod on its own.) Each cycle publishes

    stepscope_gpu_pod_info{uuid, namespace, pod, container} 1            each GPU given to a pod container
    stepscope_process_pod_info{pid, run, rank, namespace, pod, container, uuid} 1
                                                                         each registered process, once per
                                                                         GPU of its container

so every GPU and process series joins to its pod on `uuid` or (pid, run, rank), and with dcgm-exporter as
the GPU source the rules find a rank's GPUs by pod, container and UUID (docs/cluster.md). Cost: one List
call per cycle over the unix socket, one read of /proc/<pid>/environ per registered process when it first
appears; series: one per GPU given to a pod, and one per registered process and GPU of its container.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from stepscope.contract import families
from stepscope.exporter.collectors.pid_namespaces import PidResolver
from stepscope.exporter.registered import RegisteredProcess

log = logging.getLogger(__name__)

LIST_METHOD = "/v1.PodResourcesLister/List"
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
LIST_TIMEOUT_SECONDS = 2.0
VISIBLE_DEVICES = b"NVIDIA_VISIBLE_DEVICES="


def _is_gpu(resource_name: str) -> bool:
    """NVIDIA's device plugin resources, as dcgm-exporter filters them: whole GPUs and MIG slices."""
    return resource_name == "nvidia.com/gpu" or resource_name.startswith("nvidia.com/mig-")


def _message_classes() -> dict[str, type]:
    """The PodResources v1 messages that `List` uses (k8s.io/kubelet/pkg/apis/podresources/v1/api.proto, same
    package, names and field numbers; the fields not read here are skipped on the wire), built in a pool of
    their own so they cannot clash with another copy of the API in the process."""
    string, message = descriptor_pb2.FieldDescriptorProto.TYPE_STRING, descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
    one, many = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL, descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
    shapes = {
        "ListPodResourcesRequest": [],
        "ListPodResourcesResponse": [("pod_resources", 1, message, many, "PodResources")],
        "PodResources": [("name", 1, string, one, ""), ("namespace", 2, string, one, ""),
                         ("containers", 3, message, many, "ContainerResources")],
        "ContainerResources": [("name", 1, string, one, ""), ("devices", 2, message, many, "ContainerDevices")],
        "ContainerDevices": [("resource_name", 1, string, one, ""), ("device_ids", 2, string, many, "")],
    }
    proto = descriptor_pb2.FileDescriptorProto(name="stepscope/podresources/v1/api.proto", package="v1",
                                               syntax="proto3")
    for name, fields in shapes.items():
        described = proto.message_type.add(name=name)
        for field, number, kind, label, type_name in fields:
            described.field.add(name=field, number=number, type=kind, label=label,
                                type_name=f".v1.{type_name}" if type_name else None)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{name}")) for name in shapes}


MESSAGES = _message_classes()


@dataclass(frozen=True)
class PodContainer:
    namespace: str
    pod: str
    container: str
    devices: tuple[str, ...]  # the GPU device ids (UUIDs) the container was given


def gpu_containers(response: object) -> list[PodContainer]:
    """The containers of a List answer that hold GPUs, with their GPUs."""
    found = []
    for pod in response.pod_resources:  # type: ignore[attr-defined]
        for container in pod.containers:
            devices = tuple(device_id for device in container.devices if _is_gpu(device.resource_name)
                            for device_id in device.device_ids)
            if devices:
                found.append(PodContainer(pod.namespace, pod.name, container.name, devices))
    return found


class PodResourcesClient:
    """`List` over the kubelet's unix socket; the channel reconnects by itself after a kubelet restart."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET) -> None:
        self._socket = socket_path
        self._channel = grpc.insecure_channel(f"unix://{socket_path}")
        self._list = self._channel.unary_unary(
            LIST_METHOD,
            request_serializer=MESSAGES["ListPodResourcesRequest"].SerializeToString,
            response_deserializer=MESSAGES["ListPodResourcesResponse"].FromString,
        )

    def containers(self) -> list[PodContainer]:
        """The GPU-holding containers the kubelet lists now; a failed call raises one line saying why."""
        try:
            response = self._list(MESSAGES["ListPodResourcesRequest"](), timeout=LIST_TIMEOUT_SECONDS)
        except grpc.RpcError as exc:  # its str() is a multi-line debug dump
            raise ConnectionError(f"PodResources List on {self._socket}: {exc.code().name}: {exc.details()}") from None
        return gpu_containers(response)

    def close(self) -> None:
        self._channel.close()


def visible_devices(pid: int, procfs: str = "/proc") -> tuple[str, ...] | None:
    """The device ids in the process's NVIDIA_VISIBLE_DEVICES; None when its environment cannot be read
    (another user's process without CAP_SYS_PTRACE) or does not say."""
    try:
        with open(f"{procfs}/{pid}/environ", "rb") as environ:
            entries = environ.read().split(b"\0")
    except OSError as exc:
        log.debug("environment of process %d unreadable: %s", pid, exc)
        return None
    for entry in entries:
        if entry.startswith(VISIBLE_DEVICES):
            return tuple(part.strip() for part in entry[len(VISIBLE_DEVICES):].decode(errors="replace").split(","))
    return None


class PodCollector:
    """Publishes stepscope_gpu_pod_info and stepscope_process_pod_info from one List call per cycle."""

    name = "pods"

    def __init__(self, client: PodResourcesClient, registered: Callable[[], Sequence[RegisteredProcess]],
                 procfs: str = "/proc") -> None:
        self._client = client
        self._registered = registered
        self._procfs = procfs
        self._resolver = PidResolver(procfs)
        # NVIDIA_VISIBLE_DEVICES of each registered process, read once: (reported pid, start time) -> ids
        self._devices: dict[tuple, tuple[str, ...] | None] = {}

    def collect(self) -> Iterable[Metric]:
        containers = self._client.containers()
        gpus = GaugeMetricFamily(families.GPU_POD_INFO, "The pod container the kubelet gave the GPU to.",
                                 labels=["uuid", *families.POD])
        for container in containers:
            for device in container.devices:
                gpus.add_metric([device, container.namespace, container.pod, container.container], 1)
        processes = GaugeMetricFamily(families.PROCESS_POD_INFO,
                                      "The pod container of a registered training process, once per GPU of "
                                      "that container.", labels=[*families.PROCESS, *families.POD, "uuid"])
        for pid, run, rank, key in self._processes():
            container = self._container_of(pid, key, containers)
            for device in container.devices if container else ():
                processes.add_metric([str(pid), run, rank, container.namespace, container.pod,
                                      container.container, device], 1)
        return [gpus, processes]

    def close(self) -> None:
        self._client.close()

    def _processes(self) -> list[tuple[int, str, str, tuple]]:
        """(pid here, run, rank, the process as it reported itself) of each registered process found here."""
        registered = self._registered()
        found = self._resolver.resolve((p.pid, p.start_time) for p in registered)
        live = [(found[p.pid, p.start_time], p.run, p.rank, (p.pid, p.start_time))
                for p in registered if (p.pid, p.start_time) in found]
        self._devices = {key: self._devices[key] for *_, key in live if key in self._devices}
        return live

    def _container_of(self, pid: int, key: tuple, containers: list[PodContainer]) -> PodContainer | None:
        """The container given the GPUs the process sees; None off Kubernetes or where it cannot be told."""
        if key not in self._devices:
            self._devices[key] = visible_devices(pid, self._procfs)
        devices = set(self._devices[key] or ())
        return next((container for container in containers if devices & set(container.devices)), None)

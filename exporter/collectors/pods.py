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

and the rules find a rank's GPUs by pod, container and UUID where dcgm-exporter is the GPU source
(docs/cluster.md). The same answer, kept in a `PodAttribution`, puts `namespace`, `pod` and `container` on
every series the GPU, process and ingest sides publish, as dcgm-exporter does on its GPU series: a GPU's
from the container it was given to, a process's from its own NVIDIA_VISIBLE_DEVICES, a pushed group's from
its registered process. A GPU or process of no pod container carries the three labels empty, which
Prometheus stores as no label, so label names stay the same within a family and such a series is the one
it was off the cluster. Cost: one List call per cycle over the unix socket, one read of
/proc/<pid>/environ per process when it first appears; series: one per GPU given to a pod, and one per
registered process and GPU of its container; the labels add no series.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from stepscope.contract import families
from stepscope.exporter.collectors.pid_namespaces import PidResolver
from stepscope.exporter.metric_families import GaugeMetricFamily, Metric
from stepscope.exporter.registered import RegisteredProcess

log = logging.getLogger(__name__)

LIST_METHOD = "/v1.PodResourcesLister/List"
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
LIST_TIMEOUT_SECONDS = 2.0
VISIBLE_DEVICES = b"NVIDIA_VISIBLE_DEVICES="
PodLabels = tuple[str, str, str]  # values of families.POD: namespace, pod, container
NO_POD: PodLabels = ("", "", "")


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

    @property
    def labels(self) -> PodLabels:
        return self.namespace, self.pod, self.container


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


def _container_seeing(devices: Iterable[str], containers: Sequence[PodContainer]) -> PodContainer | None:
    """The container given any of `devices` (a process's NVIDIA_VISIBLE_DEVICES)."""
    seen = set(devices)
    return next((container for container in containers if seen & set(container.devices)), None)


class PodAttribution:
    """The pod labels of the node's GPUs, processes and pushed groups, from the pods collector's last List.

    The GPU and process collectors and the ingest renderer run on threads of their own and read it while
    the pods collector replaces it: each view is an immutable mapping swapped by one assignment. `version`
    grows when the ranks' labels change, so the ingest side re-renders only then.
    """

    def __init__(self, procfs: str = "/proc") -> None:
        self._procfs = procfs
        self._containers: tuple[PodContainer, ...] = ()
        self._gpus: Mapping[str, PodLabels] = MappingProxyType({})
        self._ranks: Mapping[tuple[str, str], PodLabels] = MappingProxyType({})
        self._version = 0
        self._devices: dict[int, tuple[str, ...] | None] = {}  # process collector's pid -> its visible devices
        self._devices_lock = threading.Lock()

    def update(self, containers: Sequence[PodContainer], ranks: Mapping[tuple[str, str], PodLabels]) -> None:
        """The pods collector's cycle: the containers listed and each registered (run, rank)'s labels."""
        self._containers = tuple(containers)
        self._gpus = MappingProxyType({device: c.labels for c in containers for device in c.devices})
        if ranks != self._ranks:
            self._ranks = MappingProxyType(dict(ranks))
            self._version += 1

    def version(self) -> int:
        return self._version

    def gpu(self, uuid: str) -> PodLabels:
        return self._gpus.get(uuid, NO_POD)

    def rank(self, run: str, rank: str) -> PodLabels:
        return self._ranks.get((run, rank), NO_POD)

    def ranks(self) -> Mapping[tuple[str, str], PodLabels]:
        return self._ranks

    def processes(self, pids: Iterable[int]) -> dict[int, PodLabels]:
        """The labels of each pid (as this exporter sees it) from its NVIDIA_VISIBLE_DEVICES, read once per
        pid while the process collector keeps asking for it."""
        containers, found = self._containers, {}
        with self._devices_lock:
            devices = {pid: self._devices[pid] if pid in self._devices else visible_devices(pid, self._procfs)
                       for pid in pids}
            self._devices = devices
        for pid, visible in devices.items():
            container = _container_seeing(visible or (), containers)
            found[pid] = container.labels if container else NO_POD
        return found

    def label(self, metrics: Iterable[Metric], labels_of: Callable[[dict[str, str]], PodLabels | None]) -> list[Metric]:
        """`metrics` with namespace, pod and container added to each sample `labels_of` gives labels for
        (None: the sample stays as it is, e.g. a node-wide family)."""
        labelled = []
        for metric in metrics:
            samples = []
            for sample in metric.samples:
                values = labels_of(sample.labels)
                if values is not None:
                    sample = sample._replace(labels={**sample.labels, **dict(zip(families.POD, values, strict=True))})
                samples.append(sample)
            metric.samples = samples
            labelled.append(metric)
        return labelled


class PodCollector:
    """Publishes stepscope_gpu_pod_info and stepscope_process_pod_info from one List call per cycle, and
    hands the answer to the `PodAttribution` the other collectors label their series with."""

    name = "pods"

    def __init__(self, client: PodResourcesClient, registered: Callable[[], Sequence[RegisteredProcess]],
                 procfs: str = "/proc", attribution: PodAttribution | None = None) -> None:
        self._client = client
        self._registered = registered
        self._procfs = procfs
        self._resolver = PidResolver(procfs)
        self.attribution = attribution if attribution is not None else PodAttribution(procfs)
        # NVIDIA_VISIBLE_DEVICES of each registered process, read once: (reported pid, start time) -> ids
        self._devices: dict[tuple, tuple[str, ...] | None] = {}

    def prime(self) -> None:
        """One List before the collectors start, so their first cycle already carries the labels; a kubelet
        that does not answer is reported by this collector's first cycle instead."""
        try:
            self.collect()
        except ConnectionError as exc:
            log.debug("first PodResources List failed: %s", exc)

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
        ranks = self._kept_ranks()
        for pid, run, rank, key in self._processes():
            container = self._container_of(pid, key, containers)
            if container is not None:
                ranks[run, rank] = container.labels
            for device in container.devices if container else ():
                processes.add_metric([str(pid), run, rank, container.namespace, container.pod,
                                      container.container, device], 1)
        self.attribution.update(containers, ranks)
        return [gpus, processes]

    def close(self) -> None:
        self._client.close()

    def _kept_ranks(self) -> dict[tuple[str, str], PodLabels]:
        """The labels of each live group as last found: a group outlives its process (until the ingest TTL
        drops it) and keeps its pod meanwhile, so a finished rank's last pushes do not start new series."""
        live = {(process.run, process.rank) for process in self._registered()}
        return {key: labels for key, labels in self.attribution.ranks().items() if key in live}

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
        return _container_seeing(self._devices[key] or (), containers)

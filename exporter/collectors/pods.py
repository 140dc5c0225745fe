"""Pod attribution on Kubernetes: the pod, namespace and container of each GPU and training process.

The kubelet's PodResources API (gRPC `v1.PodResourcesLister/List` on the node's pod-resources socket, the
call dcgm-exporter makes) says which device ids the device plugin gave to which container of which pod:
for NVIDIA's device plugin, GPU UUIDs (`GPU-...`, `MIG-...`), or with `--device-id-strategy=index` NVML indices,
which the GPU collector's index -> UUID translates where a `uuid` label is published (`published_uuid`). A training
process finds its container through the GPUs it was given: the device plugin hands them to the container in
NVIDIA_VISIBLE_DEVICES, which /proc/<pid>/environ shows. (The process's cgroup names only its pod's UID and its
container's runtime id, neither of which the List answer carries, so it cannot name the pod on its own.) A GPU several
pods share (time-slicing lists it as `<uuid>::<replica>`, once per share; MPS) is told apart by the HOSTNAME the runtime
sets to the pod's name; a process it cannot place gets no pod, and a shared GPU's series none either, while
gpu_pod_info lists every holder (`_container_seeing`, `_sole_holders`). Each cycle publishes

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
from google.protobuf.message import DecodeError

from stepscope.contract import families
from stepscope.exporter.collectors.pid_namespaces import PidResolver
from stepscope.exporter.collectors.proc_stat import stat_of
from stepscope.exporter.metric_families import GaugeMetricFamily, Metric
from stepscope.exporter.registered import RegisteredProcess

log = logging.getLogger(__name__)

LIST_METHOD = "/v1.PodResourcesLister/List"
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
LIST_TIMEOUT_SECONDS = 2.0
RECONNECT_MAX_MS = 2000  # the longest wait between reconnect attempts to a kubelet that went away
# The largest List answer taken, the kubelet's own tools' and node e2e tests' (defaultPodResourcesMaxSize). gRPC's
# default, 4 MiB, refused whole nodes: dcgm-exporter hit 4.7-5.8 MB answers (NVIDIA/dcgm-exporter#378, #509), and
# device plugins that list one id per share (HAMi's vGPU memory, 1,000 per pod) pass 4 MiB at 100 pods.
LIST_MAX_BYTES = 16 * 1024 * 1024
STALE_AFTER_FAILED_LISTS = 3  # the cycle of this many failed List calls in a row clears the last answer
# a device id named by no UUID this many cycles in a row is warned about: the first cycles run before the GPU
# collector identified the GPUs whose indices the device plugin may list
UNPUBLISHED_WARN_CYCLES = 3
VISIBLE_DEVICES = b"NVIDIA_VISIBLE_DEVICES="
HOSTNAME = b"HOSTNAME="
REPLICA_SEPARATOR = "::"  # time-slicing's device ids: <uuid>::<replica>
HOSTNAME_MAX = 63  # the kubelet cuts a pod's name to a DNS label for its hostname
PodLabels = tuple[str, str, str]  # values of families.POD: namespace, pod, container
NO_POD: PodLabels = ("", "", "")


def _is_gpu(resource_name: str) -> bool:
    """NVIDIA's device plugin resources, as dcgm-exporter filters them: whole GPUs and MIG slices."""
    return resource_name == "nvidia.com/gpu" or resource_name.startswith("nvidia.com/mig-")


def gpu_uuid(device_id: str) -> str:
    """The GPU of a device id. NVIDIA's device plugin with time-slicing lists one id per share of a GPU,
    `<uuid>::<replica>`, where the GPU collector and the container's NVIDIA_VISIBLE_DEVICES name the bare uuid;
    dcgm-exporter strips the suffix the same way."""
    return device_id.split(REPLICA_SEPARATOR, 1)[0]


def published_uuid(device_id: str, uuids: Mapping[str, str]) -> str | None:
    """The UUID a device id stands for, given NVML's GPU index -> UUID (`uuids`). NVIDIA's device plugin with
    `--device-id-strategy=index` lists NVML indices ("0") for whole GPUs, which the GPU collector's UUIDs translate
    (None until it identified the GPU, or with no NVML in the exporter), and "<gpu>:<mig>" for a MIG device, which
    names no whole GPU (None); every other id (a UUID) is its own."""
    if device_id.isdigit():
        return uuids.get(device_id)
    gpu, colon, mig = device_id.partition(":")
    return None if colon and gpu.isdigit() and mig.isdigit() else device_id


def process_started(pid: int, procfs: str = "/proc") -> float | None:
    """The process's start time in clock ticks after boot: with the pid, what names one process for good, as a
    pid alone does not once the kernel reuses it. None when it is gone or hidden (hidepid=1 shows its directory
    but not what is in it)."""
    try:
        found = stat_of(pid, procfs)
    except PermissionError:
        return None
    return None if found is None else found.started


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
    devices: tuple[str, ...]  # the GPUs (UUIDs, time-slicing's replica suffix cut) the container was given, once each

    @property
    def labels(self) -> PodLabels:
        return self.namespace, self.pod, self.container


def gpu_containers(response: object) -> list[PodContainer]:
    """The containers of a List answer that hold GPUs, with their GPUs: a container given two replicas of one
    time-sliced GPU holds that GPU once (one gpu_pod_info series, not two alike). A container the answer lists
    twice (one namespace, pod and container name: a pod recreated under its name while the old one is still
    listed, or a broken kubelet) is one container with the GPUs of both: before, each of its GPUs was published
    twice with the same labels, an exposition Prometheus drops the second of as a duplicate sample."""
    found: dict[PodLabels, dict[str, None]] = {}
    for pod in response.pod_resources:  # type: ignore[attr-defined]
        for container in pod.containers:
            devices = [gpu_uuid(device_id) for device in container.devices
                       if _is_gpu(device.resource_name) for device_id in device.device_ids]
            if devices:
                found.setdefault((pod.namespace, pod.name, container.name), {}).update(dict.fromkeys(devices))
    return [PodContainer(*labels, tuple(devices)) for labels, devices in found.items()]


class PodResourcesClient:
    """`List` over the kubelet's unix socket; the channel reconnects by itself after a kubelet restart, trying
    at least every RECONNECT_MAX_MS: gRPC's default backoff grows to 120 s, so after a kubelet gone for a minute
    its pods' labels came back up to a minute or two after it did (an attempt on a unix socket costs nothing).
    Answers up to LIST_MAX_BYTES are taken.

    The answer comes as bytes and is decoded here, not by gRPC: a deserializer that raises inside gRPC has it log
    the exception's traceback at ERROR (logger grpc._common) before the call fails, 7 lines a cycle for a socket
    that answers garbage or a pod name of invalid UTF-8 (112 lines in 10 s at --collect-interval 0.5)."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET) -> None:
        self._socket = socket_path
        self._channel = grpc.insecure_channel(f"unix://{socket_path}",
                                              options=[("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
                                                       ("grpc.max_receive_message_length", LIST_MAX_BYTES)])
        self._list = self._channel.unary_unary(
            LIST_METHOD,
            request_serializer=MESSAGES["ListPodResourcesRequest"].SerializeToString,
        )

    def containers(self) -> list[PodContainer]:
        """The GPU-holding containers the kubelet lists now; a failed call raises one line saying why."""
        try:
            response = self._list(MESSAGES["ListPodResourcesRequest"](), timeout=LIST_TIMEOUT_SECONDS)
        except grpc.RpcError as exc:  # its str() is a multi-line debug dump
            raise ConnectionError(f"PodResources List on {self._socket}: {exc.code().name}: {exc.details()}") from None
        return gpu_containers(self._decoded(response))

    def _decoded(self, answer: bytes) -> object:
        """The ListPodResourcesResponse in `answer`; one line saying why where it is none."""
        try:
            return MESSAGES["ListPodResourcesResponse"].FromString(answer)
        except DecodeError as exc:
            raise ConnectionError(f"PodResources List on {self._socket}: the answer ({len(answer)} bytes) is no "
                                  f"ListPodResourcesResponse: {exc}") from None

    def close(self) -> None:
        self._channel.close()


@dataclass(frozen=True)
class ProcessView:
    """What a process's environment says of its container: the GPUs the device plugin gave it
    (NVIDIA_VISIBLE_DEVICES) and its pod's hostname (HOSTNAME, which the container runtime sets; "" if unset)."""

    devices: tuple[str, ...]
    hostname: str = ""


def process_view(pid: int, procfs: str = "/proc") -> ProcessView | None:
    """The process's `ProcessView`; None when its environment cannot be read (another user's process without
    CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH) or has no NVIDIA_VISIBLE_DEVICES."""
    try:
        with open(f"{procfs}/{pid}/environ", "rb") as environ:
            entries = environ.read().split(b"\0")
    except OSError as exc:
        log.debug("environment of process %d unreadable: %s", pid, exc)
        return None
    values = {name: entry[len(name):].decode(errors="replace") for entry in entries
              for name in (VISIBLE_DEVICES, HOSTNAME) if entry.startswith(name)}
    if VISIBLE_DEVICES not in values:
        return None
    devices = tuple(gpu_uuid(part.strip()) for part in values[VISIBLE_DEVICES].split(","))
    return ProcessView(devices, values.get(HOSTNAME, ""))


def pod_hostname(pod: str) -> str:
    """The hostname the kubelet gives a pod without `spec.hostname`: its name, cut to 63 characters and the
    cut's trailing '-' and '.' dropped."""
    return pod if len(pod) <= HOSTNAME_MAX else pod[:HOSTNAME_MAX].rstrip("-.")


def _named(hostname: str, pod: str) -> bool:
    """Whether a process with this HOSTNAME runs in `pod` (setHostnameAsFQDN: the pod's hostname, a dot, more)."""
    expected = pod_hostname(pod)
    return hostname == expected or hostname.startswith(f"{expected}.")


def _container_seeing(view: ProcessView | None, containers: Sequence[PodContainer]) -> PodContainer | None:
    """The container given the GPUs a process sees. Several containers hold one GPU when it is shared
    (time-slicing, MPS): then the process's HOSTNAME must name exactly one of their pods, else no container,
    because the devices alone cannot tell the pods apart and another pod's labels would be wrong ones. Two
    containers of one pod sharing a GPU stay unresolved too (one hostname)."""
    if view is None:
        return None
    seen = set(view.devices)
    holding = [container for container in containers if seen & set(container.devices)]
    if len(holding) > 1:
        holding = [container for container in holding if _named(view.hostname, container.pod)]
    return holding[0] if len(holding) == 1 else None


def _sole_holders(containers: Iterable[PodContainer]) -> dict[str, PodLabels]:
    """Each GPU's labels where one container holds it. A shared GPU carries no pod on its series: any one of
    its pods would be a guess, and which one would follow the kubelet's listing order from call to call."""
    holders: dict[str, set[PodLabels]] = {}
    for container in containers:
        for device in container.devices:
            holders.setdefault(device, set()).add(container.labels)
    return {device: next(iter(labels)) for device, labels in holders.items() if len(labels) == 1}


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
        self._uuids: Mapping[str, str] = MappingProxyType({})  # NVML index -> UUID, from the GPU collector
        self._version = 0
        # the process collector's (pid, start ticks) -> what its environment says: a pid the kernel reuses for a
        # process of another pod is another key, so it cannot keep the old process's pod
        self._views: dict[tuple[int, int | None], ProcessView | None] = {}
        self._devices_lock = threading.Lock()

    def update(self, containers: Sequence[PodContainer], ranks: Mapping[tuple[str, str], PodLabels]) -> None:
        """The pods collector's cycle: the containers listed and each registered (run, rank)'s labels."""
        self._containers = tuple(containers)
        self._gpus = MappingProxyType(_sole_holders(containers))
        if ranks != self._ranks:
            self._ranks = MappingProxyType(dict(ranks))
            self._version += 1

    def version(self) -> int:
        return self._version

    def name_gpus(self, uuids: Mapping[str, str]) -> None:
        """The GPU collector's NVML index -> UUID of each identified GPU, for a device plugin listing indices."""
        if uuids != self._uuids:
            self._uuids = MappingProxyType(dict(uuids))

    def uuid(self, device_id: str) -> str | None:
        """The UUID a listed device id stands for (`published_uuid`); None where it names no known whole GPU."""
        return published_uuid(device_id, self._uuids)

    def gpu(self, uuid: str, index: str = "") -> PodLabels:
        """The labels of the GPU with this UUID and NVML index: the device plugin lists it by one or the other
        (`--device-id-strategy`)."""
        return self._gpus.get(uuid) or self._gpus.get(index, NO_POD)

    def rank(self, run: str, rank: str) -> PodLabels:
        return self._ranks.get((run, rank), NO_POD)

    def ranks(self) -> Mapping[tuple[str, str], PodLabels]:
        return self._ranks

    def processes(self, pids: Iterable[int]) -> dict[int, PodLabels]:
        """The labels of each pid (as this exporter sees it) from its environment (`_container_seeing`), read
        once per process (pid and start time) while the process collector keeps asking for it."""
        containers, found = self._containers, {}
        keys = {pid: (pid, process_started(pid, self._procfs)) for pid in pids}
        with self._devices_lock:
            views = {key: self._views[key] if key in self._views else process_view(key[0], self._procfs)
                     for key in keys.values()}
            self._views = views
        for pid, key in keys.items():
            container = _container_seeing(views[key], containers)
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
    hands the answer to the `PodAttribution` the other collectors label their series with.

    A failed List keeps the last answer for STALE_AFTER_FAILED_LISTS - 1 cycles in a row (10 s at the
    default 5 s interval), its families published again and each such cycle counted as an error
    (`failed_reading`): a kubelet restart or a slow answer does not end and restart every labelled series.
    The next failure in a row clears the attribution and raises, so the GPU, process and pushed series lose
    their pod with the info families rather than keep a pod the kubelet no longer vouches for.
    """

    name = "pods"

    def __init__(self, client: PodResourcesClient, registered: Callable[[], Sequence[RegisteredProcess]],
                 procfs: str = "/proc", attribution: PodAttribution | None = None) -> None:
        self._client = client
        self._registered = registered
        self._procfs = procfs
        self._resolver = PidResolver(procfs)
        self.attribution = attribution if attribution is not None else PodAttribution(procfs)
        # the environment of each registered process, read once: (reported pid, start time) -> what it says
        self._views: dict[tuple, ProcessView | None] = {}
        self._last: list[Metric] = []  # the families of the last answer; [] before one and once cleared
        self._failed_lists = 0  # in a row
        self._unpublished: dict[str, int] = {}  # device id named by no UUID -> cycles in a row so
        self.failed_reading = ""  # the scheduler counts a cycle that kept the last answer as an error

    def prime(self) -> None:
        """One List before the collectors start, so their first cycle already carries the labels; a kubelet
        that does not answer is reported by this collector's first cycle instead."""
        try:
            self.collect()
        except ConnectionError as exc:
            log.debug("first PodResources List failed: %s", exc)

    def collect(self) -> Iterable[Metric]:
        try:
            containers = self._client.containers()
        except ConnectionError as exc:
            return self._without_answer(exc)
        if self._failed_lists:
            log.info("PodResources List answers again")
        self._failed_lists, self.failed_reading = 0, ""
        self._last = self._answered(containers)
        return self._last

    def _without_answer(self, exc: ConnectionError) -> list[Metric]:
        """The last answer's families while fewer than STALE_AFTER_FAILED_LISTS List calls in a row failed;
        then, or with no answer yet, the attribution cleared and `exc` raised."""
        self._failed_lists += 1
        if not self._last or self._failed_lists >= STALE_AFTER_FAILED_LISTS:
            self._last = []
            self.attribution.update([], {})
            raise exc
        if self._failed_lists == 1:
            log.warning("%s; keeping the pod labels of the last answer for %d more failed cycles", exc,
                        STALE_AFTER_FAILED_LISTS - 2)
        self.failed_reading = str(exc)
        return self._last

    def _answered(self, containers: list[PodContainer]) -> list[Metric]:
        """The info families of a List answer, handed to the attribution with the ranks' labels."""
        gpus = GaugeMetricFamily(families.GPU_POD_INFO, "The pod container the kubelet gave the GPU to.",
                                 labels=["uuid", *families.POD])
        uuids = self._uuids(containers)
        for container in containers:
            for device in container.devices:
                if device in uuids:
                    gpus.add_metric([uuids[device], container.namespace, container.pod, container.container], 1)
        processes = GaugeMetricFamily(families.PROCESS_POD_INFO,
                                      "The pod container of a registered training process, once per GPU of "
                                      "that container.", labels=[*families.PROCESS, *families.POD, "uuid"])
        ranks = self._kept_ranks()
        for pid, run, rank, key in self._processes():
            container = self._container_of(pid, key, containers)
            if container is not None:
                ranks[run, rank] = container.labels
            for device in container.devices if container else ():
                if device in uuids:
                    processes.add_metric([str(pid), run, rank, container.namespace, container.pod,
                                          container.container, uuids[device]], 1)
        self.attribution.update(containers, ranks)
        return [gpus, processes]

    def close(self) -> None:
        self._client.close()

    def _uuids(self, containers: list[PodContainer]) -> dict[str, str]:
        """The UUID of each listed device id that names one (`published_uuid`). An id that does not (a GPU index
        with no GPU collector to translate it, a MIG index) stays off the uuid-labelled info families, which would
        otherwise carry uuid="0" and join nothing; its containers' processes still get their pod."""
        uuids, unpublished = {}, {}
        for device in {device for container in containers for device in container.devices}:
            uuid = self.attribution.uuid(device)
            if uuid is not None:
                uuids[device] = uuid
                continue
            unpublished[device] = self._unpublished.get(device, 0) + 1
            if unpublished[device] == UNPUBLISHED_WARN_CYCLES:
                log.warning("device id %r of the PodResources answer names no GPU UUID this exporter knows (the "
                            "device plugin's --device-id-strategy=index without the GPU collector, or a MIG "
                            "device): left out of %s and %s", device, families.GPU_POD_INFO,
                            families.PROCESS_POD_INFO)
        self._unpublished = unpublished
        return uuids

    def _kept_ranks(self) -> dict[tuple[str, str], PodLabels]:
        """The labels of each live group as last found: a group outlives its process (until the ingest TTL
        drops it) and keeps its pod meanwhile, so a finished rank's last pushes do not start new series."""
        live = {(process.run, process.rank) for process in self._registered()}
        return {key: labels for key, labels in self.attribution.ranks().items() if key in live}

    def _processes(self) -> list[tuple[int, str, str, tuple]]:
        """(pid here, run, rank, the process as it reported itself) of each registered process found here."""
        registered = self._registered()
        found = self._resolver.resolve(p.reported for p in registered)
        live = [(found[p.reported], p.run, p.rank, p.reported) for p in registered if p.reported in found]
        self._views = {key: self._views[key] for *_, key in live if key in self._views}
        return live

    def _container_of(self, pid: int, key: tuple, containers: list[PodContainer]) -> PodContainer | None:
        """The container given the GPUs the process sees; None off Kubernetes or where it cannot be told."""
        if key not in self._views:
            self._views[key] = process_view(pid, self._procfs)
        return _container_seeing(self._views[key], containers)

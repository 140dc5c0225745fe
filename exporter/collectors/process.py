"""Process collector: CPU, memory, I/O and GPU memory of training processes, workers included.

Covers the processes the training hooks registered and every process holding GPU memory (the GPU
collector's table). A process is reported together with all its live descendants, so data-loader
workers count towards the rank that owns them. The `pid` label is the pid this exporter (and NVML)
sees; a registered process that reported a pid from another pid namespace is found by
`pid_namespaces`, so its run and rank also land on its GPU memory.

The GPU memory series say who holds it (`holder`), from what the cycle reads anyway: a registered rank (its workers'
memory on its GPUs included, as their CPU and memory are: a data-loader worker that opened a CUDA context), a worker
(a rank's descendant, on a GPU the rank does not hold), the MPS server (by its name in /proc/PID/stat), a foreign
process (any other this exporter sees: another tenant of the GPU, whose kernels its readings count, so the rules
take the GPU as shared) or unknown (one it cannot read: another pid namespace, hidepid; or a rank it cannot tell
from another, with its workers: two pods' pid 1 started in one clock tick, their pid namespaces unsent or
unreadable). A worker's memory used to read run "", like a stranger's, and a stranger's could not be told from a
worker's or the MPS server's.

Counters stay monotonic as workers come and go: an exited worker stays visible (as a zombie) until
its parent reaps it, and reaping moves its CPU time into the parent's children_user/children_system
and its I/O into the parent's own counters, both of which are included. Where time does leave the
tree (an orphan re-parented to init, a parent that ignores SIGCHLD) or a worker is reaped between
two reads of one cycle, the published counter holds its peak rather than dropping, which Prometheus
would read as a counter reset.
"""

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

from stepscope.contract import families
from stepscope.exporter.collectors.pid_namespaces import PidResolver
from stepscope.exporter.collectors.proc_stat import ProcStat, io_of, stat_of
from stepscope.exporter.gpu_processes import GpuProcessTable
from stepscope.exporter.metric_families import CounterMetricFamily, GaugeMetricFamily, Metric
from stepscope.exporter.registered import RegisteredProcess

if TYPE_CHECKING:  # pods.py needs grpc, which only pod attribution installs
    from stepscope.exporter.collectors.pods import PodAttribution

log = logging.getLogger(__name__)

_LABELS = ["pid", "run", "rank"]
# A GPU-holding pid this exporter cannot see (another pid namespace, no hostPID) is looked up again
# only this often: a failed lookup costs ~25 µs, every cycle, for every such pid.
MISSING_RETRY_SECONDS = 30.0
# The parent recorded for a process whose stat /proc refuses (hidepid=1): the one the kernel gives init, no process.
UNKNOWN_PARENT = 0
# nvidia-cuda-mps-server as the kernel names it (15 characters): under MPS it holds memory on every GPU it serves,
# for its clients, which NVML lists apart (collectors.gpu); it is no tenant of its own.
MPS_SERVER_NAME = "nvidia-cuda-mps"


@dataclass
class _Tracked:
    """A process by its start time (a pid that names another process starts afresh), plus the peak of each
    published counter, which keeps them monotonic."""

    started: float
    peaks: dict[str, float] = field(default_factory=dict)

    def monotonic(self, counter: str, value: float) -> float:
        peak = max(value, self.peaks.get(counter, value))
        self.peaks[counter] = peak
        return peak


@dataclass
class _Reading:
    cpu_seconds: float
    rss: int
    children: int
    io: tuple[int, int] | None  # (read, written) bytes; None where the platform or permissions deny it
    io_refused: bool  # the process's own I/O counters were refused: another user's, read without the capabilities
    descendants: list[int]  # pids, the exited ones not yet reaped included


@dataclass
class _Holders:
    """What one cycle learnt of the processes that may hold GPU memory, to tell who each holder is (`holder`)."""

    identities: dict[int, tuple[str, str]]  # registered processes: pid -> (run, rank)
    gpu_table: Mapping[int, Mapping[str, int]]  # the GPU collector's: pid -> {gpu: bytes}
    names: dict[int, str] = field(default_factory=dict)  # pid -> kernel name, for every process read this cycle
    owners: dict[int, tuple[float, int]] = field(default_factory=dict)  # descendant -> (its registered ancestor's
    # start, that ancestor's pid): the nearest ancestor, the one started last, wins
    unidentified: set[int] = field(default_factory=set)  # ranks the resolver cannot tell apart, and their workers

    def own(self, root: int, root_started: float, descendants: Iterable[int]) -> None:
        for pid in descendants:
            if pid not in self.owners or self.owners[pid][0] < root_started:
                self.owners[pid] = (root_started, root)

    def series(self, pid: int, gpu: str) -> tuple[str, str, str, str, str]:
        """The labels (pid, run, rank, gpu, holder) that pid's memory on gpu is published under. A worker's
        memory on a GPU its rank holds is the rank's, in the rank's series, as its CPU and memory are; on another
        GPU (a spawned worker's CUDA calls land on GPU 0) it stays the worker's, with run "": counted as the
        run's, that GPU's idle readings would lower the run's (StepscopeGpuHeldIdle names it instead). A process
        this exporter could not read is unknown (it may be a rank in a pid namespace it does not see), never
        foreign, as is a rank it cannot tell from another (two pods' pid 1 started in one clock tick)."""
        if pid in self.identities:
            return (str(pid), *self.identities[pid], gpu, families.HOLDER_RANK)
        if pid in self.owners:
            rank = self.owners[pid][1]
            if gpu in self.gpu_table.get(rank, {}):
                return (str(rank), *self.identities[rank], gpu, families.HOLDER_RANK)
            return str(pid), "", "", gpu, families.HOLDER_WORKER
        name = self.names.get(pid)
        if name is None or pid in self.unidentified:
            holder = families.HOLDER_UNKNOWN
        elif name.startswith(MPS_SERVER_NAME):
            holder = families.HOLDER_MPS_SERVER
        else:
            holder = families.HOLDER_FOREIGN
        return str(pid), "", "", gpu, holder


class ProcessCollector:
    """Publishes the `stepscope_process_*` families (docs/exporter.md)."""

    name = "process"
    # its first cycle reads the GPU collector's process table: taken at once, it was empty, and a process's GPU
    # memory came only with the second cycle, 8.3 s after the exporter was ready at the default interval
    first_after = ("gpu",)

    def __init__(
        self,
        gpu_processes: GpuProcessTable,
        registered: Callable[[], Sequence[RegisteredProcess]],
        pods: "PodAttribution | None" = None,
    ) -> None:
        """pods: label each process's series with its pod container (Kubernetes, `collectors.pods`)."""
        self._gpu_processes = gpu_processes
        self._pods = pods
        self._registered = registered
        self._resolver = PidResolver()
        self._tracked: dict[int, _Tracked] = {}
        self._children = _ChildrenMap()
        self._missing: dict[int, float] = {}  # pid -> monotonic time of its last failed lookup
        self._io_refusal_logged = False

    def collect(self) -> Iterable[Metric]:
        identities = self._identities()
        gpu_table = self._gpu_processes.get()
        pids = sorted(set(identities) | set(gpu_table))
        for pid in set(self._tracked) - set(pids):
            del self._tracked[pid]
        for pid in set(self._missing) - set(pids):
            del self._missing[pid]

        cpu = CounterMetricFamily(families.PROCESS_CPU_SECONDS,
                                  "User+system CPU time of the process and its descendants, reaped ones "
                                  "included.", labels=_LABELS)
        rss = GaugeMetricFamily(families.PROCESS_RESIDENT_MEMORY,
                                "Resident memory of the process plus its live descendants (shared pages "
                                "counted once per process).", labels=_LABELS)
        io_read = CounterMetricFamily(families.PROCESS_IO_READ,
                                      "Storage bytes read by the process and its descendants.",
                                      labels=_LABELS)
        io_write = CounterMetricFamily(families.PROCESS_IO_WRITE,
                                       "Storage bytes written by the process and its descendants.",
                                       labels=_LABELS)
        children = GaugeMetricFamily(families.PROCESS_CHILDREN,
                                     "Live descendant processes (data-loader workers).", labels=_LABELS)
        gpu_memory = GaugeMetricFamily(families.PROCESS_GPU_MEMORY,
                                       "GPU memory the process holds on the GPU (a rank: its workers' included); "
                                       "holder: rank, worker (a rank's, on another GPU), mps_server, foreign, "
                                       "unknown.",
                                       labels=[*_LABELS, "gpu", "holder"])

        holders = _Holders(identities, gpu_table, unidentified=self._resolver.unidentified())
        children_of: dict[int, list[int]] | None = None  # read once per cycle, when first needed
        for pid in pids:
            labels = [str(pid), *identities.get(pid, ("", ""))]
            found = self._track(pid)
            if found is None:
                continue
            tracked, own = found
            holders.names[pid] = own.name
            if children_of is None:
                children_of = self._children.get()
            try:
                reading = _read_tree(pid, own, children_of)
            except (psutil.NoSuchProcess, psutil.AccessDenied) as exc:
                log.debug("process %d skipped: %s", pid, exc)
                if isinstance(exc, psutil.NoSuchProcess):
                    del self._tracked[pid]
                continue
            if pid in identities:
                holders.own(pid, own.started, reading.descendants)
            elif pid in holders.unidentified:
                holders.unidentified.update(reading.descendants)
            cpu.add_metric(labels, tracked.monotonic("cpu", reading.cpu_seconds))
            rss.add_metric(labels, reading.rss)
            children.add_metric(labels, reading.children)
            if reading.io_refused:
                self._log_io_refused(pid)
            if reading.io is not None:
                io_read.add_metric(labels, tracked.monotonic("io_read", reading.io[0]))
                io_write.add_metric(labels, tracked.monotonic("io_write", reading.io[1]))
        held_memory: dict[tuple[str, str, str, str, str], int] = defaultdict(int)
        for pid, held in gpu_table.items():
            for gpu, used in held.items():
                held_memory[holders.series(pid, gpu)] += used
        for labels, used in sorted(held_memory.items()):
            gpu_memory.add_metric(list(labels), used)
        published = [cpu, rss, io_read, io_write, children, gpu_memory]
        if self._pods is None:
            return published
        pod_of = self._pods.processes(pids)
        return self._pods.label(published, lambda labels: pod_of[int(labels["pid"])])

    def close(self) -> None:
        self._tracked.clear()

    def _log_io_refused(self, pid: int) -> None:
        """Says once why the I/O families lack a process: run as a user other than root without the two
        capabilities, the exporter published CPU and memory for another user's training process and silently
        no I/O bytes."""
        if self._io_refusal_logged:
            return
        self._io_refusal_logged = True
        log.warning("process I/O of pid %d is refused (another user's process): %s and %s are left out for "
                    "other users' processes; run the exporter as root, or give it CAP_SYS_PTRACE and "
                    "CAP_DAC_READ_SEARCH (deploy/systemd/stepscope-exporter.service)",
                    pid, families.PROCESS_IO_READ, families.PROCESS_IO_WRITE)

    def _identities(self) -> dict[int, tuple[str, str]]:
        """{pid as seen here: (run, rank)} of the registered processes that could be found here.

        A pid in several live groups takes the run and rank of the group it pushed to last: a process
        that closed one run and started another (a notebook, an in-process sweep) works for the new
        one, while the closed run's group lingers until its TTL.
        """
        registered = self._registered()
        found = self._resolver.resolve(p.reported for p in registered)
        latest: dict[int, RegisteredProcess] = {}
        for process in registered:
            pid = found.get(process.reported)
            if pid is not None and (pid not in latest or process.pushed_at > latest[pid].pushed_at):
                latest[pid] = process
        return {pid: (process.run, process.rank) for pid, process in latest.items()}

    def _track(self, pid: int) -> tuple[_Tracked, ProcStat] | None:
        """pid's tracking and this cycle's reading of it, from one /proc/PID/stat read; tracked afresh when
        the pid now names a different process (another start time)."""
        tracked = self._tracked.get(pid)
        now = time.monotonic()
        if tracked is None and now - self._missing.get(pid, -MISSING_RETRY_SECONDS) < MISSING_RETRY_SECONDS:
            return None
        try:
            own = stat_of(pid)
        except (PermissionError, psutil.AccessDenied) as exc:  # hidden by hidepid, or a platform's refusal
            log.debug("process %d skipped: %s", pid, exc)
            return None
        if own is None:
            self._tracked.pop(pid, None)
            log.debug("process %d skipped for %gs: gone", pid, MISSING_RETRY_SECONDS)
            self._missing[pid] = now
            return None
        if tracked is None or tracked.started != own.started:
            tracked = self._tracked[pid] = _Tracked(own.started)
        self._missing.pop(pid, None)
        return tracked, own


class _ChildrenMap:
    """{pid: child pids} of every process, kept from cycle to cycle: only new processes' parents are read.

    Reading every process's parent (one /proc/PID/stat each, as psutil's `_ppid_map` does) costs about
    10 µs per process on the node every cycle, most of this collector's time on a node of hundreds of
    processes, while listing the pids is one directory read. A process's parent is set when it is born
    and changes only when its parent exits: then its pid leaves the list, and the children it had are
    read again. Two cases read as before until the next change: a parent that exited but is not reaped
    yet (a zombie keeps its pid), normally for an instant, and a pid reused between two cycles, which
    `_descendants` catches by the child's start time. Without /proc the whole table is read every cycle.

    A /proc mounted with hidepid=1 (`noaccess`) lists every process but refuses another user's stat files:
    such a process is kept with the parent UNKNOWN_PARENT, read once like any other and never counted as
    anyone's child. Before, the first refusal failed the whole collector every cycle, its GPU memory series
    (NVML's) included.
    """

    def __init__(self) -> None:
        self._parent: dict[int, int] = {}
        self._children: dict[int, list[int]] = {}

    def get(self) -> dict[int, list[int]]:
        if not hasattr(psutil, "_ppid_map"):  # not Linux: psutil's public, whole-table read
            return _children_of({p.pid: p.info["ppid"] for p in psutil.process_iter(["ppid"])})
        pids = set(psutil.pids())
        parent = self._parent
        gone = parent.keys() - pids
        if not gone and len(parent) == len(pids):
            return self._children
        orphans = {pid for pid, ppid in parent.items() if ppid in gone} - gone
        for pid in gone:
            del parent[pid]
        for pid in (pids - parent.keys()) | orphans:
            ppid = _parent_of(pid)
            if ppid is None:  # exited since the listing
                parent.pop(pid, None)
            else:
                parent[pid] = ppid
        self._children = _children_of(parent)
        return self._children


def _parent_of(pid: int) -> int | None:
    """The parent pid; None when the process is gone, UNKNOWN_PARENT when /proc may not say (hidepid=1)."""
    try:
        found = stat_of(pid)
    except PermissionError:
        return UNKNOWN_PARENT
    return None if found is None else found.parent


def _children_of(parents: dict[int, int]) -> dict[int, list[int]]:
    """{pid: child pids} from {pid: parent pid}."""
    children: dict[int, list[int]] = defaultdict(list)
    for pid, ppid in parents.items():
        children[ppid].append(pid)
    return dict(children)


def _descendants(pid: int, started: float, children_of: dict[int, list[int]]) -> list[tuple[int, ProcStat]]:
    """(pid, readings) of each descendant, as `children(recursive=True)`: only children started after their
    parent (no reused pid)."""
    found: list[tuple[int, ProcStat]] = []
    stack, seen = [(pid, started)], set()
    while stack:
        parent, parent_started = stack.pop()
        if parent in seen:
            continue
        seen.add(parent)
        for child_pid in children_of.get(parent, ()):
            child = _readable_stat_of(child_pid)
            if child is not None and parent_started <= child.started:
                found.append((child_pid, child))
                stack.append((child_pid, child.started))
    return found


def _readable_stat_of(pid: int) -> ProcStat | None:
    """The process's readings; None when it is gone or /proc refuses them (a worker that exec'd another user's
    program under hidepid=1), which leaves it out of its parent's tree rather than fail the cycle."""
    try:
        return stat_of(pid)
    except PermissionError:
        return None


def _read_tree(root: int, own: ProcStat, children_of: dict[int, list[int]]) -> _Reading:
    """Sums the process (`own`: its reading this cycle) and its live descendants; a descendant that exits
    mid-read is left out."""
    cpu_seconds, rss, live = own.cpu_seconds, own.rss, 0
    try:
        io, io_refused = io_of(root), False
    except PermissionError:
        io, io_refused = None, True
    descendants = _descendants(root, own.started, children_of)
    for pid, child in descendants:
        cpu_seconds += child.cpu_seconds
        if child.zombie:  # exited, its time not yet in the parent's
            continue
        try:
            child_io = io_of(pid) if io is not None else None
        except psutil.NoSuchProcess:
            continue
        except PermissionError:  # a worker that exec'd another user's program: the tree's bytes are unknown
            child_io = None
        rss += child.rss
        live += 1
        io = (io[0] + child_io[0], io[1] + child_io[1]) if io is not None and child_io is not None else None
    return _Reading(cpu_seconds, rss, live, io, io_refused, [pid for pid, _ in descendants])

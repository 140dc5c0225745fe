"""Node collector: host CPU, memory, disk, network and chosen filesystems, read through psutil.

psutil keeps this portable; families a platform cannot give (disk busy time on macOS, say) are simply
absent. The one file parsed here is PID 1's net/dev (--collector.node.host-network), which psutil, reading
only this process's own, cannot give.
"""

import errno
import logging
import os
import platform
import queue
import re
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from stepscope.contract import families
from stepscope.exporter.metric_families import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)

# node_exporter's default: partitions (their disk is already counted) and loop/ram devices.
_IGNORED_DISKS = re.compile(r"^(z?ram|loop|fd|(h|s|v|xv)d[a-z]|nvme\d+n\d+p)\d+$")
# Intermediate functional blocks (tc's ifb): each receives traffic redirected from a real interface to
# shape it, so its bytes are that interface's again.
_IGNORED_NICS = re.compile(r"^ifb\d+$")
# Containers' own interfaces (veth pairs, CNI bridges and overlay tunnels, VMs' taps), matched at the start of
# the name (--collector.node.netdev-exclude): their traffic crosses the node's physical interfaces too, so a
# node's sum counted it twice once the node's interfaces are read (--collector.node.host-network), and one
# series pair per pod came and went with the pods.
DEFAULT_NETDEV_EXCLUDE = (r"veth|cali|lxc|cilium_|flannel|cni|docker|br-|vxlan|tunl|kube-ipvs|nodelocaldns|genev_sys"
                          r"|weave|antrea-|virbr|vnet|tap")
# Already included in user/nice on Linux: publishing them too would double count guest time and
# break "the modes add up to all CPU time", which utilization queries rely on.
_OVERLAPPING_CPU_MODES = frozenset({"guest", "guest_nice"})
# The mount table is read again when a path's filesystem changed (its device) and at least this often,
# for a bind mount of the same device over a path.
MOUNT_TABLE_SECONDS = 60.0
# How long the cycle waits for a path's statvfs and stat. A hung mount (NFS, Lustre, FUSE) blocks them in
# the kernel: waited for, it stopped the whole node cycle, so CPU and memory froze with it (and frozen CPU
# counters read as saturated). The path is skipped until its read comes back (node_exporter's
# --collector.filesystem.mount-timeout does the same).
FILESYSTEM_READ_SECONDS = 1.0
# Sizes and free space change slowly, and a read is a handoff to a path's thread (~0.05 ms, a third of the
# node cycle): read at most this often, every cycle's other readings aside; cycles in between serve the last.
FILESYSTEM_EVERY_SECONDS = 5.0
# The node's network counters from a container that shares the node's PID namespace but has a network
# namespace of its own (the Helm chart's hostPID, compose's pid: host): PID 1 is the node's init, and
# /proc/<pid>/net/dev shows that process's namespace to any user.
NODE_NET_DEV = "/proc/1/net/dev"
# Symbolic links followed when resolving a path under --path.rootfs, as the kernel's own limit (ELOOP).
MAX_SYMLINKS = 40


@dataclass(frozen=True)
class PathReading:
    device: int  # st_dev: a change means another filesystem is mounted there
    size: int
    available: int  # to unprivileged users
    resolved: str  # where the path lies in this process's view, symbolic links followed


class NodeCollector:
    """Publishes the `stepscope_node_*` families (docs/exporter.md)."""

    name = "node"

    def __init__(self, filesystem_paths: list[str], rootfs: str = "/", net_dev: str | None = None,
                 netdev_exclude: str = DEFAULT_NETDEV_EXCLUDE) -> None:
        """`rootfs`: where the node's root filesystem is mounted in this container (--path.rootfs), so that the
        paths, read under it, are the node's; "/" where the exporter runs on the node itself. `net_dev`: the
        /proc/<pid>/net/dev to read network counters from (NODE_NET_DEV: the node's), None: this process's.
        `netdev_exclude`: interfaces left out, a regular expression matched at the start of the name."""
        self._rootfs = os.path.realpath(rootfs)  # as the mount table names it: a link to it matched no mount
        self._hostname = node_hostname(self._rootfs)
        self._net_dev = net_dev
        # What the last cycle left out ("" when nothing): the scheduler counts such a cycle as an error.
        self._network_failure = ""  # why the network readings are left out ("" when they are not)
        self._netdev_exclude = re.compile(netdev_exclude) if netdev_exclude else None
        self._missing_paths: set[str] = set()
        self._mountpoints: dict[str, tuple[int, str]] = {}  # path -> (its device, its mount point on the node)
        self._readers = {path: _PathReader(path, self._rootfs) for path in dict.fromkeys(filesystem_paths)}
        self._hung: set[str] = set()  # paths whose read has not come back
        self._mounts_read = float("-inf")
        self._paths_read = float("-inf")
        self._path_values: dict[str, PathReading] = {}  # the last _read_paths()

    @property
    def failed_reading(self) -> str:
        """What the last cycle left out, for the scheduler to count (stepscope_exporter_collector_errors_total): the
        network readings PID 1's net/dev did not give, a --filesystem-paths path that is missing (a typo, an
        unmounted volume) or whose read hangs. Before, a missing path was one log line at start and counted
        nowhere: StepscopeExporterCollectionFailing never said that a dataset's free space went unwatched."""
        paths = [f"filesystem path {path!r} does not answer (a hung mount?)" for path in sorted(self._hung)]
        paths += [f"filesystem path {path!r} is missing" for path in sorted(self._missing_paths)]
        return "; ".join([reason for reason in (self._network_failure, *paths) if reason])

    def collect(self) -> Iterable[Metric]:
        yield from self._cpu()
        yield from self._memory()
        yield from self._disks()
        yield from self._network()
        yield from self._filesystems()
        yield self._info()

    def close(self) -> None:
        """Nothing to release: psutil holds no handles between calls, and the paths' reader threads are daemon
        threads (one blocked on a hung mount must not hold up the exporter's exit)."""

    def _info(self) -> Metric:
        info = GaugeMetricFamily(families.NODE_INFO, "Node identity, for joins (value is always 1).",
                                 labels=["hostname", "kernel", "os"])
        info.add_metric([self._hostname, platform.release(), platform.system()], 1)
        return info

    def _cpu(self) -> Iterable[Metric]:
        seconds = CounterMetricFamily(families.NODE_CPU_SECONDS,
                                      "CPU time spent in each mode, summed over all CPUs.", labels=["mode"])
        for mode, value in psutil.cpu_times()._asdict().items():
            if mode not in _OVERLAPPING_CPU_MODES:
                seconds.add_metric([mode], value)
        yield seconds
        yield GaugeMetricFamily(families.NODE_CPUS, "Logical CPUs.", value=psutil.cpu_count() or 0)

    def _memory(self) -> Iterable[Metric]:
        memory = psutil.virtual_memory()
        yield GaugeMetricFamily(families.NODE_MEMORY_TOTAL, "Total host memory.", value=memory.total)
        yield GaugeMetricFamily(families.NODE_MEMORY_AVAILABLE,
                                "Host memory available to new work without swapping.", value=memory.available)

    def _disks(self) -> Iterable[Metric]:
        # nowrap=False: the kernel's counters as they are (64-bit on 64-bit kernels). psutil's wrap repair
        # keeps state and cost a tenth of the cycle; a wrap would read as a counter reset, which rate() handles.
        disks = {name: io for name, io in (psutil.disk_io_counters(perdisk=True, nowrap=False) or {}).items()
                 if not _IGNORED_DISKS.match(name)}
        fields = [
            ("read_bytes", families.NODE_DISK_READ_BYTES, "Bytes read from the disk.", 1),
            ("write_bytes", families.NODE_DISK_WRITTEN_BYTES, "Bytes written to the disk.", 1),
            ("read_count", families.NODE_DISK_READS, "Reads completed.", 1),
            ("write_count", families.NODE_DISK_WRITES, "Writes completed.", 1),
            ("busy_time", families.NODE_DISK_IO_TIME,
             "Time the disk was busy doing I/O.", 0.001),  # psutil reports milliseconds
        ]
        for attribute, metric, documentation, scale in fields:
            family = CounterMetricFamily(metric, documentation, labels=["device"])
            for device in sorted(disks):
                value = getattr(disks[device], attribute, None)
                if value is not None:
                    family.add_metric([device], value * scale)
            if family.samples:
                yield family

    def _network(self) -> Iterable[Metric]:
        if self._net_dev is None:
            counters = {name: (io.bytes_recv, io.bytes_sent)
                        for name, io in psutil.net_io_counters(pernic=True, nowrap=False).items()}
        else:
            counters = self._node_counters(self._net_dev)
        receive = CounterMetricFamily(families.NODE_NETWORK_RECEIVE,
                                      "Bytes received on the interface.", labels=["device"])
        transmit = CounterMetricFamily(families.NODE_NETWORK_TRANSMIT,
                                       "Bytes transmitted on the interface.", labels=["device"])
        for device in sorted(name for name in counters if is_published_interface(name, self._netdev_exclude)):
            receive.add_metric([device], counters[device][0])
            transmit.add_metric([device], counters[device][1])
        yield receive
        yield transmit

    def _node_counters(self, net_dev: str) -> dict[str, tuple[int, int]]:
        """PID 1's counters (--collector.node.host-network), or none where they cannot be read: an SELinux or
        AppArmor policy denying the container PID 1's /proc, a /proc without PID 1's net/dev. The network
        families go missing, not the exporter (it exited at start) nor the other node readings, and
        `failed_reading` says so to the scheduler at every such cycle (stepscope_exporter_collector_errors_total).
        This process's own counters would be its container's interfaces, not the node's: never published in
        their place. Logged once until the file reads again."""
        try:
            counters = read_net_dev(net_dev)
        except OSError as exc:
            if not self._network_failure:
                log.warning("cannot read %s (--collector.node.host-network): %s; publishing no network readings "
                            "(this container's own are not the node's) until it can. Let the exporter read PID 1's "
                            "/proc (SELinux: run it as spc_t, e.g. the pod's securityContext.seLinuxOptions.type), or "
                            "run it in the node's network namespace (hostNetwork, compose's network_mode: host) with "
                            "--no-collector.node.host-network", net_dev, exc.strerror or exc)
            self._network_failure = f"network readings: cannot read {net_dev}: {exc.strerror or exc}"
            return {}
        if self._network_failure:
            log.warning("%s reads again: network readings are back", net_dev)
            self._network_failure = ""
        return counters

    def _filesystems(self) -> Iterable[Metric]:
        size = GaugeMetricFamily(families.NODE_FILESYSTEM_SIZE,
                                 "Size of the filesystem holding the path.", labels=["path", "mountpoint"])
        avail = GaugeMetricFamily(families.NODE_FILESYSTEM_AVAIL,
                                  "Bytes available to unprivileged users on the filesystem holding the path.",
                                  labels=["path", "mountpoint"])
        if time.monotonic() - self._paths_read >= FILESYSTEM_EVERY_SECONDS:
            self._path_values, self._paths_read = self._read_paths(), time.monotonic()
        read = self._path_values
        self._find_mountpoints(read)
        for path, reading in read.items():
            labels = [path, self._mountpoints[path][1]]
            size.add_metric(labels, reading.size)
            avail.add_metric(labels, reading.available)
        yield size
        yield avail

    def _read_paths(self) -> dict[str, PathReading]:
        """path -> its reading, for each path that answered within
        FILESYSTEM_READ_SECONDS; a path whose read has not come back since is not asked again until it does."""
        for path in [path for path in self._hung if self._readers[path].answer(0) is not None]:
            self._hung.discard(path)
            log.warning("filesystem path %r answers again", path)
        asked = [(path, reader) for path, reader in self._readers.items() if path not in self._hung]
        for _, reader in asked:
            reader.ask()
        deadline = time.monotonic() + FILESYSTEM_READ_SECONDS
        values: dict[str, PathReading] = {}
        for path, reader in asked:
            found = reader.answer(deadline - time.monotonic())
            if found is None:
                self._hung.add(path)
                log.warning("filesystem path %r skipped: no answer within %g s (a hung mount?); read again once "
                            "it answers", path, FILESYSTEM_READ_SECONDS)
            elif isinstance(found, OSError):
                if path not in self._missing_paths:
                    log.warning("filesystem path %r skipped: %s", path, found.strerror or found)
                    self._missing_paths.add(path)
            else:
                self._missing_paths.discard(path)
                values[path] = found
        return values

    def _find_mountpoints(self, read: dict[str, PathReading]) -> None:
        """Each path's mount point on the node, from a mount table read again only when one may have changed
        (a path on another device, a minute gone): reading it, every mount of the node, was a fifth of the cycle."""
        now = time.monotonic()
        if now - self._mounts_read < MOUNT_TABLE_SECONDS and all(
                self._mountpoints.get(path, (None, ""))[0] == reading.device for path, reading in read.items()):
            return
        table = [partition.mountpoint for partition in psutil.disk_partitions(all=True)]
        self._mountpoints = {path: (reading.device, _on_node(_mountpoint_of(reading.resolved, table), self._rootfs))
                             for path, reading in read.items()}
        self._mounts_read = now


class _PathReader:
    """Reads one path's statvfs and stat when asked, on a daemon thread of its own for the collector's life:
    the cycle can stop waiting for a hung mount, and the exporter can still exit while the thread stays
    blocked in the kernel. A thread started per read instead doubled the node cycle's CPU (0.15 -> 0.3 ms);
    SimpleQueue's handoff, in C, costs less than an Event's. Resolving the path is part of the read: a
    symbolic link on a hung mount blocks as well."""

    def __init__(self, path: str, rootfs: str) -> None:
        self._path, self._rootfs = path, rootfs
        self._asked: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[PathReading | OSError] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=f"statvfs {path}", daemon=True).start()

    def ask(self) -> None:
        self._asked.put(None)

    def answer(self, timeout: float) -> PathReading | OSError | None:
        """The path's reading, the error it met, or None when it has not answered yet."""
        try:
            found = self._answers.get(timeout=timeout) if timeout > 0 else self._answers.get_nowait()
        except queue.Empty:
            return None
        return found

    def _serve(self) -> None:
        while True:
            self._asked.get()
            try:
                resolved = resolve_on_node(self._path, self._rootfs)
                usage = psutil.disk_usage(resolved)
                self._answers.put(PathReading(os.stat(resolved).st_dev, usage.total, usage.free, resolved))
            except OSError as exc:
                self._answers.put(exc)


def node_hostname(rootfs: str) -> str:
    """The node's hostname: under a --path.rootfs, the first line of the node's /etc/hostname that is not blank
    or a comment (hostname(5)), the file found as the node finds it (NixOS links it into /etc/static); a pod's own
    hostname is the pod's name. Else, or where that file names nothing, this process's."""
    if rootfs != os.sep:
        try:
            with open(resolve_on_node("/etc/hostname", rootfs), encoding="utf-8", errors="replace") as handle:
                names = [line.strip() for line in handle if line.strip() and not line.lstrip().startswith("#")]
        except OSError:
            names = []
        if names:
            return names[0]
    return socket.gethostname()


def is_published_interface(name: str, exclude: re.Pattern[str] | None) -> bool:
    """Whether an interface's counters are published: not a tc ifb, and not one `exclude` matches at its start."""
    return not _IGNORED_NICS.match(name) and not (exclude and exclude.match(name))


def read_net_dev(path: str) -> dict[str, tuple[int, int]]:
    """Interface -> (bytes received, bytes transmitted) from a /proc/<pid>/net/dev: psutil reads only this
    process's own /proc/net/dev. Two header lines, then `name: rx_bytes ... (8 receive fields) tx_bytes ...`;
    a name may hold any byte but `/`, `:` and blanks (one not UTF-8 is shown with U+FFFD), a line of another
    shape is passed over."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        lines = handle.read().splitlines()[2:]
    counters = {}
    for line in lines:
        name, colon, fields = line.partition(":")
        values = fields.split()
        if colon and len(values) > 8 and values[0].isdigit() and values[8].isdigit():
            counters[name.strip()] = (int(values[0]), int(values[8]))
    return counters


def resolve_on_node(path: str, rootfs: str) -> str:
    """Where the node's `path` lies in this process's view with the node's root mounted at `rootfs`, each
    symbolic link followed as on the node: an absolute target is taken from the node's root, so a node's
    `/data -> /mnt/nvme` reads its /mnt/nvme, never this container's. Under "/" that is realpath()."""
    if rootfs == os.sep:
        return os.path.realpath(path)
    pending, resolved, links = [part for part in path.split(os.sep) if part], [], 0
    while pending:
        part = pending.pop(0)
        if part in (".", ".."):
            if part == ".." and resolved:
                resolved.pop()
            continue
        try:
            target = os.readlink(os.path.join(rootfs, *resolved, part))
        except OSError:  # not a link, or missing: statvfs says which
            resolved.append(part)
            continue
        links += 1
        if links > MAX_SYMLINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
        if target.startswith(os.sep):
            resolved = []
        pending[:0] = [part for part in target.split(os.sep) if part]
    return os.path.join(rootfs, *resolved)


def _on_node(mountpoint: str, rootfs: str) -> str:
    """A mount point of this process's view as the node names it: under `rootfs`, without it; a mount above
    it (the container's own, holding a rootfs that is no mount point of its own) is the node's root."""
    if rootfs == os.sep:
        return mountpoint
    if mountpoint == rootfs or mountpoint.startswith(rootfs + os.sep):
        return mountpoint[len(rootfs):] or os.sep
    return os.sep


def _mountpoint_of(real: str, mountpoints: list[str]) -> str:
    """The deepest mount point containing `real` (a path with its symlinks resolved); itself when none does."""
    best = ""
    for mountpoint in mountpoints:
        prefix = mountpoint if mountpoint.endswith(os.sep) else mountpoint + os.sep
        if (real == mountpoint or real.startswith(prefix)) and len(mountpoint) > len(best):
            best = mountpoint
    return best or real

"""Maps the pid a training process reported to the pid this exporter sees, across pid namespaces.

A training process in a container (a Kubernetes pod, a compose service) reports os.getpid() in its
own pid namespace, e.g. 27, while the exporter (hostPID, compose `pid: host`) sees host pids, where
27 is some unrelated process. The hooks therefore also report the process's start time, psutil's
create_time(): boot time plus the start ticks of /proc/<pid>/stat, the same from every namespace.
A pid is trusted only when that start time matches; otherwise the process is found by its innermost
pid in the `NSpid:` line of /proc/<pid>/status. A reported start time that matches nothing resolves
to nothing: publishing nothing beats attributing a stranger.

The start time alone does not tell two pods apart: both training processes are pid 1 in their own
namespaces, and two pods started together share a clock tick (10 ms, within TOLERANCE_SECONDS): both
resolved to the first one found, pod A's CPU, memory and GPU memory published as pod B's rank and pod B's
process as a foreign tenant of its own GPU. The hooks therefore also report their pid namespace's inode
(/proc/self/ns/pid), which a candidate must match; a report that still matches several processes (hooks
without it) resolves to nothing. An older client that reports no start time at all is resolved by its
innermost pid alone, and only when one process here has it: trusted as is, its pid 1 was the node's
init, and the whole node's CPU (76444 s) and memory were published as its rank's, every GPU holder a
"worker" of it.

That scan reads every process's status file (~20 µs of CPU each on a 2-core VM), and a reported
process it misses is almost always one that exited: its pushed group stays registered until the ingest
TTL (10 minutes by default) after every run. Looked for every cycle, such a process cost a scan per
second: on the H100 of the shared corpus, a process collector cycle took 6.25 ms of wall time (median)
with no live registered process, against 0.11 ms before the first run. A process that exited cannot be
found later, so the missed ones are looked for again only every RETRY_SECONDS (in case /proc could not be
read, say), all in one scan, and a process found before whose pid no longer names it (it exited) is missed without
a scan. Before, each missed process kept a retry time of its own and each exit cost a scan: where a sweep ended a
rank a second, 30 exits kept a scan in every 1 s cycle (120 of 120 cycles) for as long as their groups were kept.

The start time is Unix time: boot time (/proc/stat's btime) plus the start ticks. A clock step (an NTP step,
a VM resumed, a leap second) moves btime by the step, and every process then reads as started that much later
than it reported: checked again by Unix time each cycle, a rank found before a 2 s step was found no more, its
process series left without run and rank, for the rest of its life. So a process is matched by Unix time once,
then re-checked by its start ticks, which no clock step moves. (One first met after a step, the exporter
restarted meanwhile, still cannot be matched: the report says nothing of the ticks.)

Whatever a push reports, it never resolves to pid 1 here, the init of this exporter's pid namespace (the node's init
under hostPID or `pid: host`; in a container of its own, the exporter or its entrypoint): a process is published with
its descendants, and init's are every process. Any client that may push could name it, pid "1" with init's start
time (world-readable in /proc/1/stat) or none: the process collector published the node's whole CPU since boot
(93538 s) and memory as that client's run and rank, every GPU holder a "worker" of it. A training process is pid 1
only in a namespace of its own, where it is found under another pid here.
"""

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable

import psutil

from stepscope.exporter.collectors.proc_stat import stat_of

log = logging.getLogger(__name__)

TOLERANCE_SECONDS = 0.05  # create_time has clock-tick (10 ms) resolution; the hooks send milliseconds
RETRY_SECONDS = 30.0  # a reported process a scan missed is scanned for again after this long
INIT_PID = 1  # this exporter's namespace's init: never a rank (module docstring)

Reported = tuple[int, float | None, int | None]
"""(pid in the process's own namespace, its start time in Unix seconds, its pid namespace's inode; None when
not reported)."""
Identity = tuple[int, float]
"""(pid as this exporter sees it, its start in ProcStat.started's units: clock ticks after boot on Linux)."""


class PidResolver:
    """Resolves reported processes once and re-checks the answer every cycle by its start time."""

    def __init__(self, procfs: str = "/proc", clock: Callable[[], float] = time.monotonic) -> None:
        self._procfs = procfs
        self._clock = clock
        self._cache: dict[Reported, Identity] = {}
        self._missed: set[Reported] = set()  # reported processes the last scans missed, or that exited since found
        self._retried_at = -RETRY_SECONDS  # clock time of the last scan, which looked for the missed ones again
        self._ambiguous: dict[Reported, list[Identity]] = {}  # reported -> the processes its start time matched
        self._named_init: set[Reported] = set()  # reported processes found to be INIT_PID, logged

    def resolve(self, reported: Iterable[Reported]) -> dict[Reported, int]:
        """{reported: pid as this exporter sees it}; a process that cannot be found is left out.

        /proc is scanned at most once per call: for a process first reported, or, every RETRY_SECONDS, for the
        missed ones; a process that was found and exited since is missed without one.
        """
        wanted, now = set(reported), self._clock()
        retrying = now - self._retried_at >= RETRY_SECONDS
        trusted: dict[Reported, int] = {}
        identified: dict[Reported, Identity] = {}
        unresolved: list[Reported] = []
        for key in wanted:
            pid, start_time, _ = key
            if start_time is None and not sys.platform.startswith("linux"):  # no pid namespaces: trust the pid
                trusted[key] = pid
                continue
            skipped = key in self._missed and not retrying
            found = None if skipped else self._still_running(key) or self._checked(key)
            if found is None:
                unresolved.append(key)
            else:
                identified[key] = found
        identified.update(self._scan_for(unresolved, retrying, now))
        self._cache = identified
        resolved = trusted | {key: pid for key, (pid, _) in identified.items()}
        naming_init = self._naming_init(resolved)
        return {key: pid for key, pid in resolved.items() if key not in naming_init}

    def _naming_init(self, resolved: dict[Reported, int]) -> set[Reported]:
        """The reported processes found to be INIT_PID, which are never published; each is logged when it first
        appears (the set kept is the last call's: a client cannot grow it past the groups it pushes)."""
        naming = {key for key, pid in resolved.items() if pid == INIT_PID}
        for key in naming - self._named_init:
            log.warning("a push reports pid %d (start time %s, pid namespace %s), which is pid 1 here, this "
                        "exporter's pid namespace's init: its process series are not published", *key)
        self._named_init = naming
        return naming

    def unidentified(self) -> set[int]:
        """Pids here of the processes that match a reported pid and start time but as well as another does:
        ranks this exporter cannot tell apart (two pods' pid 1 started in one clock tick, their namespaces
        unsent or unreadable: the chart's exporter runs as a user without ptrace access). No stranger has
        a rank's start time to the tick, so the process collector takes them for no tenant of their GPUs."""
        return {pid for found in self._ambiguous.values() for pid, started in found if _started(pid) == started}

    def _still_running(self, key: Reported) -> Identity | None:
        """The process found for `key` before, if its pid still names it (same start ticks)."""
        cached = self._cache.get(key)
        return cached if cached is not None and _started(cached[0]) == cached[1] else None

    @staticmethod
    def _checked(key: Reported) -> Identity | None:
        """The process with the reported pid here, if it is the reported one. Without a start time nothing
        says so (pid 1 is this node's init as well as every pod's first process): the scan decides."""
        pid, start_time, namespace = key
        return None if start_time is None else _identity(pid, start_time, namespace)

    def _scan_for(self, unresolved: list[Reported], retrying: bool, now: float) -> dict[Reported, Identity]:
        """Scans /proc for all the unresolved processes, once one of them was first reported or the missed ones'
        retry time came, and remembers which are missed (a process found in the last call, now unresolved,
        exited: missed without a scan)."""
        first_reported = [key for key in unresolved if key not in self._missed and key not in self._cache]
        found: dict[Reported, Identity] = {}
        if (first_reported or (retrying and unresolved)) and sys.platform.startswith("linux"):
            self._retried_at = now
            found = self._scan(unresolved)
        self._missed = {key for key in unresolved if key not in found}
        self._ambiguous = {key: here for key, here in self._ambiguous.items() if key in self._missed}
        return found

    def _scan(self, unresolved: list[Reported]) -> dict[Reported, Identity]:
        """The unresolved processes one scan of /proc finds, each by its innermost pid, start time and pid
        namespace; one that several processes match is found as none of them."""
        innermost = self._innermost_pids({pid for pid, *_ in unresolved})
        found: dict[Reported, Identity] = {}
        for key in unresolved:
            pid, start_time, namespace = key
            matching = [here for here in (_identity(c, start_time, namespace) for c in innermost.get(pid, ()))
                        if here is not None]
            if len(matching) == 1:
                found[key] = matching[0]
                continue
            if start_time is not None and matching:
                self._ambiguous[key] = matching
            if key not in self._missed:
                log.debug("%d processes here have pid %d in their own pid namespace, start time %s and pid "
                          "namespace %s; publishing nothing for it", len(matching), *key)
        return found

    def _innermost_pids(self, wanted: set[int]) -> dict[int, list[int]]:
        """{innermost pid: [pids here]} for every process whose innermost pid is in `wanted`."""
        found: dict[int, list[int]] = {}
        try:
            entries = [entry for entry in os.scandir(self._procfs) if entry.name.isdigit()]
        except OSError as exc:
            log.debug("cannot list %s: %s", self._procfs, exc)
            return found
        for entry in entries:
            innermost = _innermost_pid(entry.path)
            if innermost in wanted:
                found.setdefault(innermost, []).append(int(entry.name))
        return found


def _innermost_pid(proc_dir: str) -> int | None:
    """The last entry of `NSpid:` in <proc_dir>/status: the pid in the process's own namespace."""
    nspid = _nspid(proc_dir)
    return nspid[-1] if nspid else None


def _namespace_depth(proc_dir: str) -> int | None:
    """How many pid namespaces, from this /proc's inwards, the process has a pid in (1: this one's only)."""
    nspid = _nspid(proc_dir)
    return len(nspid) if nspid else None


def _nspid(proc_dir: str) -> list[int] | None:
    """The `NSpid:` line of <proc_dir>/status, read by hand because psutil has no accessor for it.

    It lists the pid in each nested namespace from this /proc's namespace inwards (Linux 4.1+); None when
    unreadable or absent.
    """
    try:
        with open(f"{proc_dir}/status", "rb") as status:
            for line in status:
                if line.startswith(b"NSpid:"):
                    return [int(pid) for pid in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return None


def _identity(pid: int, start_time: float | None, namespace: int | None) -> Identity | None:
    """pid with its start ticks, if it names a process here created at start_time (Unix seconds) in the pid
    namespace whose inode is `namespace` (either None: not checked)."""
    try:
        if start_time is not None and abs(psutil.Process(pid).create_time() - start_time) > TOLERANCE_SECONDS:
            return None
    except (psutil.Error, OSError):
        return None
    if namespace is not None and _namespace_of(pid) not in (namespace, None):
        return None
    started = _started(pid)
    return None if started is None else (pid, started)


def _namespace_of(pid: int) -> int | None:
    """The inode of pid's pid namespace; None where /proc does not say (gone, not Linux): then the start time
    alone decides, as for hooks that do not send theirs.

    /proc/<pid>/ns/pid asks for ptrace access, which even root may lack (this node's init refused it: then
    it matched every pod's pid 1); a process whose `NSpid:` has one entry lives in this exporter's own
    namespace, which /proc/self/ns/pid always gives.
    """
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        pass
    try:
        return os.stat("/proc/self/ns/pid").st_ino if _namespace_depth(f"/proc/{pid}") == 1 else None
    except OSError:
        return None


def _started(pid: int) -> float | None:
    """The process's start ticks; None when it is gone or /proc refuses it."""
    try:
        found = stat_of(pid)
    except PermissionError:
        return None
    return None if found is None else found.started

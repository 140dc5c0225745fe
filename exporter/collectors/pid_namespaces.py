"""Maps the pid a training process reported to the pid this exporter sees, across pid namespaces.

A training process in a container (a Kubernetes pod, a compose service) reports os.getpid() in its
own pid namespace, e.g. 27, while the exporter (hostPID, compose `pid: host`) sees host pids, where
27 is some unrelated process. The hooks therefore also report the process's start time, psutil's
create_time(): boot time plus the start ticks of /proc/<pid>/stat, the same from every namespace.
A pid is trusted only when that start time matches; otherwise the process is found by its innermost
pid in the `NSpid:` line of /proc/<pid>/status. A reported start time that matches nothing resolves
to nothing: publishing nothing beats attributing a stranger.

That scan reads every process's status file (~20 µs of CPU each on a 2-core VM), and a reported
process it misses is almost always one that exited: its pushed group stays registered until the ingest
TTL (10 minutes by default) after every run. Looked for every cycle, such a process cost a scan per
second: on the H100 of the shared corpus, a process collector cycle took 6.25 ms of wall time (median)
with no live registered process, against 0.11 ms before the first run. A process that exited cannot be
found later, so a missed one is looked for again only every RETRY_SECONDS (in case /proc could not be
read, say).

The start time is Unix time: boot time (/proc/stat's btime) plus the start ticks. A clock step (an NTP step,
a VM resumed, a leap second) moves btime by the step, and every process then reads as started that much later
than it reported: checked again by Unix time each cycle, a rank found before a 2 s step was found no more, its
process series left without run and rank, for the rest of its life. So a process is matched by Unix time once,
then re-checked by its start ticks, which no clock step moves. (One first met after a step, the exporter
restarted meanwhile, still cannot be matched: the report says nothing of the ticks.)
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

Reported = tuple[int, float | None]
"""(pid in the process's own namespace, its start time in Unix seconds or None when not reported)."""
Identity = tuple[int, float]
"""(pid as this exporter sees it, its start in ProcStat.started's units: clock ticks after boot on Linux)."""


class PidResolver:
    """Resolves reported processes once and re-checks the answer every cycle by its start time."""

    def __init__(self, procfs: str = "/proc", clock: Callable[[], float] = time.monotonic) -> None:
        self._procfs = procfs
        self._clock = clock
        self._cache: dict[Reported, Identity] = {}
        self._missed: dict[Reported, float] = {}  # reported -> clock time of the scan that missed it

    def resolve(self, reported: Iterable[Reported]) -> dict[Reported, int]:
        """{reported: pid as this exporter sees it}; a process that cannot be found is left out.

        /proc is scanned at most once per call, and only when a cached or same-pid answer fails for a
        process that no scan missed in the last RETRY_SECONDS.
        """
        wanted, now = set(reported), self._clock()
        trusted: dict[Reported, int] = {}
        identified: dict[Reported, Identity] = {}
        unresolved: list[Reported] = []
        for key in wanted:
            pid, start_time = key
            if start_time is None:  # an older client, or psutil could not read it: trust the pid
                trusted[key] = pid
                continue
            found = None if self._missed_lately(key, now) else self._still_running(key) or _identity(pid, start_time)
            if found is None:
                unresolved.append(key)
            else:
                identified[key] = found
        identified.update(self._scan_for(unresolved, now))
        self._cache = identified
        return trusted | {key: pid for key, (pid, _) in identified.items()}

    def _still_running(self, key: Reported) -> Identity | None:
        """The process found for `key` before, if its pid still names it (same start ticks)."""
        cached = self._cache.get(key)
        return cached if cached is not None and _started(cached[0]) == cached[1] else None

    def _missed_lately(self, key: Reported, now: float) -> bool:
        """Whether a scan missed this process in the last RETRY_SECONDS: no process that started later can
        have its start time, which is in the past, so until then it is neither checked nor scanned for."""
        return now - self._missed.get(key, -RETRY_SECONDS) < RETRY_SECONDS

    def _scan_for(self, unresolved: list[Reported], now: float) -> dict[Reported, Identity]:
        """Scans /proc for the unresolved processes not missed lately, and remembers which it missed (a
        process still unresolved stays remembered, any other is forgotten)."""
        due = [key for key in unresolved if not self._missed_lately(key, now)]
        found: dict[Reported, Identity] = {}
        if due and sys.platform.startswith("linux"):
            innermost = self._innermost_pids({pid for pid, _ in due})
            for pid, start_time in due:
                here = next(filter(None, (_identity(c, start_time) for c in innermost.get(pid, ()))), None)
                if here is not None:
                    found[pid, start_time] = here
        for key in due:
            if key not in found and key not in self._missed:
                log.debug("no process here has pid %d in its own pid namespace and start time %.3f; "
                          "publishing nothing for it", *key)
        missed = {key: now for key in due if key not in found}
        self._missed = {key: self._missed[key] for key in unresolved if key in self._missed} | missed
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
    """The last entry of `NSpid:` in <proc_dir>/status: the pid in the process's own namespace.

    Read by hand because psutil has no accessor for it. The line lists the pid in each nested
    namespace from this /proc's namespace inwards (Linux 4.1+); None when unreadable or absent.
    """
    try:
        with open(f"{proc_dir}/status", "rb") as status:
            for line in status:
                if line.startswith(b"NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def _identity(pid: int, start_time: float) -> Identity | None:
    """pid with its start ticks, if it names a process here created at start_time (Unix seconds)."""
    try:
        if abs(psutil.Process(pid).create_time() - start_time) > TOLERANCE_SECONDS:
            return None
    except (psutil.Error, OSError):
        return None
    started = _started(pid)
    return None if started is None else (pid, started)


def _started(pid: int) -> float | None:
    """The process's start ticks; None when it is gone or /proc refuses it."""
    try:
        found = stat_of(pid)
    except PermissionError:
        return None
    return None if found is None else found.started

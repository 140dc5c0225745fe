"""Maps the pid a training process reported to the pid this exporter sees, across pid namespaces.

A training process in a container (a Kubernetes pod, a compose service) reports os.getpid() in its
own pid namespace, e.g. 27, while the exporter (hostPID, compose `pid: host`) sees host pids, where
27 is some unrelated process. The hooks therefore also report the process's start time, psutil's
create_time(): boot time plus the start ticks of /proc/<pid>/stat, the same from every namespace.
A pid is trusted only when that start time matches; otherwise the process is found by its innermost
pid in the `NSpid:` line of /proc/<pid>/status. A reported start time that matches nothing resolves
to nothing: publishing nothing beats attributing a stranger.
"""

import logging
import os
import sys
from collections.abc import Iterable

import psutil

log = logging.getLogger(__name__)

TOLERANCE_SECONDS = 0.05  # create_time has clock-tick (10 ms) resolution; the hooks send milliseconds

Reported = tuple[int, float | None]
"""(pid in the process's own namespace, its start time in Unix seconds or None when not reported)."""


class PidResolver:
    """Resolves reported processes once and re-checks the answer every cycle by its start time."""

    def __init__(self, procfs: str = "/proc") -> None:
        self._procfs = procfs
        self._cache: dict[Reported, int] = {}
        self._logged: set[Reported] = set()

    def resolve(self, reported: Iterable[Reported]) -> dict[Reported, int]:
        """{reported: pid as this exporter sees it}; a process that cannot be found is left out.

        /proc is scanned at most once per call, and only when a cached or same-pid answer fails.
        """
        wanted = set(reported)
        resolved: dict[Reported, int] = {}
        unresolved: list[tuple[int, float]] = []
        for key in wanted:
            pid, start_time = key
            if start_time is None:  # an older client, or psutil could not read it: trust the pid
                resolved[key] = pid
                continue
            cached = self._cache.get(key)
            found = next((c for c in (cached, pid) if c is not None and _started_at(c, start_time)), None)
            if found is None:
                unresolved.append((pid, start_time))
            else:
                resolved[key] = found
        if unresolved and sys.platform.startswith("linux"):
            innermost = self._innermost_pids({pid for pid, _ in unresolved})
            for pid, start_time in unresolved:
                found = next((c for c in innermost.get(pid, ()) if _started_at(c, start_time)), None)
                if found is not None:
                    resolved[pid, start_time] = found
        for key in unresolved:
            if key not in resolved and key not in self._logged:
                log.debug("no process here has pid %d in its own pid namespace and start time %.3f; "
                          "publishing nothing for it", *key)
                self._logged.add(key)
        self._cache = {key: pid for key, pid in resolved.items() if key[1] is not None}
        self._logged &= wanted
        return resolved

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


def _started_at(pid: int, start_time: float) -> bool:
    """Whether pid names a process here created at start_time (Unix seconds)."""
    try:
        return abs(psutil.Process(pid).create_time() - start_time) <= TOLERANCE_SECONDS
    except (psutil.Error, OSError):
        return False

"""One process's readings in as few reads as the kernel allows, for the process collector.

A training rank is read together with its data-loader workers every cycle, and a node of 8 ranks
with 8 workers each has 72 processes to read a second. psutil reads a worker's /proc/PID/stat twice
(its constructor, for the start time, then cpu_times) plus /proc/PID/statm for the resident set. One
read of /proc/PID/stat holds the start time, the state, the CPU times (the reaped children's included)
and the resident set, all that psutil would have returned; /proc/PID/io adds the storage bytes. A rank
with 16 workers on a 2-core VM: 1,676 µs of CPU a cycle through psutil, 499 µs so
(`bench_exporter_cpu.py --worker-tree`). Where there is no /proc, psutil reads them.
"""

import os
import sys
from dataclasses import dataclass

import psutil

_LINUX = sys.platform.startswith("linux")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if _LINUX else 0
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if _LINUX else 0


@dataclass(frozen=True)
class ProcStat:
    """What the kernel says of one process at one instant."""

    parent: int
    started: float  # comparable between processes of this node: clock ticks after boot on Linux
    zombie: bool  # exited and not yet reaped: its CPU time is not yet in its parent's
    cpu_seconds: float  # user + system, its reaped children's included
    rss: int  # bytes
    name: str  # the kernel's name for it (comm: the executable's, 15 characters at most), which tells the MPS server


def stat_of(pid: int, procfs: str | None = None) -> ProcStat | None:
    """The process's readings; None when it is gone. `procfs`: another mount of proc than psutil's (the pod
    collector reads the host's through its own)."""
    if not _LINUX:
        return _psutil_stat_of(pid)
    try:
        with open(f"{procfs or psutil.PROCFS_PATH}/{pid}/stat", "rb") as stat:
            data = stat.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    name_ends = data.rfind(b")")
    fields = data[name_ends + 2:].split()  # after the name: proc(5)'s fields from the 3rd, the state
    return ProcStat(parent=int(fields[1]), started=int(fields[19]), zombie=fields[0] == b"Z",
                    cpu_seconds=sum(int(ticks) for ticks in fields[11:15]) / _CLOCK_TICKS,
                    rss=int(fields[21]) * _PAGE_SIZE,
                    name=data[data.find(b"(") + 1:name_ends].decode(errors="replace"))


def io_of(pid: int) -> tuple[int, int] | None:
    """(read, written) storage bytes, or None where the platform or kernel has none. Raises PermissionError where
    they are refused (another user's process, read without CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH), which the
    collector tells the operator about, and psutil.NoSuchProcess when the process is gone."""
    if not _LINUX:
        return _psutil_io_of(pid)
    process = f"{psutil.PROCFS_PATH}/{pid}"
    try:
        with open(f"{process}/io", "rb") as io:
            counters = dict(line.split(b":", 1) for line in io.read().splitlines())
    except FileNotFoundError as exc:
        # A kernel built without CONFIG_TASK_IO_ACCOUNTING has no io file for any process: taken for a process
        # gone, every process lost its CPU and memory series with it.
        if os.path.isdir(process):
            return None
        raise psutil.NoSuchProcess(pid) from exc
    except ProcessLookupError as exc:
        raise psutil.NoSuchProcess(pid) from exc
    return int(counters[b"read_bytes"]), int(counters[b"write_bytes"])


def _psutil_stat_of(pid: int) -> ProcStat | None:
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            times = process.cpu_times()
            return ProcStat(process.ppid(), process.create_time(), process.status() == psutil.STATUS_ZOMBIE,
                            times.user + times.system + times.children_user + times.children_system,
                            process.memory_info().rss, process.name())
    except psutil.NoSuchProcess:  # ZombieProcess included: its readings are gone with it here
        return None


def _psutil_io_of(pid: int) -> tuple[int, int] | None:
    io_counters = getattr(psutil.Process(pid), "io_counters", None)  # absent on macOS
    if io_counters is None:
        return None
    try:
        counters = io_counters()
    except psutil.AccessDenied as exc:
        raise PermissionError(f"I/O counters of process {pid} refused") from exc
    return counters.read_bytes, counters.write_bytes

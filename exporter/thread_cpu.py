"""The exporter's CPU time by part, from the kernel's per-thread accounting.

Every job of the exporter runs on threads of its own, named for it: a collector's timer thread and its
helpers are `collect-<collector>[-<helper>]` (the GPU collector's slow readings and XID events), and the
rest serve HTTP (the event loop on the main thread: scrapes and pushes; the pools that parse large pushes
and check passwords; the expiry of push groups). Summing the threads' CPU by part says what the exporter
costs the node it watches and which part to turn down, without instrumenting any of them: the kernel
already accounts every thread (/proc/self/task/<tid>/stat). Linux only; elsewhere nothing.
"""

import os
import threading
from pathlib import Path

SERVER_PART = "server"
_COLLECTOR_THREAD = "collect-"
_TASKS = Path("/proc/self/task")
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# Fields of /proc/<pid>/task/<tid>/stat after the ")" that ends the command name: utime is the 12th, stime
# the 13th (proc(5) numbers them 14 and 15 counting pid and comm).
_UTIME, _STIME = 11, 12


def collector_thread_name(collector: str, helper: str = "") -> str:
    """The name of a collector's thread, or of one of its helpers: what `part_of` counts for the collector."""
    return f"{_COLLECTOR_THREAD}{collector}" + (f"-{helper}" if helper else "")


def part_of(thread_name: str) -> str:
    """The collector a thread works for, or SERVER_PART."""
    if thread_name.startswith(_COLLECTOR_THREAD):
        return thread_name.removeprefix(_COLLECTOR_THREAD).split("-", 1)[0]
    return SERVER_PART


class CpuByPart:
    """The live Python threads' CPU seconds summed by part, plus what ended threads had spent when last
    read, so each part's total only grows (a counter that fell when a thread ended would read to
    Prometheus as a reset, and rate() would count the whole total again). Empty off Linux; native
    threads Python did not start are left out: their names are not the exporter's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: dict[tuple[int, int], tuple[str, int]] = {}  # (native id, object id) -> (part, ticks)
        self._ended: dict[str, int] = {}  # part -> ticks of its threads that ended

    def read(self) -> dict[str, float]:
        live = {}
        for thread in threading.enumerate():
            ticks = _thread_ticks(thread.native_id) if thread.native_id is not None else None
            if ticks is not None:
                live[(thread.native_id, id(thread))] = (part_of(thread.name), ticks)
        with self._lock:
            for key, (part, ticks) in self._threads.items():
                now = live.get(key)
                if now is None or now[1] < ticks:  # ended (or its id taken by a new thread since)
                    self._ended[part] = self._ended.get(part, 0) + ticks
            self._threads = live
            totals = dict(self._ended)
        for part, ticks in live.values():
            totals[part] = totals.get(part, 0) + ticks
        return {part: ticks / _TICKS_PER_SECOND for part, ticks in totals.items()}


def _thread_ticks(native_id: int) -> int | None:
    """utime + stime of one thread in clock ticks; None when it ended or there is no /proc."""
    try:
        stat = (_TASKS / str(native_id) / "stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[_UTIME]) + int(fields[_STIME])

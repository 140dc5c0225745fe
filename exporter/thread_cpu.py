"""The exporter's CPU time per thread, from the kernel's accounting.

Each job of the exporter runs on a thread of its own (a collector's timer, the slow NVML readings, the
XID events, the HTTP server and push parsing on the main thread), so CPU per thread says what the
exporter costs the node it watches and which part costs it, without instrumenting any of them: the
kernel already accounts every thread (/proc/self/task/<tid>/stat). Linux only; elsewhere nothing.
"""

import os
import threading
from collections.abc import Mapping
from pathlib import Path

_TASKS = Path("/proc/self/task")
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# Fields of /proc/<pid>/task/<tid>/stat after the ")" that ends the command name: utime is the 12th, stime
# the 13th (proc(5) numbers them 14 and 15 counting pid and comm).
_UTIME, _STIME = 11, 12


def thread_cpu_seconds() -> Mapping[str, float]:
    """User plus system CPU seconds of each live Python thread, by thread name; empty off Linux.

    Threads of one name (a pool's, say) are summed. Native threads Python did not start are left
    out: their names would not be the exporter's.
    """
    names = {thread.native_id: thread.name for thread in threading.enumerate() if thread.native_id is not None}
    seconds: dict[str, float] = {}
    for native_id, name in names.items():
        ticks = _thread_ticks(native_id)
        if ticks is not None:
            seconds[name] = seconds.get(name, 0.0) + ticks / _TICKS_PER_SECOND
    return seconds


def _thread_ticks(native_id: int) -> int | None:
    """utime + stime of one thread in clock ticks; None when it ended or there is no /proc."""
    try:
        stat = (_TASKS / str(native_id) / "stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[_UTIME]) + int(fields[_STIME])

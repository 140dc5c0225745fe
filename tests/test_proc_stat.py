"""The process collector's own /proc reading against psutil's, on real processes: the same CPU, memory,
I/O, state and parent, from one read of /proc/PID/stat where psutil takes three (Linux)."""

import os
import subprocess
import sys
import time

import psutil
import pytest

from stepscope.exporter.collectors import proc_stat
from stepscope.exporter.collectors.proc_stat import io_of, stat_of

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# Burns 0.3 s of CPU, writes 1 MiB to storage and holds 40 MiB, then waits; exits when stdin closes.
WORKER = """
import os, sys, tempfile, time
start = time.process_time()
while time.process_time() - start < 0.3:
    pass
with tempfile.NamedTemporaryFile(dir=sys.argv[1]) as scratch:
    scratch.write(os.urandom(1 << 20)); scratch.flush(); os.fsync(scratch.fileno())
ballast = bytearray(40 << 20)
print(flush=True)
sys.stdin.read()
"""


def test_one_read_says_what_psutil_says(tmp_path) -> None:
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        worker.stdout.readline()
        read, process = stat_of(worker.pid), psutil.Process(worker.pid)
        with process.oneshot():
            times, rss, io = process.cpu_times(), process.memory_info().rss, process.io_counters()
        mine = io_of(worker.pid)
    finally:
        worker.stdin.close()
        worker.wait(10)
    assert read is not None
    assert read.parent == os.getpid() and not read.zombie
    assert read.cpu_seconds == pytest.approx(times.user + times.system + times.children_user
                                             + times.children_system, abs=0.02)
    assert read.cpu_seconds >= 0.3
    assert abs(read.rss - rss) <= 1 << 20 and read.rss >= 40 << 20
    assert mine == (io.read_bytes, io.write_bytes) and mine[1] >= 1 << 20
    boot_ticks = (process.create_time() - psutil.boot_time()) * os.sysconf("SC_CLK_TCK")
    assert read.started == pytest.approx(boot_ticks, abs=2)  # psutil's start time, in clock ticks after boot


def test_a_zombie_reads_as_one_and_a_gone_process_as_none() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)  # exited; not reaped until wait()
    zombie = stat_of(child.pid)
    child.wait()
    assert zombie is not None and zombie.zombie and zombie.rss == 0
    assert stat_of(child.pid) is None
    with pytest.raises(psutil.NoSuchProcess):
        io_of(child.pid)


def test_a_kernel_without_io_accounting_reads_no_io_and_the_process_as_there(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A /proc without PID/io (CONFIG_TASK_IO_ACCOUNTING off): the process collector took each process for gone
    (psutil.NoSuchProcess) and published neither its CPU nor its memory; a process gone still reads as gone."""
    (tmp_path / str(os.getpid())).mkdir()
    (tmp_path / str(os.getpid()) / "stat").symlink_to(f"/proc/{os.getpid()}/stat")
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path))
    assert io_of(os.getpid()) is None
    assert stat_of(os.getpid()) is not None
    with pytest.raises(psutil.NoSuchProcess):
        io_of(os.getpid() + 1)


def test_without_proc_psutil_reads_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    linux = stat_of(os.getpid())
    monkeypatch.setattr(proc_stat, "_LINUX", False)
    elsewhere, io = stat_of(os.getpid()), io_of(os.getpid())
    assert elsewhere is not None and linux is not None
    assert (elsewhere.parent, elsewhere.zombie) == (linux.parent, linux.zombie)
    assert elsewhere.cpu_seconds == pytest.approx(linux.cpu_seconds, abs=0.1)
    assert abs(elsewhere.rss - linux.rss) <= 4 << 20
    assert io is not None

"""The benchmarks' reading of a process's memory by mapping, which the GPU side by side prints for both
exporters to say what an RSS gap between them is made of."""

import subprocess
import sys

import psutil

from benchmarks.exporter_profile import ANONYMOUS, memory_by_mapping, memory_table

# Touches 48 MiB of fresh anonymous memory (one mapping of its own: above malloc's mmap threshold), then waits.
HOLDS_48_MIB = ("import sys; block = bytearray(48 << 20); block[::4096] = b'x' * (48 << 8); print(flush=True); "
                "sys.stdin.read()")


def test_a_processs_memory_by_mapping_adds_up_to_its_rss_and_shows_what_it_allocated() -> None:
    holder, idle = (subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                    for code in (HOLDS_48_MIB, "import sys; print(flush=True); sys.stdin.read()"))
    try:
        holder.stdout.readline()
        idle.stdout.readline()
        resident = memory_by_mapping(holder.pid)
        rss_kib = psutil.Process(holder.pid).memory_info().rss // 1024
        table = memory_table({"holder": holder.pid, "idle": idle.pid}, rows=3)
    finally:
        for process in (holder, idle):
            process.stdin.close()
            process.wait(10)
    assert abs(sum(resident.values()) - rss_kib) <= 0.02 * rss_kib, (sum(resident.values()), rss_kib)
    assert resident[ANONYMOUS] >= 48 << 10
    assert any(name.startswith(("libpython", "python")) for name in resident), sorted(resident)
    lines = table.splitlines()
    assert lines[0] == "| mapping | holder | idle |"
    holder_anonymous, idle_anonymous = (float(cell) for cell in lines[2].split("|")[2:4])
    assert lines[2].startswith(f"| {ANONYMOUS} | ") and holder_anonymous >= 48.0 > idle_anonymous + 40
    assert len(lines) == 2 + 3 + 2  # header, three mappings, the rest and the total
    assert lines[-1].startswith("| RSS | ") and abs(float(lines[-1].split("|")[2]) - rss_kib / 1024) < 0.5

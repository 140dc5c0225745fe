"""Where a running exporter's CPU goes: the kernel's per-thread CPU time and py-spy's sampled stacks by
category. Used by bench_exporter_cpu.py --profile (fake NVML) and bench_gpu.py --side-by-side (a real GPU,
when py-spy is installed), so both split the same way."""

from __future__ import annotations

import collections
import contextlib
import linecache
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import requests

RATE_HZ = 250

# py-spy stack categories, first match wins: (label, substring of a frame "function (file:line)")
CATEGORIES = (
    # the fake's module (stepscope_testkit/fake_nvml/pynvml.py) or nvidia-ml-py's on a GPU
    ("GPU collector: NVML calls (the driver's share; without a GPU the fake's modelled latency)", "pynvml.py:"),
    ("deflate of published text (Chunk: collectors' bodies, pushed groups)", "Chunk.__init__ ("),
    ("rendering families (CachedRenderer, metric_families)", "exposition.py"),
    ("GPU slow readings thread", "gpu_slow.py"),
    ("GPU collector: its own Python", "collectors/gpu"),
    ("node collector (psutil)", "collectors/node.py"),
    ("process collector (psutil, /proc)", "collectors/process.py"),
    ("pid namespaces", "pid_namespaces.py"),
    ("scheduler (self metrics, loop)", "scheduler.py"),
    ("push parsing and storing (ingest)", "exporter/ingest/"),
    ("scrape handler (/metrics)", "_metrics (stepscope/exporter/server.py"),
    ("HTTP/1.1 on connections (exporter/http_exchange.py, h11)", "http_exchange.py"),
    ("HTTP/1.1 on connections (exporter/http_exchange.py, h11)", "h11/"),  # h11 called from server.py
    ("asyncio loop", "asyncio/"),
)


IDLE_LINE = re.compile(r"\bsleep\(|\.wait\(|\.select\(|\.poll\(|\.acquire\(")
MAPPING_LINE = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")  # an smaps entry's first line: address range, perms, ...
ANONYMOUS = "[anonymous]"


def idle(leaf: str) -> bool:
    """A leaf frame that sleeps or waits: py-spy sometimes samples a thread entering or leaving one as active."""
    match = re.search(r"\((.+):(\d+)\)$", leaf)
    if match is None:
        return False
    path = next((str(Path(root) / match[1]) for root in sys.path if (Path(root) / match[1]).is_file()), match[1])
    return bool(IDLE_LINE.search(linecache.getline(path, int(match[2]))))


def categorize(raw: Path) -> collections.Counter[str]:
    """py-spy's raw (collapsed) stacks counted by CATEGORIES; the rest by their thread's leaf frame."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if idle(stack.rsplit(";", 1)[-1]):
            continue
        label = next((name for name, marker in CATEGORIES if marker in stack), None)
        if label is None:
            leaf = stack.rsplit(";", 1)[-1]
            label = f"other: {leaf.split(' (')[0]} ({leaf.rsplit('/', 1)[-1].rstrip(')')})"
        counts[label] += int(count)
    return counts


def thread_names(pid: int) -> dict[int, str]:
    """{native thread id: Python thread name}, from `py-spy dump` ('Thread 1100 (idle): "collect-gpu"')."""
    dump = subprocess.run([py_spy() or "py-spy", "dump", "--pid", str(pid)],
                          capture_output=True, text=True, check=True).stdout
    return {int(match[1]): match[2] for match in re.finditer(r'^Thread (\d+) \([a-z]+\): "(.*)"$', dump, re.M)}


def thread_cpu(pid: int) -> dict[int, float]:
    return {thread.id: thread.user_time + thread.system_time for thread in psutil.Process(pid).threads()}


def by_thread(names: dict[int, str], before: dict[int, float], after: dict[int, float], wall: float) -> str:
    """Exact CPU ms per second of each thread over the window (the kernel's accounting, not sampled)."""
    spent: collections.Counter[str] = collections.Counter()
    for tid, seconds in after.items():
        name = re.sub(r"_\d+$", "_N", names.get(tid, "a thread started during the window"))
        spent[name] += (seconds - before.get(tid, 0.0)) / wall * 1e3
    lines = ["| thread | CPU ms/s |", "|---|---:|"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in spent.most_common() if ms >= 0.005]
    return "\n".join(lines)


def py_spy() -> str | None:
    """py-spy next to this Python or on PATH; None if absent."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def profile_pid(pid: int, seconds: float, raw: Path) -> str:
    """py-spy on the running process `pid` for `seconds` (non-blocking: it never stops the process), its
    stacks kept in `raw`: the process's CPU, by thread (exact) and by category (sampled), as markdown."""
    spy = py_spy()
    if spy is None:
        raise RuntimeError("py-spy is not installed (`pip install py-spy`)")
    names = thread_names(pid)
    cpu0, threads0, started = cpu_seconds(pid), thread_cpu(pid), time.monotonic()
    subprocess.run([spy, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--duration", str(int(seconds)),
                    "--format", "raw", "--nonblocking", "--output", str(raw)], check=True, capture_output=True)
    wall = time.monotonic() - started
    cpu_ms, threads = (cpu_seconds(pid) - cpu0) / wall * 1e3, by_thread(names, threads0, thread_cpu(pid), wall)
    counts = categorize(raw)
    total = max(sum(counts.values()), 1)
    lines = ["| where | samples | share | CPU ms/s |", "|---|---:|---:|---:|"]
    for label, count in counts.most_common():
        if count / total >= 0.005:
            lines.append(f"| {label} | {count} | {count / total:.1%} | {count / total * cpu_ms:.2f} |")
    rest = sum(c for c in counts.values() if c / total < 0.005)
    lines.append(f"| everything under 0.5% each | {rest} | {rest / total:.1%} | {rest / total * cpu_ms:.2f} |")
    return (f"Exporter CPU over the profile: **{cpu_ms:.2f} ms/s** (psutil), {seconds:.0f} s.\n\nBy thread (the "
            f"kernel's per-thread CPU time):\n\n{threads}\n\nBy category: py-spy at {RATE_HZ} Hz, idle samples "
            f"left out (and those whose leaf line sleeps or waits), {sum(counts.values())} samples, shared out in "
            "proportion of the process's CPU. On a loaded machine a thread waiting for a CPU samples as active, so "
            "shares lean towards code that runs right after a wake-up (socket writes, the event loop).\n\n"
            + "\n".join(lines))


def memory_by_mapping(pid: int) -> collections.Counter[str]:
    """Resident KiB of process `pid` by what is mapped (/proc/PID/smaps): each file by its name (libpython,
    libnvidia-ml, ...), the heap and stacks as the kernel names them, and anonymous memory (Python's objects
    outside the heap, malloc arenas of threads): what an RSS gap between two exporters is made of."""
    resident: collections.Counter[str] = collections.Counter()
    mapping = ANONYMOUS
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            if MAPPING_LINE.match(line):
                fields = line.split(maxsplit=5)
                mapping = Path(fields[5].strip()).name if len(fields) > 5 else ANONYMOUS
            elif line.startswith("Rss:"):
                resident[mapping] += int(line.split()[1])
    return resident


def memory_table(pids: dict[str, int], rows: int = 8) -> str:
    """Markdown: each process's RSS in MiB by mapping, the `rows` largest mappings of any of them, the rest
    summed, and the total."""
    by_process = {name: memory_by_mapping(pid) for name, pid in pids.items()}
    largest = collections.Counter[str]()
    for resident in by_process.values():
        largest |= resident  # keeps each mapping's largest size among the processes
    shown = [mapping for mapping, _ in largest.most_common(rows)]

    def mib(kib: int) -> str:
        return f"{kib / 1024:.1f}"

    lines = ["| mapping | " + " | ".join(pids) + " |", "|---|" + "---:|" * len(pids)]
    lines += [f"| {mapping} | " + " | ".join(mib(r[mapping]) for r in by_process.values()) + " |" for mapping in shown]
    lines.append("| everything else | " + " | ".join(
        mib(sum(kib for m, kib in r.items() if m not in shown)) for r in by_process.values()) + " |")
    lines.append("| RSS | " + " | ".join(mib(sum(r.values())) for r in by_process.values()) + " |")
    return "\n".join(lines)


@contextlib.contextmanager
def scraping(url: str, interval: float) -> Iterator[None]:
    """For the block: a Prometheus-like gzip scrape of `url`/metrics every `interval` s on one connection,
    on a thread of its own; a failed scrape is skipped, not the end of the load."""
    stop = threading.Event()

    def scrape() -> None:
        with requests.Session() as session:
            while not stop.wait(interval):
                with contextlib.suppress(requests.RequestException):
                    session.get(f"{url}/metrics", headers={"Accept-Encoding": "gzip"}, timeout=10)

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=15)

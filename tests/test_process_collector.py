"""Process collector against real processes: a trainer-like parent with two fork()ed workers."""

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

from stepscope.exporter.collectors.process import ProcessCollector
from stepscope.exporter.exposition import render
from stepscope.exporter.gpu_processes import GpuProcessTable
from stepscope.exporter.registered import RegisteredProcess
from stepscope_testkit.fake_nvml.scenario import make_gpu, write_scenario
from stepscope_testkit.ingest_bodies import info_family
from stepscope_testkit.processes import running_exporter, sample_values, samples, scrape

MiB = 1 << 20
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="uses fork() workers")

# A stand-in for a training process with two data-loader workers: each worker burns 1 s of CPU,
# reports its own measured CPU time and holds 32 MiB; the parent then holds 64 MiB of its own.
TRAINER = """
import json, multiprocessing, sys, time

def worker(conn):
    start = time.process_time()
    while time.process_time() - start < 1.0:
        pass
    ballast = b"w" * (32 << 20)
    conn.send(time.process_time())
    conn.recv()

if __name__ == "__main__":
    context = multiprocessing.get_context("fork")
    pipes, workers = [], []
    for _ in range(2):
        mine, theirs = context.Pipe()
        process = context.Process(target=worker, args=(theirs,))
        process.start()
        pipes.append(mine)
        workers.append(process)
    burned = [pipe.recv() for pipe in pipes]
    ballast = b"p" * (64 << 20)
    print(json.dumps(burned), flush=True)
    sys.stdin.readline()
    for pipe in pipes:
        pipe.send("stop")
    for process in workers:
        process.join()
    print("joined", flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, float]]:
    """The running trainer and the CPU seconds its workers measured for themselves."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    process = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        burned = sum(json.loads(process.stdout.readline()))
        yield process, burned
    finally:
        for descendant in [*psutil.Process(process.pid).children(recursive=True), process]:
            descendant.kill()
        process.wait()


def scraped(collector: ProcessCollector) -> str:
    return render(list(collector.collect())).decode()


def value(text: str, name: str, **labels: str) -> float:
    (found,) = sample_values(text, name, **labels)
    return found


def test_registered_process_includes_its_workers(trainer: tuple[subprocess.Popen, float]) -> None:
    process, burned = trainer
    pid = str(process.pid)
    collector = ProcessCollector(GpuProcessTable(), lambda: [RegisteredProcess(process.pid, "r1", "0")])
    text = scraped(collector)
    labels = {"pid": pid, "run": "r1", "rank": "0"}
    cpu = value(text, "stepscope_process_cpu_seconds_total", **labels)
    print(f"workers burned {burned:.2f}s, exported {cpu:.2f}s")
    assert cpu >= 0.9 * burned
    assert value(text, "stepscope_process_children", **labels) == 2
    assert value(text, "stepscope_process_resident_memory_bytes", **labels) >= (64 + 2 * 32) * MiB
    if hasattr(psutil.Process, "io_counters"):
        assert value(text, "stepscope_process_io_read_bytes_total", **labels) >= 0
        assert value(text, "stepscope_process_io_write_bytes_total", **labels) >= 0

    process.stdin.write("stop workers\n")
    process.stdin.flush()
    assert process.stdout.readline() == "joined\n"
    # A fresh collector has no peak to hold: the reaped workers' time must come from children_*.
    text = scraped(ProcessCollector(GpuProcessTable(), lambda: [RegisteredProcess(process.pid, "r1", "0")]))
    assert value(text, "stepscope_process_cpu_seconds_total", **labels) >= 0.9 * burned
    assert value(text, "stepscope_process_children", **labels) == 0
    assert value(scraped(collector), "stepscope_process_cpu_seconds_total", **labels) >= cpu


def test_gpu_process_without_registration_has_empty_run_and_rank(
    trainer: tuple[subprocess.Popen, float],
) -> None:
    process, _ = trainer
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as other:
        try:
            table = GpuProcessTable()
            table.replace({other.pid: {"0": 123 * MiB}, process.pid: {"0": 1 * MiB, "1": 2 * MiB}})
            text = scraped(ProcessCollector(table, lambda: [RegisteredProcess(process.pid, "r1", "3")]))
        finally:
            other.kill()
    unregistered = {"pid": str(other.pid), "run": "", "rank": ""}
    assert value(text, "stepscope_process_gpu_memory_bytes", gpu="0", **unregistered) == 123 * MiB
    assert value(text, "stepscope_process_children", **unregistered) == 0
    registered = {"pid": str(process.pid), "run": "r1", "rank": "3"}
    assert value(text, "stepscope_process_gpu_memory_bytes", gpu="1", **registered) == 2 * MiB
    assert sample_values(text, "stepscope_process_gpu_memory_bytes", pid=str(process.pid)) == [MiB, 2 * MiB]


# A rank whose data-loader worker opened a CUDA context: it prints the worker's pid once the worker runs.
RANK_WITH_WORKER = """
import multiprocessing, time
worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
worker.start()
print(worker.pid, flush=True)
time.sleep(60)
"""
# The MPS server as the kernel names it (comm), without being it.
MPS_SERVER = ("open('/proc/self/comm', 'w').write('nvidia-cuda-mps'); print('named', flush=True)\n"
              "import time; time.sleep(60)")


@dataclass
class GpuNeighbours:
    """Real processes that may share a GPU with a rank, by pid."""

    rank: int
    worker: int  # the rank's child
    mps_server: int
    stranger: int  # a process the hooks do not know
    unseen: int  # no process this test (or an exporter) can see


@pytest.fixture
def neighbours() -> Iterator[GpuNeighbours]:
    if not sys.platform.startswith("linux"):
        pytest.skip("names the MPS server through /proc/self/comm")
    rank = subprocess.Popen([sys.executable, "-c", RANK_WITH_WORKER], stdout=subprocess.PIPE, text=True)
    mps = subprocess.Popen([sys.executable, "-c", MPS_SERVER], stdout=subprocess.PIPE, text=True)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        worker = int(rank.stdout.readline())
        assert mps.stdout.readline() == "named\n"
        yield GpuNeighbours(rank.pid, worker, mps.pid, stranger.pid, max(psutil.pids()) + 100_000)
    finally:
        for process in (*psutil.Process(rank.pid).children(), rank, mps, stranger):
            process.kill()
        for process in (rank, mps, stranger):
            process.wait()
            if process.stdout:
                process.stdout.close()


def test_gpu_holders_are_told_apart_and_a_workers_memory_is_its_ranks(neighbours: GpuNeighbours) -> None:
    """Only a process that is neither a rank, nor a rank's worker, nor the MPS server is a foreign tenant of the
    GPU; one this exporter cannot read is unknown. Before, all but the rank read run "" alike, and the worker's
    memory on its rank's GPU was not the rank's."""
    table = GpuProcessTable()
    table.replace({neighbours.rank: {"0": 2048 * MiB}, neighbours.worker: {"0": 500 * MiB, "1": 300 * MiB},
                   neighbours.mps_server: {"0": 30 * MiB}, neighbours.stranger: {"0": 20480 * MiB},
                   neighbours.unseen: {"0": 700 * MiB}})
    text = scraped(ProcessCollector(table, lambda: [RegisteredProcess(neighbours.rank, "light", "0")]))
    gpu_memory = "stepscope_process_gpu_memory_bytes"
    # the worker's memory on its rank's GPU is the rank's, as its CPU and resident memory are
    assert value(text, gpu_memory, pid=str(neighbours.rank), run="light", rank="0", holder="rank") == 2548 * MiB
    # a context on a GPU its rank does not hold (spawned workers' land on GPU 0) does not make that GPU the run's
    assert value(text, gpu_memory, pid=str(neighbours.worker), run="", holder="worker") == 300 * MiB
    assert value(text, gpu_memory, pid=str(neighbours.mps_server), run="", holder="mps_server") == 30 * MiB
    assert value(text, gpu_memory, pid=str(neighbours.stranger), run="", holder="foreign") == 20480 * MiB
    assert value(text, gpu_memory, pid=str(neighbours.unseen), run="", holder="unknown") == 700 * MiB
    assert sample_values(text, gpu_memory, holder="foreign") == [20480 * MiB]


def test_the_exporter_names_the_holders_of_a_gpu_from_nvml(tmp_path: Path, neighbours: GpuNeighbours) -> None:
    """The real exporter on the fake NVML: GPU 0 time-sliced between the rank, its worker and a stranger, GPU 1
    under MPS (the server in the compute list, the rank among its clients)."""
    scenario = {"driver_version": "550.54.15", "gpus": [
        make_gpu(0, processes=[(neighbours.rank, 2048 * MiB), (neighbours.worker, 500 * MiB),
                               (neighbours.stranger, 20480 * MiB)]),
        make_gpu(1, processes=[(neighbours.mps_server, 30 * MiB)],
                 mps_processes=[{"pid": neighbours.rank, "used_memory": 1024 * MiB}]),
    ]}
    started = f"{psutil.Process(neighbours.rank).create_time():.3f}"
    with running_exporter(tmp_path, "--collectors", "gpu,process",
                          fake_nvml_scenario=write_scenario(tmp_path / "nvml.json", scenario)) as exporter:
        requests.put(f"{exporter.url}/metrics/job/stepscope/run/light/rank/0", timeout=10,
                     data=info_family(pid=neighbours.rank, start_time=started)).raise_for_status()
        text = wait_for(exporter.url, "stepscope_process_gpu_memory_bytes", holder="rank")
    holders = {(labels["gpu"], labels["pid"]): (labels["holder"], labels["run"])
               for name, labels in ((name, dict(items)) for name, items in samples(text))
               if name == "stepscope_process_gpu_memory_bytes"}
    assert holders == {
        ("0", str(neighbours.rank)): ("rank", "light"),
        ("0", str(neighbours.stranger)): ("foreign", ""), ("1", str(neighbours.rank)): ("rank", "light"),
        ("1", str(neighbours.mps_server)): ("mps_server", ""),
    }
    assert sample_values(text, "stepscope_process_gpu_memory_bytes", gpu="0", pid=str(neighbours.rank)) == [
        2548 * MiB]  # its worker's 500 MiB included
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def wait_for(base_url: str, name: str, timeout: float = 15.0, **labels: str) -> str:
    """The first scrape with a `name` sample carrying `labels`, within `timeout` (the last one tried after it)."""
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(base_url)
        if sample_values(text, name, **labels) or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def test_vanished_and_unknown_pids_are_dropped_quietly() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    never = max(psutil.pids()) + 100_000  # beyond every live pid
    registered = [RegisteredProcess(child.pid, "r", "0"), RegisteredProcess(never, "r", "1")]
    collector = ProcessCollector(GpuProcessTable(), lambda: registered)
    try:
        first = scraped(collector)
    finally:
        child.kill()
        child.wait()
    assert sample_values(first, "stepscope_process_children", pid=str(child.pid)) == [0]
    assert sample_values(first, "stepscope_process_children", pid=str(never)) == []
    after = scraped(collector)
    assert sample_values(after, "stepscope_process_cpu_seconds_total") == []
    assert "# TYPE stepscope_process_cpu_seconds_total counter" in after


@pytest.mark.parametrize("closed_listed_first", [True, False])
def test_a_process_in_two_runs_is_published_under_the_run_it_pushed_to_last(closed_listed_first: bool) -> None:
    """A notebook closed run "first" and started "second": the closed group lives on until its TTL."""
    pid = os.getpid()
    closed = RegisteredProcess(pid, "first", "0", pushed_at=100.0)
    current = RegisteredProcess(pid, "second", "1", pushed_at=160.0)
    registered = [closed, current] if closed_listed_first else [current, closed]
    table = GpuProcessTable()
    table.replace({pid: {"0": 3 * MiB}})
    text = scraped(ProcessCollector(table, lambda: registered))
    assert sample_values(text, "stepscope_process_gpu_memory_bytes", pid=str(pid)) == [3 * MiB]
    assert value(text, "stepscope_process_gpu_memory_bytes", pid=str(pid), run="second", rank="1") == 3 * MiB
    assert sample_values(text, "stepscope_process_cpu_seconds_total", run="first") == []
    assert len(sample_values(text, "stepscope_process_cpu_seconds_total", run="second", rank="1")) == 1


def test_promtool_accepts_process_families(trainer: tuple[subprocess.Popen, float]) -> None:
    promtool = shutil.which("promtool") or "promtool"
    process, _ = trainer
    table = GpuProcessTable()
    table.replace({process.pid: {"0": MiB}})
    text = scraped(ProcessCollector(table, lambda: [RegisteredProcess(process.pid, "r1", "0")]))
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_registered_pid_is_trusted_only_with_its_own_start_time(trainer: tuple[subprocess.Popen, float]) -> None:
    process, _ = trainer
    started = psutil.Process(process.pid).create_time()
    table = GpuProcessTable()
    table.replace({process.pid: {"0": MiB}})
    # The pid exists here, but a process from another pid namespace started at another time reported it.
    stranger = scraped(ProcessCollector(table, lambda: [RegisteredProcess(process.pid, "other", "1", started + 5)]))
    assert sample_values(stranger, "stepscope_process_cpu_seconds_total", run="other") == []
    assert sample_values(stranger, "stepscope_process_gpu_memory_bytes", pid=str(process.pid), run="", rank="") \
        == [MiB]  # still published as the unregistered GPU process it is
    same = scraped(ProcessCollector(table, lambda: [RegisteredProcess(process.pid, "r1", "0", started + 0.004)]))
    labels = {"pid": str(process.pid), "run": "r1", "rank": "0"}
    assert value(same, "stepscope_process_children", **labels) == 2
    assert value(same, "stepscope_process_gpu_memory_bytes", gpu="0", **labels) == MiB


def test_one_process_table_pass_per_cycle_and_unseen_pids_retried_slowly(
    trainer: tuple[subprocess.Popen, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    from stepscope.exporter.collectors import process as process_module

    parent, _ = trainer
    hidden = 4_000_000  # a GPU process in another pid namespace: NVML lists it, this exporter cannot see it
    table = GpuProcessTable()
    table.replace({parent.pid: {"0": 2 * MiB}, hidden: {"1": MiB}, **{os.getpid(): {"1": MiB}}})
    collector = ProcessCollector(table, registered=lambda: [])
    lookups: list[int] = []
    reads: list[list[int]] = [[]]  # parent pids read, by cycle
    listed: list[set[int]] = []  # the pids each cycle listed
    real_parent_of, real_pids = process_module._parent_of, psutil.pids
    real_stat_of, monotonic = process_module.stat_of, time.monotonic
    monkeypatch.setattr(process_module, "_parent_of", lambda pid: (reads[-1].append(pid), real_parent_of(pid))[1])
    monkeypatch.setattr(psutil, "pids", lambda: (listed.append(set(pids := real_pids())), pids)[1])
    monkeypatch.setattr(process_module, "stat_of", lambda pid: (lookups.append(pid), real_stat_of(pid))[1])
    for _ in range(3):
        text = scraped(collector)
        reads.append([])
    assert len(listed) == 3  # the pids listed once per cycle, not once per tracked process
    assert set(reads[0]) >= {parent.pid, *(child.pid for child in psutil.Process(parent.pid).children())}
    for cycle in (1, 2):  # after the first cycle only new processes' parents are read (and orphans')
        new = listed[cycle] - listed[cycle - 1]
        orphaned = {pid for pid in reads[cycle] if pid in listed[cycle - 1]}
        assert set(reads[cycle]) - orphaned <= new
        assert len(orphaned) < len(listed[cycle]) / 4
    assert value(text, "stepscope_process_children", pid=str(parent.pid)) == 2  # the workers, from that pass
    assert lookups.count(hidden) == 1  # not again within MISSING_RETRY_SECONDS
    assert sample_values(text, "stepscope_process_gpu_memory_bytes", pid=str(hidden)) == [MiB]
    monkeypatch.setattr(process_module.time, "monotonic",
                        lambda: monotonic() + process_module.MISSING_RETRY_SECONDS + 1)
    scraped(collector)
    assert lookups.count(hidden) == 2


SPAWNER = """
import subprocess, sys
children = []
for line in sys.stdin:
    if line == "spawn\\n":
        children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    elif line == "reap\\n":
        worker = children.pop()
        worker.kill()
        worker.wait()
    print("done", flush=True)
"""


def test_the_kept_process_table_follows_workers_started_and_reaped_between_cycles() -> None:
    """The children map is kept from cycle to cycle (only new pids read): a worker started after one
    cycle counts at the next, one reaped drops out at the next, on the same collector."""
    with subprocess.Popen([sys.executable, "-c", SPAWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as parent:
        collector = ProcessCollector(GpuProcessTable(), lambda: [RegisteredProcess(parent.pid, "r1", "0")])
        labels = {"pid": str(parent.pid), "run": "r1", "rank": "0"}

        def tell(command: str) -> None:
            parent.stdin.write(command + "\n")
            parent.stdin.flush()
            assert parent.stdout.readline() == "done\n"

        try:
            assert value(scraped(collector), "stepscope_process_children", **labels) == 0
            tell("spawn")
            assert value(scraped(collector), "stepscope_process_children", **labels) == 1
            tell("spawn")
            assert value(scraped(collector), "stepscope_process_children", **labels) == 2
            tell("reap")
            assert value(scraped(collector), "stepscope_process_children", **labels) == 1
        finally:
            for child in psutil.Process(parent.pid).children():
                child.kill()
            parent.kill()


def test_a_tracked_process_costs_one_stat_read_a_cycle_and_a_reused_pid_starts_afresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its start time, state, CPU and memory all come from one /proc/PID/stat read (psutil's is_running read it
    a second time every cycle: on the H100 VM each read costs ~24 µs); another start time under the same pid is
    another process, whose counters start afresh instead of holding the old one's peaks."""
    import builtins

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        table = GpuProcessTable()
        table.replace({sleeper.pid: {"0": MiB}})
        collector = ProcessCollector(table, registered=lambda: [])
        scraped(collector)
        stat_reads: list[str] = []
        real_open = builtins.open

        def counting_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
            if str(file).endswith(f"/{sleeper.pid}/stat"):
                stat_reads.append(str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", counting_open)
        for _ in range(3):
            text = scraped(collector)
        assert len(stat_reads) == 3
        assert value(text, "stepscope_process_cpu_seconds_total", pid=str(sleeper.pid)) >= 0
        peak = 10_000.0  # as if the pid had named a process that ran for hours
        collector._tracked[sleeper.pid].peaks["cpu"] = peak
        assert value(scraped(collector), "stepscope_process_cpu_seconds_total", pid=str(sleeper.pid)) == peak
        collector._tracked[sleeper.pid].started -= 1  # that process started earlier: the pid was reused since
        assert value(scraped(collector), "stepscope_process_cpu_seconds_total", pid=str(sleeper.pid)) < 5
    finally:
        sleeper.kill()
        sleeper.wait()


# Runs in a mount namespace whose /proc is mounted hidepid=1 (`noaccess`), as root without capabilities in
# group 65534: /proc lists every process but refuses the files of any process with other credentials. Its
# rank (a shell) has a worker that later execs a setgid copy of sleep, which makes it unreadable from then on.
HIDEPID_INSIDE = """
import json, os, subprocess, sys, time
from stepscope.exporter.collectors.process import ProcessCollector
from stepscope.exporter.exposition import render
from stepscope.exporter.gpu_processes import GpuProcessTable

setgid_sleep, stranger = sys.argv[1], int(sys.argv[2])


def refused(pid):
    try:
        open(f"/proc/{pid}/stat", "rb").close()
    except PermissionError:
        return True
    return False


rank = subprocess.Popen(["sh", "-c", 'sh -c "read line; exec $0 60" "$0"; true', setgid_sleep], stdin=subprocess.PIPE,
                        stdout=subprocess.DEVNULL)
time.sleep(0.5)
(worker,) = [int(pid) for pid in open(f"/proc/{rank.pid}/task/{rank.pid}/children").read().split()]
table = GpuProcessTable()
table.replace({rank.pid: {"0": 1 << 20}, stranger: {"1": 1 << 20}})
collector = ProcessCollector(table, registered=lambda: [])


def cycle():
    try:
        return render(list(collector.collect())).decode()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


cycles = [cycle()]
rank.stdin.write(b"go\\n")
rank.stdin.flush()
deadline = time.monotonic() + 10
while not refused(worker) and time.monotonic() < deadline:
    time.sleep(0.05)
cycles.append(cycle())
print(json.dumps({"rank": rank.pid, "stranger": stranger, "stranger_refused": refused(stranger),
                  "worker_refused": refused(worker), "cycles": cycles}), flush=True)
os.kill(worker, 9)
rank.kill()
"""


def test_a_proc_mounted_hidepid_noaccess_leaves_out_the_processes_it_refuses(tmp_path: Path) -> None:
    """/proc with hidepid=1 lists other users' processes and refuses their files. The children table read every
    process's parent and the first refusal failed the whole collector, every cycle: no CPU, memory or worker
    series for the processes it could read, and not even NVML's GPU memory per process. Now the refused ones
    are left out: the rank is published with its readable worker, then without it once it is refused."""
    unshare, setpriv, mount = (shutil.which(tool) for tool in ("unshare", "setpriv", "mount"))
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or None in (unshare, setpriv, mount):
        pytest.skip("needs Linux, root, and util-linux's unshare, setpriv and mount")
    setgid_sleep = tmp_path / "setgid-sleep"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", setgid_sleep)
    os.chown(setgid_sleep, 0, 0)
    os.chmod(setgid_sleep, 0o2755)
    tmp_path.chmod(0o755)
    inside = tmp_path / "inside.py"
    inside.write_text(HIDEPID_INSIDE)
    stranger = subprocess.Popen(["sleep", "60"])  # root's, with every capability: refused inside
    script = (f'{mount} -t proc -o hidepid=1 proc /proc || exit 77; exec {setpriv} --regid=65534 --clear-groups '
              f'--bounding-set=-all --inh-caps=-all "$@"')
    try:
        done = subprocess.run([unshare, "-m", "--propagation", "private", "sh", "-c", script, "sh", sys.executable,
                               str(inside), str(setgid_sleep), str(stranger.pid)],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    finally:
        stranger.kill()
        stranger.wait()
    if done.returncode == 77:
        pytest.skip(f"cannot mount /proc with hidepid=1 here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    if not found["worker_refused"]:
        pytest.skip("the setgid worker stayed readable (a nosuid temporary directory?)")
    assert found["stranger_refused"]
    first, second = found["cycles"]
    assert "stepscope_process" in first, first
    assert "stepscope_process" in second, second
    rank = str(found["rank"])
    assert value(first, "stepscope_process_children", pid=rank) == 1
    assert value(second, "stepscope_process_children", pid=rank) == 0
    for cycle in (first, second):
        assert value(cycle, "stepscope_process_cpu_seconds_total", pid=rank) >= 0
        assert value(cycle, "stepscope_process_gpu_memory_bytes", pid=str(found["stranger"])) == MiB
        assert sample_values(cycle, "stepscope_process_cpu_seconds_total", pid=str(found["stranger"])) == []

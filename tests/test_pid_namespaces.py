"""A training process in its own pid namespace (as in a pod or a compose service), made real with unshare.

The process reports its in-namespace pid (1 here) and start time; the exporter must publish it
under the pid it sees, and never the unrelated process that has pid 1 in the exporter's namespace.
"""

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

from stepscope.exporter.collectors.pid_namespaces import RETRY_SECONDS, TOLERANCE_SECONDS, PidResolver
from stepscope.exporter.collectors.process import ProcessCollector
from stepscope.exporter.exposition import render
from stepscope.exporter.gpu_processes import GpuProcessTable
from stepscope.exporter.registered import RegisteredProcess
from stepscope_testkit.fake_nvml.scenario import make_gpu, make_scenario, write_scenario
from stepscope_testkit.ingest_bodies import counter, info_family
from stepscope_testkit.processes import running_exporter, sample_values, samples, scrape

MiB = 1 << 20

# Burns a little CPU, reports what the hooks would (its own pid, psutil's create_time) and waits.
INSIDE = """
import json, os, sys, time
import psutil
start = time.process_time()
while time.process_time() - start < 0.3:
    pass
print(json.dumps({"pid": os.getpid(), "start_time": psutil.Process().create_time()}), flush=True)
sys.stdin.read()
"""


@dataclass
class Namespaced:
    inner_pid: int  # os.getpid() inside the namespace
    host_pid: int  # the same process as the test (and the exporter) sees it
    start_time: float


@contextlib.contextmanager
def in_pid_namespaces(script: str, *argvs: Sequence[str]) -> Iterator[list[Namespaced]]:
    """`script` run once per argv, each in a pid namespace of its own (pid 1 there), started back to back as a
    Job's pods are; each prints its pid and start time as it sees them, then waits for its stdin to close."""
    unshare = shutil.which("unshare")
    if not sys.platform.startswith("linux") or unshare is None:
        pytest.skip("needs Linux and util-linux's unshare")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with contextlib.ExitStack() as stack:
        processes = [stack.enter_context(_waited(subprocess.Popen(
            [unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c", script, *argv], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))) for argv in argvs]
        yield [_reported(process) for process in processes]


def _reported(process: subprocess.Popen) -> Namespaced:
    """What the process in its namespace printed, with the pid this test sees it under."""
    line = process.stdout.readline()
    if not line:
        process.wait(timeout=10)
        error = process.stderr.read()
        if "Operation not permitted" in error:
            pytest.skip(f"creating a pid namespace is not permitted here (EPERM): {error.strip()}")
        raise RuntimeError(f"unshare exited with {process.returncode}: {error}")
    reported = json.loads(line)
    (child,) = psutil.Process(process.pid).children()  # unshare --fork's child, pid 1 inside
    return Namespaced(reported["pid"], child.pid, reported["start_time"])


@contextlib.contextmanager
def _waited(process: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """Closes the process's stdin on the way out (its script returns, pid 1 exits, the namespace goes)."""
    try:
        yield process
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()
        process.stderr.close()


@pytest.fixture
def namespaced() -> Iterator[Namespaced]:
    with in_pid_namespaces(INSIDE, []) as (process,):
        yield process


def test_the_namespace_is_real(namespaced: Namespaced) -> None:
    assert namespaced.inner_pid == 1 != namespaced.host_pid
    assert psutil.Process(1).create_time() != pytest.approx(namespaced.start_time, abs=1)  # pid 1 here differs


# --- the resolver -------------------------------------------------------------------------------

def own_pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def test_a_pid_from_this_namespace_with_its_start_time_is_itself() -> None:
    mine = (os.getpid(), psutil.Process().create_time(), None)
    named = (os.getpid(), psutil.Process().create_time(), own_pid_namespace())
    assert PidResolver().resolve([mine, named]) == {mine: os.getpid(), named: os.getpid()}


def test_a_pid_with_another_start_time_is_a_stranger() -> None:
    stranger = (os.getpid(), psutil.Process().create_time() - 10, None)
    assert PidResolver().resolve([stranger]) == {}


def test_without_a_start_time_a_pid_only_one_process_has_is_trusted() -> None:
    never = (max(psutil.pids()) + 100_000, None, None)
    mine = (os.getpid(), None, None)
    assert PidResolver().resolve([never, mine]) == {mine: os.getpid()}


def test_init_here_is_never_a_rank_whatever_a_push_reports(caplog: pytest.LogCaptureFixture) -> None:
    """A push of pid 1 with init's start time (world-readable): before, the process collector published init with
    its descendants, the whole node (93538 s of CPU), as the pushing client's run and rank."""
    init = (1, psutil.Process(1).create_time(), None)
    resolver = PidResolver()
    with caplog.at_level(logging.WARNING, logger="stepscope.exporter.collectors.pid_namespaces"):
        assert resolver.resolve([init]) == {}
        assert resolver.resolve([init]) == {}
    (warning,) = [record.getMessage() for record in caplog.records]
    assert "which is pid 1 here, this exporter's pid namespace's init" in warning


def test_a_pid_from_another_namespace_resolves_to_the_pid_seen_here(namespaced: Namespaced) -> None:
    reported = (namespaced.inner_pid, namespaced.start_time, None)
    later = (namespaced.inner_pid, namespaced.start_time + 1, None)  # pid 1 of some other namespace
    assert PidResolver().resolve([reported, later]) == {reported: namespaced.host_pid}


def test_a_pid_and_start_time_from_another_pid_namespace_is_a_stranger(namespaced: Namespaced) -> None:
    """Two pods' pid 1 started in one clock tick report the same pid and start time: only the namespace tells
    them apart (before, both resolved to the first process found)."""
    inode = os.stat(f"/proc/{namespaced.host_pid}/ns/pid").st_ino
    reported = (namespaced.inner_pid, namespaced.start_time, inode)
    other_pod = (namespaced.inner_pid, namespaced.start_time, own_pid_namespace())
    assert PidResolver().resolve([reported, other_pod]) == {reported: namespaced.host_pid}


class CountingResolver(PidResolver):
    """Counts the scans of /proc, which the resolver should spend only on unresolved processes."""

    scans = 0

    def _innermost_pids(self, wanted: set[int]) -> dict[int, list[int]]:
        self.scans += 1
        return super()._innermost_pids(wanted)


def test_resolutions_are_cached_and_scans_happen_once_per_call_at_most(namespaced: Namespaced) -> None:
    reported = (namespaced.inner_pid, namespaced.start_time, None)
    strangers = [(namespaced.inner_pid, namespaced.start_time + 1, None), (2, namespaced.start_time + 2, None)]
    now = [1000.0]
    resolver = CountingResolver(clock=lambda: now[0])
    assert resolver.resolve([reported, *strangers]) == {reported: namespaced.host_pid}
    assert resolver.scans == 1
    assert resolver.resolve([reported]) == {reported: namespaced.host_pid}
    assert resolver.scans == 1  # cached, and the cached pid still has the start time
    now[0] += RETRY_SECONDS
    assert resolver.resolve([reported, *strangers]) == {reported: namespaced.host_pid}
    assert resolver.scans == 2  # the strangers are looked for again once their retry time came
    resolver.resolve([])  # its group is gone: forgotten
    assert resolver.resolve([reported]) == {reported: namespaced.host_pid}
    assert resolver.scans == 3


def test_a_registered_process_that_exited_costs_one_scan_per_retry_time_not_one_per_cycle() -> None:
    """Its group stays registered until the ingest TTL (10 minutes) after the run: the H100 corpus's
    process collector's cycle took 6.25 ms of wall time scanning /proc for such processes."""
    exited = subprocess.run([sys.executable, "-c", "import os, psutil; print(os.getpid(), "
                             "psutil.Process().create_time())"], capture_output=True, text=True, check=True)
    pid, start_time = exited.stdout.split()
    gone = (int(pid), float(start_time), None)
    now = [0.0]
    resolver = CountingResolver(clock=lambda: now[0])
    for _ in range(45):  # 45 s of 1 s cycles
        assert resolver.resolve([gone]) == {}
        now[0] += 1.0
    assert resolver.scans == 2  # at 0 s and 30 s
    newcomer = (os.getpid(), psutil.Process().create_time() + 5, None)  # at 45 s: a new key is scanned for at once
    assert resolver.resolve([gone, newcomer]) == {}
    assert resolver.scans == 3


def test_ranks_that_exit_one_a_cycle_cost_one_scan_per_retry_time_all_together() -> None:
    """A sweep's ranks end one after another while their groups stay registered (--ingest-ttl): each exit cost a
    scan of /proc and each missed process was retried on a clock of its own, so 30 exits over 30 s kept a scan in
    every 1 s cycle (120 of 120). An exited process found before is missed without a scan; the missed ones are
    scanned for together, once per RETRY_SECONDS."""
    ranks = [subprocess.Popen(["sleep", "60"]) for _ in range(10)]
    reported = [(rank.pid, psutil.Process(rank.pid).create_time(), None) for rank in ranks]
    now = [0.0]
    resolver = CountingResolver(clock=lambda: now[0])
    assert len(resolver.resolve(reported)) == 10 and resolver.scans == 0  # each found by its own pid
    for cycle in range(45):  # 45 s of 1 s cycles, a rank exiting in each of the first 10
        if cycle < len(ranks):
            ranks[cycle].kill()
            ranks[cycle].wait()
        assert len(resolver.resolve(reported)) == max(0, 9 - cycle)
        now[0] += 1.0
    assert resolver.scans == 2  # at 0 s and 30 s


# Runs in a mount namespace of its own: resolves a process it started, then steps the clock as the exporter sees
# it (a copy of /proc/stat with btime 2 s later bound over /proc/stat: what an NTP step of +2 s does to btime)
# and resolves it again.
CLOCK_STEP_INSIDE = """
import json, subprocess, sys
import psutil
from stepscope.exporter.collectors.pid_namespaces import PidResolver

rank = subprocess.Popen(["sleep", "60"])
reported = (rank.pid, round(psutil.Process(rank.pid).create_time(), 3), None)  # as the hooks report it
resolver = PidResolver()
before = resolver.resolve([reported])
with open("/proc/stat") as stat:
    lines = stat.read().splitlines()
with open(sys.argv[1], "w") as stepped:
    stepped.write("".join(f"btime {int(line.split()[1]) + 2}\\n" if line.startswith("btime ") else line + "\\n"
                          for line in lines))
subprocess.run(["mount", "--bind", sys.argv[1], "/proc/stat"], check=True)
seen_after = psutil.Process(rank.pid).create_time()
after = resolver.resolve([reported])
rank.kill()
print(json.dumps({"pid": rank.pid, "before": list(before.values()), "after": list(after.values()),
                  "step": seen_after - reported[1]}))
"""


def test_a_process_found_before_a_clock_step_is_still_found_after_it(tmp_path: Path) -> None:
    """A clock step moves /proc/stat's btime, so every process's Unix start time with it: before, the resolver
    checked the reported start time again each cycle, and a rank found before a 2 s step was found no more (its
    process series lost their run and rank for good). It is now checked by its start ticks once found."""
    unshare, mount = shutil.which("unshare"), shutil.which("mount")
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or unshare is None or mount is None:
        pytest.skip("needs Linux, root, and util-linux's unshare and mount")
    done = subprocess.run([unshare, "-m", "--propagation", "private", sys.executable, "-c", CLOCK_STEP_INSIDE,
                           str(tmp_path / "stat")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if done.returncode != 0 and "mount" in done.stderr:
        pytest.skip(f"cannot bind a file over /proc/stat here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert abs(found["step"] - 2) < 0.05  # the step is real: psutil now reads the process as started 2 s later
    assert found["before"] == [found["pid"]]
    assert found["after"] == [found["pid"]]


# --- the process collector and the real exporter ------------------------------------------------

def test_collector_labels_the_host_pid_and_its_gpu_memory(namespaced: Namespaced) -> None:
    table = GpuProcessTable()
    table.replace({namespaced.host_pid: {"0": 5 * MiB}})  # NVML reports host pids
    registered = [RegisteredProcess(namespaced.inner_pid, "ns", "2", namespaced.start_time)]
    text = render(list(ProcessCollector(table, lambda: registered).collect())).decode()
    labels = {"pid": str(namespaced.host_pid), "run": "ns", "rank": "2"}
    assert sample_values(text, "stepscope_process_gpu_memory_bytes", gpu="0", holder="rank", **labels) == [5 * MiB]
    (cpu,) = sample_values(text, "stepscope_process_cpu_seconds_total", **labels)
    assert cpu >= 0.25  # the 0.3 s the process burned inside its namespace
    assert sample_values(text, "stepscope_process_cpu_seconds_total", pid=str(namespaced.inner_pid)) == []


def test_an_older_client_without_a_start_time_is_not_taken_for_the_nodes_init(namespaced: Namespaced) -> None:
    """Hooks from before `start_time` report a pod's rank as pid 1 and nothing else. Trusted as is, the node's
    init took the run and rank, and with it the whole node's CPU (76444 s) and memory (6.9 GB), every GPU holder
    a "worker" of it. Several processes here are pid 1 in their own namespace: nothing is published for it."""
    table = GpuProcessTable()
    table.replace({namespaced.host_pid: {"0": 5 * MiB}})
    registered = [RegisteredProcess(namespaced.inner_pid, "old", "0")]
    text = render(list(ProcessCollector(table, lambda: registered).collect())).decode()
    assert sample_values(text, "stepscope_process_cpu_seconds_total", run="old") == []
    assert sample_values(text, "stepscope_process_cpu_seconds_total", pid="1") == []
    assert sample_values(text, "stepscope_process_gpu_memory_bytes", pid=str(namespaced.host_pid),
                         holder="worker") == []


@pytest.fixture
def two_pods() -> Iterator[list[Namespaced]]:
    with in_pid_namespaces(INSIDE, [], []) as pods:
        yield pods


def test_ranks_the_exporter_cannot_tell_apart_are_no_foreign_tenants_of_their_gpus(two_pods: list[Namespaced]) -> None:
    """Two pods' pid 1 started in one clock tick, hooks without pid_namespace (or the chart's exporter, a user
    without ptrace access, who cannot read it): nothing says which rank is which, so neither is published as a
    rank. Each read holder "foreign" on its own GPU, a tenant for the rules (gpu_runs, the energy split); they are
    "unknown" now, as a process the exporter cannot read."""
    apart = abs(two_pods[0].start_time - two_pods[1].start_time)
    if apart > 2 * TOLERANCE_SECONDS:
        pytest.skip(f"the two pods started {apart * 1000:.0f} ms apart: no start time matches both")
    start_time = (two_pods[0].start_time + two_pods[1].start_time) / 2
    table = GpuProcessTable()
    table.replace({pod.host_pid: {str(gpu): 5 * MiB} for gpu, pod in enumerate(two_pods)})
    registered = [RegisteredProcess(1, "pod-a", "0", start_time), RegisteredProcess(1, "pod-b", "0", start_time)]
    text = render(list(ProcessCollector(table, lambda: registered).collect())).decode()
    for gpu, pod in enumerate(two_pods):
        assert sample_values(text, "stepscope_process_gpu_memory_bytes", pid=str(pod.host_pid), gpu=str(gpu), run="",
                             holder="unknown") == [5 * MiB]
    assert sample_values(text, "stepscope_process_gpu_memory_bytes", holder="foreign") == []


def published(base_url: str, timeout: float = 15.0, family: str = "stepscope_process_cpu_seconds_total",
              **labels: str) -> bool:
    """Whether a scrape shows `family` with `labels` within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sample_values(scrape(base_url), family, **labels):
            return True
        time.sleep(0.1)
    return False


def test_exporter_publishes_a_namespaced_push_under_the_host_pid(tmp_path: Path, namespaced: Namespaced) -> None:
    with running_exporter(tmp_path, "--collectors", "process") as exp:
        body = (info_family(pid=namespaced.inner_pid, start_time=f"{namespaced.start_time:.3f}")
                + counter("stepscope_steps_total", 1))
        url = f"{exp.url}/metrics/job/stepscope/run/pods/rank/3"
        requests.put(url, data=body, timeout=10).raise_for_status()
        assert published(exp.url, pid=str(namespaced.host_pid), run="pods", rank="3"), exp.log()
        text = scrape(exp.url)
    process_series = [dict(lbls) for name, lbls in samples(text) if name.startswith("stepscope_process_")]
    assert not [series for series in process_series if series["pid"] == str(namespaced.inner_pid)]
    assert [series["pid"] for series in process_series if series["run"] == "pods"] == [str(namespaced.host_pid)] * 5


# A pod's rank with the real hooks: pushes a few steps to the exporter at argv[2] as run argv[1], says who it is.
HOOKED_INSIDE = """
import json, os, sys
import psutil
import stepscope.hooks as th
tracker = th.init(run=sys.argv[1], push_url=sys.argv[2], push_interval=0.2, rank=0, local_rank=0, world_size=1,
                  handle_sigterm=False, share_bounds=False)
for _ in range(3):
    tracker.step(samples=8)
print(json.dumps({"pid": os.getpid(), "start_time": psutil.Process().create_time()}), flush=True)
sys.stdin.read()
tracker.close()
"""


def test_two_pods_pid_1_are_each_published_under_their_own_host_pid(tmp_path: Path) -> None:
    """Two pods of a Job started together: both ranks are pid 1, and their start times fell in one clock tick (as
    they did in 4 tries of 4 here). Both resolved to the first one found: pod A's CPU, memory and GPU memory were
    published as pod-b's rank, and pod B's process, alone on GPU 1, as a foreign tenant of it. The hooks now
    send their pid namespace, which tells them apart."""
    scenario = write_scenario(tmp_path / "nvml.json", make_scenario(gpus=2, processes_per_gpu=0))
    with running_exporter(tmp_path, "--collectors", "gpu,process", fake_nvml_scenario=scenario) as exp, \
            in_pid_namespaces(HOOKED_INSIDE, ["pod-a", exp.url], ["pod-b", exp.url]) as pods:
        assert [pod.inner_pid for pod in pods] == [1, 1]
        gpus = make_scenario(gpus=2, processes_per_gpu=0)
        gpus["gpus"] = [make_gpu(index, processes=[(pod.host_pid, (index + 2) * MiB)])
                        for index, pod in enumerate(pods)]
        write_scenario(scenario, gpus)
        for pod, run in zip(pods, ["pod-a", "pod-b"], strict=True):
            assert published(exp.url, pid=str(pod.host_pid), run=run, rank="0"), exp.log()
        assert published(exp.url, family="stepscope_process_gpu_memory_bytes", gpu="1"), exp.log()
        text = scrape(exp.url)
    for index, (pod, run) in enumerate(zip(pods, ["pod-a", "pod-b"], strict=True)):
        assert sample_values(text, "stepscope_process_cpu_seconds_total", pid=str(pod.host_pid), run=run) != []
        assert sample_values(text, "stepscope_process_gpu_memory_bytes", pid=str(pod.host_pid), run=run,
                             gpu=str(index), holder="rank") == [(index + 2) * MiB]
    assert sample_values(text, "stepscope_process_gpu_memory_bytes", holder="foreign") == []
    assert sample_values(text, "stepscope_process_cpu_seconds_total", pid="1") == []

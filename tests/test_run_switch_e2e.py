"""End to end: one process that closes a run and starts the next (a notebook, an in-process sweep).

The process keeps its pid, and the closed run's group stays live until its TTL; the exporter must
publish the process's GPU memory (and CPU, memory, ...) under the run it works for now, or the new
run has no GPU utilization, no GPU verdict and no GPU alert.
"""

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepscope_testkit.fake_nvml.scenario import make_scenario, write_scenario
from stepscope_testkit.processes import REPO_ROOT, running_exporter, sample_values, scrape
from tests.support.prometheus import wait_for

GIB = 1 << 30
pytestmark = pytest.mark.timeout(120)

# Runs "first", closes it (its final push says idle), waits for a line on stdin, then runs "second".
TRAINER = """
import sys, stepscope.hooks as th

first = th.init(run="first", push_url=sys.argv[1], push_interval=0.2, handle_sigterm=False)
first.step(samples=8)
first.close()
print("first closed", flush=True)
sys.stdin.readline()
second = th.init(run="second", push_url=sys.argv[1], push_interval=0.2, handle_sigterm=False)
second.step(samples=8)
print("second started", flush=True)
sys.stdin.readline()
second.close()
"""


@pytest.fixture
def trainer_and_exporter(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """A running exporter whose fake NVML lists the trainer holding 8 GiB on GPU 0, and the trainer."""
    path = write_scenario(tmp_path / "nvml.json", make_scenario(gpus=1, processes_per_gpu=0))
    with running_exporter(tmp_path, fake_nvml_scenario=path) as exporter:
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, exporter.url], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        try:
            write_scenario(path, make_scenario(gpus=1, processes_per_gpu=1, pids=[trainer.pid],
                                               process_memory=8 * GIB))
            yield trainer, exporter.url
        finally:
            trainer.kill()
            trainer.wait()


def _gpu_memory_runs(base_url: str, pid: int) -> list[str]:
    """The run labels of the pid's stepscope_process_gpu_memory_bytes series on a fresh scrape."""
    return sorted(s.labels["run"] for family in text_string_to_metric_families(scrape(base_url))
                  for s in family.samples
                  if s.name == "stepscope_process_gpu_memory_bytes" and s.labels["pid"] == str(pid))


def test_a_process_that_starts_a_second_run_maps_its_gpu_to_the_second_run(
    trainer_and_exporter: tuple[subprocess.Popen, str],
) -> None:
    trainer, url = trainer_and_exporter
    assert trainer.stdout.readline() == "first closed\n"
    mapped = wait_for(lambda: _gpu_memory_runs(url, trainer.pid) == ["first"], 20, interval=0.1)
    assert mapped, _gpu_memory_runs(url, trainer.pid)

    trainer.stdin.write("go\n")
    trainer.stdin.flush()
    assert trainer.stdout.readline() == "second started\n"
    mapped = wait_for(lambda: _gpu_memory_runs(url, trainer.pid) == ["second"], 20, interval=0.1)
    assert mapped, _gpu_memory_runs(url, trainer.pid)
    text = scrape(url)
    assert sample_values(text, "stepscope_process_gpu_memory_bytes", pid=str(trainer.pid), run="second",
                         rank="0", gpu="0") == [8 * GIB]
    assert sample_values(text, "stepscope_training_info", run="first", pid=str(trainer.pid)) == [1]  # still live
    assert sample_values(text, "stepscope_process_cpu_seconds_total", run="first") == []
    assert len(sample_values(text, "stepscope_process_cpu_seconds_total", run="second", pid=str(trainer.pid))) == 1

"""End to end: effective GPU utilization and the alerts on it, on a real exporter (fake NVML scenario
`busy_but_idle`), real training-hook processes and a real Prometheus loading the shipped rules.

GPU 0 is an H100 that runs kernels 97% of the time with its SMs active 6% (small kernels, launch-bound
loops), GPU 1 an H100 doing bf16 matmuls (SM active 94%, tensor cores 92%), GPU 2 an A100 without GPM
at 85%. The shipped alerts wait 15 minutes or an hour (`for`), so Prometheus also loads a copy of the
alert group with `for: 0s`: the alerts that copy fires, with their annotations rendered by a real
Prometheus, are what the shipped ones fire after their `for`.
"""

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from grafana.rules import RULE_FILES, rules
from stepscope_testkit.fake_nvml.scenario import load_scenario, write_scenario
from stepscope_testkit.processes import REPO_ROOT, running_exporter
from tests.support.prometheus import query, running_prometheus, wait_for

NODE = "gpu-node"
RUNS = {"tiny": 0, "bf16": 1, "old": 2}  # run -> the GPU its one rank holds memory on
TRAINER = """
import time, training_hooks as th
tracker = th.init(run={run!r}, push_url={url!r}, push_interval=1)
while True:  # a training loop: ~20 steps/s, no loader(), so its first step() means train
    time.sleep(0.05)
    tracker.step(samples=8)
"""

pytestmark = pytest.mark.timeout(240)


@dataclass
class Stack:
    exporter: str
    prometheus: str
    trainers: dict[str, subprocess.Popen]


def _alerts_without_for(tmp: Path) -> Path:
    """The shipped alerts with every `for` set to 0s, in a group of their own."""
    alerts = [{**rule, "for": "0s"} for rule in rules() if "alert" in rule]
    path = tmp / "alerts-now.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "stepscope-alerts-now", "rules": alerts}]}))
    return path


def _firing(base_url: str, name: str) -> dict[tuple[str, ...], dict]:
    """Firing alerts called `name`: (gpu, run, source) -> the alert (labels, annotations)."""
    response = requests.get(f"{base_url}/api/v1/alerts", timeout=10)
    response.raise_for_status()
    return {
        (alert["labels"].get("gpu", ""), alert["labels"].get("run", ""), alert["labels"].get("source", "")): alert
        for alert in response.json()["data"]["alerts"]
        if alert["labels"]["alertname"] == name and alert["state"] == "firing"
    }


def _verdicts(base_url: str) -> dict[str, str]:
    return {item["metric"]["run"]: item["metric"]["verdict"]
            for item in query(base_url, "run:stepscope_bottleneck:verdict")}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gpu-signals")
    scenario = load_scenario("busy_but_idle")
    path = write_scenario(tmp / "nvml.json", scenario)
    with running_exporter(tmp, fake_nvml_scenario=path) as exporter:
        address = exporter.url.removeprefix("http://")
        rule_files = [*RULE_FILES, _alerts_without_for(tmp)]
        with running_prometheus(tmp, {NODE: address}, rule_files) as prometheus:
            trainers = {
                run: subprocess.Popen(
                    [sys.executable, "-c", textwrap.dedent(TRAINER.format(run=run, url=exporter.url))],
                    env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                )
                for run in RUNS
            }
            try:
                for run, gpu in RUNS.items():  # now the trainers hold memory on their GPUs
                    scenario["gpus"][gpu]["processes"] = [{"pid": trainers[run].pid, "used_memory": 8 << 30}]
                write_scenario(path, scenario)
                expected = {"tiny": "gpu_busy_idle", "bf16": "gpu_bound", "old": "gpu_bound"}
                assert wait_for(lambda: _verdicts(prometheus.url) == expected, 90, interval=1.0), (
                    f"verdicts {_verdicts(prometheus.url)}\n{exporter.log()}"
                )
                yield Stack(exporter.url, prometheus.url, trainers)
            finally:
                for proc in trainers.values():
                    proc.kill()
                    proc.wait()


def test_effective_utilization_reads_sm_active_where_gpm_is_and_nvml_elsewhere(stack: Stack) -> None:
    effective = {
        (item["metric"]["gpu"], item["metric"]["source"]): round(float(item["value"][1]), 3)
        for item in query(stack.prometheus, "instance_gpu:stepscope_gpu_effective_utilization:avg_ratio")
    }
    assert effective == {("0", "sm_active"): 0.06, ("1", "sm_active"): 0.94, ("2", "utilization"): 0.85}


def test_busy_but_idle_alert_fires_for_the_gpu_with_high_utilization_and_low_sm_active(stack: Stack) -> None:
    firing = wait_for(lambda: _firing(stack.prometheus, "StepscopeGpuBusyButIdle"), 30)
    assert set(firing) == {("", "tiny", "")}  # per node and run: no gpu label
    alert = firing[("", "tiny", "")]
    assert alert["labels"]["instance"] == NODE and alert["labels"]["severity"] == "warning"
    assert "SMs were active only 6% of it" in alert["annotations"]["description"]
    assert "CUDA graphs" in alert["annotations"]["runbook"] and "torch.compile" in alert["annotations"]["runbook"]


def test_underutilized_alert_uses_effective_utilization_and_leaves_busy_but_idle_out(stack: Stack) -> None:
    """bf16 (SM active 94%) is fine; the A100 at 85% NVML is under 90%; tiny has its own alert."""
    firing = wait_for(lambda: _firing(stack.prometheus, "StepscopeGpuUnderutilized"), 30)
    assert set(firing) == {("", "old", "utilization")}  # per node and run: no gpu label
    assert "85% effective utilization (utilization)" in firing[("", "old", "utilization")]["annotations"][
        "description"]


def test_tensor_core_hint_names_the_gpu_without_tensor_core_work(stack: Stack) -> None:
    firing = wait_for(lambda: _firing(stack.prometheus, "StepscopeTensorCoresIdle"), 30)
    assert set(firing) == {("0", "tiny", "")}  # bf16 uses them; the A100 has no GPM to tell


def test_alerts_stop_when_the_run_pushes_its_final_state_on_sigterm(stack: Stack) -> None:
    """The rate windows still hold tiny's last minute of steps; its state idle ends the alert."""
    trainer = stack.trainers["tiny"]
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(timeout=30) == -signal.SIGTERM
    assert wait_for(lambda: not _firing(stack.prometheus, "StepscopeGpuBusyButIdle"), 15)
    assert wait_for(lambda: _verdicts(stack.prometheus)["tiny"] == "idle", 15)  # evaluated by its own group
    steps = query(stack.prometheus, 'run:stepscope_steps:rate1m{run="tiny"} > 0')
    assert steps, "the run's last minute of steps is still in the rate window"

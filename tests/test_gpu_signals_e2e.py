"""End to end: GPU utilization, the run verdicts and the GPU alerts on it, on a real exporter (fake NVML
scenario `busy_but_idle`), real training-hook processes and a real Prometheus loading the shipped rules.

The scenario's readings are an H100 80GB HBM3's (benchmarks/corpus/h100-2026-11-24): GPU 0 ("tiny")
runs one single-SM kernel per step, a kernel resident all the time (NVML utilization 100%) with its SMs
active 0.8%; GPU 1 ("bf16") is an H100 saturated with bf16 matmuls (NVML 98%, SM active 72.5%, tensor
cores 57.5%); GPU 2 ("old") an A100 without GPM, saturated too (NVML 98%). The shipped alerts wait 15
minutes or an hour (`for`), so Prometheus also loads a copy of the alert group with `for: 0s`: the
alerts that copy fires, with their annotations rendered by a real Prometheus, are what the shipped ones
fire after their `for`. The expected values are read from the scenario, not retyped.
"""

import copy
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from grafana.rules import RULE_FILES, rules
from stepscope_testkit.fake_nvml.scenario import load_scenario, write_scenario
from stepscope_testkit.processes import REPO_ROOT, running_exporter
from tests.support.prometheus import query, running_prometheus, wait_for

NODE = "gpu-node"
RUNS = {"tiny": 0, "bf16": 1, "old": 2}  # run -> the GPU its one rank holds memory on
SCENARIO = load_scenario("busy_but_idle")  # as shipped; the stack's copy is what the fake reads now
BUSY = 0.8  # NVML utilization at or above which a GPU is busy (a kernel resident); below it, it waits
SMS_IDLE = 0.2  # SM active below which a busy GPU's SMs idle
LAUNCH_BOUND_UTILIZATION = {"gpu": 14, "memory": 0}  # NVML on an H100 running a launch-bound loop
# Verdicts wait until a rank has trained 30 s, then read 1m windows; the trainers start after Prometheus
SETTLE_SECONDS = 120
TRAINER = """
import time, stepscope.hooks as th
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
    scenario_path: Path
    scenario: dict[str, Any]  # what the fake NVML reads now (trainer pids included)

    def rewrite(self, change: Callable[[dict[str, Any]], None]) -> None:
        """Changes the fake's readings mid-test; the exporter picks the file up on its next cycle."""
        change(self.scenario)
        write_scenario(self.scenario_path, self.scenario)


def _gpu(run: str) -> dict[str, Any]:
    """The shipped scenario's GPU that `run` trains on."""
    return SCENARIO["gpus"][RUNS[run]]


def _alerts_without_for(tmp: Path) -> Path:
    """The shipped alerts with every `for` set to 0s, in a group of their own."""
    alerts = [{**rule, "for": "0s"} for rule in rules() if "alert" in rule]
    path = tmp / "alerts-now.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "stepscope-alerts-now", "rules": alerts}]}))
    return path


def _alerts(base_url: str, name: str) -> list[dict]:
    """Alerts called `name` in any state (pending or firing)."""
    response = requests.get(f"{base_url}/api/v1/alerts", timeout=10)
    response.raise_for_status()
    return [alert for alert in response.json()["data"]["alerts"] if alert["labels"]["alertname"] == name]


def _firing(base_url: str, name: str) -> dict[tuple[str, str], dict]:
    """Firing alerts called `name`: (gpu, run) -> the alert (labels, annotations)."""
    return {(alert["labels"].get("gpu", ""), alert["labels"].get("run", "")): alert
            for alert in _alerts(base_url, name) if alert["state"] == "firing"}


def _per_gpu_run(base_url: str, expr: str) -> dict[tuple[str, str], float]:
    """A per-GPU-and-run recording: (gpu, run) -> value."""
    return {(item["metric"]["gpu"], item["metric"]["run"]): float(item["value"][1]) for item in query(base_url, expr)}


def _verdicts(base_url: str) -> dict[str, str]:
    return {item["metric"]["run"]: item["metric"]["verdict"]
            for item in query(base_url, "run:stepscope_bottleneck:verdict")}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gpu-signals")
    scenario = copy.deepcopy(SCENARIO)
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
                assert wait_for(lambda: _verdicts(prometheus.url) == expected, SETTLE_SECONDS, interval=1.0), (
                    f"verdicts {_verdicts(prometheus.url)}\n{exporter.log()}"
                )
                yield Stack(exporter.url, prometheus.url, trainers, path, scenario)
            finally:
                for proc in trainers.values():
                    proc.kill()
                    proc.wait()


def test_effective_utilization_reads_sm_active_where_gpm_is_and_nvml_elsewhere(stack: Stack) -> None:
    effective = {
        (item["metric"]["gpu"], item["metric"]["source"]): float(item["value"][1])
        for item in query(stack.prometheus, "instance_gpu:stepscope_gpu_effective_utilization:avg_ratio")
    }
    expected = {
        (str(index), "sm_active" if "gpm" in gpu else "utilization"):
            gpu["gpm"]["sm_util"] / 100 if "gpm" in gpu else gpu["utilization"]["gpu"] / 100
        for index, gpu in enumerate(SCENARIO["gpus"])
    }
    assert set(expected) == {("0", "sm_active"), ("1", "sm_active"), ("2", "utilization")}
    assert effective == pytest.approx(expected, abs=1e-6)


def test_busy_but_idle_alert_fires_for_the_gpu_with_high_utilization_and_low_sm_active(stack: Stack) -> None:
    tiny = _gpu("tiny")
    assert tiny["utilization"]["gpu"] / 100 >= BUSY and tiny["gpm"]["sm_util"] / 100 < SMS_IDLE
    firing = wait_for(lambda: _firing(stack.prometheus, "StepscopeGpuBusyButIdle"), 30)
    assert set(firing) == {("", "tiny")}  # per node and run: no gpu label; bf16's SMs work (72.5%)
    alert = firing[("", "tiny")]
    assert alert["labels"]["instance"] == NODE and alert["labels"]["severity"] == "warning"
    # humanizePercentage of the least active GPU's SM activity (0.008 -> 0.8%)
    assert f"SMs were active only {tiny['gpm']['sm_util']:.4g}% of it" in alert["annotations"]["description"]
    # the GPU and its rank, from the query the description makes
    named = f"SMs idle: GPU {RUNS['tiny']} (rank 0) {tiny['gpm']['sm_util']:.4g}% active."
    assert named in alert["annotations"]["description"]
    assert "CUDA graphs" in alert["annotations"]["runbook"] and "torch.compile" in alert["annotations"]["runbook"]


def test_underutilized_alert_reads_nvml_utilization_so_a_saturated_gpm_gpu_stays_out(stack: Stack) -> None:
    """bf16's H100 is saturated (NVML 98%) with its SMs active 72.5%, as a real one at full bf16 load
    (0.67-0.90): no alert. tiny's GPU is busy too (its idle SMs have their own alert). The A100 dropping
    to a launch-bound loop's 14% NVML waits: the alert fires for it, and for it alone."""
    bf16 = _gpu("bf16")
    assert bf16["utilization"]["gpu"] / 100 >= BUSY and bf16["gpm"]["sm_util"] / 100 < BUSY
    # One evaluation of the alert group: BusyButIdle firing there means the group read the settled runs
    assert wait_for(lambda: _firing(stack.prometheus, "StepscopeGpuBusyButIdle"), 30)
    utilization = _per_gpu_run(stack.prometheus, "instance_gpu_run:stepscope_gpu_utilization:avg_ratio")
    sm_active = _per_gpu_run(stack.prometheus, "instance_gpu_run:stepscope_gpu_sm_active:avg_ratio")
    assert utilization == pytest.approx(
        {(str(gpu), run): _gpu(run)["utilization"]["gpu"] / 100 for run, gpu in RUNS.items()}, abs=1e-6)
    assert sm_active == pytest.approx(
        {(str(gpu), run): _gpu(run)["gpm"]["sm_util"] / 100 for run, gpu in RUNS.items() if "gpm" in _gpu(run)},
        abs=1e-6)
    assert _alerts(stack.prometheus, "StepscopeGpuUnderutilized") == []

    stack.rewrite(lambda s: s["gpus"][RUNS["old"]].update(utilization=dict(LAUNCH_BOUND_UTILIZATION)))
    firing = wait_for(lambda: _firing(stack.prometheus, "StepscopeGpuUnderutilized"), 60)
    assert set(firing) == {("", "old")}  # per node and run: no gpu label
    alert = firing[("", "old")]
    assert "source" not in alert["labels"]
    assert alert["labels"]["instance"] == NODE and alert["labels"]["severity"] == "warning"
    assert "(NVML utilization, threshold 80%)" in alert["annotations"]["description"]
    # once the 1m window holds only the new readings, the value is the A100's NVML utilization itself
    percent = f"only {LAUNCH_BOUND_UTILIZATION['gpu']}% of the time"

    def reading_percent() -> dict[tuple[str, str], dict]:
        firing = _firing(stack.prometheus, "StepscopeGpuUnderutilized")
        return firing if any(percent in a["annotations"]["description"] for a in firing.values()) else {}

    firing = wait_for(reading_percent, 90)
    assert set(firing) == {("", "old")}, _firing(stack.prometheus, "StepscopeGpuUnderutilized")
    assert percent in firing[("", "old")]["annotations"]["description"]


def test_tensor_core_hint_names_the_busy_gpu_without_tensor_core_work(stack: Stack) -> None:
    """None: bf16 uses its tensor cores (57.5%), tiny's SMs idle (its fix is elsewhere), the A100 has no GPM
    to tell. A busy GPU without tensor work gets the hint in grafana/rules/tests/effective.yml (fp32)."""
    assert _gpu("bf16")["gpm"]["any_tensor_util"] / 100 >= 0.01
    assert wait_for(lambda: _firing(stack.prometheus, "StepscopeGpuBusyButIdle"), 30)  # the group evaluated
    assert _alerts(stack.prometheus, "StepscopeTensorCoresIdle") == []


def test_alerts_stop_when_the_run_pushes_its_final_state_on_sigterm(stack: Stack) -> None:
    """The rate windows still hold tiny's last minute of steps; its state idle ends the alert."""
    trainer = stack.trainers["tiny"]
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(timeout=30) == -signal.SIGTERM
    assert wait_for(lambda: not _firing(stack.prometheus, "StepscopeGpuBusyButIdle"), 15)
    assert wait_for(lambda: _verdicts(stack.prometheus)["tiny"] == "idle", 15)  # evaluated by its own group
    steps = query(stack.prometheus, 'run:stepscope_steps:rate1m{run="tiny"} > 0')
    assert steps, "the run's last minute of steps is still in the rate window"

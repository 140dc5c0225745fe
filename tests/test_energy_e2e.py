"""Energy per run, exactly, end to end: a registered training process (the real hooks) holds the fake NVML's
H100 twice for a known number of seconds (the test writes the scenario that lists it as holding memory);
its energy counter grows at exactly the GPU's power. A real exporter, seconds old, reads the counter every
second (--collector.gpu.slow-interval 1), a real Prometheus evaluates the shipped rules, and
stepscope-report charges the run.

The recorded watts must be the GPU's power at every evaluation, although the exporter is younger than the
rules' 1-minute window (a rate() of the counter read a third of the power there), and the report's joules
the power times the seconds the run held the GPU, within the sampling a hold passes through (the bound
below, derived from the running configuration).
"""

import csv
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from grafana.rules import RULE_FILES
from stepscope.contract import families, recordings
from stepscope_testkit.fake_nvml.scenario import MODELS, make_gpu, make_scenario, write_scenario
from stepscope_testkit.processes import REPO_ROOT, running_exporter
from tests.support.alerting import seconds
from tests.support.prometheus import query, rule_groups, running_prometheus, wait_for

pytestmark = [pytest.mark.timeout(120), pytest.mark.alone]  # alone: scripts/test.sh says why

RUN = "energy-e2e"
NODE = "node-1"
WATTS = MODELS["H100"]["power_usage_mw"] / 1000  # the fake's counter grows by exactly this per second
COLLECT_INTERVAL = 0.5  # running_exporter's --collect-interval
READ_INTERVAL = "1"  # --collector.gpu.slow-interval: the energy counter read every second
HOLDS = (10.0, 8.0)  # seconds the run's process holds the GPU, with a gap between
GAP_SECONDS = 3.0
# The node's read time is taken as a round starts, a moment before the GPU's read: a delay of d seconds
# between them that differs from one read to another errs by d over the ~59 s between the minute's first and
# last read (1.1e-5 seen at most; this allows 59 ms)
EXACT = 1e-3
# The recordings from a process's GPU memory to the watts its run is charged, upstream first
CHARGE_CHAIN = (recordings.RANK_GPU_MEMORY, recordings.GPU_RUN_ENERGY_RATE, recordings.RUN_ENERGY_RATE)
TRAINER = """
import pathlib, sys, time
import stepscope.hooks as th
run, url, stop = sys.argv[1:4]
tracker = th.init(run=run, rank=0, world_size=1, push_url=url, push_interval=0.25)
while not pathlib.Path(stop).exists():
    with tracker.phase("forward"):
        time.sleep(0.05)
    tracker.step(samples=8)
tracker.close()
"""


@dataclass
class Observed:
    held: list[float]  # seconds the test had the scenario list the process as holding the GPU, per hold
    report: Path
    prometheus: str


def gpu_held_by(pid: int | None) -> dict:
    """One H100 at a known power; `pid` holds memory on it (None: nobody)."""
    scenario = make_scenario(gpus=0, processes_per_gpu=0)
    scenario["gpus"] = [make_gpu(0, "H100", processes=[(pid, 8 * 1024**3)] if pid else [])]
    return scenario


def hold(scenario: Path, pid: int, duration: float) -> float:
    """Lists `pid` as holding the GPU for `duration`; the seconds it really was listed."""
    start = time.monotonic()
    write_scenario(scenario, gpu_held_by(pid))
    time.sleep(duration)
    write_scenario(scenario, gpu_held_by(None))
    return time.monotonic() - start


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("energy")
    scenario = write_scenario(tmp / "gpus.json", gpu_held_by(None))
    stop = tmp / "stop"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    flags = ("--collector.gpu.slow-interval", READ_INTERVAL)
    with running_exporter(tmp, *flags, fake_nvml_scenario=scenario) as exporter, \
            running_prometheus(tmp, {NODE: exporter.url.removeprefix("http://")}, RULE_FILES) as prometheus:
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, RUN, exporter.url, str(stop)], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            registered = f'{families.TRAINING_INFO}{{run="{RUN}"}}'
            assert wait_for(lambda: query(prometheus.url, registered), 30), "the trainer's pushes are not scraped"
            assert wait_for(lambda: query(prometheus.url, recordings.GPU_SOURCE_ENERGY_RATE), 30), "no watts"
            held = [hold(scenario, trainer.pid, HOLDS[0])]
            time.sleep(GAP_SECONDS)
            held.append(hold(scenario, trainer.pid, HOLDS[1]))
            time.sleep(3)  # the release scraped, the rules evaluated on it
        finally:
            stop.touch()
            output, _ = trainer.communicate(timeout=30)
        assert trainer.returncode == 0, output
        report = tmp / "report"
        result = subprocess.run([sys.executable, "-m", "stepscope.report", "--prometheus", prometheus.url,
                                 "--run", RUN, "--out", str(report)], capture_output=True, text=True, env=env,
                                timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        yield Observed(held, report, prometheus.url)


def recorded(prometheus: str, name: str) -> list[float]:
    """Every value `name` was recorded with over the test (the exporter is younger than 5 minutes)."""
    return [float(value) for series in query(prometheus, f"{name}[5m]") for _, value in series["values"]]


def test_the_recorded_watts_are_the_gpus_power_from_the_exporters_first_seconds(observed: Observed) -> None:
    """Each GPU's watts and the run's charge are the power at every evaluation: the counter's increase over
    the time between the reads the minute holds (a rate() over the minute read 1/60 of the power per second
    of the series' age, so about a third 20 s after the exporter started)."""
    gpu = recorded(observed.prometheus, recordings.GPU_SOURCE_ENERGY_RATE)
    charged = recorded(observed.prometheus, f'{recordings.RUN_ENERGY_RATE}{{run="{RUN}"}}')
    print(f"\nGPU watts {min(gpu):.4f}-{max(gpu):.4f} over {len(gpu)} evaluations, the run's {min(charged):.4f}-"
          f"{max(charged):.4f} over {len(charged)}; the GPU draws {WATTS} W")
    assert gpu and charged
    assert all(value == pytest.approx(WATTS, rel=EXACT) for value in gpu), sorted(gpu)[:5]
    assert all(value == pytest.approx(WATTS, rel=EXACT) for value in charged), sorted(charged)[:5]


def quantization(prometheus: str) -> float:
    """Seconds by which a hold's length may come out longer or shorter in the report: the collection and the
    scrape each see its two ends on their own grid (up to one interval each), one evaluation of each group
    on CHARGE_CHAIN may run late at one end and read its upstream's previous one, and the report sums the
    run's watts on its own grid of steps (one step). Read from the running server, not assumed."""
    targets = requests.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    scrape = max(seconds(target["scrapeInterval"]) for target in targets)
    groups = {rule["name"]: group["interval"] for group in rule_groups(prometheus) for rule in group["rules"]
              if rule["name"] in CHARGE_CHAIN}
    assert groups.keys() == set(CHARGE_CHAIN), groups.keys()
    step = scrape  # the report's resolution over a window of seconds is the scrape interval
    return COLLECT_INTERVAL + scrape + sum(groups.values()) + step


def _seconds_seen(prometheus: str) -> str:
    """Where a hold went missing: the seconds each link of the charge was recorded at, and failed scrapes."""
    def stamps(expr: str) -> list[int]:
        return sorted({round(float(t)) for series in query(prometheus, f"{expr}[5m]") for t, _ in series["values"]})

    seen = {name: stamps(f'{name}{{run="{RUN}"}}') for name in (families.PROCESS_GPU_MEMORY, *CHARGE_CHAIN)}
    seen["failed scrapes"] = [round(float(t)) for series in query(prometheus, "up[5m]")
                              for t, value in series["values"] if value == "0"]
    return "; ".join(f"{name} at {_spans(times)}" for name, times in seen.items())


def _spans(times: list[int]) -> str:
    """Whole seconds as runs: [3, 4, 5, 9] -> '3-5, 9'."""
    spans: list[list[int]] = []
    for t in times:
        if spans and t - spans[-1][1] <= 1:
            spans[-1][1] = t
        else:
            spans.append([t, t])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans) or "never"


def test_the_reports_joules_are_the_power_times_the_seconds_the_run_held_the_gpu(observed: Observed) -> None:
    with (observed.report / "goodput.csv").open() as rows:
        run = next(row for row in csv.DictReader(rows) if row["rank"] == "all")
    joules = float(run["energy_joules"])
    truth = WATTS * sum(observed.held)
    bound = quantization(observed.prometheus)
    print(f"\nreport {joules:.1f} J; truth {truth:.1f} J ({WATTS} W x {sum(observed.held):.3f} s held in"
          f" {len(observed.held)} holds): {joules - truth:+.1f} J, {(joules - truth) / WATTS:+.3f} s of power"
          f" (bound {bound:g} s per hold)")
    assert abs(joules - truth) <= WATTS * bound * len(observed.held), _seconds_seen(observed.prometheus)
    assert float(run["energy_kwh"]) == pytest.approx(joules / 3.6e6, rel=1e-6)

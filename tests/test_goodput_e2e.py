"""Goodput, badput by cause and energy, end to end: a training script with known injected times pushes
through the real hooks to a real exporter (fake NVML: one H100 drawing a known power, its energy counter
growing at that rate); a real Prometheus evaluates the shipped rules; stepscope-report writes the run's
goodput headline and goodput.csv. The issue's times are scaled down to keep the test under a minute
(3 s setup for its 20 s, a 1.5 s checkpoint every 6 s of training for its 10 s every 60 s).

The run: attempt 1 sets up, trains with a loader that waits 30 ms of every 100 ms step, checkpoints, runs
one eval, then is SIGKILLed (its rank lost); after a gap attempt 2 comes back under the same run name,
restores the last checkpoint (its global step goes back: the steps since are lost progress), sets up
again, trains and closes. Each attempt measures its own truth (perf_counter around each part);
the report's share of every cause, the restart gap included, must be within 2 percentage points of it.
"""

import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest
import requests

from grafana.rules import RULE_FILES
from stepscope.contract import families, recordings
from stepscope.contract.goodput import LOST_PROGRESS, REPORT_CAUSES, RESTART_GAP
from stepscope_testkit.fake_nvml.scenario import MODELS, make_gpu, make_scenario, write_scenario
from stepscope_testkit.processes import REPO_ROOT, running_exporter
from tests.support.alerting import seconds
from tests.support.prometheus import query, rule_groups, running_prometheus, wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.alone]  # alone: scripts/test.sh says why

RUN = "goodput-e2e"
NODE = "node-1"
TOLERANCE = 0.02  # the issue's: 2 percentage points
WATTS = MODELS["H100"]["power_usage_mw"] / 1000
GAP_SECONDS = 3.0  # between attempt 1's death and attempt 2's start (its imports come on top)
# The recordings from a process's GPU memory to the watts its run is charged, upstream first
CHARGE_CHAIN = (recordings.RANK_GPU_MEMORY, recordings.GPU_RUN_ENERGY_RATE, recordings.RUN_ENERGY_RATE)
TRAINER = """
import json, os, signal, sys, time
started = time.time()
import stepscope.hooks as th
run, attempt, url, out, global_step = sys.argv[1:5] + [int(sys.argv[5])]
setup_s, train_s = (3.0, 14.0) if attempt == "1" else (1.0, 6.0)
LOAD, COMPUTE, CKPT_EVERY, CKPT, EVAL_AT, EVAL = 0.03, 0.07, 6.0, 1.5, 9.0, 1.5
tracker = th.init(run=run, rank=0, world_size=1, push_url=url, push_interval=0.25)
truth = {"started": started, "init": time.time(), "setup": 0.0, "data_wait": 0.0, "checkpoint": 0.0, "eval": 0.0,
         "productive": 0.0, "lost_progress": 0.0, "checkpoint_step": global_step}
productive_saved = 0.0  # productive seconds up to the last checkpoint: what a restore keeps
clock = time.perf_counter
t0 = clock()
time.sleep(setup_s)
print("pid", os.getpid(), flush=True)
def batches():
    while True:
        begin = clock()
        time.sleep(LOAD)
        truth["data_wait"] += clock() - begin
        yield 8
trained, evaluated, next_ckpt = 0.0, attempt != "1", CKPT_EVERY
for batch in tracker.loader(batches()):
    if truth["setup"] == 0.0:
        truth["setup"] = clock() - t0
        t_train = clock()
    with tracker.phase("forward"):
        time.sleep(COMPUTE)
    global_step += 1
    tracker.step(samples=batch, global_step=global_step)
    trained = clock() - t_train - truth["checkpoint"] - truth["eval"]
    if trained >= next_ckpt:
        truth["checkpoint_step"], productive_saved = global_step, trained - truth["data_wait"]
        begin = clock()
        with tracker.state("checkpoint"):
            time.sleep(CKPT)
        truth["checkpoint"] += clock() - begin
        next_ckpt += CKPT_EVERY
    if not evaluated and trained >= EVAL_AT:
        begin = clock()
        with tracker.state("eval"):
            time.sleep(EVAL)
        truth["eval"] += clock() - begin
        evaluated = True
    if trained >= train_s:
        break
truth["productive"] = clock() - t_train - truth["checkpoint"] - truth["eval"] - truth["data_wait"]
if attempt == "1":  # the steps since the last checkpoint are done again by attempt 2: lost progress
    truth["lost_progress"] = truth["productive"] - productive_saved
    truth["productive"] = productive_saved
truth["end"] = time.time()
truth["samples"] = tracker.steps * 8
if attempt == "1":  # the rank is lost: no close, no final push
    open(out, "w").write(json.dumps(truth))
    os.kill(os.getpid(), signal.SIGKILL)
tracker.close()
truth["end"] = time.time()
open(out, "w").write(json.dumps(truth))
"""


@dataclass
class Observed:
    truth: list[dict]  # what each attempt measured
    report: Path  # the report's directory
    prometheus: str

    def truth_seconds(self) -> dict[str, float]:
        """Seconds by cause over both attempts; the restart gap from attempt 1's death to attempt 2's start
        of the Tracker (its interpreter's start and imports are gap too)."""
        seconds = {cause: sum(attempt.get(cause, 0.0) for attempt in self.truth) for cause in REPORT_CAUSES}
        seconds[RESTART_GAP] = self.truth[1]["init"] - self.truth[0]["end"]
        return seconds


def gpu_held_by(pid: int | None) -> dict:
    """One H100 at a known power; `pid` holds memory on it (None: nobody, as after a SIGKILL)."""
    scenario = make_scenario(gpus=0, processes_per_gpu=0)
    scenario["gpus"] = [make_gpu(0, "H100", processes=[(pid, 8 * 1024**3)] if pid else [])]
    return scenario


def attempt(number: int, url: str, tmp: Path, scenario: Path, global_step: int) -> dict:
    """Runs one attempt from `global_step` to its end (a SIGKILL for attempt 1), its GPU held while it
    lives; its truth."""
    out = tmp / f"truth-{number}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, RUN, str(number), url, str(out), str(global_step)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    write_scenario(scenario, gpu_held_by(proc.pid))
    output, _ = proc.communicate(timeout=60)
    write_scenario(scenario, gpu_held_by(None))
    assert out.exists(), output
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("goodput")
    scenario = write_scenario(tmp / "gpus.json", gpu_held_by(None))
    with running_exporter(tmp, fake_nvml_scenario=scenario) as exporter, \
            running_prometheus(tmp, {NODE: exporter.url.removeprefix("http://")}, RULE_FILES) as prometheus:
        assert wait_for(lambda: query(prometheus.url, "up == 1"), 30), "Prometheus does not scrape the exporter"
        first = attempt(1, exporter.url, tmp, scenario, 0)
        time.sleep(GAP_SECONDS)
        second = attempt(2, exporter.url, tmp, scenario, first["checkpoint_step"])  # restored: steps done again
        time.sleep(3)  # the last push scraped, the rules evaluated on it
        report = tmp / "report"
        result = subprocess.run([sys.executable, "-m", "stepscope.report", "--prometheus", prometheus.url,
                                 "--run", RUN, "--out", str(report)], capture_output=True, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        yield Observed([first, second], report, prometheus.url)


def report_rows(observed: Observed) -> dict[str, dict[str, str]]:
    with (observed.report / "goodput.csv").open() as rows:
        return {row["rank"]: row for row in csv.DictReader(rows)}


def test_each_cause_is_within_two_points_of_the_truth_the_script_measured(observed: Observed) -> None:
    run = report_rows(observed)["all"]
    truth = observed.truth_seconds()
    held_truth = sum(truth.values())
    held = float(run["held_seconds"])
    print(f"\nheld {held:.2f} s (truth {held_truth:.2f} s)")
    for cause in REPORT_CAUSES:
        measured, expected = float(run[f"{cause}_seconds"]) / held, truth[cause] / held_truth
        print(f"{cause:>12}: report {measured:6.1%}  truth {expected:6.1%}  ({float(run[f'{cause}_seconds']):6.2f} s)")
        assert abs(measured - expected) <= TOLERANCE, cause
    assert truth[RESTART_GAP] >= GAP_SECONDS and float(run[f"{RESTART_GAP}_seconds"]) >= GAP_SECONDS - 1
    assert truth[LOST_PROGRESS] > 0.5 and float(run[f"{LOST_PROGRESS}_seconds"]) > 0.5
    assert abs(float(run["goodput_ratio"]) - truth["productive"] / held_truth) <= TOLERANCE


def test_the_headline_names_goodput_and_the_largest_badput_first(observed: Observed) -> None:
    run = report_rows(observed)["all"]
    page = (observed.report / "index.html").read_text()
    goodput = float(run["goodput_ratio"])
    largest = max((float(run[f"{cause}_seconds"]), cause) for cause in REPORT_CAUSES if cause != "productive")[1]
    headline = f"goodput {goodput:.0%}: "
    assert headline in page, page[:2000]
    start = page.index(headline) + len(headline)
    assert page[start:].split(",")[0].endswith(largest.replace("_", " ")), page[start:start + 200]


def test_the_recorded_steps_lost_are_where_attempt_1_was_less_where_attempt_2_restored_from(
        observed: Observed) -> None:
    """run:stepscope_steps_redone:last_restore while attempt 2 catches up: exactly the global step attempt 1
    last pushed less the checkpoint's attempt 2 restored from, and short of the steps the script itself
    redid by at most what its last push trailed the SIGKILL."""
    first = observed.truth[0]
    steps = query(observed.prometheus, f'{families.TRAINING_GLOBAL_STEP}{{run="{RUN}"}}[10m]')
    pushed = [float(value) for series in steps for _, value in series["values"]]
    last_before = next(before for before, after in pairwise(pushed) if after < before)
    expected = last_before - first["checkpoint_step"]  # attempt 2 restored from attempt 1's last checkpoint
    truth = first["samples"] / 8 - first["checkpoint_step"]  # attempt 1 started at 0: its steps are its reach
    lost = query(observed.prometheus, f'max_over_time({recordings.RUN_STEPS_REDONE}{{run="{RUN}"}}[10m])')
    recorded = float(lost[0]["value"][1])
    print(f"\nsteps lost: recorded {recorded:g}, pushed {expected:g}, truth {truth:g}")
    assert expected > 0 and recorded == expected
    assert truth - 5 <= expected <= truth  # the last push trails the SIGKILL by a push interval (0.25 s) and the
    # push itself: up to 5 steps of 0.1 s (15 of 18 and 17 of 19 in two runs)


@dataclass
class ChargeTiming:
    """How late the run's charge may follow its processes' holding, from the running server's intervals: a
    release shows at the next scrape (the series goes stale), then each rule group on CHARGE_CHAIN passes it
    on at its own evaluation, up to one interval late (Prometheus places a group in its interval by a hash of
    its file and name: from the CI's checkout path the three groups evaluate at .088 s, .201 s and .938 s of
    each second, 1.7-2.7 s end to end; rules of one group see each other at once). A start lags alike: the
    charge is shifted, not lengthened."""
    scrape: float  # seconds between scrapes of the exporter
    groups: dict[str, float]  # evaluation interval of each group holding a recording of CHARGE_CHAIN
    charged_every: float  # the evaluation interval of the run's watts

    @property
    def lag(self) -> float:
        return self.scrape + sum(self.groups.values())


def charge_timing(prometheus: str) -> ChargeTiming:
    """Read from the server the test runs (not assumed), so the bounds follow its configuration and rules."""
    targets = requests.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    groups = {rule["name"]: group for group in rule_groups(prometheus) for rule in group["rules"]
              if rule["name"] in CHARGE_CHAIN}
    assert groups.keys() == set(CHARGE_CHAIN), groups.keys()
    return ChargeTiming(max(seconds(target["scrapeInterval"]) for target in targets),
                        {group["name"]: group["interval"] for group in groups.values()},
                        groups[recordings.RUN_ENERGY_RATE]["interval"])


def _carried_through_failed_scrapes(prometheus: str, times: list[float]) -> set[float]:
    """The evaluation times among `times` whose latest scrape of the exporter before them failed (`up` 0): a
    loaded exporter missed 1 s scrapes in a clean-clone CI run, and the run was charged 7 and 12 s after it
    released the GPU, at two such evaluations."""
    ups = sorted((float(t), value) for series in query(prometheus, "up[10m]") for t, value in series["values"])
    carried = set()
    for at in times:
        before = [value for t, value in ups if t <= at]
        if before and before[-1] == "0":
            carried.add(at)
    return carried


def _recorded_while_held(prometheus: str, times: list[float], held: list[list[float]], lag: float) -> set[float]:
    """The charges among `times` whose chain leads back to a GPU mapping recorded while a process held the GPU:
    each link's latest sample at or before the one downstream of it (a group not evaluated since, so the next
    one read that sample). In a clean-clone CI run the run was charged 5.4-7.4 s after its process released the
    GPU, the scrapes around then answered; in the next, beside five busy workers, Prometheus recorded the GPU
    mapping twice in 20 s (tests/test_energy_e2e.py's message): a group that far behind its 1 s interval."""
    samples = {name: sorted(float(t) for series in query(prometheus, f'{name}{{run="{RUN}"}}[10m]')
                            for t, _ in series["values"]) for name in CHARGE_CHAIN[:2]}

    def origin(at: float) -> float | None:
        for name in reversed(CHARGE_CHAIN[:2]):
            before = [t for t in samples[name] if t <= at]
            if not before:
                return None
            at = before[-1]
        return at

    return {at for at in times if (mapped := origin(at)) is not None
            and any(attempt[0] <= mapped < attempt[-1] + lag for attempt in held)}


def test_energy_is_charged_to_the_run_while_it_holds_the_gpu(observed: Observed) -> None:
    """The run is charged its GPU's energy while its processes hold it (none before, in the gap, after),
    and the report's kWh and joules per sample follow from its joules. The joules themselves are checked
    exactly in grafana/rules/tests/goodput.yml and tests/test_energy_e2e.py; here the exporter reads the
    energy counter every 10 s (the default), so its GPU has no watts until the second read."""
    run = report_rows(observed)["all"]
    joules = float(run["energy_joules"])
    charged = query(observed.prometheus, f'{recordings.RUN_ENERGY_RATE}{{run="{RUN}"}}[10m]')
    memory = query(observed.prometheus, f'{families.PROCESS_GPU_MEMORY}{{run="{RUN}"}}[10m]')
    charged_at = sorted({float(t) for series in charged for t, value in series["values"] if float(value) > 0})
    held = [[float(t) for t, _ in series["values"]] for series in memory]  # one series per attempt (its pid)
    held_at = [t for attempt_held in held for t in attempt_held]
    timing = charge_timing(observed.prometheus)
    print(f"\nenergy {joules:.0f} J charged over {len(charged_at)} s; {float(run['joules_per_sample']):.2f} J per"
          f" sample; the GPU held {len(held_at)} s at {WATTS} W ({WATTS * len(held_at):.0f} J); charged until"
          f" {charged_at[-1] - max(held_at):.3f} s after the last held sample (bound {timing.lag:g} s)")
    assert joules > 0 and charged_at and len(held) == 2
    # charged only from a held sample on, until the lag after an attempt's last: none before, in the gap, after
    # (held() carries the process's GPU memory through a failed scrape of the exporter, and a group that runs
    # late leaves its last recording to the groups downstream: a charge that either explains is allowed anywhere)
    carried = (_carried_through_failed_scrapes(observed.prometheus, charged_at)
               | _recorded_while_held(observed.prometheus, charged_at, held, timing.lag))
    outside = [t for t in charged_at
               if t not in carried and not any(attempt[0] <= t < attempt[-1] + timing.lag for attempt in held)]
    assert not outside, f"{outside}, holds {[(attempt[0], attempt[-1]) for attempt in held]}, {timing}, {carried}"
    carried = {t for t in carried if not any(attempt[0] <= t < attempt[-1] + timing.lag for attempt in held)}
    # and not for longer than held: the lag may differ at an attempt's two ends by one evaluation per group (one
    # that runs late under load reads its upstream's previous evaluation)
    late = len(held) * sum(timing.groups.values())
    assert (len(charged_at) - len(carried)) * timing.charged_every <= len(held_at) * timing.scrape + late
    # the watts are the GPU's power from the exporter's second read on, so the joules are the power times the
    # seconds charged, up to one evaluation per attempt (the report's step re-reading a late one's sample)
    assert abs(joules - WATTS * len(charged_at) * timing.charged_every) <= WATTS * timing.charged_every * len(held)
    assert float(run["energy_kwh"]) == pytest.approx(joules / 3.6e6, rel=1e-6)
    samples = float(next(csv.DictReader((observed.report / "run_summary.csv").open()))["samples"])
    assert float(run["joules_per_sample"]) == pytest.approx(joules / samples, rel=1e-6)

"""Step-time p50/p95 of the Lightning and Hugging Face callbacks, through a real Prometheus running the shipped
rules, against the true quantiles of the optimizer-step intervals from the first full minute of a run on.

One Lightning fit and one Trainer run (tests/support/framework_pace.py: the callback as the README shows it,
the default 5 s push, lognormal step times ~30-55 ms, the truth the wall-clock time of every optimizer step
from an optimizer step post-hook) train at the same time for TRAIN_SECONDS, pushing to one exporter that a
Prometheus scrapes every second, evaluating the rules every second. Afterwards the test reads Prometheus at
every READ_EVERY seconds from FIRST_READING after the run's first optimizer step to its last (each query at
that past instant, which reads the samples the live evaluation read).

The window is the one rate() sees: the samples in (t - 60 s, t]. The steps in it are told by the same
samples of stepscope_steps_total (the k-th counted step is the k-th optimizer step): steps first+1..last of
the window's first and last sample, whatever the push interval and scrape lag (here up to 5 s + 1 s). A
window up to ~6 s after the first step can still start at a push from before it: its steps are then 2..last,
step 1's time being observed by no tracker (setup precedes it). The first reading is FIRST_READING = 60 + 2 s
after the first step, past the 1-2 s that a push takes to be scraped. The recorded run quantile reads the bucket
rates the run's rule chain recorded up to ~2 s before its evaluation (tests/test_quantiles_e2e.py's
CHAINED_SECONDS): its window is taken at its evaluation's timestamp, steady step times make those 2 s
immaterial.
"""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import requests

from stepscope.contract.recordings import RUN_STEP_SECONDS_P50, RUN_STEP_SECONDS_P95, rank_step_seconds_quantile
from stepscope_testkit.processes import REPO_ROOT, running_exporter
from tests.support.prometheus import QUANTILE_CHAIN, running_prometheus, shipped_groups

RUNS = {"pace-lightning": "lightning", "pace-huggingface": "huggingface"}
TRAIN_SECONDS = 100
FIRST_READING = 62.0
READ_EVERY = 5.0
TOLERANCE = 0.10
# A window whose true quantile moved more than this from the first window's: the machine's load moved the run's
# pace (a clean-clone CI run: true p95 78 -> 92 -> 114 ms over 30 s), which this test's steady runs do not do
# (their first windows' true p95 stay within 5%: 78.4-82.1 ms there). The exported buckets follow a move only
# once the new ones are a rate window old (stepscope.hooks.timing), and the recorded run quantile lags its
# evaluation by ~2 s: such readings were off by 10.7% (82 against 92 ms) and 65% (235 against 142 ms). A reading
# off by more than the tolerance in such a window is listed and excused; at most half may be. Readings within the
# tolerance count whether or not the pace moved: another clean-clone run moved the true p95 81 -> 120-145 ms and
# the p50 41 -> 52-54 ms, 10-11 of each case's 16 readings in moved windows, and of its four cases 0, 0, 2 and 6
# readings were off by more than the tolerance (13-47%), every one in a moved window.
# tests/test_quantiles_e2e.py holds the quantiles through scripted shifts.
PACE_MOVED = 0.15
QUANTILES = {"p50": (0.5, RUN_STEP_SECONDS_P50), "p95": (0.95, RUN_STEP_SECONDS_P95)}
# Prometheus evaluates the step-time quantile chain alone (QUANTILE_CHAIN): the recorded run quantiles are the only
# recordings read here, and the other groups, evaluated each second, cost CPU the two runs' pace shares.


@dataclass
class Paced:
    prometheus: str
    stamps: dict[str, list[float]]  # run -> wall-clock time of each optimizer step, in order

    def query(self, expr: str, at: float) -> list[dict]:
        response = requests.get(f"{self.prometheus}/api/v1/query", params={"query": expr, "time": at}, timeout=10)
        body = response.json()
        assert body.get("status") == "success", (expr, body)
        return body["data"]["result"]

    def readings(self, run: str) -> list[float]:
        first, last = self.stamps[run][0], self.stamps[run][-1]
        return list(np.arange(first + FIRST_READING, last, READ_EVERY))


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Paced]:
    tmp = tmp_path_factory.mktemp("framework-quantiles")
    with running_exporter(tmp, "--collectors", "node") as exporter, \
            running_prometheus(tmp, {"node": exporter.url.removeprefix("http://")},
                               [shipped_groups(tmp, *QUANTILE_CHAIN)]) as prometheus:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
               "STEPSCOPE_PUSH_URL": exporter.url}
        logs = {run: (tmp / f"{run}.log").open("w") for run in RUNS}
        procs = {run: subprocess.Popen([sys.executable, "-m", "tests.support.framework_pace", framework, str(tmp),
                                        run, str(TRAIN_SECONDS)], stdout=logs[run], stderr=subprocess.STDOUT,
                                       env=env, cwd=REPO_ROOT)
                 for run, framework in RUNS.items()}
        for run, proc in procs.items():
            rc = proc.wait(timeout=TRAIN_SECONDS + 120)
            logs[run].close()
            assert rc == 0, (tmp / f"{run}.log").read_text()[-3000:]
        yield Paced(prometheus.url, {run: json.loads((tmp / f"{run}.json").read_text()) for run in RUNS})


def _window_truth(paced: Paced, run: str, at: float) -> tuple[list[float], tuple[int, int]]:
    """The optimizer-step intervals of the steps counted in the samples of (at - 1m, at]."""
    (found,) = paced.query(f'stepscope_steps_total{{run="{run}"}}[1m]', at)
    counts = [int(float(value)) for _, value in found["values"]]
    first, last = max(counts[0], 1), counts[-1]  # step 1 is never observed: its start (setup) is unknown
    intervals = np.diff(paced.stamps[run])  # intervals[i]: step i + 2's
    return list(intervals[first - 1:last - 1]), (first, last)


def _truth(intervals: list[float], q: float) -> float:
    return float(np.quantile(intervals, q, method="inverted_cdf"))


def _errors(paced: Paced, run: str, recorded: bool) -> list[str]:
    """One line per reading and quantile: '!' marks one off by more than the tolerance, '~' one so off where its
    window's true quantile moved more than PACE_MOVED from the first window's (excused)."""
    lines, first_truth = [], {}
    for at in paced.readings(run):
        for name, (q, series) in QUANTILES.items():
            if recorded:
                (found,) = paced.query(f'{series}{{run="{run}"}}[3s]', at)
                evaluated, value = found["values"][-1]
            else:
                (found,) = paced.query(rank_step_seconds_quantile(q, f'run="{run}"'), at)
                evaluated, value = found["value"]
            intervals, (first, last) = _window_truth(paced, run, float(evaluated))
            truth = _truth(intervals, q)
            error = float(value) / truth - 1
            moved = abs(truth / first_truth.setdefault(name, truth) - 1) > PACE_MOVED
            mark = " " if abs(error) <= TOLERANCE else "~" if moved else "!"
            lines.append(f"{mark} {run:17} +{at - paced.stamps[run][0]:5.1f}s {name} steps {first}..{last}: "
                         f"{1000 * float(value):6.2f} ms vs {1000 * truth:6.2f} ms true ({100 * error:+6.2f}%)")
    return lines


def _judged(lines: list[str]) -> None:
    """No reading off by more than the tolerance in a steady window, and at most half excused."""
    assert not [line for line in lines if line.startswith("!")], "\n".join(lines)
    assert 2 * sum(line.startswith("~") for line in lines) <= len(lines), "\n".join(lines)


def test_every_optimizer_step_is_a_counted_step(paced: Paced) -> None:
    """The window's steps are told by the counter: it must count exactly the optimizer steps."""
    for run, stamps in paced.stamps.items():
        (found,) = paced.query(f'max_over_time(stepscope_steps_total{{run="{run}"}}[5m])', stamps[-1] + 8)
        assert int(float(found["value"][1])) == len(stamps), run
        assert len(paced.readings(run)) >= 6, (run, stamps[-1] - stamps[0])


@pytest.mark.parametrize("run", RUNS)
def test_rank_quantiles_from_the_first_full_minute_are_within_ten_percent(paced: Paced, run: str) -> None:
    lines = _errors(paced, run, recorded=False)
    print(f"\n{run} rank p50/p95 (dashboard query) against the optimizer steps in the same 1m window:\n"
          + "\n".join(lines))
    _judged(lines)


@pytest.mark.parametrize("run", RUNS)
def test_recorded_run_quantiles_from_the_first_full_minute_are_within_ten_percent(paced: Paced, run: str) -> None:
    lines = _errors(paced, run, recorded=True)
    print(f"\n{run} recorded p50/p95 against the optimizer steps in the same 1m window:\n" + "\n".join(lines))
    _judged(lines)

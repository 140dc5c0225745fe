"""Live step-time quantiles in the minute after a rank stopped exporting some of its bucket bounds.

The hooks drop a block of fine bounds left unused for a while when they need the room
(stepscope.hooks.timing.FollowingLayout): the blocks of a run's slow first steps, once it steps fast. The
dropped series stays in the rules' 1m window for a minute, its rate taken over its part of the window only:
below the rates of the bounds under it, since the run steps faster now. Prometheus' histogram_quantile raises
that dip; VictoriaMetrics 1.79's lowers every bucket below it to it and read the dropped bound or above it for
both quantiles (a live run falling from 1 s to 45 ms steps: p50 1.8-2.7 s, p95 3.9 s for a minute).

One rank, its pushes crafted as the hooks push them, one a second into a real exporter that the engine
scrapes every second: 1 step of 0.45 s a push for SLOW_PUSHES pushes, then FAST_STEPS steps of 0.045 s a push;
the bounds 0.4 and 0.5 leave the pushes from DROPPED_AT_PUSH on. Read while the dropped series is still in the
window and its last rate is under half the run's, from when every step but a few per cent in the window is
fast: the run's recorded p50/p95 and the Training dashboard's per-rank query must read inside (0.04, 0.05].
"""

import time
from contextlib import ExitStack

import pytest
import requests

from grafana.rules import RULE_FILES
from stepscope.contract.recordings import RUN_STEP_SECONDS_P50, RUN_STEP_SECONDS_P95, rank_step_seconds_quantile
from stepscope_testkit.ingest_bodies import counter, histogram, state_family
from stepscope_testkit.processes import running_exporter
from tests.support.prometheus import query
from tests.support.replay_judge import ENGINES
from tests.support.victoria import running_engine

pytestmark = [pytest.mark.timeout(240), pytest.mark.alone]  # alone: scripts/test.sh says why

RUN = "dropped"
SLOW_STEP, FAST_STEP = 0.45, 0.045  # in the buckets (0.4, 0.5] and (0.04, 0.05]
SLOW_PUSHES, FAST_STEPS = 15, 30
DROPPED_AT_PUSH = 20  # the bounds 0.4 and 0.5 are last pushed in push 19
LIVE_BOUNDS, DROPPED_BOUNDS = ("0.04", "0.05", "0.06", "1"), ("0.4", "0.5")
# Readings from push 50 (the engines' evaluations from push 30 on, VictoriaMetrics' recordings up to 20 s late:
# 96% of the window's steps fast, both quantiles in (0.04, 0.05]) to push 72, before the dropped series' last
# sample (push 19) leaves the 1m window.
FIRST_READING, LAST_READING = 50, 72
HOLDING = (0.04, 0.05)


def _body(push: int) -> str:
    """What the rank pushes at `push` (one a second): cumulative counts, the dropped bounds until DROPPED_AT_PUSH."""
    slow = min(push + 1, SLOW_PUSHES)
    fast = max(0, push + 1 - SLOW_PUSHES) * FAST_STEPS
    steps = slow + fast
    bounds = LIVE_BOUNDS + (DROPPED_BOUNDS if push < DROPPED_AT_PUSH else ())
    buckets = sorted(((le, steps if float(le) >= SLOW_STEP else fast if float(le) >= FAST_STEP else 0)
                      for le in bounds), key=lambda bucket: float(bucket[0]))
    seconds = slow * SLOW_STEP + fast * FAST_STEP
    return ("# TYPE stepscope_step_seconds histogram\n"
            + histogram("stepscope_step_seconds", [*buckets, ("+Inf", steps)], steps, seconds)
            + counter("stepscope_steps_total", steps) + state_family("train"))


def _read(url: str) -> dict[str, float]:
    """The run's recorded quantiles and the dashboard's per-rank ones, as the engine reads them now."""
    exprs = {"run p50": RUN_STEP_SECONDS_P50, "run p95": RUN_STEP_SECONDS_P95,
             "rank p50": rank_step_seconds_quantile(0.5, f'run="{RUN}"'),
             "rank p95": rank_step_seconds_quantile(0.95, f'run="{RUN}"')}
    return {name: float(result[0]["value"][1]) if (result := query(url, expr)) else float("nan")
            for name, expr in exprs.items()}


@pytest.fixture(scope="module")
def readings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, float]]]:
    """Engine -> what it reads every second from FIRST_READING to LAST_READING. Both engines scrape the one
    exporter through the same pushes at once: the pushes keep to the wall clock, so each engine's minute is
    the same minute, spent once (146 s for the two one after the other, 73 s side by side)."""
    tmp = tmp_path_factory.mktemp("dropped")
    with running_exporter(tmp, "--collectors", "node") as exporter, ExitStack() as engines:
        urls = {engine: engines.enter_context(running_engine(engine, tmp / engine, exporter.url.removeprefix("http://"),
                                                             RULE_FILES))
                for engine in ENGINES}
        group = f"{exporter.url}/metrics/job/stepscope/run/{RUN}/rank/0"
        start, found = time.monotonic(), {engine: [] for engine in ENGINES}
        for push in range(LAST_READING + 1):
            time.sleep(max(0.0, start + push - time.monotonic()))
            requests.put(group, data=_body(push), timeout=10).raise_for_status()
            if push >= FIRST_READING:
                for engine, url in urls.items():
                    found[engine].append(_read(url))
        return found


@pytest.mark.parametrize("engine", ENGINES)
def test_quantiles_read_the_steps_not_the_dropped_bounds(readings: dict[str, list[dict[str, float]]],
                                                         engine: str) -> None:
    outside = [reading for reading in readings[engine]
               if not all(HOLDING[0] < value <= HOLDING[1] for value in reading.values())]
    assert not outside, f"{len(outside)} of {len(readings[engine])} readings outside {HOLDING}, first: {outside[0]}"

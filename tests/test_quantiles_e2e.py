"""Step-time quantiles on the real path, against the true quantiles of the same steps.

Real trackers observe chosen step times (their clock is scripted, so a minute of 9 s steps takes no
time), push their bodies to a real exporter, a real Prometheus scrapes it every second and evaluates
the shipped recording rules; the rules' p50 and p95, per rank and per run, must be within 10% of the
quantiles of the steps in the rule's 1m window, at several spreads and step times from 1 ms to 10 s.
The simulated comparison of bucket layouts is benchmarks/bench_quantiles.py.

Each rank: 3 compilation steps at 20x (the first snapshot with steps), then what the run did before
(a slow start falling from x50, or a x3 shift and back, in snapshots 5 s apart on the hooks' clock),
five snapshots of 5 s of steps (20 to 2000; the last one is the first push Prometheus sees), then the
measured steps (the second push). The 1m window then holds exactly the measured steps: every series
starts at the first push. On VictoriaMetrics the measured push waits until the first one has left the
1m window (FIRST_PUSH_AGE). Every query reads the instant the rules had evaluated the measured push.
What the first minutes after a change read through `rate()` (a bucket that appears mid-window) is
benchmarks/bench_pace.py's subject.

Every case runs on Prometheus and on VictoriaMetrics + vmalert (docs/engines.md): VictoriaMetrics scrapes
the exporter every second, vmalert evaluates the same rule files every second against it.
"""

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests

import stepscope.hooks as th
import stepscope.hooks.timing
import stepscope.hooks.tracker
from grafana.dashboards.training import RANKS
from grafana.rules import RULE_FILES
from stepscope.contract.recordings import rank_step_seconds_quantile
from stepscope.hooks.pusher import Pusher, group_url
from stepscope_testkit.processes import running_exporter
from tests.support.dashboard_queries import substitute
from tests.support.prometheus import query, running_prometheus, wait_for
from tests.support.replay_judge import ENGINES
from tests.support.victoria import running_victoria, running_vmalert

WARMUP_SNAPSHOTS = 5  # a run a minute or more in: its fine buckets placed
PUSH_SECONDS = 5.0  # the hooks' default push interval: steps per snapshot = 5 s of steps, 20..2000
MEASURED_STEPS = 400
TOLERANCE = 0.10
QUANTILES = {"p50": 0.5, "p95": 0.95}
# The run quantiles read a chain of rule groups (shard partial sums -> run), each evaluated every
# second: 3 s after the push is seen, both have evaluated since, with a second to spare. On
# VictoriaMetrics each level waits for vmalert's write to become visible; the levels' series exist
# since the first push and only the quantiles are new (measured: a partial chain's p50, one shard group
# updated, read 4.4 s after the measured push, the full chain's from 5.4 s).
CHAINED_SECONDS = {"prometheus": 3, "victoriametrics": 20}
# MetricsQL's rate() over a series younger than its window is the increase since the series' first
# sample over the series' age (no extrapolation): while the 1m window holds the first push, every
# rank's rate falls ~1/age a second, so ranks first scraped a second apart, or read by the shard groups
# a second apart, differ by ~2%, and a run whose ranks export different bounds reads its p50 at 0.18 s
# or at 7.5 s depending on which rank's rate is higher (docs/engines.md). Pushed after the first push
# has left the window, every rank's rate is its measured steps over the same 60 s, at every evaluation
# until the measured push leaves the window. Prometheus extrapolates instead: the window may hold both.
FIRST_PUSH_AGE = {"prometheus": 0.0, "victoriametrics": 62.0}
WINDOW_SECONDS = 60
# How far a bound's share of a run's steps may read apart between the recorded run buckets and a user's
# sum: the shard partials are taken a second or more apart, over windows that span different seconds
# once a scrape came off VictoriaMetrics' grid (measured under load: ranks 4% apart, shares 0.0104).
SHARE_APART = 0.05

Draw = Callable[[random.Random], float]


def jitter(centre: float, spread: float) -> Draw:
    return lambda rng: centre * (1 + spread * rng.gauss(0, 1))


def lognormal(centre: float, sigma: float) -> Draw:
    return lambda rng: centre * rng.lognormvariate(0, sigma)


def two_modes(centre: float, share: float, ratio: float) -> Draw:
    return lambda rng: centre * (1 + 0.02 * rng.gauss(0, 1)) * (ratio if rng.random() < share else 1)


def stalls(centre: float) -> Draw:
    return lambda rng: centre * (1 + 0.02 * rng.gauss(0, 1)) * (rng.uniform(3, 10) if rng.random() < 0.1 else 1)


def every_rank(draw: Draw) -> Callable[[int], Draw]:
    return lambda rank: draw


def per_rank(centre: float, spread: float) -> Callable[[int], Draw]:
    """Ranks that step alike but not exactly: rank r's steps sit up to `spread` from the centre."""
    return lambda rank: jitter(centre * (1 + spread * ((rank * 7919) % 101 / 50 - 1)), 0.03)


# run -> (ranks, typical step seconds, step-time distribution): the 24 ms steps that read
# +39..+50% with 16 buckets, a lognormal spread, gradient accumulation (p95 in the second mode), data
# stalls, 1 ms and 9 s steps, one eval-like step in ten 5x longer, and 64 ranks a few per cent apart.
CASES: dict[str, tuple[int, float, Callable[[int], Draw]]] = {
    "narrow-24ms": (4, 0.024, every_rank(jitter(0.024, 0.01))),
    "lognormal-180ms": (2, 0.18, every_rank(lognormal(0.18, 0.2))),
    "accumulation-7ms": (1, 0.007, every_rank(two_modes(0.007, 0.25, 2.5))),
    "stalls-1ms": (1, 0.0012, every_rank(stalls(0.0012))),
    "slow-9s": (1, 9.0, every_rank(jitter(9.0, 0.02))),
    "slow-start-21ms": (2, 0.021, every_rank(jitter(0.021, 0.04))),
    "shift-30ms": (1, 0.03, every_rank(jitter(0.03, 0.03))),
    "bimodal-40ms": (1, 0.04, every_rank(two_modes(0.04, 0.1, 5))),
    "ranks-64-50ms": (64, 0.05, per_rank(0.05, 0.04)),
}
# What a run did before the measured minute, in (seconds, step seconds at the segment's start, at its
# end) segments: the slow start (x50 for 20 s, falling to 80 ms over 50 s, then steady for 90 s)
# and a shift (x3 slower for two minutes, then back for 30 s). The standard warm-up follows.
PRELUDES: dict[str, tuple[tuple[float, float, float], ...]] = {
    "slow-start-21ms": ((20, 1.05, 1.05), (50, 1.0, 0.08), (90, 0.021, 0.021)),
    "shift-30ms": ((60, 0.03, 0.03), (120, 0.09, 0.09), (30, 0.03, 0.03)),
}
PHASE_RUN, PHASE = "lognormal-180ms", "forward"  # this run also pushes phase buckets (the switch on)


class ScriptedClock:
    """perf_counter_ns for the hooks: advances only when a test step or phase takes time."""

    def __init__(self) -> None:
        self.now = 10**12

    def __call__(self) -> int:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += max(1, round(seconds * 1e9))


@dataclass
class Rank:
    tracker: th.Tracker
    pusher: Pusher
    steps: list[float]
    phase_times: list[float]


@dataclass
class Measured:
    engine: str
    prometheus: str  # the query URL (Prometheus, or VictoriaMetrics)
    steps: dict[tuple[str, str], list[float]]  # (run, rank) -> measured step seconds
    phase_times: list[float]
    at: float  # the instant every test reads: the rules had evaluated the measured push

    def query(self, expr: str) -> list[dict]:
        """`expr` at the measured instant, however long the tests before took (a minute on, the
        measured push has left the 1m window)."""
        response = requests.get(f"{self.prometheus}/api/v1/query", params={"query": expr, "time": self.at},
                                timeout=10)
        body = response.json()
        assert body.get("status") == "success", (expr, body)
        return body["data"]["result"]


def _run_steps(rank: Rank, clock: ScriptedClock, draw: Draw, rng: random.Random, n: int, keep: bool) -> None:
    phase = rank.tracker.phase(PHASE)
    for _ in range(n):
        seconds = max(draw(rng), 1e-6)
        forward = seconds * 0.4 * rng.lognormvariate(0, 0.3)
        with phase:
            clock.spend(forward)
        clock.spend(seconds - forward)
        rank.tracker.step()
        if keep:
            rank.steps.append(seconds)
            rank.phase_times.append(forward)


def _prelude(rank: Rank, clock: ScriptedClock, rng: random.Random,
             segments: tuple[tuple[float, float, float], ...]) -> None:
    """Steps through the segments in snapshots PUSH_SECONDS apart, the step time moving geometrically."""
    for seconds, start, end in segments:
        for index in range(round(seconds / PUSH_SECONDS)):
            centre = start * (end / start) ** (index * PUSH_SECONDS / seconds)
            _run_steps(rank, clock, jitter(centre, 0.02), rng, max(1, round(PUSH_SECONDS / centre)), keep=False)
            rank.tracker.render()


def _pushed_steps(prometheus: str) -> dict[tuple[str, str], float]:
    return {(item["metric"]["run"], item["metric"]["rank"]): float(item["value"][1])
            for item in query(prometheus, "stepscope_steps_total")}


def _seen(prometheus: str, ranks: dict[tuple[str, str], Rank]) -> bool:
    pushed = _pushed_steps(prometheus)
    return all(pushed.get(key) == rank.tracker.steps for key, rank in ranks.items())


@contextmanager
def _engine(engine: str, tmp: Path, address: str) -> Iterator[str]:
    """The query URL of `engine` scraping the exporter at `address` (instance "node") every second and
    evaluating the shipped rules every second."""
    if engine == "victoriametrics":
        target = {"job_name": "stepscope", "static_configs": [{"targets": [address], "labels": {"instance": "node"}}]}
        with running_victoria(tmp / "victoria", [target]) as victoria, \
                running_vmalert(tmp / "vmalert", victoria.url, RULE_FILES):
            yield victoria.url
        return
    with running_prometheus(tmp, {"node": address}, RULE_FILES) as prometheus:
        yield prometheus.url


@pytest.fixture(scope="module", params=ENGINES)
def measured(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Measured]:
    tmp = tmp_path_factory.mktemp(f"quantiles-{request.param}")
    clock = ScriptedClock()
    patch = pytest.MonkeyPatch()
    patch.setattr(stepscope.hooks.tracker, "perf_counter_ns", clock)
    patch.setattr(stepscope.hooks.timing, "perf_counter_ns", clock)
    try:
        with running_exporter(tmp, "--collectors", "node") as exporter, \
                _engine(request.param, tmp, exporter.url.removeprefix("http://")) as url:
            yield _measure(request.param, exporter.url, url, clock)
    finally:
        patch.undo()


def _measure(engine: str, exporter: str, prometheus: str, clock: ScriptedClock) -> Measured:
    chained_seconds = CHAINED_SECONDS[engine]
    rng = random.Random(11)
    ranks: dict[tuple[str, str], Rank] = {}
    for run, (size, _, _) in CASES.items():
        for rank in range(size):
            tracker = th.init(run=run, rank=rank, world_size=size, push_url="", handle_sigterm=False,
                              phase_buckets=run == PHASE_RUN)
            pusher = Pusher(group_url(exporter, run, rank), tracker.render, interval=60)
            ranks[(run, str(rank))] = Rank(tracker, pusher, [], [])
    draws = {(run, rank): CASES[run][2](int(rank)) for run, rank in ranks}
    for key, rank in ranks.items():
        run, draw = key[0], draws[key]
        per_push = min(max(round(PUSH_SECONDS / CASES[run][1]), 20), 2000)
        rank.tracker.state("train")
        _run_steps(rank, clock, lambda r, draw=draw: 20 * draw(r), rng, 3, keep=False)  # compilation
        rank.tracker.render()  # the first snapshot with steps
        _prelude(rank, clock, rng, PRELUDES.get(run, ()))
        for _ in range(WARMUP_SNAPSHOTS - 1):  # pushes that left the 1m window long ago
            _run_steps(rank, clock, draw, rng, per_push, keep=False)
            rank.tracker.render()
        _run_steps(rank, clock, draw, rng, per_push, keep=False)
        assert rank.pusher.push_once(), rank.pusher.stats.last_error  # the window's first sample
    assert wait_for(lambda: _seen(prometheus, ranks), 60), _pushed_steps(prometheus)  # the window's start
    time.sleep(FIRST_PUSH_AGE[engine])  # every first sample is older than that now
    measured_push = time.time()
    for key, rank in ranks.items():
        _run_steps(rank, clock, draws[key], rng, MEASURED_STEPS, keep=True)
        assert rank.pusher.push_once(), rank.pusher.stats.last_error
    assert wait_for(lambda: _seen(prometheus, ranks), 60), _pushed_steps(prometheus)
    seen_at = time.time()

    def evaluated_since_then() -> float | None:
        """The oldest of the runs' latest evaluations, once all came after the chain had the push: an
        instant whose recordings have landed (a later query at a later one may find a write in flight)."""
        stamps = [float(s["value"][1]) for s in query(prometheus, "timestamp(run:stepscope_step_seconds:p95_rate1m)")]
        done = len(stamps) == len(CASES) and min(stamps) > seen_at + chained_seconds
        return min(stamps) if done else None

    at = wait_for(evaluated_since_then, 30 + chained_seconds)
    assert at, "the rules did not evaluate the measured push"
    assert at < measured_push + WINDOW_SECONDS, "the measured push left the 1m window before the rules read it"
    for rank in ranks.values():
        rank.tracker.close()
    return Measured(engine, prometheus, {key: rank.steps for key, rank in ranks.items()},
                    ranks[(PHASE_RUN, "0")].phase_times, at)


def _truth(values: list[float], q: float) -> float:
    return float(np.quantile(values, q, method="inverted_cdf"))  # the step at rank ceil(q n)


def _errors(measured: Measured, expr: Callable[[str, float], str], by: str) -> dict[tuple[str, str], float]:
    """(run or run/rank, p50|p95) -> relative error of the shipped query against the true quantile."""
    errors = {}
    for name, q in QUANTILES.items():
        for item in measured.query(expr(name, q)):
            labels = item["metric"]
            keys = [k for k in measured.steps if k[0] == labels["run"] and (by == "run" or k[1] == labels["rank"])]
            truth = _truth([s for k in keys for s in measured.steps[k]], q)
            where = labels["run"] if by == "run" else f"{labels['run']}/{labels['rank']}"
            errors[(where, name)] = float(item["value"][1]) / truth - 1
    return errors


def _report(errors: dict[tuple[str, str], float]) -> str:
    return "\n".join(f"  {where:22} {name}: {100 * error:+6.2f}%" for (where, name), error in sorted(errors.items()))


def test_rank_quantiles_are_within_ten_percent_of_the_truth(measured: Measured) -> None:
    # The Training dashboard's per-rank query (not recorded), with its run and rank variables at .*
    errors = _errors(measured, lambda _, q: substitute(rank_step_seconds_quantile(q, RANKS)), by="rank")
    print("\nrank p50/p95 errors (dashboard query vs true quantiles of the same steps):\n" + _report(errors))
    assert len(errors) == 2 * len(measured.steps)
    assert all(abs(error) <= TOLERANCE for error in errors.values()), _report(errors)


def _runs_with_bounds_some_ranks_lack(measured: Measured) -> set[str]:
    """Runs whose ranks do not all export the same step-time bounds (a rank's fine buckets follow its
    own steps): their summed buckets dip at a bound only some ranks have."""
    expr = ('count by (run, le) (stepscope_step_seconds_bucket) != on (run) group_left ()'
            ' count by (run) (stepscope_step_seconds_bucket{le="+Inf"})')
    return {item["metric"]["run"] for item in measured.query(expr)}


def test_run_quantiles_over_ranks_with_their_own_buckets_are_within_ten_percent(measured: Measured) -> None:
    errors = _errors(measured, lambda name, _: f"run:stepscope_step_seconds:{name}_rate1m", by="run")
    print("\nrun p50/p95 errors (all ranks' steps pooled):\n" + _report(errors))
    assert {where for where, _ in errors} == set(CASES)
    if measured.engine == "victoriametrics":
        # MetricsQL's histogram_quantile repairs a dip by lowering every bucket below it (Prometheus
        # raises the dip), so a bound only some ranks export pulls the run quantile up to the tail:
        # docs/engines.md. The other runs must hold; these read far off (+2,500% and more when measured),
        # or right where one shard group's rates came out 0.5% above the other's (a scrape late under
        # load, read a second apart): which, the last scrapes decide.
        mixed = _runs_with_bounds_some_ranks_lack(measured)
        assert mixed, "every run's ranks export one set of bounds: the mixed case is not exercised"
        off = {where for (where, _), error in errors.items() if abs(error) > TOLERANCE}
        assert off <= mixed, _report(errors)
        return
    assert all(abs(error) <= TOLERANCE for error in errors.values()), _report(errors)


def test_phase_quantiles_behind_the_switch_are_within_ten_percent(measured: Measured) -> None:
    for name, q in QUANTILES.items():
        expr = (f"histogram_quantile({q}, sum by (le) (rate(stepscope_step_phase_seconds_bucket"
                f'{{run="{PHASE_RUN}",rank="0",phase="{PHASE}"}}[1m])))')
        (result,) = measured.query(expr)
        error = float(result["value"][1]) / _truth(measured.phase_times, q) - 1
        print(f"\nphase {PHASE} {name}: {100 * error:+.2f}%")
        assert abs(error) <= TOLERANCE, (name, error)


def _bucket_shares(measured: Measured, expr: str) -> dict[tuple[str, str], float]:
    """(run, le) -> the share of the run's steps at or below `le`, in `expr`'s run buckets."""
    buckets = {(item["metric"]["run"], item["metric"]["le"]): float(item["value"][1])
               for item in measured.query(expr)}
    return {(run, le): value / buckets[(run, "+Inf")] for (run, le), value in buckets.items()}


def test_a_users_own_promql_over_the_exported_buckets_reads_what_the_rules_record(measured: Measured) -> None:
    """No intersection or repair in the rules: summing every rank's buckets per `le` is the run's histogram,
    bound for bound, and its quantiles are the user's. Over the rules' 1m window: a 5m one holds every
    series' start, where MetricsQL's rates depend on each rank's age (FIRST_PUSH_AGE).

    On VictoriaMetrics a run whose ranks export different bounds reads its quantiles off MetricsQL's dip
    repair, where ranks' rates 0.5% apart move the 180 ms run's p50 from 7.53 s to 0.18 s: the recorded
    run buckets sum shard partials evaluated a second apart, 0.5% apart when a scrape came late under
    load (measured: 1 run in 5), while the user's query reads one instant. There the buckets say it: the
    same bounds, each holding the same share of the run's steps within SHARE_APART (intersecting the
    ranks' bounds drops bounds; a repair moves a dip's share by about half)."""
    own = _bucket_shares(measured, "sum by (run, le) (rate(stepscope_step_seconds_bucket[1m]))")
    recorded = _bucket_shares(measured, "run_le:stepscope_step_seconds_bucket:rate1m")
    assert own.keys() == recorded.keys()
    assert {run for run, _ in own} == set(CASES)
    apart = {key: (own[key], recorded[key]) for key in own if abs(own[key] - recorded[key]) > SHARE_APART}
    assert not apart, apart
    repaired = _runs_with_bounds_some_ranks_lack(measured) if measured.engine == "victoriametrics" else set()
    for name, q in QUANTILES.items():
        own_q = {item["metric"]["run"]: float(item["value"][1]) for item in measured.query(
            f"histogram_quantile({q}, sum by (run, le) (rate(stepscope_step_seconds_bucket[1m])))")}
        recorded_q = {item["metric"]["run"]: float(item["value"][1])
                      for item in measured.query(f"run:stepscope_step_seconds:{name}_rate1m")}
        assert own_q.keys() == recorded_q.keys() == set(CASES)
        for run in set(CASES) - repaired:
            assert own_q[run] == pytest.approx(recorded_q[run], rel=0.01), (run, name, own_q[run], recorded_q[run])

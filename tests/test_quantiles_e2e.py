"""Step-time quantiles on the real path, against the true quantiles of the same steps.

Real trackers observe chosen step times (their clock is scripted, so a minute of 9 s steps takes no
time), push their bodies to a real exporter, a real Prometheus scrapes it every second and evaluates
the shipped recording rules; the rules' p50 and p95, per rank and per run, must be within 10% of the
quantiles of the steps in the rule's 1m window, at several spreads and step times from 1 ms to 10 s.
The simulated comparison of bucket layouts is benchmarks/bench_quantiles.py.

Each rank: 3 compilation steps at 20x (the first snapshot with steps), then what the run did before
(a slow start falling from x50, or a x3 shift and back, in snapshots 5 s apart on the hooks' clock),
five snapshots of 400 steps (the last one is the first push Prometheus sees), then the
measured steps (the second push). The 1m window then holds exactly the measured steps: every series
starts at the first push. On VictoriaMetrics the measured push waits until the first one has left the
1m window (FIRST_PUSH_AGE). Every query reads the instant the rules had evaluated the measured push.
What the first minutes after a change read through `rate()` (a bucket that appears mid-window) is
benchmarks/bench_pace.py's subject.

The ranks of a run agree on their bounds through a shared store; those of the `-no-store` runs share none and
agree through the exporter, pushing every snapshot (their pushes carry the agreement) before the engine
starts scraping: the engine's first sample is still the window's first push.

Every case runs on Prometheus and on VictoriaMetrics + vmalert (docs/engines.md): VictoriaMetrics scrapes
the exporter every second, vmalert evaluates the same rule files every second against it.
"""

import random
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import pytest
import requests
import torch.distributed as dist

import stepscope.hooks as th
import stepscope.hooks.timing
import stepscope.hooks.tracker
from grafana.dashboards.training import RANKS
from stepscope.contract.recordings import rank_step_seconds_quantile
from stepscope.hooks.pusher import Pusher, group_url
from stepscope_testkit.processes import running_exporter
from tests.support.dashboard_queries import substitute
from tests.support.prometheus import QUANTILE_CHAIN, query, shipped_groups, wait_for
from tests.support.replay_judge import ENGINES
from tests.support.victoria import running_engine

WARMUP_SNAPSHOTS = 5  # a run a minute or more in: its fine buckets placed
PUSH_SECONDS = 5.0  # the hooks' default push interval: a prelude's snapshots are 5 s of steps apart
# Steps in each warm-up snapshot and in the measured push: the layout then decides on snapshots like the
# measured one before the window starts. A bound the measured push added would have one value in the
# window: no rate on Prometheus, a rate of 0 on VictoriaMetrics, whose histogram_quantile then lowers every
# bucket below it (a rank's p50 read +296% so). In a run the next push, 5 s on, gives it its rate.
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
# a second apart, differ by ~2% (docs/engines.md). Pushed after the first push
# has left the window, every rank's rate is its measured steps over the same 60 s, at every evaluation
# until the measured push leaves the window. Prometheus extrapolates instead: the window may hold both.
FIRST_PUSH_AGE = {"prometheus": 0.0, "victoriametrics": 62.0}
WINDOW_SECONDS = 60
# The ranks agree on their bounds when the test says (_agree), not in their thread's rounds: the longest
# interval the hooks take (600 s, the exporter's default --ingest-ttl), far past the test's two minutes.
AGREEMENT_SECONDS = 600.0
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


def two_paces(centre: float, ratio: float) -> Callable[[int], Draw]:
    """One rank in four `ratio` times slower than the others: their fine buckets lie apart. (Not half:
    a run's p50 would then fall between the paces, where any bound reads right.)"""
    return lambda rank: jitter(centre * (ratio if rank % 4 == 3 else 1), 0.03)


# run -> (ranks, typical step seconds, step-time distribution): the 24 ms steps that read
# +39..+50% with 16 buckets, a lognormal spread, gradient accumulation (p95 in the second mode), data
# stalls, 1 ms and 9 s steps, one eval-like step in ten 5x longer, 64 ranks a few per cent apart, and
# ranks at two paces 3x apart (whose fine buckets only agree through stepscope.hooks.run_bounds).
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
    "two-paces-8": (8, 0.06, two_paces(0.05, 3)),
    # The ranks of these runs share no torch.distributed store (no process group): they agree on their bounds
    # through the exporter they push to (stepscope.exporter.ingest.node_bounds), one push at a time.
    "lognormal-180ms-no-store": (2, 0.18, every_rank(lognormal(0.18, 0.2))),
    "ranks-64-50ms-no-store": (64, 0.05, per_rank(0.05, 0.04)),
    "two-paces-8-no-store": (8, 0.06, two_paces(0.05, 3)),
}
NO_STORE = frozenset(run for run in CASES if run.endswith("-no-store"))
# What a run did before the measured minute, in (seconds, step seconds at the segment's start, at its
# end) segments: the slow start (x50 for 20 s, falling to 80 ms over 50 s, then steady for 90 s)
# and a shift (x3 slower for two minutes, then back for 30 s). The standard warm-up follows.
PRELUDES: dict[str, tuple[tuple[float, float, float], ...]] = {
    "slow-start-21ms": ((20, 1.05, 1.05), (50, 1.0, 0.08), (90, 0.021, 0.021)),
    "shift-30ms": ((60, 0.03, 0.03), (120, 0.09, 0.09), (30, 0.03, 0.03)),
}
PHASE_RUN, PHASE = "lognormal-180ms", "forward"  # this run also pushes phase buckets (the switch on)
# The engines load the step-time quantile chain (QUANTILE_CHAIN), the only recordings read here: with every shipped
# group the two engines took 111 s of the module's 118 s of CPU, evaluating over 159 ranks' series each second.


class ScriptedClock:
    """perf_counter_ns for the hooks: advances only when a test step or phase takes time. Each rank has a
    timeline of its own (`switch`), as ranks of a real run step side by side: otherwise a rank's first step
    after the others' would last all of theirs."""

    def __init__(self) -> None:
        self._times: dict[tuple[str, ...], int] = {}
        self._current: tuple[str, ...] = ()

    def switch(self, rank: tuple[str, ...]) -> None:
        self._current = rank
        self._times.setdefault(rank, 10**12)

    def __call__(self) -> int:
        return self._times.setdefault(self._current, 10**12)

    def spend(self, seconds: float) -> None:
        self._times[self._current] = self() + max(1, round(seconds * 1e9))


@dataclass
class Rank:
    key: tuple[str, str]  # (run, rank)
    timeline: tuple[str, str, str]  # (engine, run, rank): its clock's timeline, apart from the other engine's rank
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
    """`n` steps on the rank's timeline, which stays current for its snapshot or push that follows."""
    clock.switch(rank.timeline)
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


@pytest.fixture(scope="module")
def measured_by_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Measured]]:
    """Both engines' runs, each with its own exporter, side by side: VictoriaMetrics' window starts first, and
    Prometheus is measured while VictoriaMetrics waits for its first push to leave the 1m window
    (FIRST_PUSH_AGE), rather than after it."""
    tmp = tmp_path_factory.mktemp("quantiles")
    clock = ScriptedClock()
    patch = pytest.MonkeyPatch()
    patch.setattr(stepscope.hooks.tracker, "perf_counter_ns", clock)
    patch.setattr(stepscope.hooks.timing, "perf_counter_ns", clock)
    longest_wait_first = sorted(ENGINES, key=lambda engine: -FIRST_PUSH_AGE[engine])
    try:
        with ExitStack() as stack:
            started = {}
            for engine in longest_wait_first:
                (tmp / engine).mkdir()
                exporter = stack.enter_context(running_exporter(tmp / engine, "--collectors", "node"))
                warm = _warm_up(engine, exporter.url, clock)
                url = stack.enter_context(running_engine(engine, tmp / engine, exporter.url.removeprefix("http://"),
                                                         [shipped_groups(tmp / engine, *QUANTILE_CHAIN)]))
                started[engine] = (url, warm, _window_started(url, warm.ranks))
            yield {engine: _measure(engine, *started[engine], clock) for engine in reversed(longest_wait_first)}
    finally:
        patch.undo()


@pytest.fixture(scope="module", params=ENGINES)
def measured(request: pytest.FixtureRequest, measured_by_engine: dict[str, Measured]) -> Measured:
    return measured_by_engine[request.param]


@dataclass
class WarmRun:
    """The ranks a minute or more into their runs, their steps' draws and random streams."""

    ranks: dict[tuple[str, str], Rank]
    draws: dict[tuple[str, str], Draw]
    rngs: dict[tuple[str, str], random.Random]

    def snapshot_steps(self, clock: ScriptedClock, key: tuple[str, str], push: bool) -> None:
        """MEASURED_STEPS steps, then the rank's snapshot: pushed, or only rendered (the layouts decide)."""
        rank = self.ranks[key]
        _run_steps(rank, clock, self.draws[key], self.rngs[key], MEASURED_STEPS, keep=False)
        if push:
            assert rank.pusher.push_once(), rank.pusher.stats.last_error
        else:
            rank.tracker.render()


def _start_ranks(engine: str, exporter: str, clock: ScriptedClock) -> dict[tuple[str, str], Rank]:
    """Every case's ranks: sharing one store (what torch.distributed's is to a real run's ranks), or, in the
    NO_STORE runs, none: those push with their tracker's own pusher, whose pushes carry the agreement."""
    store = dist.HashStore()
    ranks: dict[tuple[str, str], Rank] = {}
    for run, (size, _, _) in CASES.items():
        for rank in range(size):
            timeline = (engine, run, str(rank))
            clock.switch(timeline)
            no_store = run in NO_STORE
            tracker = th.init(run=run, rank=rank, world_size=size, push_url=exporter if no_store else "",
                              handle_sigterm=False, phase_buckets=run == PHASE_RUN, push_interval=AGREEMENT_SECONDS,
                              store=None if no_store else store)
            pusher = tracker.pusher if no_store else Pusher(group_url(exporter, run, rank), tracker.render, interval=60)
            assert pusher is not None
            ranks[(run, str(rank))] = Rank((run, str(rank)), timeline, tracker, pusher, [], [])
    # A tracker's pusher pushes once as it starts: done before the test's own pushes, which it would race.
    assert wait_for(lambda: all(r.pusher.stats.successes for r in ranks.values() if r.key[0] in NO_STORE), 60)
    return ranks


def _warm_up(engine: str, exporter: str, clock: ScriptedClock) -> WarmRun:
    """The runs until the push before the measured one (the window's first sample), before any engine scrapes:
    the NO_STORE ranks push every snapshot, as the hooks do every push interval, and so agree."""
    ranks = _start_ranks(engine, exporter, clock)
    draws = {(run, rank): CASES[run][2](int(rank)) for run, rank in ranks}
    # Each rank draws from its own stream, so that a case added or reordered leaves the others' steps as they were.
    warm = WarmRun(ranks, draws, {(run, rank): random.Random(f"{run}/{rank}") for run, rank in ranks})
    for key, rank in ranks.items():
        clock.switch(rank.timeline)
        rank.tracker.state("train")
        _run_steps(rank, clock, lambda r, draw=draws[key]: 20 * draw(r), warm.rngs[key], 3, keep=False)  # compilation
        rank.tracker.render()  # the first snapshot with steps
        _prelude(rank, clock, warm.rngs[key], PRELUDES.get(key[0], ()))
        for _ in range(WARMUP_SNAPSHOTS - 2):  # snapshots that left the 1m window long ago
            warm.snapshot_steps(clock, key, push=key[0] in NO_STORE)
    _agree(ranks)  # what the agreement's thread does every push interval
    for key in ranks:
        warm.snapshot_steps(clock, key, push=key[0] in NO_STORE)
    _agree(ranks)
    for key in ranks:
        warm.snapshot_steps(clock, key, push=True)  # the window's first sample
    return warm


def _window_started(prometheus: str, ranks: dict[tuple[str, str], Rank]) -> float:
    """When the engine had every rank's first push: the window's start."""
    assert wait_for(lambda: _seen(prometheus, ranks), 60), _pushed_steps(prometheus)
    return time.monotonic()


def _measure(engine: str, prometheus: str, warm: WarmRun, window_started: float, clock: ScriptedClock) -> Measured:
    chained_seconds = CHAINED_SECONDS[engine]
    ranks, draws, rngs = warm.ranks, warm.draws, warm.rngs
    time.sleep(max(0.0, window_started + FIRST_PUSH_AGE[engine] - time.monotonic()))  # every first sample is older
    measured_push = time.time()
    for key, rank in ranks.items():
        _run_steps(rank, clock, draws[key], rngs[key], MEASURED_STEPS, keep=True)
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
        clock.switch(rank.timeline)
        rank.tracker.close()
    return Measured(engine, prometheus, {key: rank.steps for key, rank in ranks.items()},
                    ranks[(PHASE_RUN, "0")].phase_times, at)


def _agree(ranks: dict[tuple[str, str], Rank]) -> None:
    """Every rank publishes its blocks, then every rank reads the run's."""
    for _ in range(2):
        for rank in ranks.values():
            rank.tracker.agree_on_bounds()


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


def _bounds_some_ranks_lack(measured: Measured) -> dict[str, set[str]]:
    """Run -> the step-time bounds that not all its ranks have rates for in the 1m window: the run's summed
    buckets dip there, which Prometheus and VictoriaMetrics repair differently (docs/engines.md). A bound
    a rank adds at the measured push has no rate yet, on any rank."""
    expr = ('count by (run, le) (rate(stepscope_step_seconds_bucket[1m])) != on (run) group_left ()'
            ' count by (run) (rate(stepscope_step_seconds_bucket{le="+Inf"}[1m]))')
    lacking: dict[str, set[str]] = {}
    for item in measured.query(expr):
        lacking.setdefault(item["metric"]["run"], set()).add(item["metric"]["le"])
    return lacking


def test_every_runs_ranks_export_the_same_bounds(measured: Measured) -> None:
    """The ranks agreed on their bounds through the store (stepscope.hooks.run_bounds), though their own
    steps would place different fine buckets: lognormal draws, ranks a few per cent or 3x apart."""
    lack = _bounds_some_ranks_lack(measured)
    assert not lack, lack


def test_run_quantiles_over_ranks_with_their_own_buckets_are_within_ten_percent(measured: Measured) -> None:
    errors = _errors(measured, lambda name, _: f"run:stepscope_step_seconds:{name}_rate1m", by="run")
    print("\nrun p50/p95 errors (all ranks' steps pooled):\n" + _report(errors))
    assert {where for where, _ in errors} == set(CASES)
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

    The recorded run buckets sum shard partials evaluated a second apart (0.5% apart when a scrape came
    late under load on VictoriaMetrics), while the user's query reads one instant: each bound holds the
    same share of the run's steps within SHARE_APART, and the quantiles agree within 1%."""
    own = _bucket_shares(measured, "sum by (run, le) (rate(stepscope_step_seconds_bucket[1m]))")
    recorded = _bucket_shares(measured, "run_le:stepscope_step_seconds_bucket:rate1m")
    assert own.keys() == recorded.keys()
    assert {run for run, _ in own} == set(CASES)
    apart = {key: (own[key], recorded[key]) for key in own if abs(own[key] - recorded[key]) > SHARE_APART}
    assert not apart, apart
    for name, q in QUANTILES.items():
        own_q = {item["metric"]["run"]: float(item["value"][1]) for item in measured.query(
            f"histogram_quantile({q}, sum by (run, le) (rate(stepscope_step_seconds_bucket[1m])))")}
        recorded_q = {item["metric"]["run"]: float(item["value"][1])
                      for item in measured.query(f"run:stepscope_step_seconds:{name}_rate1m")}
        assert own_q.keys() == recorded_q.keys() == set(CASES)
        for run in CASES:
            assert own_q[run] == pytest.approx(recorded_q[run], rel=0.01), (run, name, own_q[run], recorded_q[run])

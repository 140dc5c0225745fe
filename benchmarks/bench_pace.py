"""Step-time quantiles when a run changes pace, through Prometheus' own `rate()` and
`histogram_quantile`, for the shipped bucket layout and the one before it.

    PYTHONPATH=. python benchmarks/bench_pace.py        # ~2 minutes

Each case is a timeline of step-time segments (a slow start, a x3 shift and back, one eval-like step
in ten x5 longer, a steady control) around a centre log-uniform in 1 ms..10 s, for 1 rank and for 8
ranks whose steps sit up to 4% apart. Every rank pushes every 5 s, Prometheus scrapes every 15 s; the
layout decides its bounds on the hooks' clock (the simulated one). The estimate is what Prometheus
2.42 computes: `extrapolatedRate` per bucket series over its samples in the window (a bound that
appeared mid-window has fewer, a bound that left has none after it left), summed per `le` over the
ranks, then `histogram_quantile` with its monotonic repair. The truth is the quantile of the steps
that ended in the window. Two readings, after the run's last change of pace at C:

- 2m from the change: the quantile over `[2m]` at C + 2 min, the window holding exactly the new pace;
- 1m windows: the recorded `rate1m` quantile every 15 s from C + 1 min to the end; the share within
  10%, and how long after C the estimate stays within 10% (settled).

The real-path check of the same cases (hooks -> exporter -> Prometheus -> recording rules) is
tests/test_quantiles_e2e.py. Writes benchmarks/results/quantiles-pace.md.
"""

from __future__ import annotations

import math
import platform
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import stepscope.hooks.timing as timing
from stepscope.hooks.timing import FINE_GRID, FOLLOWED_QUANTILES, MAX_EXPORTED, SKELETON, Histogram

RESULTS = Path(__file__).resolve().parent / "results" / "quantiles-pace.md"
PUSH_SECONDS = 5.0
SCRAPE_SECONDS = 15  # Prometheus' scrape interval in the shipped compose stack and chart
EVAL_SECONDS = 15.0
MAX_STEPS_PER_PUSH = 400  # 1 ms steps make 5000 per push; fewer keep the run quick, same shape
CENTRES = 24
QUANTILES = (0.5, 0.95)
TOLERANCE = 0.10

Draw = Callable[[np.random.Generator, float, int], np.ndarray]


def jitter(rng: np.random.Generator, centre: float, n: int) -> np.ndarray:
    return centre * (1 + 0.02 * rng.standard_normal(n))


def eval_like(rng: np.random.Generator, centre: float, n: int) -> np.ndarray:
    return jitter(rng, centre, n) * np.where(rng.random(n) < 0.1, 5.0, 1.0)


@dataclass(frozen=True)
class Segment:
    seconds: float
    start: float  # step time at the segment's start, in centres
    end: float  # ... and at its end (geometric in between)
    draw: Draw = jitter


CASES: dict[str, tuple[Segment, ...]] = {
    "steady (control)": (Segment(240, 1, 1),),
    "slow start: x50 for 20 s, falling to x4 over 50 s": (Segment(20, 50, 50), Segment(50, 48, 4), Segment(240, 1, 1)),
    "shift: x3 slower for 2 min, then back": (Segment(120, 1, 1), Segment(120, 3, 3), Segment(240, 1, 1)),
    "one eval-like step in ten, x5": (Segment(240, 1, 1, eval_like),),
}


class PreviousLayout:
    """The layout before issue 24 (main at fcb51e8): windows of 3 bins each side of the recent p50,
    p95 and p99, placed after the first snapshot with steps, never removed, up to the cap."""

    def __init__(self) -> None:
        self._exported: tuple[int, ...] = SKELETON
        self._base: Sequence[int] | None = None
        self._lock = threading.Lock()

    def export(self, cumulative: Sequence[int]) -> Sequence[int]:
        if self._base is None:
            if cumulative[-1] > 0:
                self._base = cumulative
            return self._exported
        new = cumulative[-1] - self._base[-1]
        if new < 20:
            return self._exported
        recent = [now - before for now, before in zip(cumulative, self._base, strict=True)]
        for quantile in FOLLOWED_QUANTILES:
            self._cover(bisect_left(recent, quantile * new))
        self._base = cumulative
        return self._exported

    def _cover(self, fine_bin: int) -> None:
        exported = set(self._exported)
        core, whole = _bins(fine_bin, 1), _bins(fine_bin, 3)
        if exported.issuperset(core):
            return
        for window in (whole, core):
            if len(exported.union(window)) <= MAX_EXPORTED:
                self._exported = tuple(sorted(exported.union(window)))
                return


def _bins(fine_bin: int, margin: int) -> range:
    return range(max(fine_bin - 1 - margin, 0), min(fine_bin + margin, len(FINE_GRID) - 1) + 1)


LAYOUTS: dict[str, Callable[[], Histogram]] = {
    "before (fcb51e8): windows never removed": lambda: Histogram(FINE_GRID, PreviousLayout()),
    "shipped: aligned quarter-octave blocks, unused 30 s may go": Histogram.following,
}


@dataclass
class Series:
    """One bucket series as Prometheus stores it: (time, cumulative count) per scrape it was in."""

    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class Run:
    series: dict[tuple[int, float], Series]  # (rank, le) -> samples; le inf for +Inf
    steps: np.ndarray  # end time of every step (all ranks)
    durations: np.ndarray
    change: float  # when the last segment started


class Clock:
    """perf_counter_ns for the layouts: the simulated time."""

    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def simulate(make: Callable[[], Histogram], segments: Sequence[Segment], centre: float, ranks: int,
             seed: int, clock: Clock) -> Run:
    rng = np.random.default_rng(seed)
    offsets = 1 + 0.04 * (rng.random(ranks) * 2 - 1) if ranks > 1 else np.ones(1)
    hists = [make() for _ in range(ranks)]
    series: dict[tuple[int, float], Series] = {}
    ends: list[np.ndarray] = []
    durations: list[np.ndarray] = []
    now = 0.0
    for segment in segments:
        for index in range(round(segment.seconds / PUSH_SECONDS)):
            factor = segment.start * (segment.end / segment.start) ** (index * PUSH_SECONDS / segment.seconds)
            for rank, hist in enumerate(hists):
                step = centre * factor * offsets[rank]
                count = max(1, min(round(PUSH_SECONDS / step), MAX_STEPS_PER_PUSH))
                seconds = np.maximum(segment.draw(rng, step, count), 1e-6)
                _observe(hist, seconds)
                ends.append(now + np.linspace(PUSH_SECONDS / count, PUSH_SECONDS, count))
                durations.append(seconds)
            now += PUSH_SECONDS
            clock.ns = round(now * 1e9)
            scraped = round(now) % SCRAPE_SECONDS == 0  # the exporter serves the latest push
            for rank, hist in enumerate(hists):
                snap = hist.snapshot()  # each push: the layout decides here
                if snap.held_back or not scraped:
                    continue
                for le, value in zip((*snap.bounds, math.inf), snap.cumulative, strict=True):
                    entry = series.setdefault((rank, le), Series())
                    entry.times.append(now)
                    entry.values.append(value)
    change = sum(segment.seconds for segment in segments[:-1])
    return Run(series, np.concatenate(ends), np.concatenate(durations), change)


def _observe(hist: Histogram, seconds: np.ndarray) -> None:
    indices = np.searchsorted(hist.bounds_ns, np.round(seconds * 1e9), side="left")
    for index, count in zip(*np.unique(indices, return_counts=True), strict=True):
        hist.counts[index] += int(count)


def extrapolated_rate(times: Sequence[float], values: Sequence[float], at: float, window: float) -> float | None:
    """Prometheus 2.42 promql.extrapolatedRate for a counter without resets (None: fewer than 2 samples)."""
    start, end = at - window, at
    picked = [(t, v) for t, v in zip(times, values, strict=True) if start <= t <= end]
    if len(picked) < 2:
        return None
    (first_t, first_v), (last_t, last_v) = picked[0], picked[-1]
    increase, sampled = last_v - first_v, last_t - first_t
    average = sampled / (len(picked) - 1)
    to_start, to_end = first_t - start, end - last_t
    if increase > 0 and first_v >= 0:
        to_start = min(to_start, sampled * first_v / increase)
    threshold = average * 1.1
    interval = sampled + (to_start if to_start < threshold else average / 2)
    interval += to_end if to_end < threshold else average / 2
    return increase * interval / sampled / window


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus 2.42 bucketQuantile, with ensureMonotonic's repair of a bucket below its lower one."""
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return math.nan
    counts = list(running_max([buckets[b] for b in bounds]))
    total = counts[-1]
    if total <= 0:
        return math.nan
    rank = q * total
    b = bisect_left(counts, rank)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = bounds[b - 1] if b > 0 else 0.0
    below = counts[b - 1] if b > 0 else 0.0
    return start + (bounds[b] - start) * (rank - below) / (counts[b] - below)


def running_max(values: Sequence[float]) -> list[float]:
    out, top = [], -math.inf
    for value in values:
        top = max(top, value)
        out.append(top)
    return out


def estimate(run: Run, q: float, at: float, window: float) -> float:
    buckets: dict[float, float] = {}
    for (_, le), entry in run.series.items():
        rate = extrapolated_rate(entry.times, entry.values, at, window)
        if rate is not None:
            buckets[le] = buckets.get(le, 0.0) + rate
    return histogram_quantile(q, buckets)


def truth(run: Run, q: float, at: float, window: float) -> float:
    inside = run.durations[(run.steps > at - window) & (run.steps <= at)]
    return float(np.quantile(inside, q, method="inverted_cdf")) if len(inside) else math.nan


def readings(run: Run, end: float) -> dict[str, float]:
    """The 2m-from-the-change error (worst of p50 and p95), the share of 1m readings within 10%, and
    how long after the change the 1m readings stay within 10%."""
    def error(at: float, window: float) -> float:
        return max(abs(estimate(run, q, at, window) / truth(run, q, at, window) - 1) for q in QUANTILES)

    two_minutes = error(run.change + 120, 120)
    times = np.arange(run.change + 60, end + 1e-9, EVAL_SECONDS)
    within = [error(at, 60) <= TOLERANCE for at in times]
    settled = next((at - run.change for i, at in enumerate(times) if all(within[i:])), math.inf)
    return {"two_minutes": two_minutes, "within": sum(within) / len(within), "settled": settled}


def main() -> None:
    started = time.monotonic()
    clock = Clock()
    timing.perf_counter_ns = clock  # the layouts' clock is the simulated one
    centres = np.exp(np.random.default_rng(7).uniform(math.log(1e-3), math.log(10.0), CENTRES))
    rows = []
    for case, segments in CASES.items():
        end = sum(segment.seconds for segment in segments)
        for ranks in (1, 8):
            for layout, make in LAYOUTS.items():
                results = [readings(simulate(make, segments, float(c), ranks, seed, clock), end)
                           for seed, c in enumerate(centres)]
                two = [r["two_minutes"] for r in results]
                settled = [r["settled"] for r in results]
                rows.append([
                    case, str(ranks), layout,
                    f"{100 * float(np.median(two)):.1f} / {100 * max(two):.1f}",
                    f"{sum(t <= TOLERANCE for t in two)} of {len(two)}",
                    ", ".join(f"{c:.3g}" for c, t in zip(centres, two, strict=True) if t > TOLERANCE) or "-",
                    f"{100 * float(np.mean([r['within'] for r in results])):.0f}%",
                    f"{_seconds(float(np.median(settled)))} / {_seconds(max(settled))}",
                ])
    text = "\n".join([
        "# Step-time quantiles when a run changes pace",
        "",
        f"Python {platform.python_version()}, numpy {np.__version__}; {CENTRES} centres log-uniform in 1 ms..10 s "
        f"per row; pushes every {PUSH_SECONDS:.0f} s, scrapes every {SCRAPE_SECONDS} s, readings every "
        f"{EVAL_SECONDS:.0f} s; "
        f"took {time.monotonic() - started:.0f} s (`PYTHONPATH=. python benchmarks/bench_pace.py`).",
        "",
        table(["timeline", "ranks", "layout", "2m from the change: worst of p50/p95 error % (median / worst)",
               "2m from the change: within 10%", "2m: off by > 10% at centres (s)",
               "1m readings from change + 1 min within 10%", "settled after the change (median / worst)"], rows),
        "",
        "Rates and quantiles as Prometheus 2.42 computes them (extrapolatedRate per series, sum per le over "
        "ranks, histogram_quantile with its monotonic repair); truth: the quantile of the steps that ended "
        "in the window (numpy inverted_cdf). Settled: from then on every 1m reading is within 10% (inf: never).",
        "",
    ])
    RESULTS.write_text(text)
    print(text)


def _seconds(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:.0f} s"


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


if __name__ == "__main__":
    main()

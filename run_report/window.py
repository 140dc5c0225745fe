"""Which runs Prometheus holds, when a run lived, and the report's time window and resolution.

A run's life is found from its `stepscope_training_info` series without reading all of them: count
samples per hour over the search range, then per minute inside the first and last hour, then read
the raw samples of those two minutes. The first and last sample are exact whatever the scrape
interval or Prometheus's lookback, and a month of a 64-rank run costs a few small queries.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass

from stepscope.contract import TRAINING_INFO
from stepscope.report.prometheus import Prometheus, Series
from stepscope.report.times import iso

SEARCH_DAYS = 30  # how far back a run is looked for when --from is not given
RESOLUTION_POINTS = 1200  # query_range points over the window, at most (finer: the scrape interval)
NICE_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)
# A run's window starts at its processes' start when they began at most this long before its first sample
# (the queries' lookback before a window, queries.BEFORE, is as long).
PROCESS_START_SECONDS = 600


class NoData(Exception):
    """Nothing to report on (no run, no samples in the range); the message is one line."""


@dataclass(frozen=True)
class RunSeen:
    run: str
    ranks: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Window:
    """The report's range [start, end] (unix seconds) and its query resolution `step` (seconds)."""

    start: float
    end: float
    step: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def range_ms(self) -> str:
        """The window as a PromQL duration, for range selectors evaluated at `end`."""
        return f"{max(1, round(self.seconds * 1000))}ms"

    @property
    def rate_window(self) -> str:
        """Rate window for raw counters: the rules' 1m, or the step where it is longer (no sample skipped)."""
        return f"{max(60, math.ceil(self.step))}s"


def run_matcher(run: str) -> str:
    """`run="..."` with the name escaped as a PromQL string."""
    return f"run={promql_string(run)}"


def promql_string(value: str) -> str:
    """`value` as a double-quoted PromQL string literal. PromQL takes Go's escapes and UTF-8 as it is;
    JSON's default escapes every non-ASCII character, one beyond the BMP (an emoji) as a UTF-16 surrogate
    pair that Prometheus refuses ("invalid Unicode code point"). Without that, the escapes JSON writes
    (backslash, quote, newline, tab, and u-escapes of other control characters) are Go's."""
    return json.dumps(value, ensure_ascii=False)


def runs_seen(prom: Prometheus, start: float, end: float) -> list[RunSeen]:
    """The runs with a training process pushing in [start, end], from the series index."""
    ranks: dict[str, set[str]] = {}
    nodes: dict[str, set[str]] = {}
    for labels in prom.series(TRAINING_INFO, start, end):
        run = labels.get("run", "")
        ranks.setdefault(run, set()).add(labels.get("rank", ""))
        nodes.setdefault(run, set()).add(labels.get("instance", ""))
    return [RunSeen(run, len(ranks[run]), tuple(sorted(nodes[run]))) for run in sorted(ranks)]


def run_life(prom: Prometheus, run: str, start: float, end: float) -> tuple[float, float, float]:
    """(when the run started, last sample, typical scrape interval) of the run's info series in [start, end]:
    its first sample there, or its processes' start just before it (run_start).

    Raises NoData when the run has no sample there.
    """
    selector = f"{TRAINING_INFO}{{{run_matcher(run)}}}"
    first_hour = _bucket_ends(prom, selector, start, end, 3600, from_end=False)
    last_hour = _bucket_ends(prom, selector, start, end, 3600, from_end=True)
    if not first_hour or not last_hour:
        raise NoData(f"run {run!r} has no samples between {iso(start)} and {iso(end)}")
    first_minute = _bucket_ends(prom, selector, first_hour[0] - 3600, first_hour[0], 60, from_end=False)[0]
    last_minute = _bucket_ends(prom, selector, last_hour[-1] - 3600, last_hour[-1], 60, from_end=True)[-1]
    first_raw = prom.query(f"{selector}[60s]", first_minute)
    raw = first_raw + prom.query(f"{selector}[60s]", last_minute)
    times = [t for series in raw for t, _ in series.points if start <= t <= end]
    if not times:
        raise NoData(f"run {run!r} has no samples between {iso(start)} and {iso(end)}")
    return max(start, run_start(min(times), first_raw)), max(times), _scrape_interval(raw)


def run_start(first_sample: float, first_minute: list[Series]) -> float:
    """Where the run's window starts. The hooks count steps from their process's start, so a rank's first
    sample already holds the steps it made before Prometheus first scraped it, and the report counts them
    (queries: a rank born inside the window counts from zero). The window therefore begins at the earliest
    process start (`start_time` of stepscope_training_info) among the ranks of the first minute when that
    is before the first sample by at most PROCESS_START_SECONDS, so the header's start is where the counts
    start; otherwise (no start_time, or a process older than that) at the first sample."""
    starts = [_seconds(series.labels.get("start_time", "")) for series in first_minute]
    before = [t for t in starts if t is not None and first_sample - PROCESS_START_SECONDS <= t < first_sample]
    return min(before, default=first_sample)


def _seconds(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def resolution(start: float, end: float, scrape_interval: float) -> float:
    """The scrape interval, or coarser so that the window has at most RESOLUTION_POINTS points."""
    wanted = max(scrape_interval, (end - start) / RESOLUTION_POINTS, 1.0)
    return float(next((step for step in NICE_STEPS if step >= wanted), math.ceil(wanted)))


def aligned(start: float, end: float, step: float) -> Window:
    """The window widened to whole steps, so every query (instant or range) sees the same points."""
    return Window(math.floor(start / step) * step, math.ceil(end / step) * step, step)


def _bucket_ends(prom: Prometheus, selector: str, lo: float, hi: float, size: int, from_end: bool) -> list[float]:
    """End times t of the `size`-second buckets [t - size, t] holding a sample, covering [lo, hi].

    The grid starts at `lo` (from_end=False: no bucket reaches before lo, the last may pass hi) or
    ends at `hi` (from_end=True: no bucket passes hi), so the first or the last sample found is in range.
    """
    count = max(1, math.ceil((hi - lo) / size))
    first, last = (hi - (count - 1) * size, hi) if from_end else (lo + size, lo + count * size)
    found = prom.query_range(f"count(count_over_time({selector}[{size}s]))", first, last, size)
    return sorted(t for series in found for t, value in series.points if value > 0)


def _scrape_interval(raw: list[Series]) -> float:
    gaps = [b[0] - a[0] for series in raw for a, b in zip(series.points, series.points[1:], strict=False)]
    return statistics.median(gaps) if gaps else 15.0

"""Which runs Prometheus holds, when a run lived, and the report's time window and resolution.

A run's life is found from its `stepscope_training_info` series without reading all of them: count
samples per hour over the search range, then per minute inside the first and last hour, then read
the raw samples of those two minutes. A range longer than SEARCH_POINTS hours (about 14 months; --from
0 is 56 years) is first searched in buckets SEARCH_REFINE times longer, as many times as it takes, each
first and last bucket then searched in SEARCH_REFINE of the next size: Prometheus refuses a query of
more than 11,000 points. A range longer than SEARCH_SPAN_SECONDS (years 1 to 9999 are valid times) is
searched a span at a time, from its start for the first sample and from its end for the last:
Prometheus holds a query's span in nanoseconds (at most 292 years) and answers a longer one with
nothing or an error. The first and last sample are exact whatever the scrape interval or
Prometheus's lookback, and a month of a 64-rank run costs a few small queries.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass

from stepscope.contract import THRESHOLDS, TRAINING_INFO
from stepscope.report.prometheus import Prometheus, Series
from stepscope.report.times import iso

# The longest scrape interval the rules' 1m windows serve (two scrapes in each): the report names it where a run's is
# longer.
SCRAPE_INTERVAL_MAX_SECONDS = THRESHOLDS["scrape_interval_max_seconds"].value

SEARCH_DAYS = 30  # how far back a run is looked for when --from is not given
RESOLUTION_POINTS = 1200  # query_range points over the window, at most (finer: the scrape interval)
NICE_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)
# A run's window starts at its processes' start when they began at most this long before its first sample
# (the queries' lookback before a window, queries.BEFORE, is as long).
PROCESS_START_SECONDS = 600
SEARCH_POINTS = 10_000  # buckets of one search query at most (Prometheus: 11,000 points per series)
SEARCH_REFINE = 100  # each search size is this many times the next finer one (minute, hour, 100 hours, ...)
SEARCH_SPAN_SECONDS = 100 * 365 * 86400  # one search query's range at most (Prometheus: under 292 years)


class NoData(Exception):
    """Nothing to report on (no run, no samples in the range); the message is one line."""


@dataclass(frozen=True)
class RunSeen:
    run: str
    ranks: int
    nodes: tuple[str, ...]


# A timeline point looks back a step and a half for its series' latest sample, and at least 1.5 x this many scrape
# intervals: a live run's late scrapes must not cut its states apart.
FRESH_SCRAPES = 4


@dataclass(frozen=True)
class Window:
    """The report's range [start, end] (unix seconds), its query resolution `step` and the run's scrape interval
    (seconds; 0 where not measured: the step)."""

    start: float
    end: float
    step: float
    scrape_interval: float = 0.0

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def scraped_too_rarely(self) -> bool:
        """Whether the run's exporter was scraped less often than the rules' 1m windows need: then they record no
        verdict however long the ranks train (at 60 s Prometheus recorded nothing, VictoriaMetrics rates but no
        verdict)."""
        return self.scrape_interval > SCRAPE_INTERVAL_MAX_SECONDS

    @property
    def range_ms(self) -> str:
        """The window as a PromQL duration, for range selectors evaluated at `end`."""
        return f"{max(1, round(self.seconds * 1000))}ms"

    @property
    def after_start_ms(self) -> str:
        """The window less its start, as a PromQL duration: a subquery over it evaluated at `end` takes the points
        after the start only, on both engines (Prometheus' ranges include their start; VictoriaMetrics' do not)."""
        return f"{max(1, round(self.seconds * 1000) - 1)}ms"

    @property
    def step_duration(self) -> str:
        """The step as a PromQL duration: in milliseconds, as PromQL has no fractional seconds ("2.5s")."""
        return f"{max(1, round(self.step * 1000))}ms"

    @property
    def fresh_duration(self) -> str:
        """How old a sample a point of the timeline's series may show: a step and a half, and at least six scrape
        intervals, room for scrapes that came late. A series that ends without a staleness marker (backfilled,
        imported) was shown by Prometheus for its 5-minute lookback, by VictoriaMetrics for about an interval;
        with a scrape interval and a half, a live run's scrapes 2 s late on a busy server (1 s scrapes, --step 1)
        cut its ranks' states into pieces the report drew apart."""
        return f"{max(1, round(max(self.step, FRESH_SCRAPES * self.scrape_interval) * 1500))}ms"

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


# The raw samples read at each edge of a run: three scrapes at a 60 s interval, so their gaps give the interval. With
# 60 s, one sample or none fell in each edge's minute and the interval was taken for the 15 s default.
RAW_SECONDS = 180


def run_life(prom: Prometheus, run: str, start: float, end: float) -> tuple[float, float, float]:
    """(when the run started, last sample, typical scrape interval) of the run's info series in [start, end]:
    its first sample there, or its processes' start just before it (run_start).

    Raises NoData when the run has no sample there.
    """
    selector = f"{TRAINING_INFO}{{{run_matcher(run)}}}"
    first_minute = _edge_minute(prom, selector, start, end, from_end=False)
    last_minute = _edge_minute(prom, selector, start, end, from_end=True)
    if first_minute is None or last_minute is None:
        raise NoData(f"run {run!r} has no samples between {iso(start)} and {iso(end)}")
    first_raw = prom.query(f"{selector}[{RAW_SECONDS}s]", first_minute)
    raw = first_raw + prom.query(f"{selector}[{RAW_SECONDS}s]", last_minute)
    times = [t for series in raw for t, _ in series.points if start <= t <= end]
    if not times:
        raise NoData(f"run {run!r} has no samples between {iso(start)} and {iso(end)}")
    return max(start, run_start(min(times), first_raw)), max(times), _scrape_interval(raw)


def _edge_minute(prom: Prometheus, selector: str, start: float, end: float, from_end: bool) -> float | None:
    """The end of the first (from_end: last) minute bucket holding a sample in [start, end], found a span at
    a time from coarse to fine (see the module docstring); None when there is none."""
    spans = [(lo, min(end, lo + SEARCH_SPAN_SECONDS)) for lo in _span_starts(start, end)]
    for lo, hi in reversed(spans) if from_end else spans:
        found = _edge_minute_in(prom, selector, lo, hi, from_end)
        if found is not None:
            return found
    return None


def _span_starts(start: float, end: float) -> list[float]:
    count = max(1, math.ceil((end - start) / SEARCH_SPAN_SECONDS))
    return [start + index * SEARCH_SPAN_SECONDS for index in range(count)]


def _edge_minute_in(prom: Prometheus, selector: str, start: float, end: float, from_end: bool) -> float | None:
    """_edge_minute in a range of at most SEARCH_SPAN_SECONDS."""
    lo, hi = start, end
    for size in search_sizes(end - start):
        found = _bucket_ends(prom, selector, lo, hi, size, from_end)
        if not found:
            return None
        edge = found[-1] if from_end else found[0]
        lo, hi = edge - size, edge
    return hi


def search_sizes(seconds: float) -> list[int]:
    """Bucket sizes from the coarsest to the minute: hours, then SEARCH_REFINE times longer until the range
    holds at most SEARCH_POINTS of them."""
    sizes = [3600, 60]
    while seconds / sizes[0] > SEARCH_POINTS:
        sizes.insert(0, sizes[0] * SEARCH_REFINE)
    return sizes


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


def aligned(start: float, end: float, step: float, scrape_interval: float = 0.0) -> Window:
    """The window widened to whole steps, so every query (instant or range) sees the same points."""
    return Window(math.floor(start / step) * step, math.ceil(end / step) * step, step, scrape_interval)


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

"""Lock-free fixed-bucket histograms and the host phase timer that feeds them.

Concurrency: every histogram has exactly one writer, the training thread, which only ever increments
(`counts[i] += 1`, then `sum_ns += d`). The pusher thread only reads. With one writer there are no lost
updates, so no lock and no syscall are needed per observation. A reader may see a torn state (an
observation counted in a bucket but not yet in the sum, or vice versa); `snapshot` therefore copies
the bucket counts once and derives `_count` and the cumulative buckets from that copy, so `_count`
always equals the +Inf bucket and every bucket only grows between pushes. The sum is at most one
in-flight observation off, which the next push corrects — pushes are cumulative.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from time import perf_counter_ns


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]  # seconds, without +Inf
    cumulative: tuple[int, ...]  # one per bound, then +Inf
    sum_seconds: float

    @property
    def count(self) -> int:
        return self.cumulative[-1]


class Histogram:
    """Bucket counts in integer nanoseconds; `counts[len(bounds)]` is the overflow (+Inf only) bucket."""

    __slots__ = ("bounds", "bounds_ns", "counts", "sum_ns")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.bounds_ns = [round(b * 1e9) for b in bounds]
        self.counts = [0] * (len(bounds) + 1)
        self.sum_ns = 0

    def observe_ns(self, duration_ns: int) -> None:
        # `le` semantics: a value equal to a bound belongs to that bound's bucket.
        self.counts[bisect_left(self.bounds_ns, duration_ns)] += 1
        self.sum_ns += duration_ns

    def snapshot(self) -> HistogramSnapshot:
        counts = self.counts.copy()  # one C-level copy: consistent with itself
        return HistogramSnapshot(self.bounds, tuple(accumulate(counts)), self.sum_ns / 1e9)


class HostPhase:
    """`with phase:` times wall-clock with perf_counter_ns; reused for every step (no allocation per use).

    Not re-entrant: nesting a phase inside itself would overwrite the start; use distinct names.
    """

    __slots__ = ("_bounds_ns", "_counts", "_hist", "_start", "name")

    def __init__(self, name: str, hist: Histogram) -> None:
        self.name = name
        self._hist = hist
        self._counts = hist.counts
        self._bounds_ns = hist.bounds_ns
        self._start = 0

    def __enter__(self) -> HostPhase:
        self._start = perf_counter_ns()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        duration = perf_counter_ns() - self._start
        self._counts[bisect_left(self._bounds_ns, duration)] += 1  # inlined Histogram.observe_ns
        self._hist.sum_ns += duration

    # Explicit forms for callbacks whose start and end arrive in different hooks.
    def start(self) -> None:
        self._start = perf_counter_ns()

    def end(self) -> None:
        self.__exit__(None, None, None)


class NullPhase:
    """Stands in for phases over the limit: costs nothing and records nothing."""

    __slots__ = ()
    name = ""

    def __enter__(self) -> NullPhase:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        return None

    def start(self) -> None:
        return None

    def end(self) -> None:
        return None


NULL_PHASE = NullPhase()

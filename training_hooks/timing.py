"""Lock-free histograms on a fine log grid, the bucket layouts they export, and the host phase timer.

Concurrency: every histogram has exactly one writer, the training thread, which only ever increments
(`counts[i] += 1`, then `sum_ns += d`). The pusher thread only reads. With one writer there are no lost
updates, so no lock and no syscall are needed per observation. A reader may see a torn state (an
observation counted in a bucket but not yet in the sum, or vice versa); `snapshot` therefore copies
the bucket counts once and derives `_count` and the cumulative buckets from that copy, so `_count`
always equals the +Inf bucket and every bucket only grows between pushes. The sum is at most one
in-flight observation off, which the next push corrects — pushes are cumulative.

Buckets that follow the run: `histogram_quantile` interpolates linearly inside the bucket that holds
the quantile, so its error is up to about (r - 1) / 2 at p50 and 0.95 (r - 1) at p95 for buckets r
apart when the steps sit close together (the common case: steps jitter by a few per cent). Within
10% needs r <= 1.1, about 107 buckets from 1 ms to 10 s: too many series. So the hooks count every
observation on a fine grid (2^(1/8) = 1.09 apart, 1 µs to 131 s) and export only part of it: a
coarse skeleton every second octave, plus fine windows where the recent observations' p50, p95 and
p99 fall (benchmarks/results/quantiles.md compares layouts). Exported counts are exact cumulative
counts at grid bounds, so a window that appears later starts with correct values. Bounds are added,
never removed (no series churn), up to a cap.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from time import perf_counter_ns
from typing import Protocol

from stepscope_contract import GRID_OCTAVES, MAX_EXPORTED_BOUNDS, SKELETON_EVERY_OCTAVES, STEPS_PER_OCTAVE

# Fine grid: 1 ms * 2^(k/8) for k in [-80, 136], 0.98 µs .. 131 s, 4 significant digits (readable `le`).
FINE_GRID = tuple(
    float(f"{1e-3 * 2 ** (k / STEPS_PER_OCTAVE):.4g}")
    for k in range(GRID_OCTAVES[0] * STEPS_PER_OCTAVE, GRID_OCTAVES[1] * STEPS_PER_OCTAVE)
)
_ONE_MS = -GRID_OCTAVES[0] * STEPS_PER_OCTAVE  # index of 0.001 in FINE_GRID
# Every second octave from 15.6 µs to 65.5 s (12 bounds): what every histogram exports from the start.
SKELETON = tuple(range(_ONE_MS - 6 * STEPS_PER_OCTAVE, len(FINE_GRID), SKELETON_EVERY_OCTAVES * STEPS_PER_OCTAVE))
# p50 and p95 are what the rules show; p99 keeps the tail covered when a minute holds few steps.
FOLLOWED_QUANTILES = (0.5, 0.95, 0.99)
WINDOW_MARGIN = 3  # fine bins exported on each side of a followed quantile's bin (x1.3)
WINDOW_CORE = 1  # nothing is added while the quantile's bin and one bin on each side are exported
MIN_NEW_STEPS = 20  # observations a placement decision needs
MAX_EXPORTED = MAX_EXPORTED_BOUNDS  # bounds per histogram, skeleton included; then windows stop growing


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]  # seconds, without +Inf
    cumulative: tuple[int, ...]  # one per bound, then +Inf
    sum_seconds: float

    @property
    def count(self) -> int:
        return self.cumulative[-1]


class Layout(Protocol):
    def export(self, cumulative: Sequence[int]) -> Sequence[int]:
        """The indices of the histogram's bounds to export, given its cumulative counts per bound."""


class FixedLayout:
    """Exports the same bounds on every snapshot (all of the buckets a user chose, or none: `+Inf` only)."""

    def __init__(self, indices: Sequence[int]) -> None:
        self._indices = tuple(indices)

    def export(self, cumulative: Sequence[int]) -> Sequence[int]:
        return self._indices


class FollowingLayout:
    """Exports the SKELETON of FINE_GRID plus fine windows that follow where the observations fall.

    Decisions are made when a snapshot is taken (in the pusher thread, never on the hot path), from
    the observations since the previous decision: once MIN_NEW_STEPS arrived, each followed quantile
    of them must sit in an exported fine bin with an exported neighbour on each side (WINDOW_CORE);
    otherwise the bins WINDOW_MARGIN around it are added (only the core when the whole window would
    pass MAX_EXPORTED). Observations made before the first snapshot that has any are left out: they
    are the run's first steps (compilation, cache warm-up).
    """

    def __init__(self) -> None:
        self._exported: tuple[int, ...] = SKELETON
        self._base: Sequence[int] | None = None
        self._lock = threading.Lock()

    def export(self, cumulative: Sequence[int]) -> Sequence[int]:
        if self._lock.acquire(blocking=False):  # a concurrent final push just exports what is decided
            try:
                self._follow(cumulative)
            finally:
                self._lock.release()
        return self._exported

    def _follow(self, cumulative: Sequence[int]) -> None:
        if self._base is None:
            if cumulative[-1] > 0:
                self._base = cumulative
            return
        new = cumulative[-1] - self._base[-1]
        if new < MIN_NEW_STEPS:
            return
        recent = [now - before for now, before in zip(cumulative, self._base, strict=True)]
        for quantile in FOLLOWED_QUANTILES:
            self._cover(bisect_left(recent, quantile * new))
        self._base = cumulative

    def _cover(self, fine_bin: int) -> None:
        """Makes the fine bin (FINE_GRID[fine_bin - 1], FINE_GRID[fine_bin]] an exported bucket."""
        exported = set(self._exported)
        core, whole = _window(fine_bin, WINDOW_CORE), _window(fine_bin, WINDOW_MARGIN)
        if exported.issuperset(core):
            return
        for window in (whole, core):
            if len(exported.union(window)) <= MAX_EXPORTED:
                self._exported = tuple(sorted(exported.union(window)))
                return


def _window(fine_bin: int, margin: int) -> range:
    """Indices of the bounds of fine bin `fine_bin` and of `margin` bins on either side."""
    return range(max(fine_bin - 1 - margin, 0), min(fine_bin + margin, len(FINE_GRID) - 1) + 1)


class Histogram:
    """Counts per bound in integer nanoseconds; `counts[len(bounds)]` is the overflow (+Inf only) bucket.

    `bounds` are the bounds it counts on (FINE_GRID for a following layout); `layout` picks the ones a
    snapshot exports.
    """

    __slots__ = ("bounds", "bounds_ns", "counts", "layout", "sum_ns")

    def __init__(self, bounds: tuple[float, ...], layout: Layout | None = None) -> None:
        self.bounds = bounds
        self.bounds_ns = [round(b * 1e9) for b in bounds]
        self.counts = [0] * (len(bounds) + 1)
        self.sum_ns = 0
        self.layout = layout if layout is not None else FixedLayout(range(len(bounds)))

    @classmethod
    def following(cls) -> Histogram:
        """A histogram on FINE_GRID whose exported buckets follow the run."""
        return cls(FINE_GRID, FollowingLayout())

    def observe_ns(self, duration_ns: int) -> None:
        # `le` semantics: a value equal to a bound belongs to that bound's bucket.
        self.counts[bisect_left(self.bounds_ns, duration_ns)] += 1
        self.sum_ns += duration_ns

    def snapshot(self) -> HistogramSnapshot:
        counts = self.counts.copy()  # one C-level copy: consistent with itself
        cumulative = list(accumulate(counts))
        exported = self.layout.export(cumulative)
        return HistogramSnapshot(
            tuple(self.bounds[i] for i in exported),
            (*(cumulative[i] for i in exported), cumulative[-1]),
            self.sum_ns / 1e9,
        )


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

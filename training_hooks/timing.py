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
coarse skeleton every second octave, plus aligned blocks of fine bounds where the recent
observations' p50, p95 and p99 fall (benchmarks/results/quantiles.md compares layouts). Exported
counts are exact cumulative counts at grid bounds, so a block that appears later starts with correct
values; but Prometheus has no history for it, and `rate()` over a window that began before it
under-counts it, so quantiles that read it are off until it is one rate window old. Blocks therefore
appear early (the first push that has steps covers their body and a tail as wide as their spread) and
stay while in use; one unused for a rate window may make room when the run's pace moves (a slow start,
a shift) and the cap is reached.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from time import perf_counter_ns
from typing import Protocol

from stepscope.contract import GRID_OCTAVES, MAX_EXPORTED_BOUNDS, SKELETON_EVERY_OCTAVES, STEPS_PER_OCTAVE

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
BLOCK = 2  # fine bounds are exported in aligned blocks of a quarter octave
WINDOW_MARGIN = 1  # fine bins covered on each side of a followed quantile's bin; blocks add ~0.5 on average
WINDOW_CORE = 1  # nothing is added while the quantile's bin and one bin on each side are exported
EVICT_IDLE_SECONDS = 30  # a block unused this long may make room for one in use
MAX_EXPORTED = MAX_EXPORTED_BOUNDS  # bounds per histogram, skeleton included
FIRST_SPAN_LOW = 0.1  # the first decision covers the first steps from this quantile up (_cover_first_span)...
FIRST_SPAN_ROOM = 2 * BLOCK  # ...leaving room for this many bounds under the cap...
FIRST_SPAN_STEPS = 5  # ...if it has this many steps: a few compilation steps' spread is no run's body


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]  # seconds, without +Inf
    cumulative: tuple[int, ...]  # one per bound, then +Inf
    sum_seconds: float
    held_back: bool = False  # its buckets are not decided yet: render none of it

    @property
    def count(self) -> int:
        return self.cumulative[-1]


class Layout(Protocol):
    def export(self, cumulative: Sequence[int]) -> Sequence[int] | None:
        """The indices of the histogram's bounds to export, given its cumulative counts per bound;
        None: export nothing of the histogram yet."""


class RunBlocks(Protocol):
    """The run's agreement on one histogram's fine blocks (stepscope.hooks.run_bounds)."""

    def publish(self, blocks: frozenset[int]) -> None:
        """The blocks this rank wants now."""

    def wanted(self) -> Mapping[int, int]:
        """Block -> how many of the run's ranks want it, as last read."""


class FixedLayout:
    """Exports the same bounds on every snapshot (all of the buckets a user chose, or none: `+Inf` only)."""

    def __init__(self, indices: Sequence[int]) -> None:
        self._indices = tuple(indices)

    def export(self, cumulative: Sequence[int]) -> Sequence[int]:
        return self._indices


class FollowingLayout:
    """Exports the SKELETON of FINE_GRID plus fine blocks that follow where the observations fall.

    Decisions are made when a snapshot is taken (in the pusher thread, never on the hot path), from
    the observations since the previous snapshot, at every snapshot that has any: waiting for more
    (slow steps, a rare slow mode) would place the block later, and a block's quantiles are off
    until it is a rate window old. Each followed quantile of them must sit in an exported fine bin
    with an exported neighbour on each side (WINDOW_CORE); otherwise the aligned blocks of BLOCK
    bounds covering WINDOW_MARGIN bins around it are added. Nothing is exported before the first
    decision (`None`): every bucket series of a histogram then starts in the same push, so their
    rates add up from the first rate window.

    Aligned blocks make ranks with similar steps export the same bounds (a user's
    `sum by (le) (rate(...))` over ranks needs that). When a block would pass MAX_EXPORTED, blocks
    whose bins got no observation for EVICT_IDLE_SECONDS are dropped, least recently used first, so
    a run whose pace changed (a slow start, a shift) gets fine buckets where it is now within a push
    or two (benchmarks/results/quantiles-pace.md: 60 s left the slow start's new pace without fine
    buckets for another 30 s). A bound leaves only after being unused that long and only for one in
    use, so `le` series change only when the pace does.

    Ranks that step alike still differ at the edges (a p99 block one rank's draws reached), and ranks at
    different paces differ entirely; with `run` (stepscope.hooks.run_bounds) each rank also exports the
    blocks the run's other ranks want, at its own exact counts, so that summing the ranks per `le` has no
    dip (_agreed_blocks).
    """

    def __init__(self, run: RunBlocks | None = None) -> None:
        self._run = run
        self._blocks: dict[int, int] = {}  # block -> perf_counter_ns when its bins last had observations
        self._exported: tuple[int, ...] | None = None
        self._base: Sequence[int] | None = None
        self._lock = threading.Lock()

    def export(self, cumulative: Sequence[int]) -> Sequence[int] | None:
        if self._lock.acquire(blocking=False):  # a concurrent final push just exports what is decided
            try:
                self._follow(cumulative)
            finally:
                self._lock.release()
        return self._exported

    def _follow(self, cumulative: Sequence[int]) -> None:
        base = self._base if self._base is not None else [0] * len(cumulative)
        new = cumulative[-1] - base[-1]
        if new < 1:
            return
        now = perf_counter_ns()
        recent = [after - before for after, before in zip(cumulative, base, strict=True)]
        self._mark_used(recent, now)
        if self._exported is None and new >= FIRST_SPAN_STEPS:
            self._cover_first_span(recent, now)
        for quantile in FOLLOWED_QUANTILES:
            self._cover(bisect_left(recent, quantile * new), now)
        if self._run is None:
            self._exported = _bounds_of(self._blocks)
        else:
            self._run.publish(frozenset(self._blocks))
            self._exported = _bounds_of(_agreed_blocks(self._run.wanted()))
        self._base = cumulative

    def _cover_first_span(self, recent: Sequence[int], now: int) -> None:
        """At the first decision, if it has FIRST_SPAN_STEPS steps, every fine bin from their p10 up to as far
        above their slowest as the slowest is above their median (as far as fits, FIRST_SPAN_ROOM bounds free).

        A push's few steps place p95 and p99 only roughly and the tail shows over more pushes: blocks that a
        later push adds there are under-counted by every rate window that began before them, which read the
        Lightning callback's p95 +35% until the 70th second (tests/test_framework_quantiles.py). Covering the
        body and a tail as wide as the first steps' spread from the first push makes the first full minute
        right; a run whose steps barely vary gets a few bins, as before.
        """
        new = recent[-1]
        low, median, slowest = (bisect_left(recent, q * new) for q in (FIRST_SPAN_LOW, 0.5, 1.0))
        high = min(2 * slowest - median + WINDOW_MARGIN, len(FINE_GRID) - 1)
        blocks = set(self._blocks)
        for block in range(max(low - 1 - WINDOW_MARGIN, 0) // BLOCK, high // BLOCK + 1):
            if len(_bounds_of(blocks | {block})) > MAX_EXPORTED - FIRST_SPAN_ROOM:
                break
            blocks.add(block)
        self._blocks.update(dict.fromkeys(blocks - self._blocks.keys(), now))

    def _mark_used(self, recent: Sequence[int], now: int) -> None:
        """Stamps every exported block whose bins received observations since the last decision."""
        for block in self._blocks:
            first, last = block * BLOCK, min((block + 1) * BLOCK, len(recent)) - 1
            if recent[last] - (recent[first - 1] if first > 0 else 0) > 0:
                self._blocks[block] = now

    def _cover(self, fine_bin: int, now: int) -> None:
        """Makes the fine bin (FINE_GRID[fine_bin - 1], FINE_GRID[fine_bin]] an exported bucket."""
        exported = set(_bounds_of(self._blocks))
        if exported.issuperset(_window(fine_bin, WINDOW_CORE)):
            return
        for window in (_window(fine_bin, WINDOW_MARGIN), _window(fine_bin, 0)):
            wanted = {bound // BLOCK for bound in window}
            if self._make_room(wanted, now):
                self._blocks.update(dict.fromkeys(wanted - self._blocks.keys(), now))
                return

    def _make_room(self, wanted: set[int], now: int) -> bool:
        """Drops idle blocks (least recently used first) until `wanted` fits; False when it cannot."""
        idle = sorted((used, block) for block, used in self._blocks.items()
                      if block not in wanted and now - used >= EVICT_IDLE_SECONDS * 1e9)
        blocks = set(self._blocks)
        while len(_bounds_of(blocks | wanted)) > MAX_EXPORTED:
            if not idle:
                return False
            blocks.discard(idle.pop(0)[1])
        for block in set(self._blocks) - blocks:
            del self._blocks[block]
        return True


def _bounds_of(blocks: Iterable[int]) -> tuple[int, ...]:
    """The SKELETON and every bound of the given blocks, sorted."""
    fine = (bound for block in blocks for bound in range(block * BLOCK, (block + 1) * BLOCK))
    return tuple(sorted(set(SKELETON).union(bound for bound in fine if bound < len(FINE_GRID))))


def _agreed_blocks(wanted: Mapping[int, int]) -> set[int]:
    """The blocks the run's ranks want, the most wanted first (then the lowest), as far as MAX_EXPORTED
    allows: a function of the run's counts alone, so every rank that read them exports the same bounds,
    even where they do not all fit (a bound only some ranks export dips the run's sum wherever it lies).
    Alone, a rank's own blocks, which always fit."""
    blocks: set[int] = set()
    for block in sorted(wanted, key=lambda b: (-wanted[b], b)):
        if len(_bounds_of(blocks | {block})) <= MAX_EXPORTED:
            blocks.add(block)
    return blocks


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
    def following(cls, run: RunBlocks | None = None) -> Histogram:
        """A histogram on FINE_GRID whose exported buckets follow the run (and, with `run`, agree with the
        run's other ranks)."""
        return cls(FINE_GRID, FollowingLayout(run))

    def observe_ns(self, duration_ns: int) -> None:
        # `le` semantics: a value equal to a bound belongs to that bound's bucket.
        self.counts[bisect_left(self.bounds_ns, duration_ns)] += 1
        self.sum_ns += duration_ns

    def snapshot(self) -> HistogramSnapshot:
        counts = self.counts.copy()  # one C-level copy: consistent with itself
        cumulative = list(accumulate(counts))
        exported = self.layout.export(cumulative)
        return HistogramSnapshot(
            tuple(self.bounds[i] for i in exported or ()),
            (*(cumulative[i] for i in exported or ()), cumulative[-1]),
            self.sum_ns / 1e9,
            held_back=exported is None,
        )


class HostPhase:
    """`with phase:` times wall-clock with perf_counter_ns; reused for every step (no allocation per use).

    `_start` is when the phase was entered, 0 once it is left: the pusher thread reads it to say which
    phase a rank is in when it stops stepping.

    Not re-entrant: a `with` of the phase inside one already open (a helper that times "forward" called
    from a loop that does, or a second thread) restarts it, the inner exit observes the inner span and
    leaves the phase, and the outer exit then observes nothing: an exit of a phase that is not open (left
    by the inner one, by `leave()` or `close()`, never entered) observes nothing. Before, that exit
    observed perf_counter_ns() - 0, the machine's uptime (294,301 s of forward for 0.05 s). Counting the
    outer span instead needs a nesting count on both sides of every phase (+15-20 ns of a 240 ns phase,
    measured); this check costs 0-7 ns. Use distinct names to time both.
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
        start = self._start
        if not start:  # not open: nothing to observe
            return
        duration = perf_counter_ns() - start
        self._counts[bisect_left(self._bounds_ns, duration)] += 1  # inlined Histogram.observe_ns
        self._hist.sum_ns += duration
        self._start = 0  # left: the pusher reports the phase a hung rank is in (Tracker.snapshot)

    @property
    def is_open(self) -> bool:
        """Entered and not yet left."""
        return self._start != 0

    # Explicit forms for callbacks whose start and end arrive in different hooks.
    def start(self) -> None:
        self._start = perf_counter_ns()

    def end(self) -> None:
        self.__exit__(None, None, None)

    def leave(self) -> None:
        """Leaves the phase without observing it: a `next()` that ends the loader loaded no batch, and a
        phase left open would name it as where the rank is until the process ends."""
        self._start = 0


class NullPhase:
    """Stands in for phases over the limit, and for those entered outside train: costs nothing and records nothing."""

    __slots__ = ()
    name = ""
    is_open = False

    def __enter__(self) -> NullPhase:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        return None

    def start(self) -> None:
        return None

    def end(self) -> None:
        return None

    def leave(self) -> None:
        return None


NULL_PHASE = NullPhase()

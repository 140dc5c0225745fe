"""A run that went on with another world size: a job killed and requeued with fewer (or more) ranks, an elastic
restart. Its processes state their world size (`world_size` of stepscope_training_info), so the report can say
when the run was resized, from how many ranks to how many, and which ranks ended (or joined) there.

Without it a run of 4 ranks for an hour, requeued with 2 for another, read "4 ranks" in the page's header and
ranks 2-3 "lost", as a crash to look into, shown lost in the Gantt chart for as long as their exporter kept their
groups (its TTL: 10 minutes past the resize), while nothing said the run went on with world size 2 without them.

A world size's stretch is its consecutive points (a gap of more than a step and a half, and of more than
SCRAPE_GAP_SECONDS, ends one); a stretch that begins after the stretch before it, with another world size, is a
resize at its first point: where Prometheus first saw a process of the new size. The old size's ranks that the
exporter keeps after their last push overlap it and start no stretch of their own, nor do they after a failed
scrape of their node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

from stepscope.contract import IDLE_STATE
from stepscope.contract.goodput import LOST
from stepscope.report.prometheus import Series
from stepscope.report.timeline import LOST_SECONDS, Interval

CONTIGUOUS_STEPS = 1.5  # points further apart than this many steps are two stretches (as timeline._runs)
SCRAPE_GAP_SECONDS = 120  # and than this: a node's failed scrapes, not processes of a new size


@dataclass(frozen=True)
class Resize:
    """The run went on with world size `after` from `at`, where it had `before`."""

    at: float
    before: int
    after: int

    @property
    def ended(self) -> range:
        """The ranks of the old size that the new one has not (none where the run grew)."""
        return range(self.after, self.before)

    @property
    def joined(self) -> range:
        """The ranks of the new size that the old one had not (none where the run shrank)."""
        return range(self.before, self.after)

    def ends(self, rank: str) -> bool:
        return rank.isdigit() and int(rank) in self.ended


def resizes(world_sizes: Iterable[Series], step: float) -> list[Resize]:
    """The resizes in time order, from the processes stating each world size over time (one series per size)."""
    stretches = sorted((start, size) for series in world_sizes if (size := _size(series)) is not None
                       for start in _stretch_starts([t for t, _ in series.points], step))
    return [Resize(start, before, after) for (start_before, before), (start, after) in pairwise(stretches)
            if start > start_before and after != before]


def world_sizes(world_sizes: Iterable[Series], found: Sequence[Resize]) -> list[int]:
    """The world sizes the run had, in order: before and after each resize, or the one its processes stated
    (several where they disagreed without a resize: sizes stated together from the start)."""
    if found:
        return [found[0].before, *(resize.after for resize in found)]
    return sorted({size for series in world_sizes if (size := _size(series)) is not None})


def _size(series: Series) -> int | None:
    size = series.labels.get("world_size", "")
    return int(size) if size.isdigit() else None


def _stretch_starts(times: Sequence[float], step: float) -> list[float]:
    ordered = sorted(times)
    gap = max(CONTIGUOUS_STEPS * step, SCRAPE_GAP_SECONDS)
    return [t for index, t in enumerate(ordered) if index == 0 or t - ordered[index - 1] > gap]


def end_at_resizes(intervals: Sequence[Interval], found: Sequence[Resize]) -> list[Interval]:
    """The state intervals with a rank that ended at a resize shown lost up to the resize, not after: the exporter
    keeps its group until its TTL, but from the resize on the run has no such rank."""
    return [replace(interval, end=at) if (at := _cut(interval, found)) is not None else interval
            for interval in intervals]


def _cut(interval: Interval, found: Sequence[Resize]) -> float | None:
    if interval.state != LOST:
        return None
    return next((resize.at for resize in found
                 if resize.ends(interval.rank) and interval.start < resize.at < interval.end), None)


def ended_with_the_job(resize: Resize, intervals: Sequence[Interval]) -> list[Interval]:
    """The `lost` intervals of the ranks that ended at `resize` that began when the old job ended (the last
    push of any rank before the resize, within LOST_SECONDS): a job killed whole and requeued smaller, not a
    rank lost on its own before it (a dead node, which may be why the job was requeued)."""
    before = [interval for interval in intervals if interval.start < resize.at]
    job_end = max((min(interval.end, resize.at) for interval in before if interval.state not in (LOST, IDLE_STATE)),
                  default=None)
    if job_end is None:
        return []
    return [interval for interval in before if interval.state == LOST and resize.ends(interval.rank)
            and job_end - interval.start <= LOST_SECONDS]


def ranks_words(ranks: Iterable[int]) -> str:
    """`rank 2`, `ranks 2-3`, `ranks 2, 5-7`: consecutive ranks as a range."""
    spans: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    words = ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in spans)
    return f"rank {words}" if words.isdigit() else f"ranks {words}"

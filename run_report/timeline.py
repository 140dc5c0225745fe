"""Series over time turned into intervals: each rank's states (the Gantt chart), the run's verdicts,
and the rank that bounded the run in each window (the critical path of a synchronous run).

A point at time t holds what Prometheus knew at t: the last scraped sample. A state seen at t_i..t_j
(consecutive steps) that another state follows at t_j+1 lasted [t_i, t_j+1); before a gap (the
series went stale: exporter down, group expired) it lasted [t_i, t_j + step).

A straggler for part of the run (a rank throttled or sharing its node for an hour, then well again) leaves
its whole-window score near typical: StragglerSpell is each stretch in which a rank's lower score stayed below
the straggler threshold, so the page can say when, for how long and by how much.

A rank that stopped pushing without closing (killed, its node gone) stays in its last state on the exporter
until the group's TTL. As StepscopeRankLost does, a rank whose last push is more than
THRESHOLDS["rank_lost_seconds"] old and that is not idle is `lost`: its last state ends at its last push
and `lost` follows it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from stepscope.contract import IDLE_STATE, THRESHOLDS, TRAIN_STATE
from stepscope.contract.goodput import LOST
from stepscope.contract.verdicts import IDLE as IDLE_VERDICT
from stepscope.report.prometheus import Series
from stepscope.report.window import Window

LOST_SECONDS = THRESHOLDS["rank_lost_seconds"].value
STRAGGLER_SCORE = THRESHOLDS["straggler_score"].value
# A rank below the straggler score this long while training is a straggler for part of the run: as long as
# StepscopeStragglerRank waits before it pages (`for: 10m`), so the page names what would have paged.
SPELL_MIN_SECONDS = 600
# A break without scores (eval, checkpoint: no steps in the 1m rates) shorter than this does not end a spell,
# as the alert holds a rank's scores through such a break (pause_hold_seconds).
SPELL_GAP_SECONDS = THRESHOLDS["pause_hold_seconds"].value
Key = tuple[str, str]  # (rank, node)


@dataclass(frozen=True)
class Interval:
    rank: str
    node: str
    state: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Bound:
    """Which rank bounded the run in the window ending at `time`: the lowest straggler score."""

    time: float
    rank: str
    node: str
    score: float
    kind: str  # step_time or local_phases
    step_time_score: float | None
    local_score: float | None


@dataclass(frozen=True)
class StragglerSpell:
    """A stretch in which one rank's lower straggler score stayed below STRAGGLER_SCORE while training."""

    rank: str
    node: str
    start: float  # its first point below the threshold
    end: float  # a step after its last
    slow_seconds: float  # the points below the threshold times the step: the breaks inside it left out
    score: float  # the median of its lower score over those points
    kind: str  # the score that was lower at most of them: step_time or local_phases
    recovered: bool  # whether it scored at or above the threshold again later in the window


def rank_key(rank: str) -> tuple[int, int, str]:
    """Ranks in numeric order (rank labels are strings), anything else after them."""
    return (0, int(rank), "") if rank.isdigit() else (1, 0, rank)


def state_intervals(state_series: Iterable[Series], window: Window,
                    last_push: Iterable[Series] = ()) -> list[Interval]:
    """Per rank, the intervals of each state, in time order (ranks in numeric order); a lost rank's
    (see the module docstring) end at its last push, followed by `lost`."""
    pushes = {_key(series): dict(series.points) for series in last_push}
    by_rank: dict[Key, dict[float, str]] = {}
    lost_pushes: dict[Key, dict[float, float]] = {}  # per rank, each point seen lost: the last push it saw
    for series in state_series:
        key = _key(series)
        states = by_rank.setdefault(key, {})
        for t, _ in series.points:
            state, push = series.labels.get("state", ""), pushes.get(key, {}).get(t)
            if state != IDLE_STATE and push is not None and t - push > LOST_SECONDS:
                state = LOST
                lost_pushes.setdefault(key, {})[t] = push
            states[t] = state
    intervals = []
    for (rank, node), states in sorted(by_rank.items(), key=lambda item: (rank_key(item[0][0]), item[0][1])):
        runs = [Interval(rank, node, state, start, end) for state, start, end in _runs(states, window)]
        intervals += _lost_from_last_push(runs, lost_pushes.get((rank, node), {}))
    return intervals


def _lost_from_last_push(runs: list[Interval], pushes: Mapping[float, float]) -> list[Interval]:
    """One rank's intervals with each `lost` starting at the last push its first point saw (`pushes`: point ->
    push), not at that point, which saw the push too old: the state before it ends there. Lost only seen after a
    gap keeps its points. Each loss its own: a rank lost twice (a job killed, requeued, killed again) had its
    second loss drawn from its first point, after a minute more of train (at 15 s points; a step more at a long
    window's), as every loss but its first was taken for the first one's push."""
    moved: list[Interval] = []
    for interval in runs:
        push = pushes.get(interval.start) if interval.state == LOST else None
        if push is not None and moved and moved[-1].end == interval.start and moved[-1].start < push:
            moved[-1] = replace(moved[-1], end=min(moved[-1].end, push))
            interval = replace(interval, start=moved[-1].end)
        moved.append(interval)
    return moved


def losses(intervals: Iterable[Interval]) -> list[Interval]:
    """The `lost` interval that begins each loss of a rank (where it last pushed), every loss, in time order: a
    rank lost again after a new process of it pushed (a job killed, requeued, killed again; a node lost later)
    is lost twice. A `lost` interval that continues one of its rank before it (split by a gap) is the same loss."""
    previous: dict[Key, Interval] = {}
    found = []
    for interval in sorted(intervals, key=lambda i: i.start):
        key = (interval.rank, interval.node)
        if interval.state == LOST and (key not in previous or previous[key].state != LOST):
            found.append(interval)
        previous[key] = interval
    return found


def _key(series: Series) -> Key:
    return series.labels.get("rank", ""), series.labels.get("instance", "")


def labelled_intervals(series: Iterable[Series], label: str, window: Window) -> list[tuple[str, float, float]]:
    """(label value, start, end) of a series set where one label's value holds at a time (the verdict)."""
    values: dict[float, str] = {}
    for item in series:
        for t, _ in item.points:
            values[t] = item.labels.get(label, "")
    return _runs(values, window)


def times_in_state(state_series: Iterable[Series], state: str) -> set[float]:
    """The times some rank was in `state` (the pushed state, which the verdict follows only once settled)."""
    return {t for series in state_series if series.labels.get("state") == state for t, _ in series.points}


def training_times(verdicts: Iterable[Series]) -> set[float]:
    """The times the rules judged the run training: its verdict is there (a rank has trained long enough
    to be judged) and is not idle."""
    return {t for series in verdicts if series.labels.get("verdict") != IDLE_VERDICT for t, _ in series.points}


def while_training(scores: Iterable[Series], intervals: Iterable[Interval]) -> list[Series]:
    """Each rank's scores at the times it was in `train` (its intervals, the end's point included: the score there
    is of the minute before), not lost or in another state. A rank killed or lost keeps its last recorded scores
    for the engine's lookback on history without staleness markers: a 16-rank run killed at 09:30 had its slowest
    rank bound the run on the critical path until 09:35 on Prometheus 2.42 (19 points more, every rank lost), to
    09:30:15 on VictoriaMetrics 1.79."""
    training: dict[Key, list[tuple[float, float]]] = {}
    for interval in intervals:
        if interval.state == TRAIN_STATE:
            training.setdefault((interval.rank, interval.node), []).append((interval.start, interval.end))

    def trained(key: Key, t: float) -> bool:
        return any(start <= t <= end for start, end in training.get(key, ()))

    return [Series(series.labels, tuple((t, value) for t, value in series.points if trained(_key(series), t)))
            for series in scores]


def critical_path(step_scores: Iterable[Series], local_scores: Iterable[Series]) -> list[Bound]:
    """At each time both or either score exists, the rank whose lower score is the lowest."""
    scores: dict[float, dict[tuple[str, str], dict[str, float]]] = {}
    for kind, source in (("step_time", step_scores), ("local_phases", local_scores)):
        for series in source:
            key = (series.labels.get("rank", ""), series.labels.get("instance", ""))
            for t, value in series.points:
                if math.isfinite(value):
                    scores.setdefault(t, {}).setdefault(key, {})[kind] = value
    path = []
    for t in sorted(scores):
        (rank, node), kinds = min(scores[t].items(), key=lambda item: (min(item[1].values()), rank_key(item[0][0])))
        kind = min(kinds, key=kinds.__getitem__)
        path.append(Bound(t, rank, node, kinds[kind], kind, kinds.get("step_time"), kinds.get("local_phases")))
    return path


def _runs(values: Mapping[float, str], window: Window) -> list[tuple[str, float, float]]:
    """Maximal runs of equal values over consecutive steps, as (value, start, end)."""
    runs: list[tuple[str, float, float]] = []
    times = sorted(values)
    step = window.step
    for index, t in enumerate(times):
        following = times[index + 1] if index + 1 < len(times) else None
        contiguous = following is not None and following - t <= step * 1.5
        if runs and runs[-1][0] == values[t] and abs(runs[-1][2] - t) < 1e-6:
            runs[-1] = (values[t], runs[-1][1], following if contiguous else min(t + step, window.end))
        else:
            runs.append((values[t], t, following if contiguous else min(t + step, window.end)))
    return [(value, start, end) for value, start, end in runs if end > start]


def straggler_spells(step_scores: Iterable[Series], local_scores: Iterable[Series], training: set[float],
                     step: float) -> list[StragglerSpell]:
    """Each rank's stretches below STRAGGLER_SCORE at the `training` times of at least SPELL_MIN_SECONDS and two
    points, in time order: a point at or above the threshold, or a break without scores over SPELL_GAP_SECONDS (or
    over a step and a half, at a resolution coarser than that), ends one. At the resolution of a 12-day window
    (900 s) each point is one sample of a 1m score: one below the threshold is a minute, not a spell."""
    lowest: dict[Key, dict[float, tuple[float, str]]] = {}
    for kind, source in (("step_time", step_scores), ("local_phases", local_scores)):
        for series in source:
            at = lowest.setdefault(_key(series), {})
            for t, value in series.points:
                if t in training and math.isfinite(value) and (t not in at or value < at[t][0]):
                    at[t] = (value, kind)
    spells = [spell for key, scores in lowest.items() for spell in _spells(key, scores, step)
              if spell.slow_seconds >= SPELL_MIN_SECONDS and spell.slow_seconds > step]
    return sorted(spells, key=lambda spell: (spell.start, rank_key(spell.rank)))


def _spells(key: Key, scores: Mapping[float, tuple[float, str]], step: float) -> list[StragglerSpell]:
    """One rank's stretches below the threshold (straggler_spells), whatever their length."""
    stretches: list[list[float]] = []
    for t in sorted(scores):
        if scores[t][0] >= STRAGGLER_SCORE:
            stretches.append([])
        elif stretches and stretches[-1] and t - stretches[-1][-1] <= max(SPELL_GAP_SECONDS, 1.5 * step):
            stretches[-1].append(t)
        else:
            stretches.append([t])
    spells = []
    for times in filter(None, stretches):
        kinds = [scores[t][1] for t in times]
        spells.append(StragglerSpell(
            rank=key[0], node=key[1], start=times[0], end=times[-1] + step, slow_seconds=len(times) * step,
            score=statistics.median(scores[t][0] for t in times), kind=max(set(kinds), key=kinds.count),
            recovered=any(scores[t][0] >= STRAGGLER_SCORE for t in scores if t > times[-1])))
    return spells

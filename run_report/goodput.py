"""Where a run's GPU-hours went over the report's window: goodput, badput by cause, and energy.

Each rank (its global rank, whichever processes and nodes it ran as) held its GPUs from its first push to
its last in the window. Its hooks count the seconds of each state (stepscope_state_seconds_total: exact
counters) and, inside train, the seconds waiting for the next batch (dataloader_next); the rules record
each stall (in train, no step for longer than the pace explains) with its length so far. What no process
of the rank accounted for inside its span is a restart gap: a process lost, the next not yet pushing
under the same run name. Where the loop passes its global step, the steps a restored run does again are
lost progress (their productive seconds). Productive = train - stalled - data wait - lost progress; each
cause is a share of the ranks' held seconds together, so the shares add up to 1 (docs/goodput.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise

from stepscope.contract import TRAIN_STATE
from stepscope.contract.goodput import (
    DATA_WAIT,
    JOULES_PER_KWH,
    LOST_PROGRESS,
    PRODUCTIVE,
    REPORT_CAUSES,
    RESTART_GAP,
    STALLED,
    STATE_CAUSES,
)
from stepscope.report.prometheus import Series
from stepscope.report.timeline import rank_key

HEADLINE_CAUSES = 4  # badput causes the headline names, the largest first
CSV_HEADER = ("rank", "held_seconds", *(f"{cause}_seconds" for cause in REPORT_CAUSES), "goodput_ratio",
              "energy_joules", "energy_kwh", "joules_per_sample", "joules_per_token")


@dataclass(frozen=True)
class RankTime:
    """One rank's seconds by cause over the window (REPORT_CAUSES)."""

    rank: str
    seconds: Mapping[str, float]

    @property
    def held(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float | None:
        return self.seconds[PRODUCTIVE] / self.held if self.held > 0 else None


@dataclass(frozen=True)
class Goodput:
    ranks: list[RankTime]
    energy_joules: float | None  # the run's share of its GPUs' energy over the window; None without GPUs
    samples: float
    tokens: float = 0.0  # where the run counts them (docs/mfu.md)

    @property
    def seconds(self) -> dict[str, float]:
        """Rank-seconds by cause, over every rank."""
        return {cause: sum(rank.seconds[cause] for rank in self.ranks) for cause in REPORT_CAUSES}

    @property
    def held(self) -> float:
        return sum(rank.held for rank in self.ranks)

    def share(self, cause: str) -> float | None:
        return self.seconds[cause] / self.held if self.held > 0 else None

    @property
    def goodput(self) -> float | None:
        return self.share(PRODUCTIVE)

    @property
    def kwh(self) -> float | None:
        return self.energy_joules / JOULES_PER_KWH if self.energy_joules is not None else None

    @property
    def joules_per_sample(self) -> float | None:
        return self.energy_joules / self.samples if self.energy_joules is not None and self.samples > 0 else None

    @property
    def joules_per_token(self) -> float | None:
        return self.energy_joules / self.tokens if self.energy_joules is not None and self.tokens > 0 else None

    def headline(self) -> str:
        """"goodput 71%: 18% data wait, 7% checkpoint": the badput causes of at least 0.5%, the largest first."""
        if self.goodput is None:
            return "goodput: no rank of the run held its GPUs in this window"
        badput = sorted(((self.share(cause) or 0.0, cause) for cause in REPORT_CAUSES if cause != PRODUCTIVE),
                        reverse=True)
        named = [f"{share:.0%} {cause.replace('_', ' ')}" for share, cause in badput[:HEADLINE_CAUSES]
                 if share >= 0.005]
        return f"goodput {self.goodput:.0%}" + (f": {', '.join(named)}" if named else "")

    def csv_rows(self) -> list[list[object]]:
        """One row per rank, then the run's (rank "all", with its energy)."""
        def row(rank: str, seconds: Mapping[str, float], held: float, good: float | None) -> list[object]:
            return [rank, held, *(seconds[cause] for cause in REPORT_CAUSES), good]

        rows = [[*row(r.rank, r.seconds, r.held, r.goodput), None, None, None, None] for r in self.ranks]
        return [*rows, [*row("all", self.seconds, self.held, self.goodput), self.energy_joules, self.kwh,
                        self.joules_per_sample, self.joules_per_token]]


def account(totals: Mapping[str, list[Series]], stalls: Iterable[Series],
            global_steps: tuple[Iterable[Series], Iterable[Series]], step: float, samples: float,
            window_start: float) -> Goodput:
    """The window's accounting from the report's totals (state, loading and step counts through restarts,
    first and last push per rank and node, energy), the stall series, and the global step and the one each
    process started from over time, at resolution `step`.

    A rank's span starts at its first Tracker's start or at `window_start`, whichever is later: its seconds by
    state count inside the window only. Before, a window inside a run (--from 14 h into a 3-day run of 16 ranks
    with two restarts) held each rank from its process's start, 201,600 s in a 151,200 s window, and called the
    50,400 s before the window restart gap: goodput 71% for 94%."""
    first = {rank: max(start, window_start) for rank, start in _per_rank(totals["first_push"], min).items()}
    last = _per_rank(totals["last_push"], max)
    stalled = _stalled_seconds(stalls, step)
    redone = _redone_steps(*global_steps)
    steps = _per_rank(totals.get("goodput_steps", []), sum)
    states: dict[str, dict[str, float]] = {}
    for series in totals["goodput_states"]:
        into = states.setdefault(series.labels.get("rank", ""), {})
        state = series.labels.get("state", "")
        into[state] = into.get(state, 0.0) + series.last
    loading = _per_rank(totals["goodput_loading"], sum)
    times = [_rank_time(rank, states[rank], loading.get(rank, 0.0), stalled.get(rank, 0.0),
                        last.get(rank, 0.0) - first.get(rank, 0.0), (redone.get(rank, 0.0), steps.get(rank, 0.0)))
             for rank in sorted(states, key=rank_key)]
    energy = totals["energy_joules"]
    tokens = sum(series.last for series in totals["goodput_tokens"])
    return Goodput(times, energy[0].last if energy else None, samples, tokens)


def _rank_time(rank: str, states: Mapping[str, float], loading: float, stalled: float, span: float,
               redone: tuple[float, float]) -> RankTime:
    """`redone`: (steps done again after restores, steps done in the window); the productive time of the
    redone ones, at the rank's productive seconds per step, is lost progress."""
    train = states.get(TRAIN_STATE, 0.0)
    stalled = min(stalled, train)
    data_wait = min(loading, train - stalled)  # a stall inside dataloader_next that ended counts once
    productive = train - stalled - data_wait
    again, done = redone
    lost = min(productive, again * productive / done) if done > 0 else 0.0
    seconds = {PRODUCTIVE: productive - lost, DATA_WAIT: data_wait, STALLED: stalled, LOST_PROGRESS: lost,
               **{state: states.get(state, 0.0) for state in STATE_CAUSES}}
    seconds[RESTART_GAP] = max(0.0, span - sum(seconds.values()))
    return RankTime(rank, seconds)


def _per_rank(results: list[Series], pick: Callable[[list[float]], float]) -> dict[str, float]:
    """One value per global rank over its nodes: the earliest first push, the latest last push, the sum."""
    found: dict[str, list[float]] = {}
    for series in results:
        found.setdefault(series.labels.get("rank", ""), []).append(series.last)
    return {rank: pick(values) for rank, values in found.items()}


def _redone_steps(global_steps: Iterable[Series], bases: Iterable[Series]) -> dict[str, float]:
    """Steps each rank did again: where a new process takes over or a process restores a checkpoint (its own
    step count, global step less base, starts again), the steps between where it was and where the new count
    started from (its base: where its steps count from as pushed, or its global step less its own steps, exact
    whenever it was first scraped). Restored from a checkpoint, that is
    the steps since the checkpoint; started from scratch, all of them. A rank that came back on another
    node has a series of its own: the series are taken in the order they began. The rules record only the
    restore a run is catching up from (run:stepscope_steps_redone:last_restore); this count, exact over the
    whole window and every restore in it, stays the report's (docs/goodput.md)."""
    base_at = {(_key(series), t): value for series in bases for t, value in series.points}
    by_rank: dict[str, list[Series]] = {}
    for series in global_steps:
        by_rank.setdefault(series.labels.get("rank", ""), []).append(series)
    redone: dict[str, float] = {}
    for rank, found in by_rank.items():
        points = [(value, base_at[(_key(series), t)]) for series in sorted(found, key=lambda s: s.points[0][0])
                  for t, value in series.points if (_key(series), t) in base_at]
        # a new process or a restore: its own step count (global step less base) starts again below the one before's
        redone[rank] = sum(max(0.0, reached - base) for (reached, before), (step, base) in pairwise(points)
                           if step - base < reached - before)
    return redone


def _key(series: Series) -> tuple[str, str]:
    return series.labels.get("rank", ""), series.labels.get("instance", "")


def _stalled_seconds(stalls: Iterable[Series], step: float) -> dict[str, float]:
    """Seconds stalled per rank: each stall's last recorded length (a stall ends where its series pauses
    for more than a step and a half, or where its length drops: a new stall)."""
    total: dict[str, float] = {}
    for series in stalls:
        episodes: list[float] = []
        previous: tuple[float, float] | None = None
        for t, value in series.points:
            if previous is None or t - previous[0] > 1.5 * step or value < previous[1]:
                episodes.append(value)
            else:
                episodes[-1] = value
            previous = (t, value)
        rank = series.labels.get("rank", "")
        total[rank] = total.get(rank, 0.0) + sum(episodes)
    return total

"""The run's numbers over the window: per rank, per node and for the run, from the fetched totals.

Definitions follow the recording rules, applied to the whole window instead of one minute: mean step
time = step seconds / steps timed; a phase's share = its seconds / step seconds; the straggler scores
= the run's typical value over the rank's (the median rank's; of two ranks the faster one's, as the median
of two is their mean), of mean step time and of the seconds per step in `dataloader_next` + `to_device` +
`forward` (1 typical, below 0.75 a straggler).

A process's first step far slower than its rank's steady steps (torch.compile, cudnn benchmark, a loader's workers
starting: WARM_UP_FACTOR times its steady mean or more) is a warm-up, left out of the step time, phase shares,
scores and sample rates with every step Prometheus had seen by its first scrape of the process's steps (the first
process's, and each one's that restarted in the window: a requeued job compiles again), as
Lightning's ThroughputMonitor and the profiler's warm-up leave the first steps out: on a short run an 88 s
first step read a 25 ms loop's mean 40 ms and its training rate 869 samples/s for 1,290, passing the I/O check
of a loader-limited loop. Counts (steps, samples), quantiles and time per state stay whole.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from stepscope.contract import DATA_LOADING_PHASE, LOCAL_PHASES, STANDARD_PHASES, TRAIN_STATE
from stepscope.report.collect import RunData
from stepscope.report.prometheus import Series
from stepscope.report.timeline import STRAGGLER_SCORE, rank_key

WARM_UP_FACTOR = 10  # a first step this many times the steady mean step or more is a warm-up


@dataclass(frozen=True)
class CudaMemory:
    """PyTorch's caching allocator of a rank over the window (pushed on CUDA only)."""

    peak_bytes: float  # the most allocated to tensors at once
    reserved_bytes: float  # the most the allocator held from the GPU
    alloc_retries: float  # allocations that flushed the cache and retried
    ooms: float


@dataclass(frozen=True)
class WarmUp:
    """What the report leaves out of a rank's step time, shares and rates: a process's first step and the steps up
    to Prometheus's first scrape of them (one scrape's worth: the first is all the scrape can tell apart)."""

    first_step_seconds: float  # the first step: the first scrape's step seconds less its other steps at the mean
    steps: float  # steps timed by the first scrape, the first one included
    samples: float  # their samples
    after_restart: bool = False  # a process that restarted in the window (not the rank's first)


@dataclass(frozen=True)
class RankSummary:
    rank: str
    node: str
    local_rank: str
    pids: str
    steps: float
    samples: float
    # The timed steps' seconds and count (the histogram's _sum and _count), without a warm-up (`warm_up`):
    # what the mean, the shares and the scores read. The first step of a process in setup is not timed.
    step_seconds: float
    steps_timed: float
    p50: float | None
    p95: float | None
    phase_seconds: Mapping[str, float]
    step_time_score: float | None = None
    local_score: float | None = None
    # Seconds in each state over the window, as the hooks count them (stepscope_state_seconds_total): every
    # eval and checkpoint is in, however short; the state timeline only samples the state at each push.
    state_seconds: Mapping[str, float] = field(default_factory=dict)
    cuda: CudaMemory | None = None  # None where the rank pushed no allocator memory (the CPU)
    # left out of step_seconds, steps_timed and phase_seconds, in time order: one per process that warmed up
    warm_ups: tuple[WarmUp, ...] = ()

    @property
    def mean(self) -> float | None:
        return self.step_seconds / self.steps_timed if self.steps_timed > 0 else None

    @property
    def rate_samples(self) -> float:
        """The samples of the steps in step_seconds: the rates' numerator."""
        return self.samples - sum(warm_up.samples for warm_up in self.warm_ups)

    @property
    def first_step_seconds(self) -> float | None:
        """The longest warm-up first step left out (a restarted rank may have one per process), None where none
        was: rank_summary.csv's first_step_seconds."""
        return max((warm_up.first_step_seconds for warm_up in self.warm_ups), default=None)

    @property
    def train_time_share(self) -> float | None:
        """The share of the rank's time in the window spent training (not setup, eval, checkpoint, idle)."""
        total = sum(self.state_seconds.values())
        return self.state_seconds.get(TRAIN_STATE, 0.0) / total if total > 0 else None

    def share(self, phase: str) -> float | None:
        return self.phase_seconds.get(phase, 0.0) / self.step_seconds if self.step_seconds > 0 else None

    @property
    def untimed_share(self) -> float | None:
        """Step time in no phase (the loop's own code between phases)."""
        if self.step_seconds <= 0:
            return None
        return max(0.0, 1 - sum(self.phase_seconds.values()) / self.step_seconds)

    @property
    def lowest_score(self) -> float | None:
        scores = [score for score in (self.step_time_score, self.local_score) if score is not None]
        return min(scores, default=None)

    @property
    def local_seconds(self) -> float | None:
        """Seconds per step before the first collective; None when none of those phases is timed."""
        if self.steps_timed <= 0 or not any(phase in self.phase_seconds for phase in LOCAL_PHASES):
            return None
        return sum(self.phase_seconds.get(phase, 0.0) for phase in LOCAL_PHASES) / self.steps_timed


@dataclass(frozen=True)
class NodeSummary:
    node: str
    ranks: int
    steps: float
    samples: float
    mean: float | None  # mean step time over the node's ranks
    fastest_rank_mean: float | None
    slowest_rank_mean: float | None

    @property
    def skew(self) -> float | None:
        """Slowest rank's mean step time over the fastest's (1 = even)."""
        if not self.fastest_rank_mean or self.slowest_rank_mean is None:
            return None
        return self.slowest_rank_mean / self.fastest_rank_mean


@dataclass(frozen=True)
class RunTotals:
    steps: float
    samples: float
    step_seconds: float
    steps_timed: float
    phase_seconds: Mapping[str, float]
    p50: float | None
    p95: float | None
    phases: tuple[str, ...] = field(default=())  # in the order a step runs them
    ranks: int = 1  # whose counts the totals add up
    rate_samples: float | None = None  # the samples of the steps in step_seconds (None: all of them)
    first_step_seconds: float | None = None  # the longest warm-up first step left out, None where none was

    @property
    def mean(self) -> float | None:
        return self.step_seconds / self.steps_timed if self.steps_timed > 0 else None

    @property
    def dataloader_share(self) -> float | None:
        if DATA_LOADING_PHASE not in self.phase_seconds or self.step_seconds <= 0:
            return None
        return min(1.0, self.phase_seconds[DATA_LOADING_PHASE] / self.step_seconds)

    @property
    def io_samples_per_second(self) -> float | None:
        """Samples over the seconds spent waiting in `dataloader_next`: the rate loading keeps up with, the run's
        (its ranks load side by side: the seconds are a rank's, on average; summed over the ranks, the rate read
        1/N of the run's, beside a dashboard's throughput of the whole run)."""
        loading = self.phase_seconds.get(DATA_LOADING_PHASE)
        return self._rate_samples / (loading / self.ranks) if loading else None

    @property
    def training_samples_per_second(self) -> float | None:
        """Samples over the rest of the step time: the rate training consumes them at, the run's (as above)."""
        loading = self.phase_seconds.get(DATA_LOADING_PHASE)
        if loading is None or self.step_seconds - loading <= 0:
            return None
        return self._rate_samples / ((self.step_seconds - loading) / self.ranks)

    @property
    def _rate_samples(self) -> float:
        return self.samples if self.rate_samples is None else self.rate_samples


def rank_summaries(data: RunData) -> list[RankSummary]:
    totals = data.totals
    info = _info(totals["info"])
    phases: dict[tuple[str, str], dict[str, float]] = {}
    for series in totals["phase_seconds"]:
        phases.setdefault(_key(series), {})[series.labels.get("phase", "")] = series.last
    states: dict[tuple[str, str], dict[str, float]] = {}
    for series in totals["state_seconds"]:
        states.setdefault(_key(series), {})[series.labels.get("state", "")] = series.last
    values = {name: _by_rank(totals[name]) for name in ("steps", "samples", "step_seconds", "step_count",
                                                         "p50", "p95")}
    keys = sorted(set(values["steps"]) | set(info), key=lambda key: (rank_key(key[0]), key[1]))
    ranks = [
        RankSummary(
            rank=rank, node=node,
            local_rank=info.get((rank, node), ("", ""))[0], pids=info.get((rank, node), ("", ""))[1],
            steps=values["steps"].get((rank, node), 0.0), samples=values["samples"].get((rank, node), 0.0),
            step_seconds=values["step_seconds"].get((rank, node), 0.0),
            steps_timed=values["step_count"].get((rank, node), 0.0),
            p50=_finite(values["p50"].get((rank, node))), p95=_finite(values["p95"].get((rank, node))),
            phase_seconds=phases.get((rank, node), {}), state_seconds=states.get((rank, node), {}),
            cuda=_cuda_memory(totals, (rank, node)),
        )
        for rank, node in keys
    ]
    first = _first_scrapes(totals)
    return _with_scores([_without_warm_ups(rank, first[key]) if (key := (rank.rank, rank.node)) in first else rank
                         for rank in ranks])


def run_totals(data: RunData, ranks: list[RankSummary]) -> RunTotals:
    phase_seconds: dict[str, float] = {}
    for rank in ranks:
        for phase, seconds in rank.phase_seconds.items():
            phase_seconds[phase] = phase_seconds.get(phase, 0.0) + seconds
    return RunTotals(
        steps=sum(rank.steps for rank in ranks),
        samples=sum(rank.samples for rank in ranks),
        step_seconds=sum(rank.step_seconds for rank in ranks),
        steps_timed=sum(rank.steps_timed for rank in ranks),
        phase_seconds=phase_seconds,
        p50=_finite(_only(data.totals.get("run_p50", []))),  # none asked where no bound is every rank's
        p95=_finite(_only(data.totals.get("run_p95", []))),
        phases=phase_order(phase_seconds),
        ranks=max(1, len(ranks)),
        rate_samples=sum(rank.rate_samples for rank in ranks),
        first_step_seconds=max((rank.first_step_seconds for rank in ranks if rank.warm_ups), default=None),
    )


@dataclass(frozen=True)
class _FirstScrape:
    """A process's counts at Prometheus's first scrape of its steps (queries._first_scrape)."""

    step_seconds: float
    steps_timed: float
    samples: float
    phase_seconds: Mapping[str, float]
    after_restart: bool


def _first_scrapes(totals: Mapping[str, list[Series]]) -> dict[tuple[str, str], list[_FirstScrape]]:
    """Per rank, its processes' first scrapes in the window in time order: each that follows a restart, and the
    first of a rank whose step histogram was born in the window (any other first point is the window's start).
    The counts at the first points are asked only where there are some (collect.at_first_points): none, none."""
    def points(name: str) -> dict[tuple[str, str], dict[float, float]]:
        found: dict[tuple[str, str], dict[float, float]] = {}
        for series in totals.get(name, ()):
            found.setdefault(_key(series), {}).update(series.points)
        return found

    counts, seconds, samples = (points(name) for name in ("first_step_count", "first_step_seconds", "first_samples"))
    restarts = points("first_restarts")
    born = {_key(series) for series in totals["step_histogram_born"]}
    phases: dict[tuple[str, str], dict[float, dict[str, float]]] = {}
    for series in totals.get("first_phase_seconds", ()):
        at = phases.setdefault(_key(series), {})
        for when, value in series.points:
            at.setdefault(when, {})[series.labels.get("phase", "")] = value
    scrapes: dict[tuple[str, str], list[_FirstScrape]] = {}
    for key, by_time in counts.items():
        for index, when in enumerate(sorted(by_time)):
            after_restart = index > 0 or when in restarts.get(key, {})
            if (after_restart or key in born) and when in seconds.get(key, {}):
                scrapes.setdefault(key, []).append(_FirstScrape(
                    seconds[key][when], by_time[when], samples.get(key, {}).get(when, 0.0),
                    phases.get(key, {}).get(when, {}), after_restart))
    return scrapes


def _without_warm_ups(rank: RankSummary, firsts: list[_FirstScrape]) -> RankSummary:
    """The rank without the steps of each first scrape whose first step is a warm-up (WARM_UP_FACTOR times the
    steady mean, the rank's steps after every first scrape); as it was when none is, or when no step came after
    them (nothing steady to compare with)."""
    steady_steps = rank.steps_timed - sum(first.steps_timed for first in firsts)
    if steady_steps <= 0:
        return rank
    steady_mean = (rank.step_seconds - sum(first.step_seconds for first in firsts)) / steady_steps
    if steady_mean <= 0:
        return rank
    warm = [(first, first.step_seconds - (first.steps_timed - 1) * steady_mean) for first in firsts]
    warm = [(first, seconds) for first, seconds in warm if seconds >= WARM_UP_FACTOR * steady_mean]
    if not warm:
        return rank
    return dataclasses.replace(
        rank, step_seconds=rank.step_seconds - sum(first.step_seconds for first, _ in warm),
        steps_timed=rank.steps_timed - sum(first.steps_timed for first, _ in warm),
        phase_seconds={phase: max(0.0, seconds - sum(first.phase_seconds.get(phase, 0.0) for first, _ in warm))
                       for phase, seconds in rank.phase_seconds.items()},
        warm_ups=tuple(WarmUp(seconds, first.steps_timed, first.samples, first.after_restart)
                       for first, seconds in warm),
    )


def node_summaries(ranks: list[RankSummary]) -> list[NodeSummary]:
    nodes = []
    for node in sorted({rank.node for rank in ranks}):
        on_node = [rank for rank in ranks if rank.node == node]
        means = [rank.mean for rank in on_node if rank.mean is not None]
        timed = sum(rank.steps_timed for rank in on_node)
        nodes.append(NodeSummary(
            node=node, ranks=len({rank.rank for rank in on_node}),
            steps=sum(rank.steps for rank in on_node), samples=sum(rank.samples for rank in on_node),
            mean=sum(rank.step_seconds for rank in on_node) / timed if timed > 0 else None,
            fastest_rank_mean=min(means, default=None), slowest_rank_mean=max(means, default=None),
        ))
    return nodes


def phase_order(phases: Iterable[str]) -> tuple[str, ...]:
    """Standard phases in the order a step runs them, then the user's own in name order."""
    found = set(phases)
    standard = [phase for phase in STANDARD_PHASES if phase in found]
    return (*standard, *sorted(found - set(standard)))


def stragglers(ranks: list[RankSummary]) -> list[RankSummary]:
    """Ranks with either score below the rules' threshold (runs of at least two ranks)."""
    if len(ranks) < 2:
        return []
    return [rank for rank in ranks if rank.lowest_score is not None and rank.lowest_score < STRAGGLER_SCORE]


def _with_scores(ranks: list[RankSummary]) -> list[RankSummary]:
    """Both straggler scores: the run's typical value over the rank's (as the rules, over the window)."""
    typical_mean = _typical([rank.mean for rank in ranks if rank.mean is not None])
    typical_local = _typical([rank.local_seconds for rank in ranks if rank.local_seconds])
    return [
        dataclasses.replace(
            rank,
            step_time_score=typical_mean / rank.mean if typical_mean is not None and rank.mean else None,
            local_score=typical_local / rank.local_seconds if typical_local and rank.local_seconds else None,
        )
        for rank in ranks
    ]


def _typical(values: list[float]) -> float | None:
    """The median, but of two values the smaller: the median of two is their mean, against which the slower
    of two ranks scores 0.75 only when 2x slower than the other (1.33x among three or more)."""
    if not values:
        return None
    return min(values) if len(values) == 2 else statistics.median(values)


def _key(series: Series) -> tuple[str, str]:
    return series.labels.get("rank", ""), series.labels.get("instance", "")


def _cuda_memory(totals: Mapping[str, list[Series]], key: tuple[str, str]) -> CudaMemory | None:
    values = [_by_rank(totals[name]).get(key) for name in ("cuda_peak", "cuda_reserved", "cuda_retries", "cuda_ooms")]
    return None if values[0] is None else CudaMemory(*(value or 0.0 for value in values))


def _by_rank(results: list[Series]) -> dict[tuple[str, str], float]:
    return {_key(series): series.last for series in results}


@dataclass(frozen=True)
class MissingRanks:
    """Ranks below the world size the run's processes state that never reported in the window."""

    world_size: int
    count: int
    first: tuple[int, ...]  # the lowest MISSING_SHOWN of them

    @property
    def words(self) -> str:
        """`world size 3: rank 1 never reported`, `world size 64: 12 ranks never reported (8, 9, ... and 7 more)`."""
        if self.count == 1:
            return f"world size {self.world_size}: rank {self.first[0]} never reported"
        more = f" and {self.count - len(self.first)} more" if self.count > len(self.first) else ""
        return (f"world size {self.world_size}: {self.count} ranks never reported "
                f"({', '.join(str(rank) for rank in self.first)}{more})")


MISSING_SHOWN = 5


def missing_ranks(data: RunData) -> MissingRanks | None:
    """The ranks the largest `world_size` of stepscope_training_info promises and no process of the window
    reported (a node whose exporter this Prometheus does not scrape, a rank that died before its first push),
    None when every one did. The totals, the verdict and the scores stand for the ranks seen only. The
    ranks are counted, not listed: a world size of millions costs no more than one of eight."""
    sizes = [int(size) for series in data.totals["info"] if (size := series.labels.get("world_size", "")).isdigit()]
    world_size = max(sizes, default=0)
    seen = {int(rank) for series in data.totals["info"] if (rank := series.labels.get("rank", "")).isdigit()
            and int(rank) < world_size}
    if len(seen) >= world_size:
        return None
    first = tuple(itertools.islice((rank for rank in range(world_size) if rank not in seen), MISSING_SHOWN))
    return MissingRanks(world_size, world_size - len(seen), first)


def _info(results: list[Series]) -> dict[tuple[str, str], tuple[str, str]]:
    """(local rank, pids) per rank; a rank restarted under a new pid lists every pid it had."""
    info: dict[tuple[str, str], tuple[set[str], set[str]]] = {}
    for series in results:
        local_ranks, pids = info.setdefault(_key(series), (set(), set()))
        local_ranks.add(series.labels.get("local_rank", ""))
        pids.add(series.labels.get("pid", ""))
    return {key: (" ".join(sorted(lr)), " ".join(sorted(p, key=lambda pid: (len(pid), pid))))
            for key, (lr, p) in info.items()}


def _only(results: list[Series]) -> float | None:
    return results[0].last if results else None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None

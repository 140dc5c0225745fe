"""Many ranks of one run pushing what the hooks render, each push a second more of ~60 ms steps: the scale a
dashboard has to stay readable at (64 ranks here, 512 in a large job), without 64 training processes."""

import random
from dataclasses import dataclass, field

import requests

from stepscope.contract import DATA_LOADING_PHASE
from stepscope.hooks.config import log_buckets
from stepscope.hooks.render import Snapshot, render
from stepscope.hooks.timing import Histogram

BOUNDS = log_buckets(1e-3, 10.0, 24)
STEP_SECONDS = 0.06
# Seconds per step of each phase of a typical rank; backward takes the rest of its step (the all-reduce's wait).
PHASE_SECONDS = {DATA_LOADING_PHASE: 0.002, "to_device": 0.002, "forward": 0.018, "optimizer_step": 0.006}
STEPS_PER_PUSH = 5
SAMPLES_PER_STEP = 32


@dataclass
class PushingRank:
    """One rank's cumulative histograms and counters. `step_seconds`: its mean step time (a rank that steps on its
    own, slower); `loader_seconds`: its wait for data per step (under DDP a slow loader, the step time unchanged);
    not `stepping`: it pushes but never completes a step (hung before its first)."""

    run: str
    rank: int
    world_size: int
    step_seconds: float = STEP_SECONDS
    loader_seconds: float = PHASE_SECONDS[DATA_LOADING_PHASE]
    stepping: bool = True
    steps: int = 0
    step: Histogram = field(default_factory=lambda: Histogram(BOUNDS))
    phases: dict[str, Histogram] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.rank)
        self.phases = {phase: Histogram(BOUNDS) for phase in (*PHASE_SECONDS, "backward")}

    def advance(self) -> None:
        """STEPS_PER_PUSH more steps, each a few per cent off its mean."""
        for _ in range(STEPS_PER_PUSH if self.stepping else 0):
            noise = self.rng.lognormvariate(0, 0.05)
            seconds = {**PHASE_SECONDS, DATA_LOADING_PHASE: self.loader_seconds}
            seconds["backward"] = max(self.step_seconds - sum(seconds.values()), 0.001)
            self.step.observe_ns(round(self.step_seconds * noise * 1e9))
            for phase, hist in self.phases.items():
                hist.observe_ns(round(seconds[phase] * noise * 1e9))
            self.steps += 1

    def body(self) -> str:
        snapshot = Snapshot(
            phases=[(phase, "host", hist.snapshot()) for phase, hist in self.phases.items()],
            step=self.step.snapshot(), steps=self.steps, samples=SAMPLES_PER_STEP * self.steps, state="train",
            info={"local_rank": str(self.rank % 8), "world_size": str(self.world_size), "pid": str(100_000 + self.rank),
                  "framework": "torch"},
        )
        return render(snapshot)


def ranks_of(run: str, world_size: int, slow_step: int, slow_loader: int, hung: int) -> list[PushingRank]:
    """A run's ranks: `slow_step` steps 1.5x slower, `slow_loader` waits 15x longer for its data (a local-phase
    straggler), `hung` never steps, the others alike."""
    return [PushingRank(run, rank, world_size,
                        step_seconds=STEP_SECONDS * (1.5 if rank == slow_step else 1),
                        loader_seconds=PHASE_SECONDS[DATA_LOADING_PHASE] * (15 if rank == slow_loader else 1),
                        stepping=rank != hung)
            for rank in range(world_size)]


def push_round(exporter_url: str, ranks: list[PushingRank]) -> None:
    """Every rank takes a few steps and pushes its cumulative state."""
    with requests.Session() as session:
        for rank in ranks:
            rank.advance()
            url = f"{exporter_url}/metrics/job/stepscope/run/{rank.run}/rank/{rank.rank}"
            session.put(url, data=rank.body().encode(), timeout=10).raise_for_status()

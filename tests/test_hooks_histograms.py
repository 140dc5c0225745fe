"""Buckets that follow the run, per-phase buckets behind their switch, and the first step meaning train."""

import itertools
import random
import subprocess
from bisect import bisect_left

import pytest

import stepscope.hooks as th
import stepscope.hooks.timing
from stepscope.hooks.config import Config
from stepscope.hooks.timing import (
    BLOCK,
    EVICT_IDLE_SECONDS,
    FINE_GRID,
    MAX_EXPORTED,
    SKELETON,
    Histogram,
    HistogramSnapshot,
)
from stepscope_testkit.processes import sample_values, samples


def tracker(**kwargs) -> th.Tracker:
    return th.init(run="unit", push_url="", handle_sigterm=False, **kwargs)


def observe(hist: Histogram, seconds: list[float]) -> None:
    for value in seconds:
        hist.observe_ns(round(value * 1e9))


def around(rng: random.Random, centre: float, n: int, jitter: float = 0.02) -> list[float]:
    return [centre * (1 + jitter * rng.gauss(0, 1)) for _ in range(n)]


def exact_cumulative(values: list[float], bound: float) -> int:
    return sum(1 for v in values if round(v * 1e9) <= round(bound * 1e9))


def fine_bounds(snap: HistogramSnapshot) -> set[float]:
    return set(snap.bounds) - {FINE_GRID[i] for i in SKELETON}


def test_fine_grid_is_2_to_the_eighth_apart_from_a_microsecond_to_two_minutes() -> None:
    assert FINE_GRID[0] < 1e-6 and FINE_GRID[-1] > 120
    ratios = [b / a for a, b in itertools.pairwise(FINE_GRID)]
    assert all(1.089 < r < 1.092 for r in ratios)  # 2^(1/8) = 1.0905: p95 off by <= 8.6% in one bin
    assert all(float(f"{b:.4g}") == b for b in FINE_GRID)  # readable `le`
    assert [FINE_GRID[i] for i in SKELETON][:5] == [1.563e-05, 6.25e-05, 0.00025, 0.001, 0.004]
    assert all(SKELETON[i + 1] - SKELETON[i] == 16 for i in range(len(SKELETON) - 1))  # every 2nd octave


def test_a_histogram_is_held_back_until_its_first_step_then_all_its_buckets_start_together() -> None:
    """Every bucket series of a histogram starts in one push: rates over a window add up from then on."""
    hist = Histogram.following()
    assert hist.snapshot().held_back, "nothing to export before the first observation"
    observe(hist, around(random.Random(1), 0.024, 3))
    first = hist.snapshot()
    assert not first.held_back
    assert {FINE_GRID[i] for i in SKELETON} < set(first.bounds)
    assert min(fine_bounds(first)) < 0.024 < max(fine_bounds(first)), "the first steps already have fine buckets"
    observe(hist, around(random.Random(2), 0.024, 50))
    assert hist.snapshot().bounds == first.bounds, "steps where the buckets are add nothing"
    observe(hist, [0.1])
    slow = [b for b in fine_bounds(hist.snapshot()) if b > 0.05]
    assert slow and min(slow) < 0.1 < max(slow), "one slow step places a block at the next snapshot"


def test_fine_windows_follow_the_steps_with_exact_cumulative_counts() -> None:
    rng = random.Random(2)
    hist = Histogram.following()
    seen = [30.0] * 3
    observe(hist, seen)
    hist.snapshot()
    for _ in range(5):
        batch = around(rng, 0.024, 50)
        observe(hist, batch)
        seen += batch
        snap = hist.snapshot()
    fine = sorted(b for b in fine_bounds(snap) if b < 1)  # the compilation steps' block is above
    assert fine, "no fine window around 24 ms"
    assert fine[0] < 0.024 * 0.95 and fine[-1] > 0.024 * 1.05  # the steps sit inside fine coverage
    assert all(b / a < 1.092 for a, b in itertools.pairwise(fine))  # one contiguous fine window
    assert len(snap.bounds) <= len(SKELETON) + 12  # a window here and one at the compilation steps
    for bound, cumulative in zip(snap.bounds, snap.cumulative, strict=False):
        assert cumulative == exact_cumulative(seen, bound), bound
    assert snap.count == len(seen)


def test_a_second_mode_far_above_the_median_gets_its_own_window() -> None:
    """Gradient accumulation: 3 of 4 steps short, every 4th 2.5x longer; p95 sits in the long mode."""
    rng = random.Random(3)
    hist = Histogram.following()
    observe(hist, [0.1])
    hist.snapshot()
    for _ in range(4):
        observe(hist, [step * (2.5 if i % 4 == 3 else 1) for i, step in enumerate(around(rng, 0.1, 80))])
        snap = hist.snapshot()
    for mode in (0.1, 0.25):  # the fine bin holding each mode is a bucket of its own
        below, above = FINE_GRID[bisect_left(FINE_GRID, mode) - 1], FINE_GRID[bisect_left(FINE_GRID, mode)]
        assert {below, above} <= set(snap.bounds), mode
    assert len(snap.bounds) <= len(SKELETON) + 6 * BLOCK  # a few blocks, not every bound


def test_bounds_stay_within_the_cap_and_leave_only_after_half_a_minute_unused(monkeypatch) -> None:
    clock = [0]
    monkeypatch.setattr(stepscope.hooks.timing, "perf_counter_ns", lambda: clock[0])
    rng = random.Random(4)
    hist = Histogram.following()
    last_used: dict[float, int] = {}
    exported: set[float] = set()
    for centre in (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 0.002, 0.02) * 3:  # a run all over the place
        batch = around(rng, centre, 40)
        observe(hist, batch)
        clock[0] += 5 * 10**9  # a push every 5 s
        snap = hist.snapshot()
        assert len(snap.bounds) <= MAX_EXPORTED
        used_blocks = {bisect_left(FINE_GRID, value) // BLOCK for value in batch}  # blocks of BLOCK bins
        for bound in set(snap.bounds):
            if FINE_GRID.index(bound) // BLOCK in used_blocks:
                last_used[bound] = clock[0]
        for gone in exported - set(snap.bounds):
            assert clock[0] - last_used.get(gone, 0) >= EVICT_IDLE_SECONDS * 10**9, f"{gone} left while in use"
        exported = set(snap.bounds)
    assert len(exported) > MAX_EXPORTED - BLOCK, "the cap was reached"


def test_a_run_that_speeds_up_after_a_slow_start_gets_fine_buckets_at_its_new_pace(monkeypatch) -> None:
    """The issue's reproduction: steps fall from 1 s to 80 ms over 50 s, then hold at ~21 ms."""
    clock = [0]
    monkeypatch.setattr(stepscope.hooks.timing, "perf_counter_ns", lambda: clock[0])
    rng = random.Random(5)
    hist = Histogram.following()
    for second in range(0, 50, 5):
        centre = 1.0 * 0.08 ** (second / 50)
        observe(hist, around(rng, centre, max(1, round(5 / centre))))
        clock[0] += 5 * 10**9
        hist.snapshot()
    steady = []
    for _ in range(24):  # two minutes at the new pace
        batch = around(rng, 0.021, 240)
        observe(hist, batch)
        steady += batch
        clock[0] += 5 * 10**9
        snap = hist.snapshot()
    fine = sorted(b for b in fine_bounds(snap) if b < 0.05)
    assert fine and fine[0] < min(steady) and max(steady) < fine[-1], fine
    assert all(b / a < 1.092 for a, b in itertools.pairwise(fine))


def test_fixed_buckets_export_exactly_what_the_user_chose() -> None:
    t = tracker(buckets=[0.01, 0.1, 1.0])
    t.state("train")
    t.step()
    assert t.snapshot().step.bounds == (0.01, 0.1, 1.0)
    t.close()


@pytest.mark.parametrize(
    ("phase_buckets", "env", "on"),
    [(None, {}, False), (True, {}, True), (None, {"STEPSCOPE_PHASE_BUCKETS": "on"}, True),
     (False, {"STEPSCOPE_PHASE_BUCKETS": "yes"}, False)],  # the argument wins
)
def test_phase_buckets_are_off_by_default_and_on_behind_the_switch(phase_buckets, env, on) -> None:
    config = Config.resolve(env={"STEPSCOPE_RUN": "r", "STEPSCOPE_PUSH_URL": "", **env},
                            phase_buckets=phase_buckets, handle_sigterm=False)
    t = th.Tracker(config)
    t.state("train")
    with t.phase("forward"):
        pass
    t.step()  # phase histograms are pushed from the step histogram's first push on
    text = t.render()
    les = {float(dict(labels)["le"]) for name, labels in samples(text)
           if name == "stepscope_step_phase_seconds_bucket"}
    skeleton = {FINE_GRID[i] for i in SKELETON}
    if on:  # the skeleton and fine buckets around the one observation
        assert skeleton | {float("inf")} < les
    else:
        assert les == {float("inf")}
    assert sample_values(text, "stepscope_step_phase_seconds_count", phase="forward") == [1]
    assert len(sample_values(text, "stepscope_step_phase_seconds_sum", phase="forward")) == 1
    t.close()


def test_promtool_accepts_a_body_with_windows_and_bucketless_phases() -> None:
    t = tracker()
    t.state("train")
    with t.phase("forward"):
        pass
    observe(t._step_hist, around(random.Random(5), 0.05, 60))
    t.render()
    observe(t._step_hist, around(random.Random(6), 0.05, 60))
    body = t.render()
    assert fine_bounds(t.snapshot().step)
    result = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    t.close()


def test_first_step_outside_a_state_means_train_and_is_not_timed() -> None:
    t = tracker()
    assert t.current_state == "setup"
    t.step(samples=4)
    assert t.current_state == "train"
    t.step(samples=4)
    text = t.render()
    assert sample_values(text, "stepscope_training_state", state="train") == [1]
    assert sample_values(text, "stepscope_steps_total") == [2]
    assert sample_values(text, "stepscope_samples_total") == [8]
    assert sample_values(text, "stepscope_step_seconds_count") == [1]  # setup time is no step
    t.close()


@pytest.mark.parametrize("state", ["eval", "checkpoint", "idle"])
def test_a_step_inside_another_state_keeps_that_state(state: str) -> None:
    t = tracker()
    with t.state(state):
        t.step()
        assert t.current_state == state
    assert t.current_state == "setup"
    t.close()


def test_loader_enters_train_so_the_first_step_is_timed() -> None:
    t = tracker()
    for _ in t.loader([1, 2]):
        t.step()
    assert sample_values(t.render(), "stepscope_step_seconds_count") == [2]
    t.close()


def test_the_first_push_covers_the_body_so_no_later_block_lands_below_p99(monkeypatch) -> None:
    """Lognormal steps (sigma 0.35): the first push's 60 steps only roughly show the tail, and a block a later
    push adds where p50 or p95 is read is under-counted by every rate window older than it (Lightning's p95
    read +37% for the first 70 s, tests/test_framework_quantiles.py). Later blocks may only extend the tail."""
    clock = [0]
    monkeypatch.setattr(stepscope.hooks.timing, "perf_counter_ns", lambda: clock[0])
    rng = random.Random(29)
    hist = Histogram.following()
    steps = [0.04 * rng.lognormvariate(0, 0.35) for _ in range(60)]
    observe(hist, steps)
    first = set(hist.snapshot().bounds)
    for _ in range(12):  # a minute of pushes 5 s apart
        batch = [0.04 * rng.lognormvariate(0, 0.35) for _ in range(130)]
        observe(hist, batch)
        steps += batch
        clock[0] += 5 * 10**9
        snap = hist.snapshot()
    p99 = sorted(steps)[int(0.99 * len(steps))]
    assert not {bound for bound in set(snap.bounds) - first if bound < p99}, sorted(set(snap.bounds) - first)
    assert len(snap.bounds) <= MAX_EXPORTED


@pytest.mark.parametrize("buckets", [None, (0.01, 0.1, 1.0)], ids=["following", "fixed"])
def test_phase_histograms_are_pushed_from_the_push_that_first_holds_the_step_histogram(buckets) -> None:
    """A phase histogram and the step histogram start in the same push, so that every rate window of the phases
    starts where the steps' does: pushed from the phase's first entry, a long first step's phases were in the push
    before the step histogram's first, and the rules' per-step phase seconds (a phase's rate over the steps') held
    that step in the phases' windows only (an 80 s first step read forward 0.37 s per step of 100 ms for 45 s,
    grafana/rules/tests/warmup.yml). Fixed buckets are pushed from the start, and the phases with them."""
    track = tracker(buckets=buckets)
    track.state("train")
    with track.phase("dataloader_next"):
        pass
    forward = track.phase("forward")
    with forward:
        during = track.render()  # the first step under way, its loading done
    assert bool(sample_values(during, "stepscope_step_phase_seconds_count")) is (buckets is not None)
    assert bool(sample_values(during, "stepscope_step_seconds_count")) is (buckets is not None)
    track.step(samples=1)
    text = track.render()
    track.close()
    for phase in ("dataloader_next", "forward"):
        assert sample_values(text, "stepscope_step_phase_seconds_count", phase=phase) == [1], phase
    assert sample_values(text, "stepscope_step_seconds_count") == [1]

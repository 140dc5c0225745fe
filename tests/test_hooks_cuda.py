"""CUDA-event bookkeeping of the hooks against the fake `torch.cuda` on a virtual clock (deterministic).

What is checked: one event per phase boundary, no `current_stream()` on the hot path, pooled events,
sampled steps whose weights keep counts and per-step sums right, FIFO resolution without host
synchronization, k chosen from the measured cost, and histograms that say what they hold.
"""

import logging

import pytest

import stepscope.hooks as th
from stepscope.hooks import tracker as tracker_module
from stepscope.hooks.cuda import CudaPhase, CudaTimer, SyncCudaPhase, choose_sample_every
from stepscope.hooks.timing import Histogram
from stepscope_testkit.fake_cuda import FakeCuda
from stepscope_testkit.processes import sample_values

PHASES = ("to_device", "forward", "zero_grad", "backward", "optimizer_step", "reduce_metrics")
GPU_SECONDS = {"to_device": 2e-4, "forward": 4e-4, "zero_grad": 1e-5, "backward": 8e-4,
               "optimizer_step": 3e-4, "reduce_metrics": 0.0}


class Loop:
    """A timer and six GPU phases on the fake; `step()` runs one training step of them."""

    def __init__(self, cuda: FakeCuda, **timer_kwargs) -> None:
        self.cuda = cuda
        self.timer = CudaTimer(cuda, clock=cuda.clock, seed=7, **timer_kwargs)
        self.hists = {name: Histogram((1e-5, 1e-4, 1e-3, 1e-2)) for name in PHASES}
        self.phases = {name: CudaPhase(name, self.hists[name], self.timer) for name in PHASES}

    def step(self, host_seconds: float = 0.0, phases=PHASES) -> None:
        began = self.cuda.clock()
        for name in phases:
            with self.phases[name]:
                self.cuda.launch(GPU_SECONDS[name])
        self.cuda.advance(host_seconds)
        self.timer.step_done(self.cuda.clock() - began)

    def finish(self) -> None:
        self.cuda.wait_until(self.cuda.gpu_idle_at())
        self.timer.resolve(block=True)


def test_back_to_back_phases_share_boundaries_and_reuse_events() -> None:
    cuda = FakeCuda()
    loop = Loop(cuda, sample_every=1)
    for _ in range(100):
        loop.step(host_seconds=2e-3)  # the GPU's 1.7 ms of work per step keeps up
    loop.finish()
    assert cuda.calls["Event.record"] == 100 * 7  # six phases, seven boundaries
    assert cuda.calls["Event"] <= 7 * 3  # pooled: a few steps' worth in flight at most
    for name in PHASES:  # boundaries sit at stream positions: exact GPU times
        assert sum(loop.hists[name].counts) == 100
        assert loop.hists[name].sum_ns == pytest.approx(100 * GPU_SECONDS[name] * 1e9, abs=100)
    assert cuda.calls["synchronize"] == 0


def test_host_work_between_phases_gets_its_own_start_event() -> None:
    cuda = FakeCuda()
    loop = Loop(cuda, sample_every=1)
    for _ in range(10):
        with loop.phases["forward"]:
            cuda.launch(4e-4)
        cuda.advance(50e-6)  # e.g. a loss computed outside any phase: not counted as backward's
        cuda.launch(1e-3)
        with loop.phases["backward"]:
            cuda.launch(8e-4)
        loop.timer.step_done(2_000_000)
    loop.finish()
    assert cuda.calls["Event.record"] == 10 * 4
    assert loop.hists["backward"].sum_ns == pytest.approx(10 * 8e5, abs=100)


def test_no_current_stream_lookup_on_the_hot_path_but_stream_switches_are_followed() -> None:
    cuda = FakeCuda()
    loop = Loop(cuda, sample_every=1)
    for _ in range(50):
        loop.step()
    assert cuda.calls["current_stream"] == 1  # the first record; then only the cheap raw check
    side = cuda.Stream()
    cuda.launch(5e-3)  # the default stream is busy for 5 ms; the side stream is idle
    with cuda.stream(side), loop.phases["forward"]:
        cuda.launch(4e-4)
    loop.timer.step_done(1_000_000)
    loop.finish()
    assert cuda.calls["current_stream"] == 2
    assert loop.hists["forward"].counts[3] == 0  # 0.4 ms on the side stream, not 5 ms of the default one


def test_without_raw_stream_lookup_every_record_asks_current_stream() -> None:
    cuda = FakeCuda(raw_stream_lookup=False)
    loop = Loop(cuda, sample_every=1)
    for _ in range(5):
        loop.step()
    loop.finish()
    assert cuda.calls["current_stream"] == 2 * 6 * 5  # at every start and end
    assert cuda.calls["Event.record"] == 7 * 5  # equal streams still share boundaries
    assert sum(loop.hists["backward"].counts) == 5


def test_sampled_steps_weigh_for_the_untimed_ones() -> None:
    cuda = FakeCuda()
    loop = Loop(cuda, sample_every=4)
    steps = 400
    for index in range(steps):  # optimizer_step only every other step, as with gradient accumulation
        phases = PHASES if index % 2 else tuple(p for p in PHASES if p != "optimizer_step")
        loop.step(host_seconds=5e-4, phases=phases)
    loop.finish()
    timed_steps = cuda.calls["Event.record"] // 7
    assert steps / 8 < timed_steps < steps / 2  # about one in four
    max_gap = 2 * 4 - 1
    for name, occurrences in (("forward", steps), ("optimizer_step", steps // 2)):
        count = sum(loop.hists[name].counts)
        assert occurrences - max_gap <= count <= occurrences  # every occurrence up to the last timed one
        assert loop.hists[name].sum_ns == pytest.approx(count * GPU_SECONDS[name] * 1e9, rel=1e-6)
    # per-step rates stay right: seconds per step in forward, from the histogram's sum over steps
    assert loop.hists["forward"].sum_ns / 1e9 / steps == pytest.approx(GPU_SECONDS["forward"], rel=0.02)


@pytest.mark.parametrize(("step_ms", "low", "high"), [(1.3, 5, 9), (2.8, 3, 4), (49.0, 1, 1)])
def test_sample_rate_is_chosen_from_the_measured_event_cost(step_ms: float, low: int, high: int) -> None:
    cuda = FakeCuda()
    loop = Loop(cuda)
    assert loop.timer.sample_every == 1  # every step until measured
    for _ in range(400):
        loop.step(host_seconds=step_ms / 1e3)
    # seven records (5.4 µs with the raw stream check) and six query + elapsed_time (1.4 µs) per timed
    # step, about 47 µs, kept under 0.5 % of the step
    assert low <= loop.timer.sample_every <= high
    assert choose_sample_every(47_000, step_ms * 1e6) in range(low, high + 1)


def test_resolution_waits_for_the_gpu_in_order_without_synchronizing() -> None:
    cuda = FakeCuda()
    loop = Loop(cuda, sample_every=1)
    cuda.launch(0.1)  # the GPU is 100 ms behind the host
    loop.step()
    loop.step()
    assert loop.timer.pending == 12 and sum(loop.hists["forward"].counts) == 0
    cuda.advance(0.1 + 1e-3)  # the GPU is inside the first step's backward
    loop.timer.step_done(1_000_000)
    resolved = [sum(h.counts) for h in loop.hists.values()]
    assert resolved == [1, 1, 1, 0, 0, 0]  # in order: a prefix of the queue
    assert loop.timer.pending == 12 - 3
    cuda.advance(0.01)
    loop.timer.step_done(1_000_000)
    assert loop.timer.pending == 0 and [sum(h.counts) for h in loop.hists.values()] == [2] * 6
    assert cuda.calls["synchronize"] == cuda.calls["Event.synchronize"] == 0


def test_pending_pairs_are_bounded() -> None:
    cuda = FakeCuda()
    timer = CudaTimer(cuda, clock=cuda.clock, max_pending=300, sample_every=1)
    hist = Histogram((1e-3,))
    phase = CudaPhase("forward", hist, timer)
    cuda.launch(10.0)  # a GPU far behind, and no step boundary to resolve at
    for _ in range(400):
        with phase:
            cuda.launch(1e-4)
    assert timer.pending <= 300
    assert cuda.calls["Event.synchronize"] > 0  # the oldest were waited for, not dropped
    assert sum(hist.counts) + timer.pending == 400


def test_sync_mode_synchronizes_around_the_phase() -> None:
    cuda = FakeCuda()
    hist = Histogram((1e-3,))
    with SyncCudaPhase("forward", hist, cuda):
        cuda.launch(1e-3)
    assert cuda.calls["synchronize"] == 2 and sum(hist.counts) == 1


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda()
    monkeypatch.setattr(tracker_module, "_cuda_module", lambda: cuda)
    return cuda


@pytest.mark.parametrize(("sync", "timing"), [(False, "cuda_event"), (True, "cuda_sync")])
def test_histograms_say_what_they_hold(fake_gpu: FakeCuda, sync: bool, timing: str) -> None:
    t = th.init(run="unit", push_url="", sync=sync)
    for _ in t.loader(range(3)):
        with t.phase("forward", cuda=True):
            fake_gpu.launch(1e-3)
        t.step()
    t.close()
    text = t.render()
    assert sample_values(text, "stepscope_step_phase_seconds_count", phase="forward", timing=timing) == [3]
    assert sample_values(text, "stepscope_step_phase_seconds_count", phase="dataloader_next",
                         timing="host") == [3]
    assert t.gpu_sample_every == (None if sync else 1)


def test_a_phase_timed_both_ways_warns_once(fake_gpu: FakeCuda, caplog: pytest.LogCaptureFixture) -> None:
    t = th.init(run="unit", push_url="")
    t.state("train")
    with caplog.at_level(logging.WARNING, logger="stepscope.hooks"):
        with t.phase("forward", cuda=True):
            pass
        for _ in range(3):
            with t.phase("forward"):
                pass
    assert len([r for r in caplog.records if "mixes both" in r.message]) == 1
    t.step()  # phase histograms are pushed from the step histogram's first push on
    t.close()
    assert sample_values(t.render(), "stepscope_step_phase_seconds_count", phase="forward",
                         timing="cuda_event") == [4]


def test_events_stay_on_their_device_and_a_phase_across_devices_is_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cuda = FakeCuda()
    loop = Loop(cuda, sample_every=1)
    for _ in range(20):  # a process driving two GPUs: pooled events must not hop devices
        with loop.phases["forward"]:
            cuda.launch(4e-4)
        with cuda.device(1), loop.phases["backward"]:
            cuda.launch(8e-4)
        cuda.advance(2e-3)
        loop.timer.step_done(2_000_000)
    loop.finish()
    assert sum(loop.hists["forward"].counts) == sum(loop.hists["backward"].counts) == 20
    assert loop.hists["backward"].sum_ns == pytest.approx(20 * 8e5, abs=100)
    with caplog.at_level(logging.WARNING, logger="stepscope.hooks"):
        for _ in range(2):
            loop.phases["optimizer_step"].start()
            with cuda.device(1):
                loop.phases["optimizer_step"].end()  # ends on another device: cannot be timed
            cuda.advance(1e-3)
            loop.timer.step_done(1_000_000)
        loop.finish()
    assert sum(loop.hists["optimizer_step"].counts) == 0
    assert len([r for r in caplog.records if "could not be timed" in r.message]) == 1


def test_a_pause_between_steps_does_not_lower_the_sample_rate() -> None:
    cuda = FakeCuda()
    loop = Loop(cuda)
    for index in range(400):
        loop.step(host_seconds=1.3e-3 if index % 40 else 2.0)  # an evaluation every 40 steps
    assert 5 <= loop.timer.sample_every <= 9  # as without the pauses: chosen from the median step

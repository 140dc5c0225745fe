"""CUDA-event phase timing on a real GPU (marked gpu; skipped where torch sees no CUDA device).

Six back-to-back phases of known GPU work per step: the event-timed sums (sampled steps, weighted)
stay within 10% of the `sync=True` sums, and the hot path never synchronizes.
"""

import pytest
import torch

import stepscope.hooks as th
from stepscope_testkit.processes import sample_values

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU visible to torch"),
]

STEPS = 300
# torch.cuda._sleep spins clock cycles: at ~1.5-2 GHz, 1M cycles are about 0.5-0.7 ms
PHASE_CYCLES = {"to_device": 300_000, "forward": 1_000_000, "zero_grad": 50_000, "backward": 2_000_000,
                "optimizer_step": 600_000, "reduce_metrics": 100_000}


def run(sync: bool, monkeypatch) -> tuple[dict[str, float], int, int | None]:
    """Per-step seconds of each phase, host synchronize calls, and the tracker's k."""
    calls = []
    real_synchronize = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (calls.append(1), real_synchronize(*a))[1])
    tracker = th.init(run="gpu", push_url="", sync=sync)
    for _ in range(STEPS):
        for name, cycles in PHASE_CYCLES.items():
            with tracker.phase(name, cuda=True):
                torch.cuda._sleep(cycles)
        tracker.step()
    synchronize_calls = len(calls)
    monkeypatch.setattr(torch.cuda, "synchronize", real_synchronize)
    tracker.close()  # resolves what is still pending
    text = tracker.render()
    per_step = {}
    for name in PHASE_CYCLES:
        [seconds] = sample_values(text, "stepscope_step_phase_seconds_sum", phase=name)
        [count] = sample_values(text, "stepscope_step_phase_seconds_count", phase=name)
        assert STEPS - 2 * (tracker.gpu_sample_every or 1) < count <= STEPS
        per_step[name] = seconds / count
    return per_step, synchronize_calls, tracker.gpu_sample_every


def test_event_timed_phases_match_synchronized_ones(monkeypatch) -> None:
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    events, event_syncs, k = run(sync=False, monkeypatch=monkeypatch)
    synced, sync_syncs, _ = run(sync=True, monkeypatch=monkeypatch)
    assert event_syncs == 0  # the hot path never waits for the GPU
    assert sync_syncs == 2 * STEPS * len(PHASE_CYCLES)
    assert k is not None and k >= 1
    for name in ("forward", "backward", "optimizer_step"):  # the phases long enough to compare
        assert events[name] == pytest.approx(synced[name], rel=0.10), (name, events, synced)
    assert sum(events.values()) == pytest.approx(sum(synced.values()), rel=0.10)

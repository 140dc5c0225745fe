"""CUDA-event phase timing on a real GPU (marked gpu; skipped where torch sees no CUDA device)."""

import pytest
import torch

import training_hooks as th
from tests.support.processes import sample_values

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU visible to torch"),
]

STEPS = 10
SPIN_CYCLES = 20_000_000  # torch.cuda._sleep: ~10 ms of GPU time at ~1.5-2 GHz


def run(sync: bool, monkeypatch) -> tuple[float, int]:
    """Steps whose forward phase is pure GPU time; returns (forward seconds, synchronize calls)."""
    calls = []
    real_synchronize = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (calls.append(1), real_synchronize(*a))[1])
    tracker = th.init(run="gpu", push_url="", sync=sync)
    for _ in range(STEPS):
        with tracker.phase("forward", cuda=True):
            torch.cuda._sleep(SPIN_CYCLES)
        tracker.step()
    synchronize_calls = len(calls)
    tracker.close()  # resolves what is still pending
    text = tracker.render()
    assert sample_values(text, "stepscope_step_phase_seconds_count", phase="forward") == [STEPS]
    [seconds] = sample_values(text, "stepscope_step_phase_seconds_sum", phase="forward")
    monkeypatch.setattr(torch.cuda, "synchronize", real_synchronize)
    return seconds, synchronize_calls


def test_cuda_events_measure_gpu_time_without_synchronizing(monkeypatch) -> None:
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    event_seconds, event_syncs = run(sync=False, monkeypatch=monkeypatch)
    sync_seconds, sync_syncs = run(sync=True, monkeypatch=monkeypatch)
    assert event_syncs == 0  # the hot path never waits for the GPU
    assert sync_syncs == 2 * STEPS
    # Both modes see the GPU's time, not the microseconds it takes the host to launch the kernel.
    assert event_seconds == pytest.approx(sync_seconds, rel=0.5)
    assert event_seconds > STEPS * 1e-3

"""tracker.measure_limits: the loader limit of a loader with a known cost, the compute limit on one
cached batch, what gets pushed, and the clear errors."""

import re
import time
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader

import stepscope.hooks as th
from stepscope.hooks.limits import measure, prefetched_batches, samples_in, to_device

BATCH = 8
LOADER_SLEEP = 0.03  # per batch: the loader delivers BATCH / LOADER_SLEEP = 267 samples/s at most


class SleepyLoader:
    """Each batch costs LOADER_SLEEP seconds, like reading and decoding from slow storage. It notes
    when each batch left it: on a loaded machine a sleep overshoots, so the truth is what it took."""

    def __init__(self, batches: int = 1000) -> None:
        self.batches = batches
        self.drawn = 0
        self.yielded_at: list[float] = []

    def __iter__(self):
        for _ in range(self.batches):
            time.sleep(LOADER_SLEEP)
            self.drawn += 1
            x = torch.randn(BATCH, 4)
            self.yielded_at.append(time.perf_counter())
            yield x, x.sum(dim=1)


def test_the_loader_limit_of_a_loader_with_a_known_cost_is_within_10_percent() -> None:
    tracker = th.init(run="limits", push_url="", handle_sigterm=False)
    model = torch.nn.Linear(4, 1)
    seen: list[torch.Tensor] = []

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        seen.append(batch[0])
        torch.nn.functional.mse_loss(model(batch[0]).squeeze(1), batch[1]).backward()

    loader = SleepyLoader()
    limits = tracker.measure_limits(loader, train_step, batches=20)
    # the clock spans the 20 batches after the second arrival: what the loader spent on them
    truth = 20 * BATCH / (loader.yielded_at[21] - loader.yielded_at[1])
    assert abs(limits.loader_samples_per_second - truth) / truth < 0.10, (limits, truth)
    assert limits.loader_samples_per_second < 1.05 * BATCH / LOADER_SLEEP  # never above what sleeping allows
    assert loader.drawn == 1 + 1 + 20  # the cached batch, the arrival the clock starts at, the timed ones
    assert limits.samples_per_batch == BATCH and limits.loader_batches == 20 and limits.compute_batches == 20
    assert len(seen) == 3 + 20 and all(x is seen[0] for x in seen)  # warm-up and timed calls, one cached batch
    assert limits.compute_samples_per_second > limits.loader_samples_per_second and limits.loader_bound
    assert str(limits).startswith(f"the loader can deliver {limits.loader_samples_per_second:.1f} samples/s; "
                                  f"training consumes {limits.compute_samples_per_second:.1f} samples/s; the loader "
                                  "is the limit")
    text = tracker.render()
    assert f"stepscope_loader_limit_samples_per_second {limits.loader_samples_per_second!r}" in text
    assert f"stepscope_compute_limit_samples_per_second {limits.compute_samples_per_second!r}" in text
    tracker.close()


def test_the_compute_limit_synchronizes_the_gpu_and_measuring_is_no_step() -> None:
    class Cuda:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def is_initialized(self) -> bool:
            return True

        def synchronize(self) -> None:
            self.calls.append("synchronize")

    cuda = Cuda()
    measure(SleepyLoader(), lambda batch: cuda.calls.append("step"), batches=2, warmup_steps=1, cuda=cuda)
    assert cuda.calls == ["step", "synchronize", "step", "step", "synchronize"]
    tracker = th.init(run="limits", push_url="", handle_sigterm=False)
    states: list[str] = []

    def measured_step(batch: object) -> None:
        states.extend(line for line in tracker.render().splitlines()
                      if line.startswith("stepscope_training_state{") and line.endswith(" 1"))
        time.sleep(0.05)

    for _ in tracker.loader(range(2)):
        tracker.step()
        tracker.measure_limits([[0] * 4] * 10, measured_step, batches=2, warmup_steps=0)
        assert tracker.render().count('stepscope_training_state{state="train"} 1') == 1  # back in train
    lines = tracker.render().splitlines()
    assert "stepscope_step_seconds_count 2" in lines
    step_sum = next(line for line in lines if line.startswith("stepscope_step_seconds_sum"))
    assert float(step_sum.split()[1]) < 0.05  # the 0.1 s spent measuring after the first step is not in the second
    # nor is it training time (goodput's productive time; a measure of minutes read as a stalled run): eval's
    assert set(states) == {'stepscope_training_state{state="eval"} 1'}
    seconds = {line.split('"')[1]: float(line.split()[1]) for line in lines
               if line.startswith("stepscope_state_seconds_total{")}
    assert seconds["eval"] >= 0.2 > seconds["train"], seconds
    tracker.close()


def test_batches_are_counted_and_moved_whatever_their_shape() -> None:
    x = torch.zeros(5, 3)
    assert samples_in(x) == 5
    assert samples_in((x, torch.zeros(5))) == 5
    assert samples_in({"input_ids": x, "labels": torch.zeros(5)}) == 5
    assert samples_in(["a", "b", "c"]) == 3  # a flat list of samples
    assert samples_in(object()) is None and samples_in(torch.tensor(1.0)) is None
    Pair = namedtuple("Pair", "x y")
    moved = to_device({"pair": Pair(x, [x]), "n": 3}, torch.float64)  # .to() takes a dtype as well
    assert moved["pair"].x.dtype == torch.float64 and moved["pair"].y[0].dtype == torch.float64
    assert isinstance(moved["pair"], Pair) and moved["n"] == 3


def test_prefetched_batches_of_a_dataloader_are_skipped_before_timing() -> None:
    assert prefetched_batches(DataLoader(range(10), num_workers=2, prefetch_factor=3)) == 6
    assert prefetched_batches(DataLoader(range(10), num_workers=2)) == 4
    assert prefetched_batches(DataLoader(range(10))) == 0
    assert prefetched_batches([1, 2]) == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"batches": 1}, "batches must be an integer >= 2"),
    ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
    ({"samples_per_batch": 0}, "samples_per_batch must be an integer >= 1"),
    ({"loader": [[1, 2]] * 3}, "the loader ran dry after 3 batches; measuring needs 2 plus"),
    ({"loader": [object()] * 10}, "cannot tell how many samples a object batch holds: pass samples_per_batch="),
    ({"train_step": None}, "train_step must be callable"),
])
def test_bad_arguments_raise_a_clear_value_error(kwargs: dict, message: str) -> None:
    arguments = {"loader": [[1, 2]] * 10, "train_step": lambda batch: None, "batches": 2, **kwargs}
    tracker = th.init(run="limits", push_url="", handle_sigterm=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        tracker.measure_limits(arguments.pop("loader"), arguments.pop("train_step"), **arguments)
    assert "stepscope_loader_limit" not in tracker.render()  # nothing pushed
    tracker.close()


def test_samples_per_batch_overrides_the_guess() -> None:
    limits = measure([object()] * 10, lambda batch: None, batches=2, samples_per_batch=16)
    assert limits.samples_per_batch == 16


def test_measuring_mid_epoch_leaves_a_persistent_workers_loaders_epoch_whole() -> None:
    """A DataLoader with persistent workers gives every iter() its one iterator, reset: measured at a checkpoint after
    3 of 10 batches, the measure reset and drained the training loop's iterator, which then got 4 batches in all."""
    tracker = th.init(run="limits-persistent", push_url="", handle_sigterm=False)
    loader = DataLoader(torch.arange(40.0), batch_size=4, num_workers=1, persistent_workers=True)
    seen: list[float] = []
    for index, batch in enumerate(tracker.loader(loader)):
        seen.extend(batch.tolist())
        tracker.step(samples=len(batch))
        if index == 2:
            tracker.measure_limits(loader, lambda batch: batch.sum(), batches=2, warmup_steps=0)
    tracker.close()
    assert seen == [float(item) for item in range(40)]

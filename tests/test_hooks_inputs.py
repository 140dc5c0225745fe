"""What the hooks accept from the user: the counts of each step, the loader, and the settings."""

import math
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import stepscope.hooks as th
from stepscope_testkit.processes import running_exporter, sample_values, samples, scrape

RUN = {"run": "inputs", "rank": "0"}


def counted(tracker: th.Tracker) -> tuple[object, ...]:
    """Everything step() and micro_batch() count, as the next push would show it."""
    snap = tracker.snapshot()
    return snap.steps, snap.samples, snap.micro_batches, snap.tokens, snap.flops, snap.global_step


def test_a_negative_count_raises_at_the_call_and_the_rank_keeps_pushing(tmp_path: Path) -> None:
    """The exporter refuses a push that holds a negative counter: a count of -50 accepted would keep every
    later push of the rank out, its final idle too. It raises at the call, so the run goes on being seen;
    numpy's scalars stay numbers, counted as the plain ints and floats the exporter reads."""
    with running_exporter(tmp_path) as exporter:
        tracker = th.init(run="inputs", push_url=exporter.url, push_interval=0.1, handle_sigterm=False)
        tracker.step(samples=20)
        with pytest.raises(ValueError, match=r"^samples must be a finite number >= 0, got -50$"):
            tracker.step(samples=-50)
        tracker.step(samples=np.int64(20), tokens=np.int32(6), flops=np.float32(2.5), global_step=np.int64(2))
        tracker.close()
        text = scrape(exporter.url)
    assert tracker.pusher.stats.failures == 0, tracker.pusher.stats.last_error
    assert sample_values(text, "stepscope_samples_total", **RUN) == [40]
    assert sample_values(text, "stepscope_steps_total", **RUN) == [2]
    assert sample_values(text, "stepscope_tokens_total", **RUN) == [6]
    assert sample_values(text, "stepscope_model_flops_total", **RUN) == [2.5]
    assert sample_values(text, "stepscope_training_global_step", **RUN) == [2]
    assert sample_values(text, "stepscope_training_state", state="idle", **RUN) == [1]


BAD_COUNTS = [  # (argument, value) for both step() and micro_batch()
    ("samples", -50),
    ("samples", "x"),
    ("samples", None),
    ("samples", True),
    ("samples", torch.tensor(4)),  # would render as "tensor(4)": no exporter takes that push
    ("tokens", -1),
    ("tokens", math.nan),
    ("tokens", math.inf),
    ("flops", -1e12),
    ("flops", -math.inf),
    ("flops", "1e12"),
]
BAD_STEP_COUNTS = [("micro_batches", -1), ("micro_batches", 1.5j), ("global_step", -1), ("global_step", "7")]


@pytest.mark.parametrize(
    ("method", "argument", "value"),
    [("step", *case) for case in BAD_COUNTS + BAD_STEP_COUNTS] + [("micro_batch", *case) for case in BAD_COUNTS],
    ids=repr,
)
def test_a_count_that_is_no_finite_number_at_least_zero_raises_before_anything_counts(
    method: str, argument: str, value: object
) -> None:
    tracker = th.init(run="inputs", push_url="", handle_sigterm=False, flops_per_sample=10)
    tracker.step(samples=4, tokens=8, global_step=1)
    before = counted(tracker)
    with pytest.raises(ValueError, match=f"^{argument} must be a finite number >= 0, got ") as raised:
        getattr(tracker, method)(**{argument: value})
    assert str(raised.value).endswith(f"got {value!r}")
    assert counted(tracker) == before
    tracker.close()


def entered_phases(text: str) -> list[str]:
    """The phases the exporter says the rank is in (stepscope_training_phase_entered_timestamp_seconds)."""
    return [dict(labels)["phase"] for name, labels in samples(text)
            if name == "stepscope_training_phase_entered_timestamp_seconds" and ("run", RUN["run"]) in labels]


def wait_for_pushes(tracker: th.Tracker, count: int = 2) -> None:
    """Until `count` more pushes succeeded: the last of them holds what the training thread did before."""
    target = tracker.pusher.stats.successes + count
    deadline = time.monotonic() + 20
    while tracker.pusher.stats.successes < target:
        assert time.monotonic() < deadline, f"no push: {tracker.pusher.stats.last_error}"
        time.sleep(0.02)


def test_the_loader_phase_is_left_when_the_loader_runs_out(tmp_path: Path) -> None:
    """docs/exporter.md: the entered phase is absent between phases. The next() that finds the loader empty
    loads no batch: it is not observed (one dataloader_next per batch) and leaves the phase."""
    with running_exporter(tmp_path) as exporter:
        tracker = th.init(run="inputs", push_url=exporter.url, push_interval=0.05, handle_sigterm=False)

        def batches() -> Iterator[int]:
            yield 1
            wait_for_pushes(tracker)  # the training thread waits in next(): the exporter shows where
            assert entered_phases(scrape(exporter.url)) == ["dataloader_next"]
            yield 2

        for _ in tracker.loader(batches()):
            tracker.step(samples=1)
        wait_for_pushes(tracker)
        after_the_loader = scrape(exporter.url)
        tracker.close()
        after_close = scrape(exporter.url)
    assert entered_phases(after_the_loader) == []
    assert sample_values(after_the_loader, "stepscope_step_phase_seconds_count", phase="dataloader_next",
                         **RUN) == [2]
    assert entered_phases(after_close) == []
    assert sample_values(after_close, "stepscope_training_state", state="idle", **RUN) == [1]

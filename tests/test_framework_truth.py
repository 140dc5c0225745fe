"""The Lightning and Hugging Face callbacks against truth measured in the same process, used as users do:
gradient accumulation 4, a partial last batch and a short last accumulation every epoch, validation,
checkpoints, `max_time`, a neighbour callback busy at every batch end, and Lightning DDP with 2 ranks over
gloo (tests/support/framework_truth.py says how the truth is measured). The ranks push to a real exporter.
"""

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stepscope_testkit.processes import REPO_ROOT, running_exporter, sample_values, scrape
from tests.support.framework_truth import (
    ACCUMULATE,
    BATCH,
    EPOCHS,
    ITEMS,
    Truth,
    huggingface_train,
    lightning_fit,
)

STEPS = EPOCHS * 5  # 18 batches an epoch: 4 + 4 + 4 + 4 + 2
MICRO_BATCHES = EPOCHS * 18
# The loading share against each fetch timed where the training loader yields it (tests/support/framework_truth.py),
# not against the Dataset and collate time alone: the DataLoader's and the framework's own work in each fetch, and
# the OS's preemption beside the rest of the suite, stretch the fetch past the Dataset (Lightning +0.007 idle and up
# to +0.019 beside 4 CPU hogs, +0.026 in a clean-clone CI run; accelerate +0.016 idle, +0.030 in CI), where the
# hooks' own work around the timed fetch stays within +0.0012..+0.0021 (Lightning, idle and beside 4 hogs) and
# +0.0001 (accelerate's DataLoaderShard, idle and beside 3 busy loops).
FETCH_SHARE_TOLERANCE = 0.005
# Lightning: the hook also counts as loading the work around the fetch that the loader's own timing cannot see (the
# epoch's iterator start, Lightning's combined loader), which a busy CI stretches. Against the timed fetch, one
# process: +0.0012..+0.0021 idle and beside 4 CPU hogs, +0.0077 in a clean-clone CI run; DDP, two ranks on the 2
# cores: +0.0024..+0.0037 idle, +0.0070 in CI, +0.0021..+0.0119 beside 4 hogs (against the Dataset alone up to
# +0.0162 there).
LIGHTNING_FETCH_SHARE_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def exporter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_exporter(tmp_path_factory.mktemp("exporter")) as running:
        yield running


def pushed(text: str, run: str, rank: str = "0") -> Callable[..., float]:
    def value(name: str, **labels: str) -> float:
        [found] = sample_values(text, name, run=run, rank=rank, **labels)
        return found
    return value


def check_against_truth(value: Callable[..., float], truth: Truth,
                        fetch_tolerance: float = FETCH_SHARE_TOLERANCE) -> None:
    """Steps, micro-batches and samples exact; the loading share at least the Dataset and collate time and within
    `fetch_tolerance` of the fetches the truth timed; every eval and save in its state."""
    assert value("stepscope_steps_total") == truth.optimizer_steps
    assert value("stepscope_micro_batches_total") == truth.forwards
    assert value("stepscope_samples_total") == truth.samples
    assert value("stepscope_step_phase_seconds_count", phase="optimizer_step") == truth.optimizer_steps
    step_seconds = value("stepscope_step_seconds_sum")
    share = value("stepscope_step_phase_seconds_sum", phase="dataloader_next") / step_seconds
    assert share >= truth.loading / step_seconds - FETCH_SHARE_TOLERANCE  # every fetch holds its Dataset and collate
    assert truth.fetching >= truth.loading
    assert share == pytest.approx(truth.fetching / step_seconds, abs=fetch_tolerance)
    for state, spans in truth.spans.items():
        assert spans, state
        seconds = value("stepscope_state_seconds_total", state=state)
        assert 0.9 * sum(spans) <= seconds <= sum(spans) + 0.02 * len(spans), (state, seconds, spans)


def test_plain_loop_counts_its_batches_and_a_state_shorter_than_a_push() -> None:
    """Accumulating by hand: micro_batch() for each batch but the last of a step, step() for that one."""
    import stepscope.hooks

    tracker = stepscope.hooks.init(run="plain", push_url="", handle_sigterm=False)
    for _ in range(3):
        for _ in range(ACCUMULATE - 1):
            tracker.micro_batch(samples=BATCH)
        tracker.step(samples=BATCH - 1)  # a short last batch
    with tracker.state("checkpoint"):
        time.sleep(0.2)  # shorter than the default 5 s push interval: the state gauge would likely miss it
    tracker.close()
    text = tracker.render()
    assert sample_values(text, "stepscope_steps_total") == [3]
    assert sample_values(text, "stepscope_micro_batches_total") == [3 * ACCUMULATE]
    assert sample_values(text, "stepscope_samples_total") == [3 * (ACCUMULATE * BATCH - 1)]
    [checkpoint] = sample_values(text, "stepscope_state_seconds_total", state="checkpoint")
    [eval_seconds] = sample_values(text, "stepscope_state_seconds_total", state="eval")
    assert checkpoint >= 0.2 and eval_seconds == 0
    assert sample_values(text, "stepscope_training_state", state="idle") == [1]


def test_lightning_with_accumulation_validation_checkpoints_and_max_time(tmp_path: Path, exporter: Any) -> None:
    from stepscope.hooks.lightning import StepscopeCallback

    truth = Truth()
    callback = StepscopeCallback(run="pl-truth", push_url=exporter.url, push_interval=1.0)
    trainer = lightning_fit(truth, tmp_path, callback, devices=1)

    value = pushed(scrape(exporter.url), "pl-truth")
    assert trainer.global_step == truth.optimizer_steps == STEPS
    assert (truth.forwards, truth.samples) == (MICRO_BATCHES, EPOCHS * ITEMS)
    check_against_truth(value, truth, LIGHTNING_FETCH_SHARE_TOLERANCE)
    assert value("stepscope_step_phase_seconds_count", phase="forward") == MICRO_BATCHES
    assert value("stepscope_step_seconds_count") == STEPS


def test_lightning_ddp_over_gloo_each_rank(tmp_path: Path, exporter: Any) -> None:
    """Two ranks (Lightning's DDP launcher, gloo): the Timer's broadcast and Lightning's SIGTERM broadcast
    at every batch are collectives outside dataloader_next, so each rank's share stays its loading."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.lightning_ddp", str(tmp_path), exporter.url, "pl-ddp"],
        capture_output=True, text=True, timeout=180, env=env, cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = scrape(exporter.url)
    for rank in ("0", "1"):
        truth = Truth.load(tmp_path / f"truth-{rank}.json")
        assert truth.samples == ITEMS and truth.optimizer_steps == EPOCHS * 3  # 35 items a rank: 4 + 4 + 1 batches
        check_against_truth(pushed(text, "pl-ddp", rank), truth, LIGHTNING_FETCH_SHARE_TOLERANCE)
        assert sample_values(text, "stepscope_training_info", run="pl-ddp", rank=rank, world_size="2")


def test_huggingface_with_accumulation_partial_batches_eval_and_saves(tmp_path: Path, exporter: Any) -> None:
    from stepscope.hooks.huggingface import StepscopeCallback

    truth = Truth()
    callback = StepscopeCallback(run="hf-truth", push_url=exporter.url, push_interval=1.0)
    trainer = huggingface_train(truth, tmp_path, callback)

    value = pushed(scrape(exporter.url), "hf-truth")
    assert trainer.state.global_step == truth.optimizer_steps == STEPS
    assert (truth.forwards, truth.samples) == (MICRO_BATCHES, EPOCHS * ITEMS)
    # the share is held to the timed fetches (as with two ranks below): accelerate's own work inside each
    # fetch is 0.016 of the step idle here (share 0.169, fetches 0.168, the Dataset's 0.153), and beside the
    # rest of the suite in a clean-clone CI run it read 0.251 against the Dataset's 0.229
    check_against_truth(value, truth)
    assert value("stepscope_step_phase_seconds_count", phase="dataloader_next") == MICRO_BATCHES
    assert "get_batch_samples" not in vars(trainer)  # the wrapper is gone after training


def test_huggingface_ddp_over_gloo_each_rank(tmp_path: Path, exporter: Any) -> None:
    """Two ranks started by torchrun, the Trainer's DistributedDataParallel over gloo: each rank's steps,
    micro-batches and samples are its own (the distributed sampler's share), its loading share and its
    eval and checkpoint seconds within the same bounds as one process."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "tests.support.huggingface_ddp", str(tmp_path), exporter.url, "hf-ddp"],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = scrape(exporter.url)
    for rank in ("0", "1"):
        truth = Truth.load(tmp_path / f"truth-{rank}.json")
        # accelerate's even batches: a rank's 35 items of an epoch padded to 36 from the start (4 + 4 + 1 batches)
        assert (truth.samples, truth.optimizer_steps) == (EPOCHS * 36, EPOCHS * 3)
        # two ranks on shared cores stretch accelerate's own work and the OS's preemption inside each fetch
        # (+0.03 of the step beside the rest of the suite in CI), which the Dataset's truth cannot see: the
        # share is held to the timed fetches instead
        check_against_truth(pushed(text, "hf-ddp", rank), truth)
        assert sample_values(text, "stepscope_training_info", run="hf-ddp", rank=rank, world_size="2")

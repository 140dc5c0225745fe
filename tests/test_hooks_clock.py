"""The step clock and the phase timers against truth measured in the same process (perf_counter), pushed to a
real exporter: what a step is when eval or a checkpoint comes mid-step, when loader() is called every epoch,
and what a phase entered twice before it is left records."""

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from time import perf_counter
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import stepscope.hooks as th
from stepscope.contract import STATES
from stepscope_testkit.processes import running_exporter, sample_values, samples, scrape

WORK = 0.02  # a step's own work on each side of an interruption
OUTSIDE = 0.1  # an eval or a checkpoint, or an epoch's end
SAVE_PREAMBLE_SECONDS = 0.005  # a save_checkpoint call before the hook sees the checkpoint begin, on a busy machine


@pytest.fixture(scope="module")
def exporter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_exporter(tmp_path_factory.mktemp("exporter")) as running:
        yield running


def pushed(exporter: Any, run: str) -> Callable[..., float]:
    text = scrape(exporter.url)

    def value(name: str, **labels: str) -> float:
        [found] = sample_values(text, name, run=run, rank="0", **labels)
        return found
    return value


def tracker(exporter: Any, run: str) -> th.Tracker:
    return th.init(run=run, push_url=exporter.url, push_interval=60, handle_sigterm=False)


def test_an_eval_or_a_checkpoint_mid_step_is_no_step_time_but_the_steps_own_part_stays(exporter: Any) -> None:
    """Each step works, evaluates (or checkpoints), works again: its step time is both parts of the work."""
    t = tracker(exporter, "clock-mid-step")
    t.state("train")
    truth = 0.0
    start = perf_counter()
    for index in range(4):
        time.sleep(WORK)
        with t.state("eval" if index % 2 else "checkpoint"):
            left = perf_counter()
            time.sleep(OUTSIDE)
            back = perf_counter()
        time.sleep(WORK)
        t.step(samples=1)
        end = perf_counter()
        truth += end - start - (back - left)
        start = end
    t.close()
    value = pushed(exporter, "clock-mid-step")
    assert value("stepscope_step_seconds_count") == 4
    assert value("stepscope_step_seconds_sum") == pytest.approx(truth, abs=0.004)  # 0.16 s; 0.08 before the fix
    assert value("stepscope_state_seconds_total", state="eval") >= 2 * OUTSIDE


def test_a_step_ended_inside_an_eval_holds_only_its_train_time(exporter: Any) -> None:
    """A loop that calls step() inside its eval (or checkpoint) scope: the step is its train time alone, and the next
    step starts when train is entered again. Before, each step held the whole eval: 0.48 s for 0.08 s of truth."""
    t = tracker(exporter, "clock-step-in-eval")
    t.state("train")
    truth = 0.0
    for index in range(4):
        start = perf_counter()
        time.sleep(WORK)
        with t.state("eval" if index % 2 else "checkpoint"):
            truth += perf_counter() - start
            time.sleep(OUTSIDE)
            t.step(samples=1)
    t.close()
    value = pushed(exporter, "clock-step-in-eval")
    assert value("stepscope_step_seconds_count") == 4
    assert value("stepscope_step_seconds_sum") == pytest.approx(truth, abs=0.004)


def test_a_step_in_a_state_never_left_from_train_holds_no_time_outside_train(exporter: Any) -> None:
    """step() in an eval entered from setup: no train time is in it, so none is observed (it is counted), as for a
    first step() in setup. Before, the eval's time and the setup's were observed as the step's."""
    t = tracker(exporter, "clock-step-outside")
    with t.state("eval"):
        time.sleep(OUTSIDE)
        t.step(samples=1)
    t.close()
    text = scrape(exporter.url)
    assert sample_values(text, "stepscope_steps_total", run="clock-step-outside", rank="0") == [1]
    assert sample_values(text, "stepscope_step_seconds_count", run="clock-step-outside", rank="0") in ([], [0])


def test_a_micro_batch_is_progress_the_last_step_time_moves_on_with_it(exporter: Any) -> None:
    """Under gradient accumulation a step of many micro-batches can outlast the stall alert's 60 s floor: the pushed
    last-step time is the last micro-batch's, so a rank whose micro-batches go on does not read as stalled. Before,
    it stayed at the step's start (OUTSIDE before the micro-batch here)."""
    t = tracker(exporter, "clock-micro-batch-progress")
    t.state("train")
    t.step(samples=1)
    stepped = time.time()
    time.sleep(OUTSIDE)
    t.micro_batch(samples=1)
    counted = time.time()
    t.close()
    last = pushed(exporter, "clock-micro-batch-progress")("stepscope_training_last_step_timestamp_seconds")
    assert stepped + OUTSIDE / 2 <= last <= counted + OUTSIDE / 2


class Items(Dataset):
    def __init__(self, items: int, loading: list[float]) -> None:
        self.items, self.loading = items, loading

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = perf_counter()
        time.sleep(0.004)
        x = torch.full((8,), index / self.items)
        self.loading.append(perf_counter() - start)
        return x, x.sum(dim=0, keepdim=True)


class TimedLoader(DataLoader):
    """A DataLoader whose every batch's `next()` (fetching its items, collating them) is timed into `fetches`:
    what dataloader_next times, where the items alone leave out the collation, which grows under load. Each
    `next()` first ends the open span of `outside` (a checkpoint lasts until training fetches again), where the
    callback's fetch hook ends the checkpoint state: ending it at the first item instead put the DataLoader's
    own work before it in the checkpoint, 17 ms over five saves in a clean-clone CI run (a step sum 3.2% over)."""

    fetches: list[float]
    outside: "Outside | None" = None

    def __iter__(self) -> Iterator[Any]:
        return _TimedIterator(super().__iter__(), self.fetches, self.outside)


class _TimedIterator:
    def __init__(self, inner: Iterator[Any], fetches: list[float], outside: "Outside | None") -> None:
        self.inner, self.fetches, self.outside = inner, fetches, outside

    def __iter__(self) -> "_TimedIterator":
        return self

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __next__(self) -> Any:
        if self.outside is not None:
            self.outside.resumed()
        start = perf_counter()
        batch = next(self.inner)  # the epoch's end (StopIteration) is no batch
        self.fetches.append(perf_counter() - start)
        return batch


class Outside:
    """Spans outside training, (start, end): validations, and checkpoints that last until training loads again."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self._pending: list[float] = []

    def until_resumed(self) -> None:
        self.resumed()
        self._pending.append(perf_counter())

    def resumed(self) -> None:
        if self._pending:
            self.spans.append((self._pending.pop(), perf_counter()))

    def time_validations(self, trainer: Any) -> None:
        """Each validation run of the fit (`val_loop.run`, all of it) is a span; it ends an open checkpoint."""
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        run_validation = val_loop.run

        def timed_validation(*args: Any, **kwargs: Any) -> Any:
            self.resumed()
            start = perf_counter()
            try:
                return run_validation(*args, **kwargs)
            finally:
                self.spans.append((start, perf_counter()))
        val_loop.run = timed_validation

    def steps(self, marks: list[float]) -> float:
        """The time between consecutive `marks` (step ends) less the spans inside it."""
        return sum(end - begin - sum(max(0.0, min(end, b) - max(begin, a)) for a, b in self.spans)
                   for begin, end in itertools.pairwise(marks))


def batch_end_marks(pl: Any, marks: list[float]) -> Any:
    """A Lightning callback that appends to `marks` the first epoch's start, then each batch's end."""

    class Marks(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            if not marks:
                marks.append(perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            marks.append(perf_counter())

    return Marks()


def working_module(pl: Any) -> type:
    """A LightningModule whose every training step works WORK seconds (lightning is imported by the tests)."""

    class Working(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            time.sleep(WORK)
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return Working


def test_lightning_validation_inside_an_accumulation_keeps_the_steps_loading_and_compute(
        tmp_path: Path, exporter: Any) -> None:
    """val_check_interval=4 with accumulate_grad_batches=3 validates after the first batch of a step: the step
    time is the optimizer-step intervals less the validations and checkpoints inside them, and the loading share
    the Dataset's time over it (before: 0.60 s for 0.86 s, a share of 70% for 48%: the run looked data-bound)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stepscope.hooks.lightning import StepscopeCallback

    loading: list[float] = []  # each training batch's fetch
    outside = Outside()
    marks: list[float] = []  # the first epoch's start, then each optimizer step's end

    class Module(working_module(pl)):
        def validation_step(self, batch, batch_idx):
            time.sleep(0.03)

        def on_save_checkpoint(self, checkpoint: dict) -> None:
            time.sleep(0.05)

    class Marks(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            if not marks:
                marks.append(perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step != len(marks) - 1:
                marks.append(perf_counter())

    callback = StepscopeCallback(run="clock-pl", push_url=exporter.url, push_interval=60)
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", enable_progress_bar=False, logger=False, enable_model_summary=False,
        limit_train_batches=10, val_check_interval=4, limit_val_batches=2, accumulate_grad_batches=3,
        num_sanity_val_steps=0, default_root_dir=tmp_path,
        callbacks=[callback, Marks(), ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)],
    )
    outside.time_validations(trainer)
    save = trainer.save_checkpoint

    def timed_save(*args: Any, **kwargs: Any) -> Any:
        outside.until_resumed()
        return save(*args, **kwargs)
    trainer.save_checkpoint = timed_save
    train = TimedLoader(Items(40, []), batch_size=4)
    train.fetches, train.outside = loading, outside
    trainer.fit(Module(), train, DataLoader(Items(8, []), batch_size=4))
    outside.resumed()

    steps = outside.steps(marks)
    value = pushed(exporter, "clock-pl")
    assert value("stepscope_step_seconds_count") == len(marks) - 1 == 8  # 10 batches an epoch: 3 + 3 + 3 + 1
    assert value("stepscope_step_seconds_sum") == pytest.approx(steps, rel=0.03)
    share = value("stepscope_step_phase_seconds_sum", phase="dataloader_next") / value("stepscope_step_seconds_sum")
    assert share == pytest.approx(sum(loading) / steps, abs=0.02)


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
def test_a_lightning_batch_whose_training_step_returns_none_is_a_forward_too(tmp_path: Path, exporter: Any) -> None:
    """Lightning skips the backward of a training_step that returns None (a caught OOM, a NaN loss): its forward ends
    at the optimizer step or at the batch's end. Before, the next batch's start restarted it: a fit that skipped
    every other batch of 20 ms pushed forward 5 times, 0.159 s, for 10 batches."""
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback

    skipped = (0, 3)  # of every 4 batches at accumulate_grad_batches=2: one that accumulates, one that steps
    steps_took: list[float] = []

    class Skipping(working_module(pl)):
        def training_step(self, batch, batch_idx):
            start = perf_counter()
            loss = super().training_step(batch, batch_idx)
            steps_took.append(perf_counter() - start)
            return None if batch_idx % 4 in skipped else loss

    callback = StepscopeCallback(run="clock-pl-skip", push_url=exporter.url, push_interval=60)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", enable_progress_bar=False, logger=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_train_batches=8,
                         accumulate_grad_batches=2, default_root_dir=tmp_path, callbacks=[callback])
    trainer.fit(Skipping(), DataLoader(Items(32, []), batch_size=4))

    value = pushed(exporter, "clock-pl-skip")
    assert value("stepscope_step_phase_seconds_count", phase="forward") == len(steps_took) == 8  # 4 before
    assert value("stepscope_step_phase_seconds_count", phase="backward") == 4
    forward = value("stepscope_step_phase_seconds_sum", phase="forward")
    assert sum(steps_took) <= forward <= value("stepscope_step_phase_seconds_sum", phase="train_batch")


ITERATOR_START_SECONDS = 0.2


class SlowStartLoader(DataLoader):
    """A validation DataLoader whose iterator takes ITERATOR_START_SECONDS to make, as one starting its worker
    processes does (num_workers > 0 without persistent_workers: at every validation)."""

    def __iter__(self) -> Iterator[Any]:
        time.sleep(ITERATOR_START_SECONDS)
        return super().__iter__()


def test_a_validations_loader_start_is_eval_time_not_a_slow_step(tmp_path: Path, exporter: Any) -> None:
    """Lightning makes the validation loaders' iterator before on_validation_start: the eval state covers the
    whole validation run, so each validation's 0.2 s iterator start is eval time and no step's (before: the step
    sum read 0.468 s for a truth of 0.266, the validation inside the steps counted in them)."""
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback

    outside = Outside()
    marks: list[float] = []


    class Module(working_module(pl)):
        def validation_step(self, batch, batch_idx):
            time.sleep(0.01)

    callback = StepscopeCallback(run="clock-val", push_url=exporter.url, push_interval=60)
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", enable_progress_bar=False, logger=False, enable_model_summary=False,
        enable_checkpointing=False, limit_train_batches=6, val_check_interval=3, limit_val_batches=1,
        num_sanity_val_steps=0, default_root_dir=tmp_path, callbacks=[callback, batch_end_marks(pl, marks)],
    )
    outside.time_validations(trainer)
    trainer.fit(Module(), DataLoader(Items(24, []), batch_size=4), SlowStartLoader(Items(4, []), batch_size=4))

    value = pushed(exporter, "clock-val")
    assert len(outside.spans) == 2 and value("stepscope_step_seconds_count") == len(marks) - 1 == 6
    assert value("stepscope_step_seconds_sum") == pytest.approx(outside.steps(marks), rel=0.03)
    validating = sum(end - start for start, end in outside.spans)
    assert 2 * ITERATOR_START_SECONDS < value("stepscope_state_seconds_total", state="eval") <= validating + 0.01


class SlowEpochStartLoader(TimedLoader):
    """A training TimedLoader whose iterator takes ITERATOR_START_SECONDS to make (non-persistent workers start
    at every epoch); `starts` gets when each iter() ended, and how long it took."""

    starts: list[tuple[float, float]]

    def __iter__(self) -> Iterator[Any]:
        start = perf_counter()
        time.sleep(ITERATOR_START_SECONDS)
        iterator = super().__iter__()
        self.starts.append((perf_counter(), perf_counter() - start))
        return iterator


def test_a_lightning_epochs_loader_start_is_loading_in_its_first_step(tmp_path: Path, exporter: Any) -> None:
    """Lightning makes the training loader's iterator again at each epoch after the first, in the epoch loop's
    on_run_start, before the first fetch: a step's time (train state) and loading. Before, it was in the step and
    not in dataloader_next: the loading share read 0.21 for 0.74. The first epoch's is made in setup."""
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback

    marks: list[float] = []  # the first epoch's start, then each batch's end


    callback = StepscopeCallback(run="clock-pl-epochs", push_url=exporter.url, push_interval=60)
    trainer = pl.Trainer(
        max_epochs=3, accelerator="cpu", enable_progress_bar=False, logger=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path,
        callbacks=[callback, batch_end_marks(pl, marks)],
    )
    train = SlowEpochStartLoader(Items(12, []), batch_size=4)
    train.fetches, train.starts = [], []
    trainer.fit(working_module(pl)(), train)

    value = pushed(exporter, "clock-pl-epochs")
    steps = marks[-1] - marks[0]
    assert len(train.starts) == 3 and value("stepscope_step_seconds_count") == len(marks) - 1 == 9
    assert value("stepscope_step_seconds_sum") == pytest.approx(steps, rel=0.03)
    loading = sum(train.fetches) + sum(took for _, took in train.starts[1:])  # the first start is setup's
    share = value("stepscope_step_phase_seconds_sum", phase="dataloader_next") / value("stepscope_step_seconds_sum")
    assert share == pytest.approx(loading / steps, abs=0.02)


def test_a_lightning_without_the_validation_run_warns_and_times_eval_by_the_callbacks(
        caplog: pytest.LogCaptureFixture) -> None:
    """A Lightning whose training epoch loop has no val_loop.run() trains on; eval is then the span between
    on_validation_start and on_validation_end, and the log says so once."""
    from stepscope.hooks.lightning import StepscopeCallback

    callback = StepscopeCallback(push_url="", run="no-run")
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()))
    with caplog.at_level(logging.WARNING):
        callback._wrap_validation(trainer)
    assert callback._wrapped == []
    assert caplog.text.count("eval is timed from on_validation_start to on_validation_end") == 1


def test_a_lightning_checkpoint_is_checkpoint_time_from_the_start_of_its_save(tmp_path: Path, exporter: Any) -> None:
    """A save gathers the model's state before any callback's on_save_checkpoint (here a state_dict() of 0.1 s;
    under FSDP or DeepSpeed the gather of every shard): that is the checkpoint's time, not a step's. Before, the
    five saves' gathers were in the steps. The user's own wrapper of save_checkpoint is put back after the fit."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stepscope.hooks.lightning import StepscopeCallback

    saves = Outside()  # each save, until training loads again
    marks: list[float] = []  # the epoch's start, then each batch's end (before the save that follows it)

    class Module(working_module(pl)):
        def state_dict(self, *args: Any, **kwargs: Any) -> Any:
            time.sleep(0.1)
            return super().state_dict(*args, **kwargs)

    class Marks(pl.Callback):  # runs before ModelCheckpoint, which Lightning puts last
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            marks.append(perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            marks.append(perf_counter())

    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", enable_progress_bar=False, logger=False, enable_model_summary=False,
        limit_train_batches=10, num_sanity_val_steps=0, default_root_dir=tmp_path,
        callbacks=[StepscopeCallback(run="clock-save", push_url=exporter.url, push_interval=60), Marks(),
                   ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)],
    )
    save = trainer.save_checkpoint

    def timed_save(*args: Any, **kwargs: Any) -> Any:  # the user's own wrapper
        saves.until_resumed()
        return save(*args, **kwargs)
    trainer.save_checkpoint = timed_save
    train = TimedLoader(Items(40, []), batch_size=4)
    train.fetches, train.outside = [], saves
    trainer.fit(Module(), train)
    saves.resumed()

    assert trainer.save_checkpoint is timed_save and len(saves.spans) == 5
    steps = saves.steps(marks)
    value = pushed(exporter, "clock-save")
    assert value("stepscope_step_seconds_count") == len(marks) - 1 == 10
    assert value("stepscope_step_seconds_sum") == pytest.approx(steps, rel=0.03)
    saving, count = sum(end - start for start, end in saves.spans), len(saves.spans)
    assert 0.9 * saving <= value("stepscope_state_seconds_total", state="checkpoint") <= saving + 0.02 * count


def test_a_save_in_a_callback_before_the_step_is_no_step_time(tmp_path: Path, exporter: Any) -> None:
    """A user's callback that saves in on_train_batch_end, before StepscopeCallback's counts the step: the step
    is then counted in the checkpoint state, and holds only its train time. Before, each save was in its step:
    a step sum of 3.07 s for 1.06 s of truth (a helper's probe; here 10 steps, 5 saves of 0.1 s)."""
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback

    saves = Outside()  # each save, until training loads again
    marks: list[float] = []  # the epoch's start, then each batch's end (before its save)

    class Module(working_module(pl)):
        def state_dict(self, *args: Any, **kwargs: Any) -> Any:
            time.sleep(0.1)
            return super().state_dict(*args, **kwargs)

    class SaveAtBatchEnd(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            marks.append(perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            marks.append(perf_counter())
            if batch_idx % 2:
                saves.until_resumed()
                trainer.save_checkpoint(tmp_path / f"step-{batch_idx}.ckpt")

    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", enable_progress_bar=False, logger=False, enable_model_summary=False,
        limit_train_batches=10, num_sanity_val_steps=0, default_root_dir=tmp_path, enable_checkpointing=False,
        callbacks=[SaveAtBatchEnd(), StepscopeCallback(run="clock-save-in-callback", push_url=exporter.url,
                                                       push_interval=60)],
    )
    train = TimedLoader(Items(40, []), batch_size=4)
    train.fetches, train.outside = [], saves
    trainer.fit(Module(), train)
    saves.resumed()

    assert len(saves.spans) == 5
    value = pushed(exporter, "clock-save-in-callback")
    assert value("stepscope_step_seconds_count") == len(marks) - 1 == 10
    # the test's mark is taken in its callback before save_checkpoint, the hook leaves train inside it: the save's
    # preamble lies between, 3.3 ms a save in a clean-clone CI run on 2 busy cores (0.542 s for 0.525)
    assert value("stepscope_step_seconds_sum") == pytest.approx(saves.steps(marks), rel=0.03,
                                                                abs=SAVE_PREAMBLE_SECONDS * len(saves.spans))


@pytest.mark.parametrize("users_tracker", [False, True], ids=["callbacks-tracker", "users-tracker"])
def test_a_save_after_the_fit_is_no_error_and_leaves_the_rank_idle(tmp_path: Path, exporter: Any,
                                                                    users_tracker: bool) -> None:
    """`trainer.save_checkpoint` once fit returned (a final checkpoint): before, the callback's own tracker,
    closed at teardown, made on_save_checkpoint raise AttributeError; a user's tracker was left in checkpoint."""
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback

    run = f"after-fit-{users_tracker}"
    users = tracker(exporter, run) if users_tracker else None
    callback = (StepscopeCallback(tracker=users) if users is not None
                else StepscopeCallback(run=run, push_url=exporter.url, push_interval=60))
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, accelerator="cpu", enable_progress_bar=False,
                         logger=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=tmp_path, callbacks=[callback])
    trainer.fit(working_module(pl)(), DataLoader(Items(8, []), batch_size=4))
    trainer.save_checkpoint(tmp_path / "final.ckpt")
    assert (tmp_path / "final.ckpt").is_file()
    if users is not None:
        assert users.current_state == "idle"
        users.close()


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_a_validate_test_or_predict_after_the_fit_keeps_the_runs_counters(tmp_path: Path, exporter: Any,
                                                                           stage: str) -> None:
    """`trainer.validate()` (test, predict) after fit with the same callback: before, setup made the callback a
    new tracker for the stage, whose pushes replaced the run's group with zeroed counters (steps 2 -> 0), a
    restart for the report; now only the fit is the run's, and the rank stays as the fit left it."""
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback

    class Evaluated(working_module(pl)):
        def validation_step(self, batch, batch_idx):
            self.log("loss", self.training_step(batch, batch_idx))

        def test_step(self, batch, batch_idx):
            self.log("loss", self.training_step(batch, batch_idx))

        def predict_step(self, batch, batch_idx):
            return self.net(batch[0])

    run = f"{stage}-after-fit"

    def pushed_lines() -> list[str]:  # the rank's group as pushed: not the exporter's reading of its process
        return [line for line in scrape(exporter.url).splitlines()
                if f'run="{run}"' in line and not line.startswith("stepscope_process_")]

    trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0,
                         accelerator="cpu", enable_progress_bar=False, logger=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path,
                         callbacks=[StepscopeCallback(run=run, push_url=exporter.url, push_interval=60)])
    module = Evaluated()
    trainer.fit(module, DataLoader(Items(8, []), batch_size=4))
    after_fit = pushed_lines()
    getattr(trainer, stage)(module, DataLoader(Items(4, []), batch_size=4))
    value = pushed(exporter, run)
    assert (value("stepscope_steps_total"), value("stepscope_samples_total")) == (2, 8)
    assert value("stepscope_training_state", state="idle") == 1
    assert pushed_lines() == after_fit


@pytest.mark.parametrize("new_trainer", [False, True], ids=["same-trainer", "new-trainer"])
def test_a_second_fit_with_the_same_callback_goes_on_counting_the_same_run(tmp_path: Path, exporter: Any,
                                                                          new_trainer: bool) -> None:
    """`trainer.fit()` again (more epochs) or a new Trainer's fit with the same callback, in the same process: one
    run whose counters go on. Before, the second fit's setup made a new tracker counting from 0 under the same run,
    rank and pid (steps 2, 0, 2: a counter reset; the report read 56.07 steps of 60 and the time between the fits
    as a restart gap), and a new Trainer's global step going back read as a restore redoing 30 steps."""
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback

    run = f"two-fits-{'new' if new_trainer else 'same'}-trainer"
    callback = StepscopeCallback(run=run, push_url=exporter.url, push_interval=60)

    def trainer() -> Any:
        return pl.Trainer(max_epochs=1, limit_train_batches=2, accelerator="cpu", enable_progress_bar=False,
                          logger=False, enable_model_summary=False, enable_checkpointing=False,
                          default_root_dir=tmp_path, callbacks=[callback])

    module, first = working_module(pl)(), trainer()
    first.fit(module, DataLoader(Items(8, []), batch_size=4))
    first_fit_ended = time.time()
    between = pushed(exporter, run)
    time.sleep(OUTSIDE)
    if new_trainer:
        trainer().fit(module, DataLoader(Items(8, []), batch_size=4))
    else:
        first.fit_loop.max_epochs = 2
        first.fit(module, DataLoader(Items(8, []), batch_size=4))
    value = pushed(exporter, run)
    assert between("stepscope_training_state", state="idle") == 1  # between the fits: idle, never lost
    assert (between("stepscope_steps_total"), between("stepscope_samples_total")) == (2, 8)
    assert (value("stepscope_steps_total"), value("stepscope_samples_total")) == (4, 16)  # 2 and 8 before the fix
    assert value("stepscope_training_global_step") == 4  # the run's step goes on, not back to 1 (a restore)
    assert value("stepscope_state_seconds_total", state="idle") >= OUTSIDE  # the time between the fits
    assert value("stepscope_training_state", state="idle") == 1
    assert between("stepscope_training_info", pid=str(os.getpid())) == value("stepscope_training_info",
                                                                             pid=str(os.getpid())) == 1
    # where the rules and the report take the tracker (the attempt) to have started: its last push less the seconds
    # its states add up to, before the first fit ended (a new tracker made it the second fit's start)
    started = value("stepscope_training_last_push_timestamp_seconds") - sum(
        value("stepscope_state_seconds_total", state=state) for state in STATES)
    assert started < first_fit_ended


def test_a_loop_that_calls_loader_every_epoch_keeps_the_epochs_end_in_its_steps(exporter: Any) -> None:
    """loader() each epoch, with work between an epoch's last step and the next epoch's loader() (an LR
    schedule, logging): that time is in the next step, so the steps add up to the loop's wall time from the
    first loader() to the last step and the loading share is the loader's over it (before: the work dropped,
    0.77 s of step time for 1.40 s)."""
    t = tracker(exporter, "clock-epochs")
    loader = TimedLoader(Items(12, []), batch_size=4)  # each batch's whole next(): the items leave out the collation
    loader.fetches = loading = []
    start = perf_counter()
    for _ in range(3):
        for x, _y in t.loader(loader):
            time.sleep(WORK)
            t.step(samples=len(x))
        end = perf_counter()
        time.sleep(OUTSIDE)  # the epoch's end
    t.close()
    value = pushed(exporter, "clock-epochs")
    assert value("stepscope_step_seconds_count") == 9
    assert value("stepscope_step_seconds_sum") == pytest.approx(end - start, abs=0.01)  # 0.54 s; 0.33 before
    share = value("stepscope_step_phase_seconds_sum", phase="dataloader_next") / value("stepscope_step_seconds_sum")
    assert share == pytest.approx(sum(loading) / (end - start), abs=0.02)


def test_a_validation_loader_wrapped_inside_an_eval_block_is_the_evals(exporter: Any) -> None:
    """A loop that wraps its validation loader in loader() too, inside `with tracker.state("eval")`: the validation is
    eval time, its fetches no dataloader_next, and the steps are the training's. Before, loader() set train there:
    the eval was in the next step and its fetches in dataloader_next (0.83 s of 0.96 s of step time, a share of 87%
    for 33%), and eval read 0.0001 s."""
    t = tracker(exporter, "clock-eval-loader")
    train, validation = DataLoader(Items(8, []), batch_size=4), DataLoader(Items(8, []), batch_size=4)
    steps, evals, states = 0.0, 0.0, set()
    t.state("train")  # the step clock starts here, not after the first iter() (setup's)
    for _epoch in range(2):
        start = perf_counter()
        for x, _y in t.loader(train):
            time.sleep(WORK)
            t.step(samples=len(x))
        steps += perf_counter() - start
        start = perf_counter()
        with t.state("eval"):
            for _x, _y in t.loader(validation):
                time.sleep(WORK)
                states.add(t.current_state)
        evals += perf_counter() - start
    t.close()
    value = pushed(exporter, "clock-eval-loader")
    assert value("stepscope_step_phase_seconds_count", phase="dataloader_next") == 4  # 8 before
    assert value("stepscope_step_seconds_sum") == pytest.approx(steps, abs=0.01)
    assert value("stepscope_state_seconds_total", state="eval") == pytest.approx(evals, abs=0.005)
    assert states == {"eval"}


def test_a_phase_entered_in_eval_or_a_checkpoint_is_no_steps(exporter: Any) -> None:
    """A helper that times forward, shared by the train and the eval loops: the eval's forwards are no step's phase,
    and a phase entered in train and ended inside a checkpoint (a callback saving before the step's end) still is.
    Before, forward held the eval's too: 0.61 s in 30 for a step sum of 0.20 s."""
    t = tracker(exporter, "clock-eval-phases")

    def forward() -> None:
        with t.phase("forward"):
            time.sleep(WORK)

    t.state("train")
    start = perf_counter()
    for _step in range(3):
        forward()
        t.phase("optimizer_step").start()
        time.sleep(WORK)
        with t.state("checkpoint"):
            t.phase("optimizer_step").end()
            forward()  # a save that runs the model: no step's
        t.step(samples=1)
        with t.state("eval"):
            for _batch in range(2):
                forward()
    t.state("eval")  # left by the next epoch's loader(), which times its fetches
    for _batch in t.loader(range(2)):
        t.step(samples=1)
    trained = perf_counter() - start
    t.close()
    value = pushed(exporter, "clock-eval-phases")
    assert value("stepscope_step_phase_seconds_count", phase="dataloader_next") == 2
    assert value("stepscope_step_phase_seconds_count", phase="forward") == 3  # 12 before
    assert value("stepscope_step_phase_seconds_count", phase="optimizer_step") == 3
    phases = sum(value("stepscope_step_phase_seconds_sum", phase=phase) for phase in ("forward", "optimizer_step"))
    assert 6 * WORK <= phases <= value("stepscope_step_seconds_sum") < trained


class PreparedEpochs:
    """A loader whose iter() prepares the epoch before its first batch (non-persistent workers start, a sampler
    shuffles, shards open): `loading` gets each iter()'s and each next()'s time."""

    def __init__(self, batches: int, loading: list[float]) -> None:
        self.batches, self.loading = batches, loading
        self.prepared: list[float] = []  # when each iter() returned

    def __iter__(self) -> Iterator[int]:
        start = perf_counter()
        time.sleep(OUTSIDE)
        self.prepared.append(perf_counter())
        self.loading.append(self.prepared[-1] - start)
        return self._batches()

    def _batches(self) -> Iterator[int]:
        for index in range(self.batches):
            start = perf_counter()
            time.sleep(WORK / 2)
            self.loading.append(perf_counter() - start)
            yield index


def test_an_epochs_iter_in_training_is_loading_time(exporter: Any) -> None:
    """The second and third epochs' iter() come while the loop trains: their time is in the step under way, and it
    is loading; from setup, the first epoch's is not (the clock starts after it). Before, it was in the step and
    not in dataloader_next: a loading share of 0.19 for 0.62."""
    t = tracker(exporter, "clock-epoch-iter")
    loading: list[float] = []
    loader = PreparedEpochs(3, loading)
    for _epoch in range(3):
        for _batch in t.loader(loader):
            time.sleep(WORK)
            t.step(samples=1)
        end = perf_counter()
    t.close()
    start = loader.prepared[0]  # the first iter() is setup: the step clock starts after it
    loading.pop(0)
    value = pushed(exporter, "clock-epoch-iter")
    assert value("stepscope_step_seconds_count") == 9
    assert value("stepscope_step_seconds_sum") == pytest.approx(end - start, abs=0.01)
    assert value("stepscope_step_phase_seconds_count", phase="dataloader_next") == 9
    share = value("stepscope_step_phase_seconds_sum", phase="dataloader_next") / value("stepscope_step_seconds_sum")
    assert share == pytest.approx(sum(loading) / (end - start), abs=0.02)


def test_a_phase_entered_again_before_it_is_left_never_records_more_than_the_time_it_was_open(
        exporter: Any) -> None:
    """A helper timing `forward` inside the loop's `forward`, a second thread in the same phase, and an end()
    with no start: before, the outer exit observed perf_counter_ns() - 0, the machine's uptime (294,301 s of
    forward for 0.05 s)."""
    t = tracker(exporter, "clock-nested")
    t.state("train")
    forward = t.phase("forward")
    inner = outer = 0.0
    for _ in range(5):
        began = perf_counter()
        with forward:
            time.sleep(0.002)
            start = perf_counter()
            with t.phase("forward"):  # the same timer, as a helper gets it
                time.sleep(0.01)
            inner += perf_counter() - start
        outer += perf_counter() - began
        t.step()
    t.phase("backward").end()  # an end whose start never came

    entered = threading.Barrier(2)

    def in_forward(seconds: float) -> None:
        with forward:
            entered.wait()
            time.sleep(seconds)
    began = perf_counter()
    workers = [threading.Thread(target=in_forward, args=(seconds,)) for seconds in (0.01, 0.03)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    threads_open = perf_counter() - began
    t.close()

    value = pushed(exporter, "clock-nested")
    assert inner <= value("stepscope_step_phase_seconds_sum", phase="forward") <= outer + threads_open
    assert value("stepscope_step_phase_seconds_sum", phase="backward") == 0
    assert value("stepscope_step_phase_seconds_count", phase="backward") == 0
    assert value("stepscope_step_phase_seconds_count", phase="forward") == 5 + 1  # the inner spans, one thread's


def entered_phases(exporter: Any, run: str) -> list[str]:
    return [dict(labels)["phase"] for name, labels in samples(scrape(exporter.url))
            if name == "stepscope_training_phase_entered_timestamp_seconds" and ("run", run) in labels]


class Corrupt(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index == 9:
            raise OSError("corrupt sample 9")
        return torch.zeros(8), torch.zeros(1)


def test_a_rank_closed_after_an_exception_is_in_no_phase(exporter: Any) -> None:
    """A loader that raises, and an exception between a phase's start() and end() (a callback's forward when
    training_step raises): once closed the rank is idle and in no phase. Before, its last push still named
    dataloader_next or forward, entered when the exception came."""
    t = tracker(exporter, "clock-loader-error")
    with pytest.raises(OSError, match="corrupt sample"):
        for x, _y in t.loader(DataLoader(Corrupt(), batch_size=4)):
            with t.phase("forward"):
                x.sum()
            t.step(samples=len(x))
    t.close()
    assert entered_phases(exporter, "clock-loader-error") == []

    t = tracker(exporter, "clock-forward-error")
    t.state("train")
    t.step()  # phase histograms are pushed from the step histogram's first push on
    deadline = time.monotonic() + 10
    while t.pusher.stats.successes < 1:  # the pusher thread's first push is in: a later one holds the phase
        assert time.monotonic() < deadline, "no first push"
        time.sleep(0.01)
    forward = t.phase("forward")
    with pytest.raises(RuntimeError, match="NaN loss"):
        forward.start()
        raise RuntimeError("NaN loss")
    t.pusher.push_once()  # a push while the exception is handled shows the phase it interrupted
    assert entered_phases(exporter, "clock-forward-error") == ["forward"]
    t.close()
    assert entered_phases(exporter, "clock-forward-error") == []
    value = pushed(exporter, "clock-forward-error")
    assert value("stepscope_training_state", state="idle") == 1
    forward.end()  # a phase exited after close observes nothing
    assert t.snapshot().phases[0][2].count == 0

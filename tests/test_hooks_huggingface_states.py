"""The transformers callback's states and step clock against truth timed in the same process (perf_counter), pushed
to a real exporter: evals and saves however they are scheduled (save_strategy="best", eval_on_start, a callback of
the user's after ours), a train() after one an exception ended (the caller's retry, auto_find_batch_size's), and a
training DataLoader of the user's whose iter() starts its workers eagerly."""

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from time import perf_counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from stepscope.hooks.huggingface import StepscopeCallback
from stepscope_testkit.processes import running_exporter, sample_values, samples, scrape
from tests.support.framework_truth import timed_batches

FORWARD = 0.02  # each batch's forward
EVAL = 0.15  # each evaluate()'s own time, besides the Trainer's
SAVE = 0.15  # each _save_checkpoint()'s
ITERATOR_START = 0.15  # a training DataLoader's eager iter()
fed = {"batches": 0, "samples": 0}  # what reached the model


@pytest.fixture(scope="module")
def exporter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_exporter(tmp_path_factory.mktemp("exporter")) as running:
        yield running


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        time.sleep(FORWARD)
        fed["batches"] += 1
        fed["samples"] += x.shape[0]
        return {"loss": ((self.lin(x).squeeze(-1) - labels) ** 2).mean()}


class Items(Dataset):
    def __init__(self, items: int) -> None:
        self.items = items

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((4,), float(index)), "labels": torch.tensor(0.0)}


class Clock(TrainerCallback):
    """Listed last: each train()'s begin and each step's end."""

    def __init__(self) -> None:
        self.begins: list[float] = []
        self.ends: list[float] = []

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        self.begins.append(perf_counter())

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.ends.append(perf_counter())

    def steps(self, outside: list[tuple[float, float]]) -> float:
        """Each step from the step before (or its train()'s begin) to its end, less the spans inside it."""
        marks = sorted([(at, "begin") for at in self.begins] + [(at, "end") for at in self.ends])
        total = 0.0
        for (start, _), (end, kind) in itertools.pairwise(marks):
            if kind == "end":
                total += end - start - sum(max(0.0, min(end, b) - max(start, a)) for a, b in outside)
        return total


class TimedTrainer(Trainer):
    """evaluate() and _save_checkpoint() take EVAL and SAVE seconds more, each timed into `spans`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spans: dict[str, list[tuple[float, float]]] = {"eval": [], "checkpoint": []}

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("eval", EVAL, super().evaluate, *args, **kwargs)

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("checkpoint", SAVE, super()._save_checkpoint, *args, **kwargs)

    def _timed(self, state: str, seconds: float, method: Any, *args: Any, **kwargs: Any) -> Any:
        start = perf_counter()
        time.sleep(seconds)
        try:
            return method(*args, **kwargs)
        finally:
            self.spans[state].append((start, perf_counter()))


class EvalAndSaveEveryOtherStep(TrainerCallback):
    """A user's own schedule, from a callback after StepscopeCallback's."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % 2 == 0:
            control.should_evaluate = control.should_save = True


def arguments(tmp_path: Path, **overrides: Any) -> TrainingArguments:
    settings = {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "per_device_eval_batch_size": 4,
                "report_to": [], "use_cpu": True, "disable_tqdm": True, "logging_strategy": "no", "max_steps": 6,
                "save_strategy": "no", "eval_strategy": "no", **overrides}
    return TrainingArguments(**settings)


def pushed(exporter: Any, run: str) -> Any:
    text = scrape(exporter.url)

    def value(name: str, **labels: str) -> float:
        [found] = sample_values(text, name, run=run, rank="0", **labels)
        return found
    return value


SCHEDULES = {  # (TrainingArguments, a callback after ours), each with evals and saves the flags at on_step_end missed
    "save-best": ({"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "best", "metric_for_best_model": "loss",
                   "greater_is_better": False}, None),
    "eval-on-start": ({"eval_strategy": "steps", "eval_steps": 100, "eval_on_start": True}, None),
    "later-callback": ({}, EvalAndSaveEveryOtherStep),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_eval_and_save_is_its_state_and_no_steps_time(tmp_path: Path, exporter: Any, schedule: str) -> None:
    """Before, the callback read the Trainer's flags at its on_step_end: save_strategy="best" decides after the eval
    (a step sum of 1.13 s for 0.32 and no checkpoint time), eval_on_start comes before any step end (the first step
    held the eval), and a callback after ours sets them later (1.95 s for 0.32, no eval time)."""
    overrides, later = SCHEDULES[schedule]
    clock = Clock()
    run = f"hf-{schedule}"
    callbacks = [StepscopeCallback(run=run, push_url=exporter.url, push_interval=60), *([later()] if later else []),
                 clock]
    trainer = TimedTrainer(model=Tiny(), args=arguments(tmp_path, **overrides), train_dataset=Items(40),
                           eval_dataset=Items(8), callbacks=callbacks)
    trainer.train()

    value = pushed(exporter, run)
    outside = trainer.spans["eval"] + trainer.spans["checkpoint"]
    assert value("stepscope_step_seconds_count") == 6
    assert value("stepscope_step_seconds_sum") == pytest.approx(clock.steps(outside), abs=0.02)
    for state, spans in trainer.spans.items():
        seconds = value("stepscope_state_seconds_total", state=state)
        assert 0.9 * sum(b - a for a, b in spans) <= seconds, (state, seconds, spans)
        assert seconds <= sum(b - a for a, b in spans) + 0.02 * len(spans), (state, seconds, spans)
    assert trainer.spans["eval"], "every schedule evaluates"
    if schedule != "eval-on-start":
        assert trainer.spans["checkpoint"], "and saves"
    assert not {"evaluate", "_save_checkpoint", "get_batch_samples"} & set(vars(trainer))  # put back after train()


class FailsOnce(Trainer):
    """The third batch's loss raises once: `message` says what (an out-of-memory error makes auto_find_batch_size
    train again at a smaller batch size)."""

    message = "boom"

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if self.message and fed["batches"] == 2:
            message, self.message = self.message, ""
            raise RuntimeError(message)
        return super().compute_loss(model, inputs, *args, **kwargs)


@pytest.mark.parametrize("retry", ["the-callers", "auto-find-batch-size"])
def test_a_train_after_one_an_exception_ended_counts_what_it_feeds_from_its_own_begin(
        tmp_path: Path, exporter: Any, retry: str) -> None:
    """Before, the callback stayed mid-training: the retry's first step held the failed attempt and the time between
    (2.27 s for 0.63), and its fetches went through the fetch wrapper wrapped again, each batch counted twice and
    the short last one never (48 samples for 46 fed; 58 for 54 under auto_find_batch_size)."""
    fed.update(batches=0, samples=0)
    clock = Clock()
    run = f"hf-retry-{retry}"
    trainer = FailsOnce(
        model=Tiny(), train_dataset=Items(38),
        args=arguments(tmp_path, max_steps=-1, num_train_epochs=1, auto_find_batch_size=retry != "the-callers",
                       per_device_train_batch_size=4 if retry == "the-callers" else 8),
        callbacks=[StepscopeCallback(run=run, push_url=exporter.url, push_interval=60), clock])
    if retry == "the-callers":
        with pytest.raises(RuntimeError, match=r"^boom$"):
            trainer.train()
        time.sleep(0.3)  # the caller's own time before it trains again: no step's
    else:
        trainer.message = "CUDA out of memory. Tried to allocate 2.00 GiB"
    trainer.train()

    value = pushed(exporter, run)
    assert value("stepscope_samples_total") == fed["samples"]
    assert value("stepscope_micro_batches_total") == fed["batches"]
    assert value("stepscope_step_seconds_sum") == pytest.approx(clock.steps([]), abs=0.02)
    assert value("stepscope_training_state", state="idle") == 1
    assert not [labels for name, labels in samples(scrape(exporter.url))
                if name == "stepscope_training_phase_entered_timestamp_seconds" and ("run", run) in labels]


class SlowStartLoader(DataLoader):
    """The user's own training DataLoader (get_train_dataloader's, not wrapped by accelerate): its iter() takes
    ITERATOR_START, as one starting non-persistent workers does; `loading` gets each iter()'s and next()'s time."""

    loading: list[float]

    def __iter__(self) -> Iterator[Any]:
        start = perf_counter()
        time.sleep(ITERATOR_START)
        batches = super().__iter__()
        self.loading.append(perf_counter() - start)
        return timed_batches(batches, self.loading.append)


def test_an_epochs_eager_loader_start_is_loading(tmp_path: Path, exporter: Any) -> None:
    """Each epoch's iter() comes between on_epoch_begin and the first fetch: before, it was in the step and in no
    phase (a loading share of 0.4% for 69.6% with a 0.2 s start)."""

    class OwnLoader(Trainer):
        def get_train_dataloader(self) -> DataLoader:
            loader = SlowStartLoader(self.train_dataset, batch_size=4, collate_fn=self.data_collator)
            loader.loading = loading
            return loader

    loading: list[float] = []
    clock = Clock()
    trainer = OwnLoader(model=Tiny(), args=arguments(tmp_path, max_steps=-1, num_train_epochs=3),
                        train_dataset=Items(16),
                        callbacks=[StepscopeCallback(run="hf-loader", push_url=exporter.url, push_interval=60), clock])
    trainer.train()

    value = pushed(exporter, "hf-loader")
    steps = clock.steps([])
    assert value("stepscope_step_seconds_sum") == pytest.approx(steps, abs=0.02)
    assert value("stepscope_step_phase_seconds_count", phase="dataloader_next") == 12
    share = value("stepscope_step_phase_seconds_sum", phase="dataloader_next") / value("stepscope_step_seconds_sum")
    assert share == pytest.approx(sum(loading) / steps, abs=0.02)

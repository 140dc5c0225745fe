"""The transformers callback's states and step clock against truth timed in the same process (perf_counter), pushed
to a real exporter: evals and saves however they are scheduled (save_strategy="best", eval_on_start, a callback of
the user's after ours), a train() after one an exception ended (the caller's retry, auto_find_batch_size's), and a
training DataLoader of the user's whose iter() starts its workers eagerly."""

import time
from collections.abc import Iterator
from pathlib import Path
from time import perf_counter
from typing import Any

import pytest
from torch.utils.data import DataLoader

from stepscope_testkit.processes import running_exporter, sample_values, samples, scrape
from tests.support.framework_truth import timed_batches

ITERATOR_START = 0.15  # a training DataLoader's eager iter()


@pytest.fixture(scope="module")
def exporter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_exporter(tmp_path_factory.mktemp("exporter")) as running:
        yield running


def pushed(exporter: Any, run: str) -> Any:
    text = scrape(exporter.url)

    def value(name: str, **labels: str) -> float:
        [found] = sample_values(text, name, run=run, rank="0", **labels)
        return found
    return value


SCHEDULES = {  # (TrainingArguments, whether a callback after ours sets the flags): evals and saves that the flags
    # at on_step_end missed
    "save-best": ({"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "best", "metric_for_best_model": "loss",
                   "greater_is_better": False}, None),
    "eval-on-start": ({"eval_strategy": "steps", "eval_steps": 100, "eval_on_start": True}, None),
    "later-callback": ({}, True),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_eval_and_save_is_its_state_and_no_steps_time(tmp_path: Path, exporter: Any, schedule: str) -> None:
    """Before, the callback read the Trainer's flags at its on_step_end: save_strategy="best" decides after the eval
    (a step sum of 1.13 s for 0.32 and no checkpoint time), eval_on_start comes before any step end (the first step
    held the eval), and a callback after ours sets them later (1.95 s for 0.32, no eval time)."""
    from tests.support import huggingface_states as hf

    overrides, later = SCHEDULES[schedule]
    clock = hf.Clock()
    run = f"hf-{schedule}"
    callbacks = [hf.StepscopeCallback(run=run, push_url=exporter.url, push_interval=60),
                 *([hf.EvalAndSaveEveryOtherStep()] if later else []), clock]
    trainer = hf.TimedTrainer(model=hf.Tiny(), args=hf.arguments(tmp_path, **overrides), train_dataset=hf.Items(40),
                              eval_dataset=hf.Items(8), callbacks=callbacks)
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


@pytest.mark.parametrize("retry", ["the-callers", "auto-find-batch-size"])
def test_a_train_after_one_an_exception_ended_counts_what_it_feeds_from_its_own_begin(
        tmp_path: Path, exporter: Any, retry: str) -> None:
    """Before, the callback stayed mid-training: the retry's first step held the failed attempt and the time between
    (2.27 s for 0.63), and its fetches went through the fetch wrapper wrapped again, each batch counted twice and
    the short last one never (48 samples for 46 fed; 58 for 54 under auto_find_batch_size)."""
    from tests.support import huggingface_states as hf

    hf.fed.update(batches=0, samples=0)
    clock = hf.Clock()
    run = f"hf-retry-{retry}"
    trainer = hf.FailsOnce(
        model=hf.Tiny(), train_dataset=hf.Items(38),
        args=hf.arguments(tmp_path, max_steps=-1, num_train_epochs=1, auto_find_batch_size=retry != "the-callers",
                       per_device_train_batch_size=4 if retry == "the-callers" else 8),
        callbacks=[hf.StepscopeCallback(run=run, push_url=exporter.url, push_interval=60), clock])
    if retry == "the-callers":
        with pytest.raises(RuntimeError, match=r"^boom$"):
            trainer.train()
        time.sleep(0.3)  # the caller's own time before it trains again: no step's
    else:
        trainer.message = "CUDA out of memory. Tried to allocate 2.00 GiB"
    trainer.train()

    value = pushed(exporter, run)
    assert value("stepscope_samples_total") == hf.fed["samples"]
    assert value("stepscope_micro_batches_total") == hf.fed["batches"]
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
    from tests.support import huggingface_states as hf

    class OwnLoader(hf.Trainer):
        def get_train_dataloader(self) -> DataLoader:
            loader = SlowStartLoader(self.train_dataset, batch_size=4, collate_fn=self.data_collator)
            loader.loading = loading
            return loader

    loading: list[float] = []
    clock = hf.Clock()
    trainer = OwnLoader(model=hf.Tiny(), args=hf.arguments(tmp_path, max_steps=-1, num_train_epochs=3),
                        train_dataset=hf.Items(16),
                        callbacks=[hf.StepscopeCallback(run="hf-loader", push_url=exporter.url, push_interval=60),
                                   clock])
    trainer.train()

    value = pushed(exporter, "hf-loader")
    steps = clock.steps([])
    assert value("stepscope_step_seconds_sum") == pytest.approx(steps, abs=0.02)
    assert value("stepscope_step_phase_seconds_count", phase="dataloader_next") == 12
    share = value("stepscope_step_phase_seconds_sum", phase="dataloader_next") / value("stepscope_step_seconds_sum")
    assert share == pytest.approx(sum(loading) / steps, abs=0.02)

"""The transformers side of tests/test_hooks_huggingface_states.py: a tiny model and dataset, the Trainer
subclasses and callbacks that time what the Trainer does. Apart from the test module because transformers' Trainer
takes 2.1 s of CPU to import, and every pytest-xdist worker collects every test module while one runs this one:
the tests import it when they run."""

import itertools
import time
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from stepscope.hooks.huggingface import StepscopeCallback as StepscopeCallback  # the tests': it imports transformers

FORWARD = 0.02  # each batch's forward
EVAL = 0.15  # each evaluate()'s own time, besides the Trainer's
SAVE = 0.15  # each _save_checkpoint()'s
fed = {"batches": 0, "samples": 0}  # what reached the model


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


class FailsOnce(Trainer):
    """The third batch's loss raises once: `message` says what (an out-of-memory error makes auto_find_batch_size
    train again at a smaller batch size)."""

    message = "boom"

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if self.message and fed["batches"] == 2:
            message, self.message = self.message, ""
            raise RuntimeError(message)
        return super().compute_loss(model, inputs, *args, **kwargs)

"""What tests/test_framework_truth.py trains and how it measures the truth, shared with the 2-rank
Lightning DDP run it starts (tests/support/lightning_ddp.py).

Every run accumulates gradients over 4 batches, ends every epoch on a partial batch and a short
accumulation, validates, saves checkpoints and has a neighbour callback that spends time at every batch
end (as `max_time`'s Timer does with its broadcast under DDP). The truth comes from the frameworks' own
objects, not from stepscope: optimizer steps from an optimizer step post-hook, micro-batches and samples
from the model's training forwards, loading time from the Dataset and the collate function (and, for Hugging
Face, each fetch where accelerate's DataLoaderShard yields it), evaluation and checkpoint spans from the
trainers' own methods (Lightning's checkpoint from its save until training goes on, the span its callback's
checkpoint state is documented to cover).
"""

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

BATCH = 4
ITEMS = 70  # 18 batches an epoch, the last of 2: 5 optimizer steps (4, 4, 4, 4, 2 batches) with accumulation 4
ACCUMULATE = 4
EPOCHS = 2
ITEM_SECONDS = 0.001  # loading: 4 ms a batch
COMPUTE_SECONDS = 0.02  # a training forward: steps long enough that the loader's own overhead (~0.3 ms a
# batch on top of the Dataset and the collate here) stays well inside the share's tolerance
NEIGHBOUR_SECONDS = 0.003  # another callback's work at each batch end: in the step, in no phase
EVAL_ITEM_SECONDS = 0.01
SAVE_SECONDS = 0.05


@dataclass
class Truth:
    """What the job really did, measured without stepscope."""

    loading: float = 0.0
    fetching: float = 0.0  # each next() on the training loader where the framework's fetch takes the batch
    optimizer_steps: int = 0
    forwards: int = 0
    samples: int = 0
    spans: dict[str, list[float]] = field(default_factory=lambda: {"eval": [], "checkpoint": []})

    def __post_init__(self) -> None:
        self._pending: tuple[str, float] | None = None  # (kind, start) of a span open until training goes on

    def count_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training:
            inputs = args[0] if args else kwargs["x"]
            self.forwards += 1
            self.samples += inputs.shape[0]

    def count_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.optimizer_steps += 1

    def timed(self, kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.resumed()
            start = perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.spans[kind].append(perf_counter() - start)
        return wrapper

    def timed_until_resumed(self, kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
        """Each call of `method` starts a span of `kind` that ends when training goes on (`resumed`): the
        next training batch fetched (ResumingLoader), a validation, or the fit's end. Lightning's checkpoint
        state stands for that span, the save and then the rest of the batch's end (under DDP, waiting for the
        other rank)."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.resumed()
            self._pending = (kind, perf_counter())
            return method(*args, **kwargs)
        return wrapper

    def resumed(self) -> None:
        """Ends the span that `timed_until_resumed` started, if one is open."""
        if self._pending is not None:
            kind, start = self._pending
            self.spans[kind].append(perf_counter() - start)
            self._pending = None

    def collate(self, batch: list) -> Any:
        start = perf_counter()
        result = default_collate(batch)
        self.loading += perf_counter() - start
        return result

    def timed_fetches(self, shard_iter: Callable[[Any], Iterator[Any]]) -> Callable[[Any], Iterator[Any]]:
        """Wraps accelerate's `DataLoaderShard.__iter__` so each batch of the training set's loader adds its
        next() to `fetching`: the Dataset and the collate plus the shard's own work (a batch ahead, even-batch
        padding) and whatever the OS takes from the process meanwhile, which `loading` cannot see. The last
        next(), which only ends the epoch, is no fetch."""
        truth = self

        def __iter__(loader: Any) -> Iterator[Any]:
            batches = shard_iter(loader)
            if getattr(loader.dataset, "truth", None) is not truth:  # the eval loader
                yield from batches
                return
            yield from timed_batches(batches, truth.fetched)
        return __iter__

    def fetched(self, seconds: float) -> None:
        self.fetching += seconds

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> "Truth":
        return cls(**json.loads(path.read_text()))


def timed_batches(batches: Iterator[Any], record: Callable[[float], None]) -> Iterator[Any]:
    """Yields from `batches`, handing `record` each next()'s seconds; the next() that ends them loads none."""
    while True:
        start = perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            return
        record(perf_counter() - start)
        yield batch


class Items(Dataset):
    """Regression items; each load sleeps and is timed into the truth (training) or only sleeps (eval)."""

    def __init__(self, items: int, truth: Truth | None, as_dict: bool = False) -> None:
        self.items, self.truth, self.as_dict = items, truth, as_dict

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> Any:
        start = perf_counter()
        time.sleep(ITEM_SECONDS if self.truth is not None else EVAL_ITEM_SECONDS)
        x = torch.full((8,), index / self.items)
        item = {"x": x, "labels": x.sum(dim=0, keepdim=True)} if self.as_dict else (x, x.sum(dim=0, keepdim=True))
        if self.truth is not None:
            self.truth.loading += perf_counter() - start
        return item


class ResumingLoader(DataLoader):
    """The training DataLoader: each batch's `next()` first ends the open checkpoint span, where the Lightning
    callback's fetch hook ends the checkpoint state. Ending it at the first item instead put the DataLoader's own
    work before it in the checkpoint: beside eight busy test workers 44 ms over two saves, 15% of the truth. The
    truth is the dataset's, which survives Lightning re-creating the loader with a distributed sampler."""

    def __iter__(self) -> Iterator[Any]:
        truth = self.dataset.truth
        truth.resumed()
        start = perf_counter()
        batches = super().__iter__()  # the epoch's first fetch makes the DataLoader's iterator
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            truth.fetched(perf_counter() - start)
            yield batch
            truth.resumed()
            start = perf_counter()


class Compute(nn.Module):
    """Stands for a training forward's GPU time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(COMPUTE_SECONDS)
        return x


def net(truth: Truth) -> nn.Module:
    module = nn.Sequential(Compute(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    module.register_forward_pre_hook(truth.count_forward, with_kwargs=True)
    return module


def lightning_fit(truth: Truth, root: Path, callback: Any, **trainer_args: Any) -> Any:
    """Fits the Lightning module as a user would, the truth measured beside; returns the Trainer."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net(truth)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def on_save_checkpoint(self, checkpoint: dict) -> None:
            time.sleep(SAVE_SECONDS)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            optimizer = torch.optim.SGD(self.parameters(), lr=1e-3)
            optimizer.register_step_post_hook(truth.count_step)
            return optimizer

    class Neighbour(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            time.sleep(NEIGHBOUR_SECONDS)

    trainer = pl.Trainer(
        max_epochs=EPOCHS, max_time="00:00:10:00", accumulate_grad_batches=ACCUMULATE, accelerator="cpu",
        enable_progress_bar=False, logger=False, enable_model_summary=False, val_check_interval=8,
        limit_val_batches=2, default_root_dir=root,
        callbacks=[callback, Neighbour(), ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=4, save_top_k=-1)],
        **trainer_args,
    )
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    val_loop.run = truth.timed("eval", val_loop.run)  # the sanity check and every validation
    trainer.save_checkpoint = truth.timed_until_resumed("checkpoint", trainer.save_checkpoint)
    trainer.fit(Module(), ResumingLoader(Items(ITEMS, truth), batch_size=BATCH, collate_fn=truth.collate),
                DataLoader(Items(8, None), batch_size=BATCH))
    truth.resumed()
    return trainer


def huggingface_train(truth: Truth, root: Path, callback: Any) -> Any:
    """Trains with the transformers Trainer as a user would, the truth measured beside; returns the Trainer."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net(truth)

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
            out = self.net(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    class Neighbour(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            time.sleep(NEIGHBOUR_SECONDS * ACCUMULATE)

    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    optimizer.register_step_post_hook(truth.count_step)
    args = TrainingArguments(
        output_dir=str(root / "hf"), num_train_epochs=EPOCHS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE, per_device_eval_batch_size=BATCH, report_to=[], use_cpu=True,
        logging_strategy="steps", logging_steps=1, eval_strategy="steps", eval_steps=3, save_strategy="steps",
        save_steps=4, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=Items(ITEMS, truth, as_dict=True), data_collator=truth.collate,
        eval_dataset=Items(8, None, as_dict=True), optimizers=(optimizer, None), callbacks=[callback, Neighbour()],
    )
    trainer._evaluate = truth.timed("eval", trainer._evaluate)
    trainer._save_checkpoint = truth.timed("checkpoint", trainer._save_checkpoint)
    from accelerate.data_loader import DataLoaderShard

    with mock.patch.object(DataLoaderShard, "__iter__", truth.timed_fetches(DataLoaderShard.__iter__)):
        trainer.train()
    return trainer

"""Lightning integration: `Trainer(callbacks=[StepscopeCallback()])` times every training step.

Phases (from Lightning 2.x hooks; GPU phases use CUDA events when the model is on a GPU):
  dataloader_next  previous batch end -> batch transfer start (the fetch; checkpoint/eval gaps dropped)
  to_device        the strategy's `batch_to_device` (wrapped while fitting)
  forward          on_train_batch_start -> on_before_backward (training_step, zero_grad)
  backward         on_before_backward -> on_after_backward
  optimizer_step   on_before_optimizer_step -> on_train_batch_end
  train_batch      on_train_batch_start -> on_train_batch_end
States: train, eval (validation and sanity check), checkpoint (on_save_checkpoint until the next
batch), idle after fit. Requires the `lightning` package; importing this module imports it.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.data import extract_batch_size

import training_hooks
from stepscope_contract.training import (
    BACKWARD_PHASE,
    CHECKPOINT_STATE,
    DATA_LOADING_PHASE,
    EVAL_STATE,
    FORWARD_PHASE,
    IDLE_STATE,
    OPTIMIZER_PHASE,
    SETUP_STATE,
    TO_DEVICE_PHASE,
    TRAIN_BATCH_PHASE,
    TRAIN_STATE,
)
from training_hooks.tracker import Tracker

_GPU_PHASES = (FORWARD_PHASE, BACKWARD_PHASE, OPTIMIZER_PHASE, TRAIN_BATCH_PHASE)


class StepscopeCallback(Callback):
    """Times Lightning's training loop into a Tracker (created at setup unless one is given).

    A tracker it creates takes run/rank/world size from the Trainer and the environment, framework
    "lightning", and is closed (final push) at teardown. `init_kwargs` go to `training_hooks.init`.
    """

    def __init__(self, tracker: Tracker | None = None, **init_kwargs: Any) -> None:
        self.tracker = tracker
        self._owns_tracker = tracker is None
        self._init_kwargs = init_kwargs
        self._loading = False
        self._in_optimizer = False
        self._in_forward = False
        self._wrapped: Any = None

    # -- lifecycle --------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.tracker is None:
            kwargs = {"framework": "lightning", "rank": trainer.global_rank, "local_rank": trainer.local_rank,
                      "world_size": trainer.world_size, **self._init_kwargs}
            self.tracker = training_hooks.init(**kwargs)
        if stage == "fit":
            self._wrap_batch_to_device(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._unwrap_batch_to_device()
        self._finish()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._unwrap_batch_to_device()
        self._finish()

    def _finish(self) -> None:
        if self.tracker is None:
            return
        if self._owns_tracker:
            self.tracker.close()
            self.tracker = None
        else:
            self.tracker.state(IDLE_STATE)

    # -- phases -----------------------------------------------------------------------------------

    def _phase(self, name: str) -> Any:
        assert self.tracker is not None, "StepscopeCallback used before Trainer setup"
        return self.tracker.phase(name, cuda=name in _GPU_PHASES)

    def _wrap_batch_to_device(self, trainer: Trainer) -> None:
        strategy = trainer.strategy
        original = strategy.batch_to_device

        def batch_to_device(batch: Any, *args: Any, **kwargs: Any) -> Any:
            if not trainer.training or self.tracker is None:
                return original(batch, *args, **kwargs)
            self._end_loading()
            with self._phase(TO_DEVICE_PHASE):
                return original(batch, *args, **kwargs)

        strategy.batch_to_device = batch_to_device  # instance attribute; removed at teardown
        self._wrapped = strategy

    def _unwrap_batch_to_device(self) -> None:
        if self._wrapped is not None:
            self._wrapped.__dict__.pop("batch_to_device", None)
            self._wrapped = None

    def _start_loading(self) -> None:
        self._phase(DATA_LOADING_PHASE).start()
        self._loading = True

    def _end_loading(self) -> None:
        """Closes the loading gap; a gap that contained eval or checkpointing is dropped, not recorded."""
        if self._loading and self.tracker is not None and self.tracker.current_state == TRAIN_STATE:
            self._phase(DATA_LOADING_PHASE).end()
        self._loading = False

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.tracker.state(TRAIN_STATE)
        self._start_loading()

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._end_loading()
        if self.tracker.current_state != TRAIN_STATE:  # back from a checkpoint: its time is not a step
            self.tracker.state(TRAIN_STATE)
        self._in_optimizer = False
        self._phase(TRAIN_BATCH_PHASE).start()
        self._phase(FORWARD_PHASE).start()
        self._in_forward = True

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        if self._in_forward:  # a second backward in one step (manual optimization) ends no forward
            self._phase(FORWARD_PHASE).end()
            self._in_forward = False
        self._phase(BACKWARD_PHASE).start()

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._phase(BACKWARD_PHASE).end()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if not self._in_optimizer:  # several optimizers: one span from the first to the batch end
            self._phase(OPTIMIZER_PHASE).start()
            self._in_optimizer = True

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._in_optimizer:
            self._phase(OPTIMIZER_PHASE).end()
            self._in_optimizer = False
        self._phase(TRAIN_BATCH_PHASE).end()
        self.tracker.step(samples=_batch_size(batch))
        self._start_loading()

    # -- states -----------------------------------------------------------------------------------

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.tracker.state(EVAL_STATE)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.tracker.state(TRAIN_STATE)
            self._start_loading()
        else:
            self.tracker.state(SETUP_STATE if trainer.sanity_checking else IDLE_STATE)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        self.tracker.state(CHECKPOINT_STATE)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loading = False
        self.tracker.state(IDLE_STATE)


def _batch_size(batch: Any) -> int:
    try:
        return int(extract_batch_size(batch))
    except Exception:  # a batch without tensors: count steps, not samples
        return 0

"""Hugging Face integration: `Trainer(..., callbacks=[StepscopeCallback()])` times every optimizer step.

Phases (from `transformers.TrainerCallback` hooks; one step = one optimizer step):
  dataloader_next     previous step end -> on_step_begin (fetching the step's batches; eval/save gaps dropped)
  train_batch         on_step_begin -> on_step_end (forward, backward, optimizer: not split by the Trainer)
  optimizer_step      on_pre_optimizer_step -> on_optimizer_step
  step_lr_schedulers  on_optimizer_step -> on_step_end (scheduler step and zero_grad)
samples_total counts train_batch_size (per device x GPUs in this process) x gradient_accumulation_steps
per step (the Trainer does not show the batch to callbacks). States: train, eval and checkpoint (entered
when the Trainer decides to evaluate or save at a step end, left when it reports done), idle after training.
Requires `transformers`; importing this module imports it.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import training_hooks
from stepscope_contract.training import (
    CHECKPOINT_STATE,
    DATA_LOADING_PHASE,
    EVAL_STATE,
    IDLE_STATE,
    LR_SCHEDULER_PHASE,
    OPTIMIZER_PHASE,
    TRAIN_BATCH_PHASE,
    TRAIN_STATE,
)
from training_hooks.tracker import Tracker

_GPU_PHASES = (TRAIN_BATCH_PHASE, OPTIMIZER_PHASE, LR_SCHEDULER_PHASE)


class StepscopeCallback(TrainerCallback):
    """Times the Trainer's loop into a Tracker (created at on_train_begin unless one is given).

    A tracker it creates takes rank and world size from TrainingArguments, framework "transformers",
    and is closed (final push) at on_train_end. `init_kwargs` go to `training_hooks.init`.
    """

    def __init__(self, tracker: Tracker | None = None, **init_kwargs: Any) -> None:
        self.tracker = tracker
        self._owns_tracker = tracker is None
        self._init_kwargs = init_kwargs
        self._loading = False
        self._in_step = False
        self._samples_per_step = 0

    def _phase(self, name: str) -> Any:
        return self.tracker.phase(name, cuda=name in _GPU_PHASES)

    def _start_loading(self) -> None:
        self._phase(DATA_LOADING_PHASE).start()
        self._loading = True

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self.tracker is None:
            init = {"framework": "transformers", "rank": args.process_index,
                    "local_rank": args.local_process_index, "world_size": args.world_size,
                    **self._init_kwargs}
            self.tracker = training_hooks.init(**init)
        self._samples_per_step = args.train_batch_size * args.gradient_accumulation_steps
        self.tracker.state(TRAIN_STATE)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._start_loading()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        if self.tracker.current_state != TRAIN_STATE:
            self.tracker.state(TRAIN_STATE)  # restarts the step clock: eval/save time is not a step
            self._loading = False
        if self._loading:
            self._phase(DATA_LOADING_PHASE).end()
            self._loading = False
        self._phase(TRAIN_BATCH_PHASE).start()
        self._in_step = True

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              **kwargs: Any) -> None:
        self._phase(OPTIMIZER_PHASE).start()

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          **kwargs: Any) -> None:
        self._phase(OPTIMIZER_PHASE).end()
        self._phase(LR_SCHEDULER_PHASE).start()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if not self._in_step:
            return
        self._in_step = False
        self._phase(LR_SCHEDULER_PHASE).end()
        self._phase(TRAIN_BATCH_PHASE).end()
        self.tracker.step(samples=self._samples_per_step)
        self._enter_eval_or_save(control)
        self._start_loading()

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._enter_eval_or_save(control)

    def _enter_eval_or_save(self, control: TrainerControl) -> None:
        """DefaultFlowCallback (always first) has already decided whether the Trainer evaluates or saves."""
        if control.should_evaluate:
            self.tracker.state(EVAL_STATE)
        elif control.should_save:
            self.tracker.state(CHECKPOINT_STATE)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if control.should_save:
            self.tracker.state(CHECKPOINT_STATE)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._loading = False
        if self._owns_tracker:
            self.tracker.close()
            self.tracker = None
        else:
            self.tracker.state(IDLE_STATE)

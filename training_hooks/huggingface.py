"""Hugging Face integration: `Trainer(..., callbacks=[StepscopeCallback()])` times every optimizer step.

A step is an optimizer step (what `state.global_step` counts): with `gradient_accumulation_steps=4` one
step feeds four batches, counted beside it in micro_batches_total. Samples are the sizes of the batches
really fed (a partial last batch or a short last accumulation counts what it holds). Phases (from
`transformers.TrainerCallback` hooks, and the Trainer's `get_batch_samples` wrapped while training):
  dataloader_next     each `next()` on the epoch's batch iterator, nothing else (the Trainer fetches a
                      step's batches before on_step_begin); under DDP an epoch's first `next()` also holds
                      accelerate's broadcast of the RNG state, so a rank that waits there for another (one
                      that was saving a checkpoint) counts that wait as loading
  train_batch         on_step_begin -> on_step_end (forward, backward, optimizer: not split by the Trainer)
  optimizer_step      on_pre_optimizer_step -> on_optimizer_step
  step_lr_schedulers  on_optimizer_step -> on_step_end (scheduler step and zero_grad)
What is in a step but in no phase: logging (its loss gather across ranks), the other callbacks, counting
the step's label tokens (`num_items_in_batch`, gathered across ranks when averaged).
Tokens and model FLOPs (docs/mfu.md): each batch's tokens are its main input's elements (`input_ids`:
the Trainer's own `estimate_tokens`, padding included) and its FLOPs the Trainer's own estimate,
6 x non-embedding parameters x tokens (`floating_point_ops`), counted where the model is a transformers
model; FLOPs the user states (flops_per_step=, flops_per_sample=) count instead.
States: train, eval (the Trainer's `evaluate()` while training: `eval_on_start`, eval_steps, a callback's
`should_evaluate`), checkpoint (its `_save_checkpoint`: save_steps, `save_strategy="best"` after an eval that
found a new best, a callback's `should_save`), idle after training. The work itself is wrapped, not the flags
that schedule it: those that a callback after this one sets, and "best", are known only after its hooks ran.
An exception out of `train()` leaves the rank in train, its phase open (transformers has no exception hook),
until the next `train()` (the Trainer's own retry under `auto_find_batch_size` too), which starts it afresh, or
the process's exit.
`train()` again in the same process (the same Trainer or another with this callback) is the same run, as with the
Lightning callback: the tracker closed at on_train_end is reopened at the next on_train_begin, its counters go on
and the time between is idle; a `train()` that starts from global step 0 (nothing resumed) goes on from the global
step the last one reached. That offset is kept in each checkpoint the train() saves (trainer_state.json's
`stateful_callbacks`, under "stepscope"): a `train(resume_from_checkpoint=...)` of it, with the same callback or a new
one in a new process, pushes its trainer's global step plus the offset of the train() that saved it, as the Lightning
callback does. Not as an `ExportableState`: the Trainer restores those only with
`restore_callback_states_from_checkpoint` (off by default), and then by replacing the callback with a new one built
from saved arguments, which would drop the tracker and the settings the user gave it. With that option on, the Trainer
warns that it ignores "stepscope".
Requires `transformers`; importing this module imports it.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import stepscope.hooks
from stepscope.contract.training import (
    CHECKPOINT_STATE,
    DATA_LOADING_PHASE,
    EVAL_STATE,
    IDLE_STATE,
    LR_SCHEDULER_PHASE,
    OPTIMIZER_PHASE,
    TRAIN_BATCH_PHASE,
    TRAIN_STATE,
)
from stepscope.hooks.tracker import Tracker

log = logging.getLogger("stepscope.hooks")

_GPU_PHASES = (TRAIN_BATCH_PHASE, OPTIMIZER_PHASE, LR_SCHEDULER_PHASE)
_FETCH = "get_batch_samples"  # Trainer method that draws a step's batches from the epoch iterator
_EVALUATE = "evaluate"  # the evaluation, wherever the training loop or a callback calls it
_SAVE = "_save_checkpoint"  # the training loop's save (model, optimizer, scheduler, RNG, trainer state)
_ABSENT = object()  # an attribute the Trainer instance did not have of its own
_TRAINER_SEARCH_DEPTH = 8  # frames between on_train_begin and the Trainer's training loop
_STATE_KEY = "stepscope"  # this callback's entry in TrainerState.stateful_callbacks, saved in each checkpoint


class StepscopeCallback(TrainerCallback):
    """Times the Trainer's loop into a Tracker (created at on_train_begin unless one is given).

    A tracker it creates takes rank and world size from TrainingArguments, framework "transformers",
    is closed (final push) at on_train_end and reopened at the next on_train_begin. `init_kwargs` go to
    `stepscope.hooks.init`.
    """

    def __init__(self, tracker: Tracker | None = None, **init_kwargs: Any) -> None:
        self.tracker = tracker
        self._owns_tracker = tracker is None
        self._init_kwargs = init_kwargs
        self._in_step = False
        # (samples, tokens, FLOPs or None) of the batches fetched and not yet fed, in order
        self._fed: deque[tuple[int, int, float | None]] = deque()
        self._flops_per_token: float | None = None  # 6 x non-embedding parameters, where the model says
        self._default_batch = 0  # samples per batch where the fetch is not seen
        self._trainer: Trainer | None = None
        # (attribute, the instance's own value it covered, if any) set on the Trainer while training
        self._wrapped: list[tuple[str, Any]] = []
        self._loader_starting = False  # dataloader_next was started at the epoch's begin, before its first fetch
        self._training = False  # between on_train_begin and on_train_end: a user's own evaluate() changes nothing
        self._step_offset = 0  # added to state.global_step in this train(): the run's count across them

    def _phase(self, name: str) -> Any:
        return self.tracker.phase(name, cuda=name in _GPU_PHASES)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self.tracker is None:
            init = {"framework": "transformers", "rank": args.process_index,
                    "local_rank": args.local_process_index, "world_size": args.world_size,
                    **self._init_kwargs}
            self.tracker = stepscope.hooks.init(**init)
        elif self._training:  # the last train() ended by an exception (auto_find_batch_size retries after one)
            self._end_training(close=False)
        elif self._owns_tracker:
            self.tracker.reopen()  # train() after one: the same run goes on
        self._step_offset = self._global_step_offset(state)
        self._default_batch = args.train_batch_size
        self._flops_per_token = _flops_per_token(kwargs.get("model"))
        self._trainer = _find_trainer()
        self._wrap_fetch()
        self._wrap_outside(_EVALUATE, EVAL_STATE)
        self._wrap_outside(_SAVE, CHECKPOINT_STATE)
        self._training = True
        self.tracker.state(TRAIN_STATE)

    def _global_step_offset(self, state: TrainerState) -> int:
        """What this train() adds to the Trainer's global step, noted in the state its checkpoints save.

        A train() resumed from a checkpoint takes the offset saved there (a state loaded from trainer_state.json):
        without it, a train() to step 3, a second to the run's 6 (its own 3, saving at each) and a resume of the
        second's checkpoint-1 (the run's 4) pushed 2, and the rules counted 5 steps done again for 2. Any other
        train() takes the tracker's (the global step reached so far where it starts from 0).
        """
        saved = state.stateful_callbacks.get(_STATE_KEY) if isinstance(state.stateful_callbacks, dict) else None
        if isinstance(saved, dict) and state.global_step > 0:
            offset = int(saved.get("global_step_offset", 0))
        else:
            offset = self.tracker.global_step_offset(state.global_step)
        if isinstance(state.stateful_callbacks, dict):
            state.stateful_callbacks[_STATE_KEY] = {"global_step_offset": offset}
        return offset

    def _wrap_fetch(self) -> None:
        """Hands `get_batch_samples` an iterator that times each fetch and notes each batch's size."""
        trainer = self._trainer
        if trainer is None or not callable(getattr(trainer, _FETCH, None)):
            log.warning("stepscope: no Trainer with %s found from on_train_begin; %s is not timed and samples "
                        "are counted as train_batch_size per batch", _FETCH, DATA_LOADING_PHASE)
            return
        original = getattr(trainer, _FETCH)

        def get_batch_samples(epoch_iterator: Iterator[Any], *args: Any, **kwargs: Any) -> Any:
            return original(self._timed(epoch_iterator), *args, **kwargs)

        self._wrap(_FETCH, get_batch_samples)

    def _wrap_outside(self, attribute: str, state: str) -> None:
        """Sets `state` for the time the Trainer's `attribute` (an eval, a save) runs while training, then the state
        before it. The flags that schedule them were read at on_step_end: a callback after this one sets them later,
        and save_strategy="best" after the eval, so those evals and saves were counted in the steps, in train."""
        original = getattr(self._trainer, attribute, None)
        if not callable(original):
            if self._trainer is not None:
                log.warning("stepscope: this Trainer has no %s; its time is counted in the steps", attribute)
            return

        def outside_training(*args: Any, **kwargs: Any) -> Any:  # put back at on_train_end: while training only
            with self.tracker.state(state):
                return original(*args, **kwargs)

        self._wrap(attribute, outside_training)

    def _wrap(self, attribute: str, wrapper: Any) -> None:
        """Sets `wrapper` as an instance attribute of the Trainer over its method (or over the instance's own, a
        user's wrapper), put back as it was at on_train_end."""
        self._wrapped.append((attribute, vars(self._trainer).get(attribute, _ABSENT)))
        setattr(self._trainer, attribute, wrapper)

    def _unwrap(self) -> None:
        for attribute, covered in reversed(self._wrapped):
            if covered is _ABSENT:
                vars(self._trainer).pop(attribute, None)
            else:
                setattr(self._trainer, attribute, covered)
        self._wrapped = []
        self._trainer = None

    def _timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Yields from `batches`, timing each `next()` as dataloader_next.

        The `next()` that ends the epoch (an unsized loader's: an IterableDataset) or raises loads no batch: the
        phase is left, not observed, as Tracker.loader and the Lightning callback do. Left open, the exporter
        showed the rank in dataloader_next through the epoch's end work (a save, an eval), and a stall alert
        there would have blamed data loading.
        """
        while True:
            if self.tracker.current_state != TRAIN_STATE:  # back from eval or a save: not a step's time
                self.tracker.state(TRAIN_STATE)
            phase = self._phase(DATA_LOADING_PHASE)  # taken in train: from eval or a save phase() times nothing
            if self._loader_starting:  # the epoch's first fetch goes on from its begin
                self._loader_starting = False
            else:
                phase.start()
            try:
                batch = next(batches)
            except StopIteration:
                phase.leave()
                return
            except BaseException:
                phase.leave()
                raise
            phase.end()
            tokens = _tokens(batch, self._main_input)
            per_token = None if self.tracker.flops_stated else self._flops_per_token
            self._fed.append((_batch_size(batch), tokens, per_token * tokens if per_token and tokens else None))
            yield batch

    @property
    def _main_input(self) -> str:
        model = getattr(self._trainer, "model", None)
        return getattr(model, "main_input_name", "input_ids")

    def _next_fed(self) -> tuple[int, int, float | None]:
        return self._fed.popleft() if self._fed else (self._default_batch, 0, None)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """Starts dataloader_next, which the epoch's first fetch goes on: the Trainer makes the epoch's iterator
        in between, where a DataLoader that is not accelerate's (a get_train_dataloader of the user's) starts its
        non-persistent workers; it was in the step and in no phase (a loading share of 0.4% for 69.6%)."""
        self._fed.clear()  # batches fetched but never fed (training stopped inside a step)
        if self.tracker.current_state == TRAIN_STATE and any(name == _FETCH for name, _ in self._wrapped):
            self._phase(DATA_LOADING_PHASE).start()
            self._loader_starting = True

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        if self.tracker.current_state != TRAIN_STATE:
            self.tracker.state(TRAIN_STATE)  # eval/save time is not a step's (the step clock skips it)
        self._phase(TRAIN_BATCH_PHASE).start()
        self._in_step = True

    def on_substep_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        samples, tokens, flops = self._next_fed()
        self.tracker.micro_batch(samples, tokens, flops)  # a batch of an accumulation that goes on

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
        samples, tokens, flops = self._next_fed()
        self.tracker.step(samples=samples, tokens=tokens, flops=flops,
                          global_step=state.global_step + self._step_offset)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._end_training(close=self._owns_tracker)

    def _end_training(self, close: bool) -> None:
        """Puts the Trainer's methods back and leaves the training: closes the tracker, or sets it idle (its phases
        left, the step clock to start afresh; a retry after an exception had its steps from the failed attempt on,
        and its fetches counted twice through a wrapper wrapped again)."""
        self._training = False
        self._loader_starting = False
        self._in_step = False
        self._fed.clear()
        if self._trainer is not None:
            self._unwrap()
        if close:
            self.tracker.close()  # reopened by the next on_train_begin
        else:
            self.tracker.state(IDLE_STATE)


def _find_trainer() -> Trainer | None:
    """The Trainer whose training loop called on_train_begin: callbacks are not handed it."""
    frame = sys._getframe(1)
    for _ in range(_TRAINER_SEARCH_DEPTH):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def _flops_per_token(model: Any) -> float | None:
    """The Trainer's FLOPs per token (6 x non-embedding parameters, as `floating_point_ops`), computed once;
    None where the model is not a transformers model."""
    if not callable(getattr(model, "num_parameters", None)):
        return None
    return 6 * model.num_parameters(exclude_embeddings=True)


def _tokens(batch: Any, main_input: str) -> int:
    """Elements of the batch's main input (`input_ids`), as the Trainer's `estimate_tokens`; 0 without one."""
    value = batch.get(main_input) if isinstance(batch, Mapping) else None
    return int(value.numel()) if hasattr(value, "numel") else 0


def _batch_size(batch: Any) -> int:
    """Rows of the batch's first tensor: a dict of tensors (the Trainer's usual batch), a list or a tuple."""
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, list | tuple) else (batch,)
    for value in values:
        shape = getattr(value, "shape", None)
        if shape:
            return int(shape[0])
    return 0

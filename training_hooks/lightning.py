"""Lightning integration: `Trainer(callbacks=[StepscopeCallback()])` times every training step.

A step is an optimizer step (what `trainer.global_step` counts): with `accumulate_grad_batches=4` one
step is four batches, counted beside it in micro_batches_total; samples are the batches' real sizes (with several
training loaders, a dict or a list of them, the sizes of each loader's batch added up).
Phases (from Lightning 2.x hooks; GPU phases use CUDA events when the model is on a GPU), summed per step:
  dataloader_next  the training data fetcher's `next()` on the loader, nothing else (wrapped while fitting)
  to_device        the strategy's `batch_to_device` (wrapped while fitting)
  forward          on_train_batch_start -> on_before_backward (training_step, zero_grad); a training_step that
                   skips its backward (returns None) ends at on_before_optimizer_step, or at the batch's end
  backward         on_before_backward -> on_after_backward
  optimizer_step   on_before_optimizer_step -> on_train_batch_end (only the batch that steps); under manual
                   optimization each optimizer's step, to its end (its `step()` wrapped): a GAN's generator forward
                   and backward after the discriminator's step are in forward and backward, not in this phase
  train_batch      on_train_batch_start -> on_train_batch_end (each batch)
What is in a step but in no phase: the other callbacks' batch hooks (the `Timer` of `max_time` with
its broadcast under DDP), Lightning's per-batch SIGTERM broadcast under DDP, logging, LR schedulers.
Tokens and model FLOPs (docs/mfu.md), as Lightning's ThroughputMonitor takes them: `length_fn(batch)` gives
a batch's tokens, the LightningModule's `flops_per_batch` attribute its FLOPs (Lightning's `measure_flops`
computes it); FLOPs the user states (flops_per_step=, flops_per_sample=) count instead.
States: setup, train, eval (the fit's whole validation run, its loaders' iterator included; the sanity check from its
loaders' setup on), checkpoint (from the start
of trainer.save_checkpoint, or on_save_checkpoint, until training or validation goes on), idle after fit.
Fits again in the same process (`trainer.fit()` once more, a new Trainer with the same callback, `ckpt_path=`) are
the same run: the callback's tracker, closed at each fit's end (final push, state idle), is reopened at the next
fit's setup, so its counters go on growing and the time between the fits is idle, not a restart. A fit that
starts from global step 0 (a new Trainer, nothing restored) goes on counting from the global step the last one
reached, so its steps are not taken for a restore that does them again (lost progress); a fit restored from a
checkpoint passes its global step plus the offset of the fit that saved it (kept in the checkpoint). A new
process is a restart: its counters start from 0.
The callback reports the fit only: a `trainer.validate()`, `test()` or `predict()` outside it (before or after
fit) is no state of the run, as a save after the fit, and as the Hugging Face callback's `evaluate()` after
`train()`; it creates no tracker and leaves the rank as it is.
Requires the `lightning` package; importing this module imports it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.data import extract_batch_size

import stepscope.hooks
from stepscope.contract.training import (
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
from stepscope.hooks.tracker import Tracker

log = logging.getLogger("stepscope.hooks")

_GPU_PHASES = (FORWARD_PHASE, BACKWARD_PHASE, OPTIMIZER_PHASE, TRAIN_BATCH_PHASE)
# The training epoch loop's callbacks around the fetcher's `next(iterator)` (Lightning 2.x sets them as the
# fetcher's profiler start and stop at each epoch's start): an instance attribute on the loop wraps them.
_FETCH_HOOKS = ("_on_before_fetch", "_on_after_fetch")
_ABSENT = object()  # an attribute the instance did not have of its own


class StepscopeCallback(Callback):
    """Times Lightning's training loop into a Tracker (created at setup unless one is given).

    A tracker it creates takes run/rank/world size from the Trainer and the environment, framework
    "lightning", is closed (final push) at teardown and reopened at the next fit's setup (the module
    docstring). `init_kwargs` go to `stepscope.hooks.init`.
    `length_fn(batch)`: the batch's tokens (ThroughputMonitor's argument of that name).
    """

    def __init__(self, tracker: Tracker | None = None, length_fn: Callable[[Any], int] | None = None,
                 **init_kwargs: Any) -> None:
        self.tracker = tracker
        self._length_fn = length_fn
        self._owns_tracker = tracker is None
        self._init_kwargs = init_kwargs
        self._in_optimizer = False
        self._in_forward = False
        self._forward_after_step = False  # the open forward was started by a manual optimizer step's end
        self._global_step = 0  # trainer.global_step at the last step boundary
        self._step_offset = 0  # added to trainer.global_step in this fit: the run's count across fits
        self._restored_offset: int | None = None  # the offset saved in the checkpoint this fit restored
        self._fitting = False  # from setup("fit") to teardown: a save, validate, test or predict outside it is no
        # state of the run
        self._validating = False  # inside the fit's wrapped validation run, which ends the eval state itself
        self._loader_starting = False  # dataloader_next was started at the epoch's iterator start, before its fetch
        # (object, attribute, the instance's own value it covered, if any) set on instances while fitting
        self._wrapped: list[tuple[Any, str, Any]] = []

    # -- lifecycle --------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Starts reporting a fit. Any other stage is no state of the run: a tracker made for a validate() after
        fit replaced the run's group with zeroed counters (steps 21 -> 0), a restart that never happened."""
        if stage != "fit":
            return
        self._restored_offset = None  # load_state_dict sets it, after setup, where the fit restores a checkpoint
        if self.tracker is None:
            kwargs = {"framework": "lightning", "rank": trainer.global_rank, "local_rank": trainer.local_rank,
                      "world_size": trainer.world_size, **self._init_kwargs}
            self.tracker = stepscope.hooks.init(**kwargs)
        elif self._owns_tracker:
            self.tracker.reopen()  # a fit after one: the same run goes on
        if self.tracker.current_state == IDLE_STATE:  # the fit before left it idle
            self.tracker.state(SETUP_STATE)
        self._fitting = True
        self._wrap_batch_to_device(trainer)
        self._wrap_fetch(trainer)
        self._wrap_save(trainer)
        self._wrap_validation(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._finish()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._finish()

    def _finish(self) -> None:
        """The fit's end (teardown, or an exception): outside a fit there is nothing of the run to end."""
        if not self._fitting:
            return
        self._unwrap()
        if self.tracker is None:
            return
        if self._owns_tracker:
            self.tracker.close()  # reopened by the next fit's setup
        else:
            self.tracker.state(IDLE_STATE)

    # -- phases -----------------------------------------------------------------------------------

    def _phase(self, name: str) -> Any:
        assert self.tracker is not None, "StepscopeCallback used before Trainer setup"
        return self.tracker.phase(name, cuda=name in _GPU_PHASES)

    def _wrap(self, owner: Any, attribute: str, wrapper: Callable[..., Any]) -> None:
        """Sets `wrapper` as an instance attribute over the class's method (or over the instance's own, say a
        user's wrapper), put back as it was at teardown."""
        self._wrapped.append((owner, attribute, vars(owner).get(attribute, _ABSENT)))
        setattr(owner, attribute, wrapper)

    def _unwrap(self) -> None:
        self._fitting = False
        for owner, attribute, covered in reversed(self._wrapped):
            if covered is _ABSENT:
                vars(owner).pop(attribute, None)
            else:
                setattr(owner, attribute, covered)
        self._wrapped = []

    def _wrap_batch_to_device(self, trainer: Trainer) -> None:
        original = trainer.strategy.batch_to_device

        def batch_to_device(batch: Any, *args: Any, **kwargs: Any) -> Any:
            if not trainer.training or self.tracker is None:
                return original(batch, *args, **kwargs)
            with self._phase(TO_DEVICE_PHASE):
                return original(batch, *args, **kwargs)

        self._wrap(trainer.strategy, "batch_to_device", batch_to_device)

    def _wrap_save(self, trainer: Trainer) -> None:
        """The checkpoint state from the start of `trainer.save_checkpoint` (ModelCheckpoint's saves and the
        user's): the save gathers the model's and optimizers' state before any callback's on_save_checkpoint,
        under FSDP or DeepSpeed its longest part, which was counted as training (a slow step)."""
        original = trainer.save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            if self._fitting:
                self.tracker.state(CHECKPOINT_STATE)
            return original(*args, **kwargs)

        self._wrap(trainer, "save_checkpoint", save_checkpoint)

    def _wrap_validation(self, trainer: Trainer) -> None:
        """The eval state for the whole of the fit's validation run (`val_loop.run`), not only from
        on_validation_start to on_validation_end: the run sets up the validation loaders (the first time) and
        makes its iterator over them before the first (their worker processes start there unless they persist) and
        puts the model back in training mode after the second. Both were counted in the step under way: a loader
        whose iterator took 0.2 s to start made a step sum of 0.468 s for a truth of 0.266. A save
        inside the run (ModelCheckpoint at validation's end) stays checkpoint until training fetches again."""
        loop = getattr(trainer.fit_loop.epoch_loop, "val_loop", None)
        if not callable(getattr(loop, "run", None)):
            log.warning("stepscope: this Lightning has no validation loop run() on its training epoch loop; eval is "
                        "timed from on_validation_start to on_validation_end")
            return
        original = loop.run

        def run(*args: Any, **kwargs: Any) -> Any:
            if not self._fitting or trainer.sanity_checking:  # the sanity check: on_sanity_check_start on
                return original(*args, **kwargs)
            self.tracker.state(EVAL_STATE)
            self._validating = True
            try:
                return original(*args, **kwargs)
            finally:
                self._validating = False
                if self._fitting and self.tracker.current_state == EVAL_STATE:
                    self.tracker.state(TRAIN_STATE)

        self._wrap(loop, "run", run)

    def _wrap_fetch(self, trainer: Trainer) -> None:
        """Times exactly the training fetcher's `next()` on the loader as dataloader_next.

        The fetcher calls the loop's `_on_before_fetch` right before `next(iterator)` and `_on_after_fetch`
        in a `finally` right after; a fetch that ends the epoch (StopIteration) is no batch: the phase is left
        without observing it.
        """
        loop = trainer.fit_loop.epoch_loop
        if not all(callable(getattr(loop, name, None)) for name in _FETCH_HOOKS):
            log.warning("stepscope: this Lightning has no %s on its training epoch loop; %s is not timed",
                        " or ".join(_FETCH_HOOKS), DATA_LOADING_PHASE)
            return
        before, after = (getattr(loop, name) for name in _FETCH_HOOKS)

        def on_before_fetch() -> None:
            before()
            if self.tracker is not None:
                if self.tracker.current_state != TRAIN_STATE:  # back from a checkpoint: its time is not a step
                    self.tracker.state(TRAIN_STATE)
                if self._loader_starting:  # the fetch goes on from the epoch's iterator start
                    self._loader_starting = False
                else:
                    self._phase(DATA_LOADING_PHASE).start()

        def on_after_fetch() -> None:
            if self.tracker is not None:
                phase = self._phase(DATA_LOADING_PHASE)
                if sys.exc_info()[0] is None:
                    phase.end()
                else:  # the loader's end (StopIteration) or its error: left, not observed (as Tracker.loader)
                    phase.leave()
            after()

        self._wrap(loop, _FETCH_HOOKS[0], on_before_fetch)
        self._wrap(loop, _FETCH_HOOKS[1], on_after_fetch)
        self._wrap_epoch_start(loop)

    def _wrap_epoch_start(self, loop: Any) -> None:
        """Times the training epoch loop's on_run_start, where each epoch after the first makes the loader's
        iterator again (non-persistent workers start, a sampler shuffles), as loading with the epoch's first fetch:
        it is in the step under way, and was in no phase (a loading share of 0.21 for 0.74 with a 0.2 s start)."""
        original = getattr(loop, "on_run_start", None)
        if not callable(original):
            return

        def on_run_start(*args: Any, **kwargs: Any) -> Any:
            if self.tracker is None or self.tracker.current_state != TRAIN_STATE:
                return original(*args, **kwargs)
            self._phase(DATA_LOADING_PHASE).start()
            self._loader_starting = True
            try:
                return original(*args, **kwargs)
            except BaseException:
                self._phase(DATA_LOADING_PHASE).leave()
                self._loader_starting = False
                raise

        self._wrap(loop, "on_run_start", on_run_start)

    def state_dict(self) -> dict[str, Any]:
        """Saved in each checkpoint: the offset of the fit that saved it. A fit restored from a checkpoint of a fit
        that went on from an earlier one's global step is at the run's step (its trainer's plus that offset): without
        it, a fit to step 3, a new Trainer's to 6 and a restore of the second's step 1 (the run's 4) pushed 2, and the
        rules counted 5 steps done again for 2."""
        return {"global_step_offset": self._step_offset}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_offset = int(state_dict.get("global_step_offset", 0))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._global_step = trainer.global_step  # a resumed fit starts at its checkpoint's step
        restored = self._restored_offset
        self._step_offset = self.tracker.global_step_offset(trainer.global_step) if restored is None else restored
        if not pl_module.automatic_optimization:
            for optimizer in trainer.strategy._lightning_optimizers:  # what `self.optimizers()` hands training_step
                self._wrap_manual_step(optimizer)

    def _wrap_manual_step(self, optimizer: Any) -> None:
        """Ends each manual optimizer step's span where its `step()` returns, and starts the forward of what follows.

        Lightning has no hook after an optimizer step: the span went on from the first optimizer's step to the
        batch's end, so a GAN's generator forward and backward after the discriminator's step were optimizer time
        (10 batches: optimizer_step 0.172 s for 0.002 s of stepping, forward 0.110 s for 0.216 s). Not torch's step
        post-hook: an optimizer class whose `step()` calls its base's runs it twice, the first before its own work."""
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if self._in_optimizer:  # Lightning's hook opened the span (not a step outside the fit's loop)
                self._phase(OPTIMIZER_PHASE).end()
                self._in_optimizer = False
                self._phase(FORWARD_PHASE).start()
                self._in_forward = self._forward_after_step = True
            return result

        self._wrap(optimizer, "step", step)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.tracker.state(TRAIN_STATE)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.tracker.current_state != TRAIN_STATE:
            self.tracker.state(TRAIN_STATE)
        self._in_optimizer = self._forward_after_step = False
        self._phase(TRAIN_BATCH_PHASE).start()
        self._phase(FORWARD_PHASE).start()
        self._in_forward = True

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        self._end_forward()  # a second backward in one step (manual optimization) ends no forward
        self._phase(BACKWARD_PHASE).start()

    def _end_forward(self) -> None:
        """Ends the batch's forward where it is still open. A training_step that returns None (Lightning skips the
        batch: a caught OOM, a NaN loss) has no backward to end it: the next batch's start restarted it, and a fit
        skipping every other batch of 20 ms pushed forward 5 times, 0.159 s, for 10 batches."""
        if self._in_forward:
            self._phase(FORWARD_PHASE).end()
            self._in_forward = self._forward_after_step = False

    def _close_forward(self) -> None:
        """Ends the open forward where no backward did: observed where the batch's start opened it (a skipped
        backward), left where a manual optimizer step's end opened it, since no forward ran there (the batch's rest
        after its last step, or a second optimizer stepped right after the first)."""
        if self._forward_after_step:
            self._phase(FORWARD_PHASE).leave()
            self._in_forward = self._forward_after_step = False
        else:
            self._end_forward()

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._phase(BACKWARD_PHASE).end()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._close_forward()  # the closure ran training_step before this hook: a skipped backward's forward ends here
        if not self._in_optimizer:  # several optimizers: one span from the first to the batch end (manual: each's)
            self._phase(OPTIMIZER_PHASE).start()
            self._in_optimizer = True

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Counts the batch; a step boundary only where the optimizer stepped (global_step moved on)."""
        self._close_forward()  # a skipped batch of an accumulation: neither backward nor optimizer step ended it
        if self._in_optimizer:
            self._phase(OPTIMIZER_PHASE).end()
            self._in_optimizer = False
        self._phase(TRAIN_BATCH_PHASE).end()
        samples = _samples(trainer.train_dataloader, batch)
        tokens = self._length_fn(batch) if self._length_fn is not None else 0
        flops = self._batch_flops(pl_module)
        if trainer.global_step == self._global_step:  # accumulating: the step goes on
            self.tracker.micro_batch(samples, tokens, flops)
            return
        self._global_step = trainer.global_step  # manual optimization with 2 optimizers moves it by 2: 1 step
        self.tracker.step(samples=samples, tokens=tokens, flops=flops,
                          global_step=trainer.global_step + self._step_offset)

    def _batch_flops(self, pl_module: LightningModule) -> float | None:
        """The module's `flops_per_batch` unless the user states FLOPs to the tracker (None: those count)."""
        return None if self.tracker.flops_stated else getattr(pl_module, "flops_per_batch", None)

    # -- states -----------------------------------------------------------------------------------

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The sanity check's validation: eval from before Lightning sets up its loaders.

        Under DDP that setup waits on a barrier for the slowest rank, which is validation's time too
        (on_validation_start comes after it).
        """
        self.tracker.state(EVAL_STATE)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._fitting:  # a trainer.validate() is no state of the run
            self.tracker.state(EVAL_STATE)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._fitting and not self._validating:  # the wrapped run ends the eval state itself
            self.tracker.state(SETUP_STATE if trainer.sanity_checking else TRAIN_STATE)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        """A save during the fit; after it (`trainer.save_checkpoint` once fit returned) the callback's own
        tracker is closed and a user's stays idle."""
        if self._fitting:
            self.tracker.state(CHECKPOINT_STATE)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.tracker.state(IDLE_STATE)


def _samples(loaders: Any, batch: Any) -> int:
    """The samples a training batch feeds. With several training loaders (a dict or a list of them) Lightning's
    CombinedLoader hands each step one batch of every loader, in the loaders' structure (None for one run out): their
    sizes add up. Read as one batch, `extract_batch_size` took the first loader's alone: loaders of 4 and 8 per batch
    counted 40 samples in 10 steps for 120."""
    if isinstance(loaders, Mapping) and isinstance(batch, Mapping):
        return sum(_samples(loader, batch.get(key)) for key, loader in loaders.items())
    if isinstance(loaders, list | tuple) and isinstance(batch, list | tuple) and len(loaders) == len(batch):
        return sum(_samples(loader, part) for loader, part in zip(loaders, batch, strict=True))
    return 0 if batch is None else _batch_size(batch)


def _batch_size(batch: Any) -> int:
    try:
        return int(extract_batch_size(batch))
    except Exception:  # a batch without tensors: count steps, not samples
        return 0

"""The Lightning and Hugging Face callbacks on real CPU Trainers, pushing to a real Pushgateway."""

import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from stepscope_testkit.processes import sample_values, scrape
from stepscope_testkit.pushgateway import running_pushgateway
from tests.support.tiny_models import LinearRegressor

STEPS = 6
BATCH = 4
ITEM_SLEEP = 0.002


class Regression(Dataset):
    def __init__(self, items: int, as_dict: bool = False) -> None:
        self.items, self.as_dict = items, as_dict

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int):
        time.sleep(ITEM_SLEEP)
        x = torch.full((8,), index / self.items)
        y = x.sum(dim=0, keepdim=True)
        return {"x": x, "labels": y} if self.as_dict else (x, y)


def fit_one_epoch(tmp_path: Path, run: str, dataset: Dataset,
                  fail_at_batch: int | None = None) -> tuple[str, Exception | None]:
    """A one-epoch Lightning fit of a linear model over `dataset` with the callback pushing `run` to a real
    exporter only at its end (training_step raising at `fail_at_batch`): the exporter's text after it, and what
    the fit raised."""
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback
    from stepscope_testkit.processes import running_exporter

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            if batch_idx == fail_at_batch:
                raise RuntimeError("CUDA error: an illegal memory access (simulated)")
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    with running_exporter(tmp_path) as exporter:
        callback = StepscopeCallback(run=run, push_url=exporter.url, push_interval=60)
        trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                             enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
                             callbacks=[callback])
        try:
            trainer.fit(Module(), DataLoader(dataset, batch_size=BATCH))
        except RuntimeError as exc:
            return scrape(exporter.url), exc
        return scrape(exporter.url), None


def test_lightning_callback_times_fit(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    with running_pushgateway(tmp_path) as gateway:
        callback = StepscopeCallback(run="pl-run", push_url=gateway.url, push_interval=0.2)
        trainer = pl.Trainer(
            max_steps=STEPS, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
            enable_checkpointing=False, enable_model_summary=False, val_check_interval=3, limit_val_batches=2,
            default_root_dir=tmp_path, callbacks=[callback],
        )
        trainer.fit(Module(), DataLoader(Regression(100), batch_size=BATCH),
                    DataLoader(Regression(8), batch_size=BATCH))
        text = scrape(gateway.url)
    group = {"job": "stepscope", "run": "pl-run", "rank": "0"}
    for phase in ("to_device", "forward", "backward", "optimizer_step", "train_batch"):
        counts = sample_values(text, "stepscope_step_phase_seconds_count", phase=phase, **group)
        assert counts == [STEPS], phase
    # Every fetch of a training batch is timed, also after validation; none inside validation.
    [loads] = sample_values(text, "stepscope_step_phase_seconds_count", phase="dataloader_next", **group)
    assert loads == STEPS
    [load_seconds] = sample_values(text, "stepscope_step_phase_seconds_sum", phase="dataloader_next", **group)
    assert load_seconds >= loads * BATCH * ITEM_SLEEP
    assert sample_values(text, "stepscope_steps_total", **group) == [STEPS]
    assert sample_values(text, "stepscope_samples_total", **group) == [STEPS * BATCH]
    assert sample_values(text, "stepscope_training_info", framework="lightning", **group) == [1]
    assert sample_values(text, "stepscope_training_state", state="idle", **group) == [1]
    assert "batch_to_device" not in vars(trainer.strategy)  # the wrapper is gone after fit


OPTIMIZER_SLEEP = 0.02
FORWARD_SLEEP = 0.02


def test_lightning_manual_optimization_with_two_backwards_and_optimizers(tmp_path: Path) -> None:
    """A step with two backward passes and two optimizers: one forward, two backwards, one optimizer span."""
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):  # Lightning's hook runs inside step(), after the closure
            result = super().step(closure)
            time.sleep(OPTIMIZER_SLEEP)
            return result

    class TwoLosses(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.first, self.second = nn.Linear(8, 1), nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            slow, fast = self.optimizers()
            self.manual_backward(nn.functional.mse_loss(self.first(x), y))
            self.manual_backward(nn.functional.mse_loss(self.second(x), y))
            slow.step()
            fast.step()
            slow.zero_grad()
            fast.zero_grad()

        def configure_optimizers(self):
            return [SlowSGD(self.first.parameters(), lr=1e-3), torch.optim.SGD(self.second.parameters(), lr=1e-3)]

    with running_pushgateway(tmp_path) as gateway:
        callback = StepscopeCallback(run="pl-manual", push_url=gateway.url, push_interval=0.2)
        trainer = pl.Trainer(  # manual optimization counts every optimizer.step() towards max_steps
            max_steps=2 * STEPS, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
            enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
            default_root_dir=tmp_path, callbacks=[callback],
        )
        trainer.fit(TwoLosses(), DataLoader(Regression(100), batch_size=BATCH))
        text = scrape(gateway.url)
    group = {"job": "stepscope", "run": "pl-manual", "rank": "0"}

    def count(phase: str) -> list[float]:
        return sample_values(text, "stepscope_step_phase_seconds_count", phase=phase, **group)

    assert sample_values(text, "stepscope_steps_total", **group) == [STEPS]
    assert count("forward") == [STEPS]  # ended by the first backward only
    assert count("backward") == [2 * STEPS]
    assert count("optimizer_step") == [2 * STEPS]  # each optimizer's step, to its end
    [optimizer_seconds] = sample_values(text, "stepscope_step_phase_seconds_sum", phase="optimizer_step", **group)
    assert optimizer_seconds >= STEPS * OPTIMIZER_SLEEP  # the slow optimizer's steps


def test_lightning_manual_optimization_gan_forward_after_a_step_is_forward_not_optimizer(tmp_path: Path) -> None:
    """GAN style: the discriminator's forward, backward and step, then the generator's. Lightning has no hook after
    an optimizer step: the generator's forward (and backward) were in optimizer_step, from the discriminator's step to
    the batch's end (10 batches: optimizer_step 0.172 s for 0.002 s of stepping, forward 0.110 s for 0.216 s)."""
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback

    class Gan(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.generator, self.discriminator = nn.Linear(8, 8), nn.Linear(8, 1)

        def forward_sleeping(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(FORWARD_SLEEP)
            return self.discriminator(self.generator(x)).mean()

        def training_step(self, batch, batch_idx):
            discriminator_optimizer, generator_optimizer = self.optimizers()
            x, _ = batch
            self.manual_backward(self.forward_sleeping(x))
            discriminator_optimizer.step()
            discriminator_optimizer.zero_grad()
            self.manual_backward(-self.forward_sleeping(x))
            generator_optimizer.step()
            generator_optimizer.zero_grad()

        def configure_optimizers(self):
            return [torch.optim.SGD(self.discriminator.parameters(), lr=1e-3),
                    torch.optim.SGD(self.generator.parameters(), lr=1e-3)]

    callback = StepscopeCallback(run="pl-gan", push_url="", handle_sigterm=False)
    trainer = pl.Trainer(max_steps=2 * STEPS, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
                         default_root_dir=tmp_path, callbacks=[callback])
    trainer.fit(Gan(), DataLoader(Regression(100), batch_size=BATCH))
    text = callback.tracker.render()

    def phase(name: str) -> tuple[float, float]:
        [seconds] = sample_values(text, "stepscope_step_phase_seconds_sum", phase=name)
        [count] = sample_values(text, "stepscope_step_phase_seconds_count", phase=name)
        return seconds, count

    forward_seconds, forward_count = phase("forward")
    optimizer_seconds, optimizer_count = phase("optimizer_step")
    assert (forward_count, optimizer_count) == (2 * STEPS, 2 * STEPS)
    assert forward_seconds >= 2 * STEPS * FORWARD_SLEEP  # both networks' forwards
    assert optimizer_seconds < STEPS * FORWARD_SLEEP / 2  # two SGD steps of tiny layers, no forward


def test_lightning_samples_of_several_training_loaders_add_up(tmp_path: Path) -> None:
    """fit() over a dict of two loaders (Lightning's CombinedLoader, max_size_cycle: the shorter one cycles and ends
    on a partial batch): each step feeds a batch of both, and samples_total is what training_step was fed. Before,
    extract_batch_size read the first loader's batch alone: 40 samples for 120 with batches of 4 and 8."""
    import lightning.pytorch as pl

    import stepscope.hooks as th
    from stepscope.hooks.lightning import StepscopeCallback

    fed: list[int] = []

    class MultiTask(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            fed.append(sum(len(x) for x, _y in batch.values()))
            return sum(nn.functional.mse_loss(self.net(x), y) for x, y in batch.values())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    tracker = th.init(run="pl-two-loaders", push_url="", framework="lightning")
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[StepscopeCallback(tracker=tracker)])
    loaders = {"a": DataLoader(Regression(40), batch_size=4), "b": DataLoader(Regression(20), batch_size=8)}
    trainer.fit(MultiTask(), train_dataloaders=loaders)
    assert len(fed) == 10 and sum(fed) == 10 * 4 + 3 * 8 + 3 * 8 + 3 * 4 + 8  # b: 8, 8, 4 and round again
    tracker.close()
    assert tracker.snapshot().samples == sum(fed)  # 40 before


def test_huggingface_callback_times_trainer(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from stepscope.hooks.huggingface import StepscopeCallback

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=STEPS, per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH, report_to=[], use_cpu=True, logging_strategy="no",
        save_strategy="no", eval_strategy="steps", eval_steps=3, disable_tqdm=True, dataloader_num_workers=0,
    )
    with running_pushgateway(tmp_path) as gateway:
        callback = StepscopeCallback(run="hf-run", push_url=gateway.url, push_interval=0.2)
        trainer = Trainer(model=Model(), args=args, train_dataset=Regression(100, as_dict=True),
                          eval_dataset=Regression(8, as_dict=True), callbacks=[callback])
        trainer.train()
        text = scrape(gateway.url)
    group = {"job": "stepscope", "run": "hf-run", "rank": "0"}
    for phase in ("train_batch", "optimizer_step", "step_lr_schedulers"):
        counts = sample_values(text, "stepscope_step_phase_seconds_count", phase=phase, **group)
        assert counts == [STEPS], phase
    # Every fetch of a training batch is timed, also after an evaluation; the evaluation's are not.
    assert sample_values(text, "stepscope_step_phase_seconds_count", phase="dataloader_next", **group) == [STEPS]
    assert sample_values(text, "stepscope_steps_total", **group) == [STEPS]
    assert sample_values(text, "stepscope_samples_total", **group) == [STEPS * BATCH]
    assert sample_values(text, "stepscope_training_info", framework="transformers", **group) == [1]
    assert sample_values(text, "stepscope_training_state", state="idle", **group) == [1]



def test_huggingface_train_twice_with_the_same_callback_goes_on_counting_the_same_run(tmp_path: Path) -> None:
    """`trainer.train()` twice in one process: one run whose counters go on, idle between the two. Before, the
    second train() made a new tracker counting from 0 under the same run, rank and pid (a counter reset), and its
    global step, back at 1, read as a restore."""
    from transformers import Trainer, TrainingArguments

    from stepscope.hooks.huggingface import StepscopeCallback
    from stepscope_testkit.processes import running_exporter

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=3, per_device_train_batch_size=BATCH, report_to=[], use_cpu=True,
        logging_strategy="no", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    group = {"run": "hf-twice", "rank": "0"}
    with running_exporter(tmp_path) as exporter:
        callback = StepscopeCallback(run="hf-twice", push_url=exporter.url, push_interval=60)
        trainer = Trainer(model=LinearRegressor(), args=args, train_dataset=Regression(40, as_dict=True),
                          callbacks=[callback])
        trainer.train()
        between = scrape(exporter.url)
        trainer.train()
        text = scrape(exporter.url)
    assert sample_values(between, "stepscope_training_state", state="idle", **group) == [1]
    assert sample_values(between, "stepscope_steps_total", **group) == [3]
    assert sample_values(text, "stepscope_steps_total", **group) == [6]  # 3 before the fix
    assert sample_values(text, "stepscope_samples_total", **group) == [6 * BATCH]
    assert sample_values(text, "stepscope_training_global_step", **group) == [6]
    assert sample_values(text, "stepscope_training_state", state="idle", **group) == [1]


def test_huggingface_resume_of_a_checkpoint_of_a_second_train_pushes_the_runs_global_step(tmp_path: Path) -> None:
    """train() to step 3, a second train() to the run's 6 (its Trainer's 3, saving at each), then a resume of that
    second train()'s checkpoint-1 (the run's 4) to its step 2: the run's 5, from 4, with the same callback and with a
    new one (a new process's, the Trainer restoring callback states or not). Before, the offset of the second
    train() was lost with it: 2 from 1 pushed, read by the rules as 5 steps done again for 2."""
    from transformers import Trainer, TrainingArguments

    from stepscope.contract import families
    from stepscope.hooks.huggingface import StepscopeCallback

    def train(callback: StepscopeCallback, steps: int, save: bool = False, resume: str | None = None,
              restore_callbacks: bool = False) -> str:
        args = TrainingArguments(
            output_dir=str(tmp_path / "hf"), max_steps=steps, per_device_train_batch_size=BATCH, report_to=[],
            use_cpu=True, logging_strategy="no", save_strategy="steps" if save else "no", save_steps=1,
            disable_tqdm=True, dataloader_num_workers=0, restore_callback_states_from_checkpoint=restore_callbacks,
        )
        Trainer(model=LinearRegressor(), args=args, train_dataset=Regression(40, as_dict=True),
                callbacks=[callback]).train(resume_from_checkpoint=resume)
        return callback.tracker.render()

    callback = StepscopeCallback(run="hf-resume-offset", push_url="", handle_sigterm=False)
    train(callback, 3)
    assert sample_values(train(callback, 3, save=True), families.TRAINING_GLOBAL_STEP) == [6]
    checkpoint = str(tmp_path / "hf" / "checkpoint-1")
    resumed = {"same callback": train(callback, 2, resume=checkpoint)}
    for restore_callbacks in (False, True):
        fresh = StepscopeCallback(run=f"hf-resume-new-{restore_callbacks}", push_url="", handle_sigterm=False)
        resumed[f"new callback, restore_callback_states={restore_callbacks}"] = train(
            fresh, 2, resume=checkpoint, restore_callbacks=restore_callbacks)
    for how, text in resumed.items():
        assert sample_values(text, families.TRAINING_GLOBAL_STEP) == [5], how  # 2 before the fix
        assert sample_values(text, families.TRAINING_GLOBAL_STEP_START) == [4], how


def test_lightning_leaves_dataloader_next_when_an_unsized_loader_runs_out(tmp_path: Path) -> None:
    """A loader without a length ends its epoch with a fetch that raises StopIteration: the phase is left
    (the exporter shows no phase entered after the fit)."""
    from stepscope_testkit.processes import samples

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return (Regression(STEPS * BATCH)[index] for index in range(STEPS * BATCH))

    text, raised = fit_one_epoch(tmp_path, "pl-stream", Stream())
    assert raised is None
    group = {"run": "pl-stream", "rank": "0"}
    assert sample_values(text, "stepscope_steps_total", **group) == [STEPS]
    assert sample_values(text, "stepscope_training_state", state="idle", **group) == [1]
    assert [name for name, labels in samples(text) if name == "stepscope_training_phase_entered_timestamp_seconds"
            and ("run", "pl-stream") in labels] == []


def test_huggingface_leaves_dataloader_next_when_an_iterable_dataset_runs_out(tmp_path: Path) -> None:
    """A Trainer over an IterableDataset (no length) ends each pass with a `next()` that raises StopIteration:
    the phase is left, so through the epoch's end work (a neighbour's 0.3 s here) the exporter shows the rank in
    no phase, not in dataloader_next (where a stall alert would blame data loading)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from stepscope.hooks.huggingface import StepscopeCallback
    from stepscope_testkit.processes import running_exporter, samples

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return (Regression(10 * BATCH, as_dict=True)[index] for index in range(10 * BATCH))

    def entered(text: str) -> list[str]:
        return [dict(labels)["phase"] for name, labels in samples(text)
                if name == "stepscope_training_phase_entered_timestamp_seconds" and ("run", "hf-stream") in labels]

    seen_at_epoch_end: list[list[str]] = []

    class Neighbour(TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs) -> None:
            time.sleep(0.3)  # the epoch's end work
            callback.tracker.pusher.push_once()
            seen_at_epoch_end.append(entered(scrape(exporter.url)))

    # 10 batches a pass, accumulation 2: 5 steps a pass, so the first pass ends on the loader's StopIteration
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=8, per_device_train_batch_size=BATCH, gradient_accumulation_steps=2,
        report_to=[], use_cpu=True, logging_strategy="no", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )
    with running_exporter(tmp_path) as exporter:
        callback = StepscopeCallback(run="hf-stream", push_url=exporter.url, push_interval=60)
        Trainer(model=LinearRegressor(), args=args, train_dataset=Stream(), callbacks=[callback, Neighbour()]).train()
        text = scrape(exporter.url)
    group = {"run": "hf-stream", "rank": "0"}
    assert seen_at_epoch_end and seen_at_epoch_end[0] == [], seen_at_epoch_end
    assert all(phases == [] for phases in seen_at_epoch_end), seen_at_epoch_end
    assert sample_values(text, "stepscope_steps_total", **group) == [8]
    assert sample_values(text, "stepscope_step_phase_seconds_count", phase="dataloader_next", **group) == [16]
    assert sample_values(text, "stepscope_training_state", state="idle", **group) == [1]
    assert entered(text) == []


def test_lightning_fit_ended_by_an_exception_leaves_the_rank_idle_in_no_phase(tmp_path: Path) -> None:
    """training_step raises in the 4th batch, inside the callback's forward (entered at the batch start):
    on_exception closes the tracker, whose final push shows the rank idle and in no phase (before: in forward)."""
    from stepscope_testkit.processes import samples

    text, raised = fit_one_epoch(tmp_path, "pl-error", Regression(STEPS * BATCH), fail_at_batch=3)
    assert "illegal memory access" in str(raised)
    group = {"run": "pl-error", "rank": "0"}
    assert [dict(labels)["phase"] for name, labels in samples(text)
            if name == "stepscope_training_phase_entered_timestamp_seconds" and ("run", "pl-error") in labels] == []
    assert sample_values(text, "stepscope_training_state", state="idle", **group) == [1]
    assert sample_values(text, "stepscope_steps_total", **group) == [3]


def test_accelerate_recipe_of_the_docs_counts_optimizer_steps_under_accumulation() -> None:
    """docs/hooks.md's Accelerate loop, run as written: under `accelerator.accumulate` the loop calls optimizer.step()
    at every batch and accelerate steps at every 4th and the epoch's last; the plain loop's step() at every batch
    counted each batch as a step (18 for 5)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    import stepscope.hooks as th

    section = (Path(__file__).parents[1] / "docs" / "hooks.md").read_text().split("## Hugging Face Accelerate\n")[1]
    recipe = section.split("```python\n", 1)[1].split("```", 1)[0]
    accelerator = Accelerator(gradient_accumulation_steps=4, cpu=True)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    optimizer_steps = []
    optimizer.register_step_post_hook(lambda *args: optimizer_steps.append(1))
    tracker = th.init(run="accelerate-recipe", push_url="", handle_sigterm=False)
    try:
        exec(recipe, {"accelerator": accelerator, "model": model, "optimizer": optimizer, "tracker": tracker,
                      "train_loader": DataLoader(Regression(70), batch_size=BATCH), "loss_fn": nn.functional.mse_loss})
    finally:
        tracker.close()
        AcceleratorState._reset_state(reset_partial_state=True)  # process-wide: the Trainers of later tests make theirs
        GradientState._reset_state()
    text = tracker.render()

    assert len(optimizer_steps) == 5  # 18 batches: 4 + 4 + 4 + 4 + 2
    assert sample_values(text, "stepscope_steps_total") == [5]
    assert sample_values(text, "stepscope_micro_batches_total") == [18]
    assert sample_values(text, "stepscope_samples_total") == [70]

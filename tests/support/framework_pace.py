"""A Lightning fit or a Hugging Face Trainer run of known, varying step times, with stepscope's callback as
the README shows it (`callbacks=[StepscopeCallback(run=...)]`, push URL from STEPSCOPE_PUSH_URL, the default
5 s push interval), for tests/test_framework_quantiles.py. The truth is the wall-clock time of every
optimizer step, taken by an optimizer step post-hook (not by stepscope), written to OUT as JSON at the end.

Each training forward sleeps FORWARD_SECONDS x lognormal(0, SIGMA), so the steps' p50 and p95 are ~1.8x
apart; the run stops after SECONDS (Lightning's own `max_time`; a stop callback for the Trainer, which has
no such argument).

    python -m tests.support.framework_pace lightning|huggingface OUT RUN SECONDS
"""

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

FORWARD_SECONDS = 0.03
SIGMA = 0.35
BATCH = 4
ITEMS = 4000  # 1,000 steps an epoch: a few epoch boundaries in a run


class Items(Dataset):
    """Regression items, loaded at once (loading is not this test's subject)."""

    def __init__(self, as_dict: bool) -> None:
        self.as_dict = as_dict

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> Any:
        x = torch.full((8,), index / ITEMS)
        y = x.sum(dim=0, keepdim=True)
        return {"x": x, "labels": y} if self.as_dict else (x, y)


class Compute(nn.Module):
    """Stands for a training forward's GPU time: a lognormal sleep, seeded per run."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(FORWARD_SECONDS * self.rng.lognormvariate(0, SIGMA))
        return x


def net(seed: int) -> nn.Module:
    return nn.Sequential(Compute(seed), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def optimizer_with_truth(parameters: Any, stamps: list[float]) -> torch.optim.Optimizer:
    optimizer = torch.optim.SGD(parameters, lr=1e-3)
    optimizer.register_step_post_hook(lambda *_: stamps.append(time.time()))
    return optimizer


def lightning_fit(out: Path, run: str, seconds: float, stamps: list[float]) -> None:
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net(1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer_with_truth(self.parameters(), stamps)

    trainer = pl.Trainer(max_time={"seconds": seconds}, max_epochs=-1, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=out, callbacks=[StepscopeCallback(run=run)])
    trainer.fit(Module(), DataLoader(Items(as_dict=False), batch_size=BATCH))


def huggingface_train(out: Path, run: str, seconds: float, stamps: list[float]) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from stepscope.hooks.huggingface import StepscopeCallback

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net(2)

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
            out = self.net(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    class StopAfter(TrainerCallback):
        def __init__(self) -> None:
            self.deadline = time.monotonic() + seconds

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            control.should_training_stop = time.monotonic() > self.deadline

    model = Model()
    args = TrainingArguments(output_dir=str(out / "hf"), num_train_epochs=1000, per_device_train_batch_size=BATCH,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Items(as_dict=True),
                      optimizers=(optimizer_with_truth(model.parameters(), stamps), None),
                      callbacks=[StepscopeCallback(run=run), StopAfter()])
    trainer.train()


def main(framework: str, out: Path, run: str, seconds: float) -> None:
    stamps: list[float] = []
    train = lightning_fit if framework == "lightning" else huggingface_train
    train(out, run, seconds, stamps)
    (out / f"{run}.json").write_text(json.dumps(stamps))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], float(sys.argv[4]))

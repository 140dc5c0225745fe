"""Tokens and model FLOPs from the framework callbacks (docs/mfu.md), on real CPU Trainers: the Hugging
Face Trainer's own FLOP estimate and token count, Lightning's `flops_per_batch` and `length_fn`."""

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import stepscope.hooks as th
from stepscope.contract import families
from stepscope_testkit.processes import sample_values

STEPS = 4
BATCH = 2
SEQUENCE = 16


class Tokens(Dataset):
    """Fixed-length token sequences, as dicts (the Trainer's) or tensors (Lightning's)."""

    def __init__(self, items: int, as_dict: bool) -> None:
        self.items, self.as_dict = items, as_dict

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int):
        ids = torch.arange(SEQUENCE) % 50 + index % 7
        return {"input_ids": ids, "labels": ids.clone()} if self.as_dict else ids


def test_huggingface_counts_the_trainers_own_flops_and_tokens(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from stepscope.hooks.huggingface import StepscopeCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=SEQUENCE))
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=2, report_to=[], use_cpu=True, logging_strategy="no", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0,
    )
    tracker = th.init(run="hf-flops", push_url="")
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, as_dict=True),
                      callbacks=[StepscopeCallback(tracker)])
    trainer.train()
    text = tracker.render()
    tokens = STEPS * 2 * BATCH * SEQUENCE  # 2 batches a step (accumulation)
    assert sample_values(text, families.TOKENS_TOTAL) == [tokens]
    expected = 6 * model.num_parameters(exclude_embeddings=True) * tokens  # floating_point_ops' formula
    assert sample_values(text, families.MODEL_FLOPS_TOTAL, dtype="bf16") == [expected]
    assert trainer.state.total_flos == expected  # the Trainer's own count of the same steps


def test_huggingface_leaves_its_estimate_out_where_the_user_states_flops(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from stepscope.hooks.huggingface import StepscopeCallback

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=SEQUENCE))
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=STEPS, per_device_train_batch_size=BATCH, report_to=[],
        use_cpu=True, logging_strategy="no", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    tracker = th.init(run="hf-stated", push_url="", flops_per_step=1000)
    Trainer(model=model, args=args, train_dataset=Tokens(64, as_dict=True),
            callbacks=[StepscopeCallback(tracker)]).train()
    assert sample_values(tracker.render(), families.MODEL_FLOPS_TOTAL, dtype="bf16") == [STEPS * 1000]


def test_lightning_counts_flops_per_batch_and_the_length_fns_tokens(tmp_path) -> None:
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback

    class Module(pl.LightningModule):
        flops_per_batch = 123_456  # what Lightning's measure_flops would have set

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 8)

        def training_step(self, batch, batch_idx):
            return self.embed(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    tracker = th.init(run="pl-flops", push_url="", flops_dtype="fp32")
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
        enable_checkpointing=False, enable_model_summary=False, accumulate_grad_batches=2,
        default_root_dir=tmp_path, callbacks=[StepscopeCallback(tracker, length_fn=lambda batch: batch.numel())],
    )
    trainer.fit(Module(), DataLoader(Tokens(64, as_dict=False), batch_size=BATCH))
    text = tracker.render()
    assert sample_values(text, families.TOKENS_TOTAL) == [STEPS * 2 * BATCH * SEQUENCE]
    assert sample_values(text, families.MODEL_FLOPS_TOTAL, dtype="fp32") == [STEPS * 2 * 123_456]

"""A real torch training loop whose first step is a long warm-up (a sleep in the first forward stands in for
torch.compile, cudnn benchmark, a loader's workers starting), then a loader-limited steady loop: a loader
sleeping LOADER_SECONDS per batch, a forward sleeping FORWARD_SECONDS. It writes what it measured for its
steady steps (every step after the first) as JSON, the truth the report's numbers are held against.

    python -m tests.support.warmup_run RUN RANK PUSH_URL WARMUP_SECONDS STEPS OUT_JSON
"""

import json
import sys
import time
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import stepscope.hooks

BATCH = 32
LOADER_SECONDS = 0.012  # steady: loading (12 ms) longer than the rest of the step (~9 ms): loader-limited
FORWARD_SECONDS = 0.008


class SlowBatches(IterableDataset):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            time.sleep(LOADER_SECONDS)
            x = torch.randn(BATCH, 16)
            yield x, x.sum(dim=1, keepdim=True)


def main(run: str, rank: int, push_url: str, warmup: float, steps: int, out: str) -> None:
    tracker = stepscope.hooks.init(run=run, rank=rank, world_size=2, push_url=push_url, push_interval=1)
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    steady = {"step": 0.0, "forward": 0.0, "dataloader_next": 0.0, "steps": 0, "samples": 0}
    clock = time.perf_counter()
    loaded = clock
    try:
        for x, y in tracker.loader(DataLoader(SlowBatches(), batch_size=None)):
            got = time.perf_counter()
            loading = got - loaded
            with tracker.phase("forward"):
                began = time.perf_counter()
                loss = nn.functional.mse_loss(model(x), y)
                time.sleep(warmup if tracker.steps == 0 else FORWARD_SECONDS)
                forward = time.perf_counter() - began
            with tracker.phase("backward"):
                optimizer.zero_grad()
                loss.backward()
            with tracker.phase("optimizer_step"):
                optimizer.step()
            tracker.step(samples=len(x))
            now = time.perf_counter()
            if tracker.steps > 1:  # the steady loop: every step after the warm-up
                for key, value in (("step", now - clock), ("forward", forward), ("dataloader_next", loading)):
                    steady[key] += value
                steady["steps"] += 1
                steady["samples"] += len(x)
            clock = loaded = now
            if tracker.steps >= steps:
                break
    finally:
        tracker.close()
    with open(out, "w", encoding="utf-8") as file:
        json.dump(steady, file)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), int(sys.argv[5]), sys.argv[6])

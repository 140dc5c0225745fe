"""Known training workloads for the GPU corpus: each one trains for a given time with the hooks and
measures its own truth with `perf_counter`, without stepscope code in the measurement.

    python benchmarks/gpu_workloads.py conv_bf16 --seconds 90 --run gpu-conv_bf16 --truth truth.json

Run by benchmarks/record_gpu_corpus.py, one process per workload (two for ddp_two_ranks). Each
workload is built so that one thing dominates its step, and `expected_verdict` names it:

- mlp_bf16: 4 x Linear(8192) in bf16, batch 4096 from pinned memory: the GPU saturated by matrix work.
- conv_bf16: a conv net in bf16 autocast, channels_last, batch 256 of 128x128 images resident on the GPU.
- input_copy_bound: a 512 MiB batch in pageable host memory copied to the GPU every step for a tiny model:
  the step waits on host-to-device copies, which NVML does not count as GPU utilization.
- cpu_preprocess: uint8 images normalized, flipped and blurred on the CPU in the training thread (not in
  the loader, not in a timed phase) before a small bf16 conv net: host time between the GPU phases.
- ddp_two_ranks: the conv net under DistributedDataParallel over gloo, two ranks on one GPU.

`--smoke` shrinks every size and trains on the CPU, so the recorder can be checked without a GPU.
The truth each loop writes: steps, the loader's share of wall time, the step p50/p95 (ms) over the
steady part (after the first 20%), and per workload the share of wall time in what dominates it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stepscope.hooks as th
from stepscope.contract.training import BACKWARD_PHASE, FORWARD_PHASE, OPTIMIZER_PHASE, TO_DEVICE_PHASE


@dataclass
class Clock:
    """Seconds spent in named parts of the loop, by the loop's own perf_counter."""

    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, started: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


@dataclass(frozen=True)
class Setup:
    """A built workload: where batches come from, one step on a batch, and the samples per batch."""

    batches: Callable[[], Iterator[Any]]
    step: Callable[[th.Tracker, Any, Clock], None]
    samples: int
    expected_verdict: str


def conv_net(channels: int = 64) -> nn.Module:
    """A small ResNet-like stack: many FLOPs per parameter, so GPU work dominates even under DDP."""
    layers: list[nn.Module] = []
    widths = [3, channels, channels * 2, channels * 4, channels * 4]
    for width_in, width_out in itertools.pairwise(widths):
        layers += [nn.Conv2d(width_in, width_out, 3, padding=1, bias=False), nn.BatchNorm2d(width_out),
                   nn.ReLU(inplace=True), nn.Conv2d(width_out, width_out, 3, stride=2, padding=1, bias=False),
                   nn.BatchNorm2d(width_out), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], 100))


def repeat(*items: Any) -> Callable[[], Iterator[Any]]:
    """A loader that hands out the same batch forever: the data is not what these workloads measure."""
    def batches() -> Iterator[Any]:
        while True:
            yield items
    return batches


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_phases(tracker: th.Tracker, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_of: Callable[[], torch.Tensor], device: torch.device) -> None:
    """Forward, backward and optimizer as CUDA-timed phases, then a synchronize (the truth's step end)."""
    with tracker.phase(FORWARD_PHASE, cuda=True):
        loss = loss_of()
    with tracker.phase(BACKWARD_PHASE, cuda=True):
        loss.backward()
    with tracker.phase(OPTIMIZER_PHASE, cuda=True):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync(device)


def mlp_bf16(device: torch.device, smoke: bool) -> Setup:
    width, batch = (256, 64) if smoke else (8192, 4096)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(4))).to(device, torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    host = torch.randn(batch, width, dtype=torch.bfloat16)
    host = host.pin_memory() if device.type == "cuda" else host

    def step(tracker: th.Tracker, items: Any, clock: Clock) -> None:
        with tracker.phase(TO_DEVICE_PHASE):
            x = items[0].to(device, non_blocking=True)
        train_phases(tracker, model, optimizer, lambda: model(x).float().pow(2).mean(), device)
    return Setup(repeat(host), step, batch, "gpu_bound")


def _conv_setup(device: torch.device, smoke: bool, batch: int, wrap: Callable[[nn.Module], nn.Module]) -> Setup:
    size = 32 if smoke else 128
    batch = 8 if smoke else batch
    model = wrap(conv_net(8 if smoke else 64).to(device, memory_format=torch.channels_last))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
    labels = torch.randint(0, 100, (batch,), device=device)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return F.cross_entropy(model(x), y)

    def step(tracker: th.Tracker, items: Any, clock: Clock) -> None:
        x, y = items
        train_phases(tracker, model, optimizer, lambda: loss_of(x, y), device)
    return Setup(repeat(images, labels), step, batch, "gpu_bound")


def conv_bf16(device: torch.device, smoke: bool) -> Setup:
    return _conv_setup(device, smoke, 256, lambda model: model)


def ddp_two_ranks(device: torch.device, smoke: bool) -> Setup:
    from torch.nn.parallel import DistributedDataParallel
    ids = [device.index or 0] if device.type == "cuda" else None
    return _conv_setup(device, smoke, 256, lambda model: DistributedDataParallel(model, device_ids=ids))


def input_copy_bound(device: torch.device, smoke: bool) -> Setup:
    rows = 256 if smoke else 32768
    model = nn.Linear(4096, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    host = torch.randn(rows, 4096)  # 512 MiB, pageable: each copy is staged by the driver

    def step(tracker: th.Tracker, items: Any, clock: Clock) -> None:
        started = time.perf_counter()
        with tracker.phase(TO_DEVICE_PHASE):
            x = items[0].to(device)
            sync(device)
        clock.add("copy", started)
        train_phases(tracker, model, optimizer, lambda: model(x).pow(2).mean(), device)
    return Setup(repeat(host), step, rows, "host_bound")


def cpu_preprocess(device: torch.device, smoke: bool) -> Setup:
    batch, size = (8, 32) if smoke else (128, 128)
    model = conv_net(8 if smoke else 16).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    raw = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8)
    labels = torch.randint(0, 100, (batch,))
    blur = torch.full((3, 1, 5, 5), 1 / 25)

    def preprocess(images: torch.Tensor) -> torch.Tensor:
        """What users write inline: normalize, random flip, a blur, all on the CPU."""
        x = images.float().div(255).sub(0.5).div(0.25)
        x = torch.where(torch.rand(len(x), 1, 1, 1) < 0.5, x.flip(-1), x)
        return F.conv2d(x, blur, padding=2, groups=3)

    def step(tracker: th.Tracker, items: Any, clock: Clock) -> None:
        started = time.perf_counter()
        x = preprocess(items[0])  # no phase: time between the loader and the GPU phases
        clock.add("cpu_preprocess", started)
        with tracker.phase(TO_DEVICE_PHASE):
            x, y = x.to(device).contiguous(memory_format=torch.channels_last), items[1].to(device)

        def loss_of() -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return F.cross_entropy(model(x), y)
        train_phases(tracker, model, optimizer, loss_of, device)
    return Setup(repeat(raw, labels), step, batch, "host_bound")


WORKLOADS: dict[str, Callable[[torch.device, bool], Setup]] = {
    "mlp_bf16": mlp_bf16, "conv_bf16": conv_bf16, "input_copy_bound": input_copy_bound,
    "cpu_preprocess": cpu_preprocess, "ddp_two_ranks": ddp_two_ranks,
}
RANKS = {"ddp_two_ranks": 2}


def time_is_up(began: float, seconds: float, steps: int, world: int) -> bool:
    """Past `seconds`; ranks of a DDP run agree every 10 steps (one stopping alone would hang the other
    in its next all-reduce)."""
    if world == 1:
        return time.perf_counter() - began >= seconds
    if steps % 10:
        return False
    flag = torch.tensor([float(time.perf_counter() - began >= seconds)])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def train(tracker: th.Tracker, setup: Setup, seconds: float, device: torch.device, world: int) -> dict:
    """Steps for `seconds` of wall time; the truth the loop measured, by its own clock."""
    clock, step_seconds = Clock(), []
    batches = tracker.loader(setup.batches())
    began = time.perf_counter()
    while not time_is_up(began, seconds, len(step_seconds), world):
        started = time.perf_counter()
        items = next(batches)
        clock.add("loader", started)
        setup.step(tracker, items, clock)
        tracker.step(samples=setup.samples)
        step_seconds.append(time.perf_counter() - started)
    sync(device)
    wall = time.perf_counter() - began
    steady = sorted(step_seconds[len(step_seconds) // 5:]) or [0.0]
    shares = {f"{name}_share": value / wall for name, value in clock.seconds.items()}
    return {"steps": len(step_seconds), **shares, "p50_ms": statistics.median(steady) * 1e3,
            "p95_ms": steady[min(len(steady) - 1, int(0.95 * len(steady)))] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--run", required=True)
    parser.add_argument("--truth", type=Path, required=True, help="where this rank writes its truth (JSON)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--master-port", type=int, default=29511)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the recorder")
    args = parser.parse_args()
    world = RANKS.get(args.workload, 1)
    device = torch.device("cpu" if args.smoke else "cuda:0")
    if world > 1:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.master_port}",
                                             rank=args.rank, world_size=world)
    torch.manual_seed(args.rank)
    setup = WORKLOADS[args.workload](device, args.smoke)
    started = time.time()
    with th.init(run=args.run, rank=args.rank, local_rank=args.rank, world_size=world, push_interval=1) as tracker:
        truth = train(tracker, setup, args.seconds, device, world)
    if world > 1:
        torch.distributed.destroy_process_group()
    truth = {"expected_verdict": setup.expected_verdict, "run": args.run, "started": started, "rank": args.rank,
             "world_size": world, "pid": os.getpid(), **truth}
    args.truth.write_text(json.dumps(truth, indent=1))


if __name__ == "__main__":
    main()

"""Cost of the training hooks, compared with peers in one run.

    PYTHONPATH=. python benchmarks/bench_hooks.py        # ~1-2 minutes on 2 busy cores

1. One timed phase (enter + exit + record) vs prometheus_client's Histogram.time() and .observe().
2. A real CPU training loop (~5 ms steps) with and without hooks (6 phases per step, pushing to a real
   Pushgateway every second when one is installed), interleaved repetitions.
3. Lightning: one epoch with no callback, with StepscopeCallback, and with Lightning's SimpleProfiler.
Prints markdown tables and writes benchmarks/results/hooks.md. Medians everywhere.
"""

from __future__ import annotations

import gc
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, Histogram
from torch import nn

import stepscope.hooks as th
from stepscope_testkit import results
from stepscope_testkit.pushgateway import PUSHGATEWAY, running_pushgateway

RESULTS = Path(__file__).resolve().parent / "results" / "hooks.md"


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# -- 1. per-phase cost ----------------------------------------------------------------------------

def per_op_ns(body: Callable[[int], None], ops: int) -> float:
    start = time.perf_counter_ns()
    body(ops)
    return (time.perf_counter_ns() - start) / ops


def bench_phase_cost(ops: int = 200_000, repeats: int = 7) -> str:
    tracker = th.init(run="bench", push_url="")
    bucketed = th.init(run="bench-buckets", push_url="", phase_buckets=True, handle_sigterm=False)
    hist = Histogram("bench_seconds", "x", buckets=th.log_buckets(1e-4, 60.0, 16), registry=CollectorRegistry())
    labelled = Histogram("bench_phase_seconds", "x", ["phase"], buckets=th.log_buckets(1e-4, 60.0, 16),
                         registry=CollectorRegistry())

    def ours(n: int) -> None:
        for _ in range(n):
            with tracker.phase("forward"):
                pass

    def ours_buckets(n: int) -> None:
        for _ in range(n):
            with bucketed.phase("forward"):
                pass

    def ours_step(n: int) -> None:
        for _ in range(n):
            tracker.step()

    def ours_cuda_flag(n: int) -> None:
        for _ in range(n):
            with tracker.phase("backward", cuda=True):  # no GPU here: host timing, same lookup path
                pass

    def prom_time(n: int) -> None:
        for _ in range(n):
            with hist.time():
                pass

    def prom_labels_time(n: int) -> None:
        for _ in range(n):
            with labelled.labels("forward").time():
                pass

    def prom_observe(n: int) -> None:
        for _ in range(n):
            hist.observe(0.001)

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    cases = [
        ("stepscope `with tracker.phase(name)` (default: no phase buckets)", ours),
        ("stepscope `with tracker.phase(name)`, phase buckets on (216-bound fine grid)", ours_buckets),
        ("stepscope `tracker.step()` (216-bound fine grid)", ours_step),
        ("stepscope `with tracker.phase(name, cuda=True)` (no GPU: host)", ours_cuda_flag),
        ("prometheus_client `with Histogram.time()`", prom_time),
        ("prometheus_client `with Histogram.labels(name).time()`", prom_labels_time),
        ("prometheus_client `Histogram.observe(v)` (no timing)", prom_observe),
        ("empty loop (overhead included in every row)", empty),
    ]
    results: dict[str, list[float]] = {name: [] for name, _ in cases}
    for _ in range(repeats):  # interleave so drift hits every case alike
        for name, body in cases:
            results[name].append(per_op_ns(body, ops))
    medians = {name: statistics.median(values) for name, values in results.items()}
    baseline = medians["prometheus_client `with Histogram.time()`"]
    rows = [[name, f"{ns:.0f}", f"{ns / baseline:.2f}"] for name, ns in medians.items()]
    tracker.close()
    bucketed.close()
    return table(["operation", "ns per op (median)", "vs Histogram.time()"], rows)


# -- 2. a real training loop ----------------------------------------------------------------------

@contextmanager
def pushgateway() -> Iterator[str]:
    """The tests' real Pushgateway (in memory only) when installed, else "" (push disabled)."""
    if not Path(PUSHGATEWAY).exists():
        yield ""
        return
    with tempfile.TemporaryDirectory() as logs, running_pushgateway(Path(logs)) as gateway:
        yield gateway.url


def make_model(width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
    )
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)


def batches(n: int, batch: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 256, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(n)]


def loop_plain(model: nn.Module, opt: torch.optim.Optimizer, data: list) -> None:
    for x, y in iter(data):
        x, y = x.to("cpu"), y.to("cpu")
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        float(loss.detach())


def loop_hooked(tracker: th.Tracker, model: nn.Module, opt: torch.optim.Optimizer, data: list) -> None:
    for x, y in tracker.loader(data):  # 1: dataloader_next
        with tracker.phase("to_device"):  # 2
            x, y = x.to("cpu"), y.to("cpu")
        with tracker.phase("forward", cuda=True):  # 3
            loss = nn.functional.mse_loss(model(x), y)
        with tracker.phase("backward", cuda=True):  # 4
            opt.zero_grad()
            loss.backward()
        with tracker.phase("optimizer_step", cuda=True):  # 5
            opt.step()
        with tracker.phase("reduce_metrics"):  # 6
            float(loss.detach())
        tracker.step(samples=len(x))


def calibrate_width(target_s: float = 0.005) -> tuple[int, float]:
    """The hidden width whose step takes about target_s on this machine."""
    data = batches(20)
    width, step = 256, 0.0
    for _ in range(8):
        model, opt = make_model(width)
        loop_plain(model, opt, data[:5])
        start = time.perf_counter()
        loop_plain(model, opt, data)
        step = (time.perf_counter() - start) / len(data)
        if abs(step - target_s) / target_s < 0.15:
            break
        width = max(64, int(width * (target_s / step) ** 0.5))
    return width, step


def hooks_alone_us(tracker: th.Tracker, steps: int = 20_000) -> float:
    """Per-step cost of the instrumentation itself: the hooked loop with every body emptied."""
    data = [(0, 0)] * steps
    start = time.perf_counter_ns()
    for _ in tracker.loader(data):
        for name in ("to_device", "forward", "backward", "optimizer_step", "reduce_metrics"):
            with tracker.phase(name, cuda=name in ("forward", "backward", "optimizer_step")):
                pass
        tracker.step(samples=64)
    return (time.perf_counter_ns() - start) / steps / 1e3


def bench_training_loop(
    pairs: int = 80, block: int = 25,
    target: Callable[[], AbstractContextManager[str]] = pushgateway, target_name: str = "a real Pushgateway",
) -> str:
    """Short plain/hooked blocks in pairs (order alternating); the median of per-pair ratios shrugs off
    the bursts of a shared machine better than comparing two long runs. Wall time and the training
    thread's CPU time (which other processes' load disturbs less) are both reported. `target` yields
    the push URL ("" = no pushing)."""
    width, step = calibrate_width()
    data = batches(block)
    with target() as url:
        tracker = th.init(run="bench-loop", push_url=url, push_interval=1.0)
        model, opt = make_model(width)
        loop_plain(model, opt, data)
        loop_hooked(tracker, model, opt, data)
        wall: dict[str, list[float]] = {"plain": [], "hooked": []}
        cpu: dict[str, list[float]] = {"plain": [], "hooked": []}

        def run(kind: str) -> None:
            start_wall, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
            if kind == "plain":
                loop_plain(model, opt, data)
            else:
                loop_hooked(tracker, model, opt, data)
            cpu[kind].append((time.thread_time_ns() - start_cpu) / block / 1e6)
            wall[kind].append((time.perf_counter_ns() - start_wall) / block / 1e6)

        for i in range(pairs):
            for kind in (("plain", "hooked") if i % 2 == 0 else ("hooked", "plain")):
                run(kind)
        alone = hooks_alone_us(tracker)
        tracker.close()
        pushes = tracker.pusher.stats.successes if tracker.pusher else 0

    def slowdown(times: dict[str, list[float]]) -> tuple[float, float, float]:
        ratios = [(h - p) / p * 100 for p, h in zip(times["plain"], times["hooked"], strict=True)]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        return median, q1, q3

    def cell(times: dict[str, list[float]]) -> str:
        median, q1, q3 = slowdown(times)
        return f"{median:+.2f} % (IQR {q1:+.1f} .. {q3:+.1f})"

    plain_ms = statistics.median(wall["plain"])
    rows = [
        ["without hooks", f"{plain_ms:.3f}", f"{statistics.median(cpu['plain']):.3f}", "", ""],
        [f"with hooks (6 phases + step, {'pushing' if url else 'not pushing'})",
         f"{statistics.median(wall['hooked']):.3f}", f"{statistics.median(cpu['hooked']):.3f}", cell(wall), cell(cpu)],
        ["the hooks alone (empty phase bodies)", f"{alone / 1e3:.4f}", "",
         f"{alone / (plain_ms * 1e3) * 100:.3f} %", ""],
    ]
    pushed_to = f"{target_name} every 1 s ({pushes} successful pushes)" if url else "nowhere"
    note = (f"MLP hidden width {width} (calibrated step {step * 1e3:.1f} ms), {pairs} pairs of "
            f"{block}-step blocks in alternating order, torch threads {torch.get_num_threads()}; "
            f"pusher to {pushed_to}. Slowdown = median over pairs of (hooked - plain) / plain. The last row "
            "times the instrumentation alone (loader wrapper, 5 phases, step) over the plain step.")
    headers = ["loop", "wall ms/step (median)", "training-thread CPU ms/step", "slowdown, wall",
               "slowdown, thread CPU"]
    return table(headers, rows) + "\n\n" + note


# -- 3. Lightning ---------------------------------------------------------------------------------

def bench_lightning(repeats: int = 15, steps: int = 200) -> str:
    import lightning.pytorch as pl
    from lightning.pytorch.profilers import SimpleProfiler
    from torch.utils.data import DataLoader, TensorDataset

    from stepscope.hooks.lightning import StepscopeCallback

    for name in ("lightning", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    width, _ = calibrate_width()
    g = torch.Generator().manual_seed(2)
    dataset = TensorDataset(torch.randn(steps * 64, 256, generator=g),
                            torch.randn(steps * 64, 1, generator=g))

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, _ = make_model(width)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    class EpochClock(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.start = time.perf_counter(), time.thread_time()

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.seconds = time.perf_counter() - self.start[0], time.thread_time() - self.start[1]

    def fit(mode: str, root: str, push_url: str) -> tuple[float, float]:
        gc.collect()  # the previous Trainer's garbage must not land on this one's clock
        clock = EpochClock()
        callbacks: list[pl.Callback] = [clock]
        profiler = None
        if mode == "stepscope":
            callbacks.append(StepscopeCallback(run="bench-pl", push_url=push_url, push_interval=1.0))
        elif mode == "SimpleProfiler":
            profiler = SimpleProfiler(dirpath=root, filename="simple")
        trainer = pl.Trainer(
            max_epochs=1, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
            enable_checkpointing=False, enable_model_summary=False, callbacks=callbacks, profiler=profiler,
            default_root_dir=root,
        )
        trainer.fit(Module(), DataLoader(dataset, batch_size=64))
        return clock.seconds

    modes = ["no callback", "stepscope", "SimpleProfiler"]
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as root, pushgateway() as url:
        for mode in modes:  # warm-up
            fit(mode, root, url)
        for i in range(repeats):
            for mode in modes[i % 3:] + modes[: i % 3]:  # rotate the order: no mode always goes first
                times[mode].append(fit(mode, root, url))
    medians = {m: (statistics.median(t[0] for t in times[m]), statistics.median(t[1] for t in times[m]))
               for m in modes}
    base_wall, base_cpu = medians["no callback"]
    rows = []
    for mode in modes:
        wall, cpu = medians[mode]
        rows.append([mode, f"{wall:.3f}", f"{wall / steps * 1e3:.3f}",
                     f"{(wall - base_wall) / base_wall * 100:+.2f} %", f"{cpu:.3f}",
                     f"{(cpu - base_cpu) / base_cpu * 100:+.2f} %"])
    note = (f"One epoch of {steps} steps (MLP hidden width {width}), {repeats} repetitions per mode in "
            "rotating order; stepscope pushes to a real Pushgateway every 1 s when installed.")
    headers = ["Trainer", "epoch wall s (median)", "wall ms/step", "vs none, wall", "epoch thread CPU s",
               "vs none, CPU"]
    return table(headers, rows) + "\n\n" + note


def main() -> int:
    torch.set_num_threads(1)
    logging.getLogger("stepscope.hooks").setLevel(logging.ERROR)
    started = time.perf_counter()
    sections = [
        ("Cost of one timed phase", bench_phase_cost()),
        ("CPU training loop, ~5 ms steps", bench_training_loop()),
        ("Lightning: StepscopeCallback vs SimpleProfiler", bench_lightning()),
    ]
    header = (f"# Training hooks benchmark\n\n{results.machine(f'torch {torch.__version__}')}, "
              f"{results.load_average()} at the end; total {time.perf_counter() - started:.0f} s.\n")
    results.publish(RESULTS, header + results.sections(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())

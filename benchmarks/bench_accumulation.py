"""Gradient accumulation against truth, end to end: two plain-torch ranks (gloo, gradients all-reduced at the
micro-batch that steps) accumulate 4 micro-batches per optimizer step and push to a real exporter, scraped by a
real Prometheus with the shipped rules; rank 0 feeds 18 micro-batches an epoch (4+4+4+4+2), rank 1 17 (4+4+4+4+1):
the same steps, an uneven last batch. Each rank writes what it measured itself (every step's wall time, its
fetches, forward/backward/optimizer time, samples, micro-batches); the rules' figures over the last minute of
training are compared to that truth over the same minute, then the report's over the whole run.

    PYTHONPATH=. python benchmarks/bench_accumulation.py --loading slow   # data-bound: 6 ms an item
    PYTHONPATH=. python benchmarks/bench_accumulation.py --loading fast   # 0.3 ms an item

Results: benchmarks/results/accumulation.md.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from time import perf_counter
from typing import Any

ACCUMULATE = 4
BATCH = 4
WORK = 0.006  # forward's own sleep per micro-batch (the model is tiny)
ITEM_SECONDS = {"slow": 0.006, "fast": 0.0003}
RUN = "accum-bench"


def rank_main(rank: int, url: str, store_port: int, loading: str, seconds: float, out: Path) -> None:
    """One rank's loop: tracker.loader() for the fetches, phases, micro_batch() / step()."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    import stepscope.hooks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank, world_size=2)
    torch.set_num_threads(1)

    class Items(Dataset):
        def __len__(self) -> int:
            return 18 * BATCH - rank * BATCH  # rank 0: 18 batches, rank 1: 17

        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            time.sleep(ITEM_SECONDS[loading])
            x = torch.rand(16)
            return x, x.sum(dim=0, keepdim=True)

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tracker = stepscope.hooks.init(run=RUN, rank=rank, world_size=2, push_url=url, push_interval=1.0,
                                   handle_sigterm=False)
    steps: list[dict] = []
    began = time.time()
    step_start = perf_counter()
    current = {"fetch": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0, "samples": 0, "micro_batches": 0}
    while True:
        done = torch.tensor([float(time.time() - began >= seconds)])
        dist.all_reduce(done, op=dist.ReduceOp.MAX)  # the ranks end at the same epoch's end
        if done.item():
            break
        batches = DataLoader(Items(), batch_size=BATCH)
        per_epoch = len(batches)
        fetch_start = perf_counter()
        for index, (x, y) in enumerate(tracker.loader(batches)):
            current["fetch"] += perf_counter() - fetch_start
            with tracker.phase("forward"):
                t = perf_counter()
                time.sleep(WORK)
                loss = nn.functional.mse_loss(model(x), y)
                current["forward"] += perf_counter() - t
            with tracker.phase("backward"):
                t = perf_counter()
                loss.backward()
                current["backward"] += perf_counter() - t
            current["samples"] += len(x)
            current["micro_batches"] += 1
            if (index + 1) % ACCUMULATE and index + 1 < per_epoch:
                tracker.micro_batch(samples=len(x))
                fetch_start = perf_counter()
                continue
            with tracker.phase("optimizer_step"):
                t = perf_counter()
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                opt.step()
                opt.zero_grad()
                current["optimizer"] += perf_counter() - t
            tracker.step(samples=len(x))
            now = perf_counter()
            steps.append({**current, "end": time.time(), "seconds": now - step_start})
            step_start = now
            current = dict.fromkeys(current, 0)
            fetch_start = perf_counter()
    tracker.close()
    dist.destroy_process_group()
    (out / f"truth-{rank}.json").write_text(json.dumps(steps))


def lightning_main(url: str, loading: str, seconds: float, out: Path, warmup: bool) -> None:
    """One rank fitting with Lightning, accumulate_grad_batches=4 (18 batches an epoch: 4+4+4+4+2), and with
    `warmup` a per-step linear LR warm-up over the whole run; each step's truth from a callback listed before
    StepscopeCallback (its batch end is the step boundary) and the Dataset's own loading time."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from stepscope.hooks.lightning import StepscopeCallback

    torch.set_num_threads(1)
    steps: list[dict] = []
    current = {"fetch": 0.0, "samples": 0, "micro_batches": 0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    lrs: list[float] = []

    class Items(Dataset):
        def __len__(self) -> int:
            return 18 * BATCH - 2

        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            t = perf_counter()
            time.sleep(ITEM_SECONDS[loading])
            x = torch.rand(16)
            current["fetch"] += perf_counter() - t
            return x, x.sum(dim=0, keepdim=True)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            time.sleep(WORK)
            x, y = batch
            current["samples"] += len(x)
            current["micro_batches"] += 1
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=1e-3)
            if not warmup:
                return opt
            ramp = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2000))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": ramp, "interval": "step"}}

    class StepTruth(pl.Callback):
        def __init__(self) -> None:
            self.seen, self.start = 0, perf_counter()

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.start = perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            if trainer.global_step == self.seen:
                return
            self.seen = trainer.global_step
            now = perf_counter()
            steps.append({**current, "end": time.time(), "seconds": now - self.start})
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
            self.start = now
            current.update(dict.fromkeys(current, 0))

    callback = StepscopeCallback(run=RUN, push_url=url, push_interval=1.0, handle_sigterm=False)
    trainer = pl.Trainer(max_time={"seconds": seconds}, accumulate_grad_batches=ACCUMULATE, accelerator="cpu",
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[StepTruth(), callback])
    trainer.fit(Module(), DataLoader(Items(), batch_size=BATCH))
    print(f"lr from {lrs[0]:.2e} to {lrs[-1]:.2e} over {len(lrs)} steps")
    (out / "truth-0.json").write_text(json.dumps(steps))


def truth_over(steps: list[dict], start: float, end: float) -> dict[str, float]:
    """Per second and per step over the steps that ended in [start, end]."""
    inside = [s for s in steps if start <= s["end"] <= end]
    total = sum(s["seconds"] for s in inside)
    return {
        "steps_per_s": len(inside) / (end - start),
        "samples_per_s": sum(s["samples"] for s in inside) / (end - start),
        "loading_share": sum(s["fetch"] for s in inside) / total,
        "step_s": total / len(inside),
        **{f"{phase}_per_step": sum(s[phase] for s in inside) / len(inside)
           for phase in ("fetch", "forward", "backward", "optimizer")},
        "micro_batches_per_step": sum(s["micro_batches"] for s in inside) / len(inside),
    }


def one(query: object, url: str, expr: str) -> list[tuple[dict, float]]:
    return [(found["metric"], float(found["value"][1])) for found in query(url, expr)]  # type: ignore[operator]


def orchestrate(loading: str, seconds: float, framework: str) -> None:
    from grafana.rules import RULE_FILES
    from stepscope.contract import recordings as rec
    from stepscope_testkit.processes import REPO_ROOT, free_port, running_exporter
    from tests.support.prometheus import query, running_prometheus, wait_for

    tmp = Path(tempfile.mkdtemp(prefix="accum-"))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with running_exporter(tmp) as exporter, \
            running_prometheus(tmp, {"node-a": exporter.url.removeprefix("http://")}, RULE_FILES) as prometheus:
        assert wait_for(lambda: query(prometheus.url, "up == 1"), 30)
        port = free_port()
        world = (0, 1) if framework == "torch" else (0,)
        ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--url", exporter.url,
                                   "--store-port", str(port), "--loading", loading, "--seconds", str(seconds),
                                   "--out", str(tmp), "--framework", framework], env=env) for rank in world]
        time.sleep(seconds - 3)
        asked = time.time()
        exprs = {
            "steps/s": rec.RUN_STEPS_RATE, "samples/s": rec.RUN_SAMPLES_RATE,
            "rank steps/s": rec.RANK_STEPS_RATE, "rank samples/s": rec.RANK_SAMPLES_RATE,
            "loading share": rec.RANK_DATALOADER_SHARE, "run loading share": rec.RUN_DATALOADER_SHARE,
            "step mean": rec.RANK_STEP_SECONDS_MEAN, "phase per step": rec.RANK_PHASE_SECONDS_PER_STEP,
            "verdict": rec.RUN_VERDICT, "straggler score": rec.RANK_STRAGGLER_SCORE,
            "local score": rec.RANK_STRAGGLER_LOCAL_SCORE, "alerts": "ALERTS",
            "micro-batches/step": "rate(stepscope_micro_batches_total[1m]) / rate(stepscope_steps_total[1m])",
        }
        got = {name: one(query, prometheus.url, expr) for name, expr in exprs.items()}
        for rank in ranks:
            rank.wait(timeout=120)
        time.sleep(3)
        report = tmp / "report"
        subprocess.run([sys.executable, "-m", "stepscope.report", "--prometheus", prometheus.url, "--run", RUN,
                        "--out", str(report)], env=env, check=True, capture_output=True, timeout=120)
    print(f"{framework}, loading {loading}: queried at {asked:.1f}, the rules over the last minute vs truth over it")
    for name, found in got.items():
        for labels, value in found:
            keep = {k: v for k, v in labels.items() if k in ("rank", "phase", "verdict", "alertname", "alertstate")}
            print(f"  {name:>20} {keep} {value:.4f}")
    for rank in world:
        steps = json.loads((tmp / f"truth-{rank}.json").read_text())
        truth = truth_over(steps, asked - 60, asked)
        print(f"  truth rank {rank}: " + ", ".join(f"{k} {v:.4f}" for k, v in truth.items()))
        whole = truth_over(steps, steps[0]["end"] - steps[0]["seconds"], steps[-1]["end"])
        print(f"  truth rank {rank}, whole run: steps {len(steps)}, samples {sum(s['samples'] for s in steps)}, "
              f"micro-batches {sum(s['micro_batches'] for s in steps)}, loading share {whole['loading_share']:.4f}")
    for name in ("summary.csv", "goodput.csv", "ranks.csv"):
        path = report / name
        if path.exists():
            print(f"  report {name}:")
            for row in csv.DictReader(path.open()):
                print("   ", {k: v for k, v in row.items() if v not in ("", None)})
    print(f"  report: {report}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loading", choices=sorted(ITEM_SECONDS), default="slow")
    parser.add_argument("--seconds", type=float, default=75.0)
    parser.add_argument("--framework", choices=("torch", "lightning", "lightning-warmup"), default="torch")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--url")
    parser.add_argument("--store-port", type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.rank is None:
        orchestrate(args.loading, args.seconds, args.framework)
    elif args.framework != "torch":
        lightning_main(args.url, args.loading, args.seconds, args.out, args.framework == "lightning-warmup")
    else:
        rank_main(args.rank, args.url, args.store_port, args.loading, args.seconds, args.out)


if __name__ == "__main__":
    main()

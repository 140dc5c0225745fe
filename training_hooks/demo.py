"""`python -m training_hooks.demo`: a small MLP on synthetic data, instrumented, pushing to the exporter.

Launch several with `--rank` and one with `--extra-step-seconds` to watch a straggler, or use
`--slow-loader` to watch a data-bound run. Needs torch (CPU is enough).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import training_hooks


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _positive_int(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text!r}")
        return value
    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training_hooks.demo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="demo", help="run label (default: demo)")
    parser.add_argument("--steps", type=_positive_int(0), default=0, help="steps to train, 0 = forever")
    parser.add_argument("--batch-size", type=_positive_int(1), default=64)
    parser.add_argument("--slow-loader", type=_non_negative_float, default=0.0, metavar="SECONDS",
                        help="sleep this long per batch in the data loader (a data-bound run)")
    parser.add_argument("--rank", type=_positive_int(0), default=None,
                        help="global rank (default: RANK or 0)")
    parser.add_argument("--world-size", type=_positive_int(1), default=None,
                        help="world size (default: WORLD_SIZE, or rank + 1)")
    parser.add_argument("--extra-step-seconds", type=_non_negative_float, default=0.0, metavar="SECONDS",
                        help="extra compute time per step on this rank (a straggler)")
    parser.add_argument("--push-url", default=None,
                        help="exporter or Pushgateway URL (default: STEPSCOPE_PUSH_URL or http://127.0.0.1:9847)")
    parser.add_argument("--push-interval", type=float, default=None,
                        help="seconds between pushes (default: STEPSCOPE_PUSH_INTERVAL or 5)")
    args = parser.parse_args(argv)
    if args.world_size is None and args.rank is not None:
        args.world_size = args.rank + 1
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, Dataset
    except ImportError:
        print("the demo needs torch: pip install 'stepscope[torch]'", file=sys.stderr)
        return 2

    try:
        tracker = training_hooks.init(run=args.run, rank=args.rank, world_size=args.world_size,
                                      push_url=args.push_url, push_interval=args.push_interval)
    except ValueError as exc:
        print(f"python -m training_hooks.demo: error: {exc}", file=sys.stderr)
        return 2
    cfg = tracker.config
    where = "nowhere (push disabled)"
    if tracker.pusher is not None:
        where = f"to {tracker.pusher.url} every {cfg.push_interval:g}s"
    print(f"stepscope demo: run={cfg.run} rank={cfg.rank}/{cfg.world_size} pushing {where}", flush=True)

    class SyntheticBatches(Dataset):
        """Whole batches of random regression data; sleeps per batch to mimic slow storage."""

        def __len__(self) -> int:
            return 1_000_000

        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            if args.slow_loader:
                time.sleep(args.slow_loader)
            x = torch.randn(args.batch_size, 64)
            return x, x.sum(dim=1, keepdim=True)

    torch.manual_seed(cfg.rank)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000)
    loader = DataLoader(SyntheticBatches(), batch_size=None, shuffle=False)
    step = 0
    try:
        for x, y in tracker.loader(loader):
            with tracker.phase("to_device"):
                x, y = x.to("cpu"), y.to("cpu")
            with tracker.phase("forward", cuda=True):
                loss = nn.functional.mse_loss(model(x), y)
                if args.extra_step_seconds:
                    time.sleep(args.extra_step_seconds)
            with tracker.phase("backward", cuda=True):
                optimizer.zero_grad()
                loss.backward()
            with tracker.phase("optimizer_step", cuda=True):
                optimizer.step()
            with tracker.phase("step_lr_schedulers"):
                scheduler.step()
            tracker.step(samples=len(x))
            step += 1
            if args.steps and step >= args.steps:
                break
    except KeyboardInterrupt:
        pass
    finally:
        tracker.close()
    print(f"stepscope demo: {step} steps done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

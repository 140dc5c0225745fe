"""`python -m stepscope.hooks.demo`: a small MLP on synthetic data, instrumented, pushing to the exporter.

Launch several with `--rank` and one with `--extra-step-seconds` to watch a straggler, or use
`--slow-loader` to watch a data-bound run (`--loader-workers` loads in parallel, the usual fix), and
`--measure-limits` to measure the loader and compute limits before training. `--ddp` trains
synchronously with DistributedDataParallel (gloo, CPU) under torchrun, where every rank waits for the
slowest in the gradient all-reduce:
`torchrun --nproc-per-node 2 -m stepscope.hooks.demo --ddp --slow-rank 1 --extra-step-seconds 0.03`.
Needs torch (CPU is enough).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import stepscope.hooks
from stepscope.contract.exposition import escape_label_value
from stepscope.contract.training import (
    BACKWARD_PHASE,
    DATA_LOADING_PHASE,
    EVAL_STATE,
    FORWARD_PHASE,
    LR_SCHEDULER_PHASE,
    OPTIMIZER_PHASE,
    TO_DEVICE_PHASE,
)
from stepscope.hooks.config import Config

DDP_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# How --ddp is started, the demo's flags after the `--`: without it torchrun's own parser takes them, and
# `--run` is an ambiguous abbreviation of its --run-path (docs/hooks.md, "Demo")
TORCHRUN_COMMAND = "torchrun --nproc-per-node N -m stepscope.hooks.demo --"
# Rendezvous and collective timeout: a missing or dead peer ends the demo instead of hanging it.
DDP_TIMEOUT_SECONDS = 60
PROGRESS_SECONDS = 10.0  # default of --progress-every
# The longest a seconds flag may ask for: `inf` (or 1e10) made time.sleep raise OverflowError (a traceback) and an
# eval of `inf` seconds never end; an hour per batch, step or eval is already more than a demo needs.
MAX_SECONDS = 3600.0


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SECONDS:g} seconds, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text!r}")
        return value
    return parse


class _OneLineErrors(argparse.ArgumentParser):
    """A bad flag is one line on stderr and exit 2 (argparse's usage block would bury the reason)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _OneLineErrors(prog="python -m stepscope.hooks.demo", description=__doc__.splitlines()[0],
                            allow_abbrev=False)
    parser.add_argument("--run", default="demo", help="run label (default: demo)")
    parser.add_argument("--steps", type=_int_at_least(0), default=0, help="steps to train, 0 = forever")
    parser.add_argument("--batch-size", type=_int_at_least(1), default=64)
    parser.add_argument("--slow-loader", type=_non_negative_float, default=0.0, metavar="SECONDS",
                        help="sleep this long per batch in the data loader (a data-bound run)")
    parser.add_argument("--loader-workers", type=_int_at_least(0), default=0, metavar="N",
                        help="DataLoader worker processes (default 0: load in the training process); each "
                             "sleeps --slow-loader per batch, so N workers make a slow loader N times faster")
    parser.add_argument("--measure-limits", type=_int_at_least(0), default=0, metavar="BATCHES",
                        help="before training, measure the loader limit and the compute limit over BATCHES "
                             "batches (tracker.measure_limits) and push them (default 0: do not)")
    parser.add_argument("--rank", type=_int_at_least(0), default=None,
                        help="global rank (default: RANK or 0)")
    parser.add_argument("--world-size", type=_int_at_least(1), default=None,
                        help="world size (default: WORLD_SIZE, or rank + 1)")
    parser.add_argument("--extra-step-seconds", type=_non_negative_float, default=0.0, metavar="SECONDS",
                        help="extra compute time per step in forward (a straggler): on this rank, or on "
                             "--slow-rank only")
    parser.add_argument("--warm-up-seconds", type=_non_negative_float, default=0.0, metavar="SECONDS",
                        help="a first step this much slower, as torch.compile's or cudnn.benchmark's first step is "
                             "(the report leaves such a warm-up out of its means and shares)")
    parser.add_argument("--slow-rank", type=_int_at_least(0), default=None, metavar="RANK",
                        help="apply --extra-step-seconds only on this rank (default: on every rank)")
    parser.add_argument("--eval-every", type=_int_at_least(0), default=0, metavar="STEPS",
                        help="evaluate every STEPS steps in state eval (default 0: never)")
    parser.add_argument("--eval-seconds", type=_non_negative_float, default=2.0, metavar="SECONDS",
                        help="how long each evaluation runs forward passes (default 2)")
    parser.add_argument("--ddp", action="store_true",
                        help="synchronous data parallel: DistributedDataParallel over gloo, rank and world "
                             "size from torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT")
    parser.add_argument("--push-url", default=None,
                        help="exporter or Pushgateway URL (default: STEPSCOPE_PUSH_URL or http://127.0.0.1:9847)")
    parser.add_argument("--push-interval", type=float, default=None,
                        help="seconds between pushes (default: STEPSCOPE_PUSH_INTERVAL or 5)")
    parser.add_argument("--progress-every", type=_positive_float, default=PROGRESS_SECONDS, metavar="SECONDS",
                        help=f"print the steps, their rate and the share spent waiting for data this often "
                             f"(default {PROGRESS_SECONDS:g})")
    args = parser.parse_args(argv)
    if args.ddp:
        try:
            rank, world_size = ddp_env(os.environ)
        except ValueError as exc:
            parser.error(str(exc))
        for flag, given, env_value in (("--rank", args.rank, rank), ("--world-size", args.world_size, world_size)):
            if given is not None and given != env_value:
                parser.error(f"{flag} {given} disagrees with torchrun's environment ({env_value})")
        args.rank, args.world_size = rank, world_size
    if args.measure_limits == 1:
        parser.error("--measure-limits needs at least 2 batches (0 turns it off)")
    if args.world_size is None and args.rank is not None and not os.environ.get("WORLD_SIZE", "").strip():
        args.world_size = args.rank + 1
    # the hooks' own checks, before torch's import (seconds) makes a typo slow to report
    try:
        config = Config.resolve(run=args.run, rank=args.rank, world_size=args.world_size, push_url=args.push_url,
                                push_interval=args.push_interval)
    except ValueError as exc:
        parser.error(str(exc))
    if args.slow_rank is not None and args.slow_rank >= config.world_size:
        parser.error(f"--slow-rank {args.slow_rank} must be smaller than world_size {config.world_size}")
    return args


def ddp_env(env: Mapping[str, str]) -> tuple[int, int]:
    """(rank, world size) from the variables torchrun sets; ValueError names what is missing or wrong."""
    missing = [name for name in DDP_ENV if not env.get(name, "").strip()]
    if missing:
        raise ValueError(f"--ddp needs {', '.join(missing)} in the environment: start it with "
                         f"{TORCHRUN_COMMAND} --ddp")
    try:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    except ValueError:
        raise ValueError(f"RANK and WORLD_SIZE must be integers, got {env['RANK']!r} and "
                         f"{env['WORLD_SIZE']!r}") from None
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK {rank} must be in 0..WORLD_SIZE-1 (WORLD_SIZE {world_size})")
    return rank, world_size


class Progress:
    """Says what the demo is doing and where to look, every few seconds: training prints nothing else, and a
    newcomer staring at a silent terminal cannot tell a working demo from a hung one."""

    def __init__(self, tracker: stepscope.hooks.Tracker, every: float) -> None:
        self._tracker, self._every = tracker, every
        self._since, self._steps = time.monotonic(), 0
        cfg = tracker.config
        self._where = f"look: {look_command(cfg.push_url, cfg.run)}" if cfg.push_url else "not pushing (--push-url '')"

    def tick(self) -> None:
        """After each step: prints a line when `every` seconds have passed since the last one."""
        now = time.monotonic()
        if now - self._since < self._every:
            return
        steps = self._tracker.steps
        rate = (steps - self._steps) / (now - self._since)
        self._since, self._steps = now, steps
        print(f"stepscope demo: {steps:,} steps, {rate:.1f} steps/s{self._waiting()}; {self._where}", flush=True)

    def _waiting(self) -> str:
        """The share of the step time spent in dataloader_next so far, as the rules' data-loading share."""
        snapshot = self._tracker.snapshot()
        loading = sum(hist.sum_seconds for name, _, hist in snapshot.phases if name == DATA_LOADING_PHASE)
        step = snapshot.step.sum_seconds
        return f", waiting for data {loading / step:.0%} of the step time" if step else ""


def look_command(push_url: str, run: str) -> str:
    """A shell command that shows the run's series on the exporter, whatever its name: grep -F on the label as
    /metrics writes it (a `"` or a `\\` escaped), shell-quoted. Before, `grep 'run="a"b"'` matched nothing and
    a `'` in the name broke the command."""
    label = f'run="{escape_label_value(run)}"'
    return f"curl -s {shlex.quote(push_url + '/metrics')} | grep -F {shlex.quote(label)}"


def evaluate(model: Any, batch_size: int, seconds: float) -> None:
    """Forward passes without gradients on fresh batches for `seconds` (the demo's validation)."""
    import torch

    deadline = time.monotonic() + seconds
    model.eval()
    with torch.no_grad():
        while time.monotonic() < deadline:
            model(torch.randn(batch_size, 64))
    model.train()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tracker = stepscope.hooks.init(run=args.run, rank=args.rank, world_size=args.world_size,
                                      push_url=args.push_url, push_interval=args.push_interval)
    except ValueError as exc:
        print(f"python -m stepscope.hooks.demo: error: {exc}", file=sys.stderr)
        return 2
    cfg = tracker.config
    extra_seconds = args.extra_step_seconds if args.slow_rank in (None, cfg.rank) else 0.0
    where = "nowhere (push disabled)"
    if tracker.pusher is not None:
        where = f"to {tracker.pusher.url} every {cfg.push_interval:g}s"
    mode = " ddp (gloo)" if args.ddp else ""
    # said before torch's import (seconds): the hooks need no torch, and the rank shows as in setup
    print(f"stepscope demo: run={cfg.run} rank={cfg.rank}/{cfg.world_size}{mode} pushing {where}", flush=True)
    try:
        import torch
        from torch import distributed as dist
        from torch import nn
        from torch.utils.data import DataLoader, IterableDataset
    except ImportError:
        tracker.close()
        print("python -m stepscope.hooks.demo: error: the demo needs torch: pip install torch "
              "(in a checkout of stepscope: pip install '.[torch]')", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while torch loads (seconds): as Ctrl-C while training, not a traceback
        tracker.close()
        return _done(tracker)

    class SyntheticBatches(IterableDataset):
        """Endless whole batches of random regression data (--steps 0 runs forever); sleeps per batch to
        mimic slow storage."""

        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            while True:
                if args.slow_loader:
                    time.sleep(args.slow_loader)
                x = torch.randn(args.batch_size, 64)
                yield x, x.sum(dim=1, keepdim=True)

    try:
        torch.manual_seed(cfg.rank)
        model: nn.Module = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
        if args.ddp:
            # Every backward all-reduces the gradients: the fast ranks wait there for the slow one.
            dist.init_process_group("gloo", rank=cfg.rank, world_size=cfg.world_size,
                                    timeout=datetime.timedelta(seconds=DDP_TIMEOUT_SECONDS))
            model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000)
        loader = DataLoader(SyntheticBatches(), batch_size=None, num_workers=args.loader_workers)

        warm_up_left = [args.warm_up_seconds]

        def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.mse_loss(model(x), y)
            seconds = extra_seconds + (warm_up_left.pop() if warm_up_left else 0.0)
            if seconds:
                time.sleep(seconds)
            return loss

        def backward(loss: torch.Tensor) -> None:
            optimizer.zero_grad()
            loss.backward()

        def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            backward(forward(*batch))
            optimizer.step()

        if args.measure_limits:
            limits = tracker.measure_limits(loader, train_step, batches=args.measure_limits)
            print(f"stepscope demo: {limits}", flush=True)
        progress = Progress(tracker, args.progress_every)
        for x, y in tracker.loader(loader):
            with tracker.phase(TO_DEVICE_PHASE):
                x, y = x.to("cpu"), y.to("cpu")
            with tracker.phase(FORWARD_PHASE, cuda=True):
                loss = forward(x, y)
            with tracker.phase(BACKWARD_PHASE, cuda=True):
                backward(loss)
            with tracker.phase(OPTIMIZER_PHASE, cuda=True):
                optimizer.step()
            with tracker.phase(LR_SCHEDULER_PHASE):
                scheduler.step()
            tracker.step(samples=len(x), global_step=tracker.steps + 1)  # a trainer's count (goodput: lost progress)
            progress.tick()
            if args.steps and tracker.steps >= args.steps:
                break
            if args.eval_every and tracker.steps % args.eval_every == 0:
                with tracker.state(EVAL_STATE):
                    evaluate(model, args.batch_size, args.eval_seconds)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, ConnectionError, EOFError) as exc:  # gloo: a dead peer or a timeout is a RuntimeError
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if _loader_workers_stopped(exc, reason, args.loader_workers):
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would raise again for the next one
            print(f"stepscope demo: stopped after {tracker.steps} steps: {reason}", file=sys.stderr)
            return 143
        if not args.ddp:
            raise
        print(f"stepscope demo: lost the process group after {tracker.steps} steps: {reason}", file=sys.stderr)
        return 1
    finally:
        tracker.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return _done(tracker)


def _done(tracker: stepscope.hooks.Tracker) -> int:
    """The end of a demo that trained its --steps or was interrupted (Ctrl-C): the steps it did, exit 0."""
    print(f"stepscope demo: {tracker.steps} steps done", flush=True)
    return 0


def _loader_workers_stopped(exc: Exception, reason: str, workers: int) -> bool:
    """Whether `exc` says the loader's workers were stopped under it: a signal to the whole process group
    (job control, `timeout`) can reach them before the trainer, which then reads a worker gone (RuntimeError),
    or a batch's shared memory whose sender died in its hand-over: a connection reset or refused, or an EOFError
    from multiprocessing's resource sharer."""
    return workers > 0 and (reason.startswith("DataLoader worker") or isinstance(exc, (ConnectionError, EOFError)))


if __name__ == "__main__":
    sys.exit(main())

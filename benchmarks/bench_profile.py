"""What on-demand profiler traces cost: nothing while none is requested, and what a trace costs.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_profile.py          # ~1-2 minutes on 2 busy cores

1. The hot path with no trace requested, this tree against the hooks where this branch left main (git
   archive of the fork point, imported side by side): `tracker.step()` and `with tracker.phase(name)`,
   ns per call, in short blocks interleaved in one process (rotating order), all trackers pushing to
   one real exporter. A second tracker of each tree (A/A) shows the noise floor. Medians over rounds;
   per-round paired ratios with their quartiles and extremes.
2. Taking a trace of an MLP training step (a few ms on one CPU thread): request to file through a real
   exporter, the trace's size, and the training slowdown while the profiler records.
Prints markdown tables and writes benchmarks/results/profile.md.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from bench_gpu import baseline_tree, commit_of, fork_point, median  # noqa: E402
from bench_hooks import table  # noqa: E402
from torch import nn  # noqa: E402

import stepscope.hooks as th  # noqa: E402
from stepscope_testkit import results  # noqa: E402
from stepscope_testkit.processes import running_exporter  # noqa: E402
from stepscope_testkit.traces import rank_tracing, request_state, request_trace, step_annotations, wait_until  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "profile.md"
Op = Callable[[int], None]


def baseline_hooks(tree: Path) -> ModuleType:
    """`training_hooks` of another tree, imported beside this one: its modules keep their own globals."""
    ours = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "training_hooks"}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, str(tree))
    try:
        import stepscope.hooks as theirs

        return theirs
    finally:
        sys.path.remove(str(tree))
        for name in [n for n in sys.modules if n.split(".")[0] == "training_hooks"]:
            del sys.modules[name]
        sys.modules.update(ours)


def ns_per_call(body: Op, calls: int) -> float:
    start = time.perf_counter_ns()
    body(calls)
    return (time.perf_counter_ns() - start) / calls


def step_op(tracker: Any) -> Op:
    def run(calls: int) -> None:
        for _ in range(calls):
            tracker.step(64)
    return run


def phase_op(tracker: Any) -> Op:
    def run(calls: int) -> None:
        for _ in range(calls):
            with tracker.phase("forward"):
                pass
    return run


def paired(values: list[float], base: list[float]) -> str:
    """Median and spread of per-round (value - base) / base, in per cent."""
    ratios = [100 * (v - b) / b for v, b in zip(values, base, strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return f"{statistics.median(ratios):+.1f} % (IQR {q1:+.1f} .. {q3:+.1f}; {min(ratios):+.0f} .. {max(ratios):+.0f})"


def bench_idle(exporter: str, old: ModuleType, before: str, rounds: int, calls: int) -> str:
    settings = {"push_url": exporter, "push_interval": 1.0, "handle_sigterm": False}
    trackers = {
        f"before ({before})": old.init(run="bench-before", **settings),
        "before (A/A)": old.init(run="bench-before-aa", **settings),
        "after, no trace requested": th.init(run="bench-after", **settings),
        "after, no trace requested (A/A)": th.init(run="bench-after-aa", **settings),
    }
    for tracker in trackers.values():
        for batch in tracker.loader(range(3)):  # state train, phases made: the steady hot path
            with tracker.phase("forward"):
                pass
            tracker.step(batch)
    ops = {(name, op): factory(tracker) for name, tracker in trackers.items()
           for op, factory in (("tracker.step()", step_op), ("with tracker.phase(name)", phase_op))}
    times: dict[tuple[str, str], list[float]] = {key: [] for key in ops}
    keys = list(ops)
    for round_ in range(rounds):  # rotate the order so drift and caches hit every variant alike
        for key in keys[round_ % len(keys):] + keys[:round_ % len(keys)]:
            times[key].append(ns_per_call(ops[key], calls))
    for tracker in trackers.values():
        tracker.close()
    rows = []
    base_name = next(iter(trackers))
    for op in ("tracker.step()", "with tracker.phase(name)"):
        base = times[(base_name, op)]
        for name in trackers:
            values = times[(name, op)]
            q1, _, q3 = statistics.quantiles(values, n=4)
            rows.append([op, name, f"{median(values):.0f}", f"{q1:.0f} .. {q3:.0f}",
                         "" if name == base_name else paired(values, base)])
    return table(["operation", "hooks", "ns per call (median)", "IQR over rounds", "vs before, paired per round"],
                 rows) + (f"\n\n{rounds} rounds of {calls} calls per variant, order rotated each round; the four "
                          "trackers push to one real exporter every 1 s. 'after' holds a trace taker; its step() "
                          "makes the one test main's made (a boundary hook, None without GPU phases or a "
                          "request, where main tested its CUDA timer); phases are unchanged. A/A rows are a "
                          "second tracker of the same tree: the noise floor of the paired ratios.")


def bench_trace(exporter: str, steps_per_trace: tuple[int, ...], tmp: Path) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 256)
    y = x.sum(dim=1, keepdim=True)

    def train_step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    tracker = th.init(run="bench-trace", push_url=exporter, push_interval=0.2, handle_sigterm=False,
                      trace_dir=str(tmp / "traces"))
    wait_until(lambda: rank_tracing(exporter, "bench-trace", 0) == "ready", 30, "the first push")
    rows = []
    for steps in steps_per_trace:
        plain = []
        for _ in range(100):
            start = time.perf_counter_ns()
            train_step()
            tracker.step(256)
            plain.append(time.perf_counter_ns() - start)
        request_id = request_trace(exporter, "bench-trace", 0, steps)
        asked = time.perf_counter()
        traced: list[int] = []
        while request_state(exporter, request_id)["state"] not in ("done", "failed"):
            for _ in range(10):
                start = time.perf_counter_ns()
                train_step()
                tracker.step(256)
                if tracker._tracing is not None:  # the trace records this step
                    traced.append(time.perf_counter_ns() - start)
        took = time.perf_counter() - asked
        state = request_state(exporter, request_id)
        assert state["state"] == "done" and len(step_annotations(state["path"])) == steps, state
        step_ms, traced_ms = median(plain) / 1e6, median(traced) / 1e6
        rows.append([str(steps), f"{took:.2f}", f"{state['bytes'] / 1024:.0f}",
                     f"{state['bytes'] / 1024 / steps:.1f}", f"{step_ms:.3f}", f"{traced_ms:.3f}",
                     f"{100 * (traced_ms - step_ms) / step_ms:+.0f} %"])
    tracker.close()
    return table(["steps", "request to file, s", "trace KiB (gzipped)", "KiB per step", "step ms, no trace",
                  "step ms while tracing", "slowdown while tracing"], rows) + (
        "\n\nAn MLP (256-1024-1024-1, batch 256, SGD) on the CPU, one torch thread, pushing every 0.2 s to a real "
        "exporter: 'request to file' runs from the POST to the exporter reporting the trace written (one push to "
        "take it, the steps, the writer, one push to report it). Medians of per-step wall time.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--baseline-rev", default=fork_point(),
                        help="git revision for 'before' (default: where this branch left main)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("stepscope.hooks").setLevel(logging.ERROR)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        tree = baseline_tree(args.baseline_rev, tmp)
        if tree is None:
            return 2
        old = baseline_hooks(tree)
        before = f"{args.baseline_rev[:12]} @ {commit_of(args.baseline_rev)}"
        with running_exporter(tmp) as exporter:
            sections = [
                ("Hot path with no trace requested: this tree vs where it left main",
                 bench_idle(exporter.url, old, before, args.rounds, args.calls)),
                ("Taking a trace", bench_trace(exporter.url, (5, 20, 50), tmp)),
            ]
    header = (f"# On-demand profiler traces benchmark\n\n{results.machine(f'torch {torch.__version__}')}, "
              f"{results.load_average()} at the end (the machine is shared with other test runs); total "
              f"{time.perf_counter() - started:.0f} s.\n")
    results.publish(RESULTS, header + results.sections(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())

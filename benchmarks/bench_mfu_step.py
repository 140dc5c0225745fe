"""What counting tokens and model FLOPs adds to `tracker.step()` (issue 22), before against after, one run.

    PYTHONPATH=. python benchmarks/bench_mfu_step.py [--before ef4d514] [--after COMMIT]   # ~1 minute

The hooks at `--before` (the commit before tokens and FLOPs were counted) and at `--after` (default: this
checkout) are extracted with `git archive` and timed in child processes, alternating: `step(samples=8)` as
every loop calls it, and after also with tokens and stated FLOPs. Prints a markdown table (medians of the
repetitions, their spread as min..max) and writes benchmarks/results/mfu_step.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "mfu_step.md"
BEFORE = "ef4d514"  # the parent of 73c8c87, which added tokens and model FLOPs to the hooks
TREES = ("stepscope", "training_hooks", "stepscope_contract")
CHILD = """
import json, sys, time
import stepscope.hooks as th
ops, kind = int(sys.argv[1]), sys.argv[2]
kwargs = {"flops_per_step": 6 * 10**12} if kind == "flops" else {}
tracker = th.init(run="bench", push_url="", handle_sigterm=False, **kwargs)
step = tracker.step
if kind == "flops":
    def body():
        for _ in range(ops):
            step(samples=8, tokens=4096)
else:
    def body():
        for _ in range(ops):
            step(samples=8)
body()  # warm-up: the step histogram's buckets settle
start = time.perf_counter_ns()
body()
print(json.dumps((time.perf_counter_ns() - start) / ops))
"""


def extract(commit: str, into: Path) -> Path:
    """The hooks and the contract as they were at `commit`, under `into`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, *TREES], capture_output=True, check=True)
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="tar")
    return into


def ns_per_step(tree: Path, kind: str, ops: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(ops), kind], env=env, capture_output=True, text=True,
                         check=True, cwd=tree)
    return float(json.loads(out.stdout))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help="commit whose hooks are the baseline (default %(default)s)")
    parser.add_argument("--after", default="", help="commit to compare (default: this checkout as it is)")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--ops", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = extract(args.before, Path(tmp) / "before")
        after = extract(args.after, Path(tmp) / "after") if args.after else REPO
        cases = {"before: step(samples=8)": (before, "plain"), "after: step(samples=8)": (after, "plain"),
                 "after: step(samples=8, tokens=4096), flops_per_step stated": (after, "flops")}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):  # interleaved, so load changes hit every case alike
            for name, (tree, kind) in cases.items():
                times[name].append(ns_per_step(tree, kind, args.ops))
    base = statistics.median(times["before: step(samples=8)"])
    rows = [f"| {name} | {statistics.median(values):.0f} | {min(values):.0f}..{max(values):.0f} | "
            f"{statistics.median(values) - base:+.0f} |" for name, values in times.items()]
    load = os.getloadavg()[0]
    text = "\n".join([
        "# tracker.step() before and after counting tokens and model FLOPs",
        "",
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load:.1f} at the end; before "
        f"{args.before}, after {args.after or 'this checkout'}; {args.repeats} interleaved repetitions of "
        f"{args.ops:,} steps each (after as many warm-up steps), each in a fresh process.",
        "",
        "| call | ns per step (median) | spread (min..max) | vs before (ns) |",
        "|---|---|---|---|",
        *rows,
        "",
    ])
    print(text)
    RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

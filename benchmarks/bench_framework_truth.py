"""What the Lightning and Hugging Face callbacks report against the truth, before and after issue 29.

Runs the scenarios of tests/test_framework_truth.py (tests/support/framework_truth.py: accumulation 4, a
partial last batch and a short last accumulation each epoch, validation, checkpoints, max_time, a
neighbour callback busy at every batch end; Lightning on 1 rank and DDP over gloo on 2, the transformers
Trainer on 1 and on 2 under torchrun) with the hooks of a git revision (default 0781a5f, before the
change) and with the work tree's, each in its own process pushing to a real Pushgateway, REPEATS times,
and prints medians and ranges of what was pushed over the truth measured in the same process:

    PYTHONPATH=. .venv/bin/python benchmarks/bench_framework_truth.py [--repeats 3] [--before REV]

The table goes to benchmarks/results/framework_truth.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

from stepscope_testkit.processes import REPO_ROOT, free_port, sample_values, scrape
from stepscope_testkit.pushgateway import running_pushgateway
from tests.support.framework_truth import Truth

RESULTS = REPO_ROOT / "benchmarks" / "results" / "framework_truth.md"
SCENARIOS = {"lightning": 1, "lightning_ddp": 2, "huggingface": 1, "huggingface_ddp": 2}  # scenario -> ranks


def child(scenario: str, out: Path, push_url: str, run: str) -> None:
    """One scenario in this process (rank 0; Lightning's launcher starts rank 1 of its DDP run, torchrun
    both ranks of the Trainer's)."""
    from tests.support.framework_truth import huggingface_train, lightning_fit

    if scenario == "lightning_ddp":
        from tests.support.lightning_ddp import main

        main(out, push_url, run)
        return
    truth = Truth()
    if scenario == "lightning":
        from stepscope.hooks.lightning import StepscopeCallback as PL

        lightning_fit(truth, out, PL(run=run, push_url=push_url, push_interval=1.0), devices=1)
        truth.save(out / "truth-0.json")
        return
    from stepscope.hooks.huggingface import StepscopeCallback as HF

    trainer = huggingface_train(truth, out, HF(run=run, push_url=push_url, push_interval=1.0))
    truth.save(out / f"truth-{trainer.args.process_index}.json")


def hooks_tree(revision: str, into: Path) -> Path:
    """The hooks and the contract of `revision`, with this tree's test scenario beside them."""
    archive = subprocess.run(["git", "archive", revision, "training_hooks", "stepscope_contract"],
                             cwd=REPO_ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    for path in ("tests/__init__.py", "tests/support/__init__.py", "tests/support/framework_truth.py",
                 "tests/support/lightning_ddp.py", "stepscope_testkit", "benchmarks/bench_framework_truth.py"):
        target = into / path
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-r", str(REPO_ROOT / path), str(target)], check=True)
    return into


def measure(root: Path, scenario: str, push_url: str, run: str, out: Path) -> list[dict[str, float | None]]:
    """Runs the scenario with the hooks under `root`; per rank, pushed value over truth (None: not pushed)."""
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "benchmarks.bench_framework_truth", "--child", scenario, str(out), push_url, run]
    if scenario == "huggingface_ddp":  # torchrun starts both ranks, as a user would (gloo on the CPU)
        argv[1:2] = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m"]
    subprocess.run(argv, cwd=root, env=env, capture_output=True, check=True, timeout=300)
    text = scrape(push_url)
    rows = []
    for rank in range(SCENARIOS[scenario]):
        truth = Truth.load(out / f"truth-{rank}.json")

        def value(name: str, rank: int = rank, **labels: str) -> float | None:
            found = sample_values(text, name, run=run, rank=str(rank), **labels)
            return found[0] if found else None

        step = value("stepscope_step_seconds_sum") or 0.0
        eval_s, ckpt_s = (value("stepscope_state_seconds_total", state=s) for s in ("eval", "checkpoint"))
        rows.append({
            "steps": _ratio(value("stepscope_steps_total"), truth.optimizer_steps),
            "samples": _ratio(value("stepscope_samples_total"), truth.samples),
            "micro_batches": _ratio(value("stepscope_micro_batches_total"), truth.forwards),
            "share_error": (value("stepscope_step_phase_seconds_sum", phase="dataloader_next") - truth.loading) / step,
            "eval": _ratio(eval_s, sum(truth.spans["eval"])),
            "checkpoint": _ratio(ckpt_s, sum(truth.spans["checkpoint"])),
        })
    return rows


def _ratio(pushed: float | None, truth: float) -> float | None:
    return None if pushed is None or not truth else pushed / truth


def spread(values: list[float | None], show: Callable[[float], str]) -> str:
    """Median (min .. max) of the runs, or "not pushed"."""
    known = [v for v in values if v is not None]
    if not known:
        return "not pushed"
    return f"{show(statistics.median(known))} ({show(min(known))} .. {show(max(known))})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", default="0781a5f", help="git revision of the hooks before (default 0781a5f)")
    parser.add_argument("--child", nargs=4, metavar=("SCENARIO", "OUT", "PUSH_URL", "RUN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), args.child[2], args.child[3])
        return 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, running_pushgateway(Path(tmp)) as gateway:
        trees = {f"before ({args.before})": hooks_tree(args.before, Path(tmp) / "before"), "after": REPO_ROOT}
        results: dict[tuple[str, str], list[dict[str, float | None]]] = {}
        for repeat in range(args.repeats):
            for scenario in SCENARIOS:
                for index, (version, root) in enumerate(trees.items()):
                    run = f"{scenario}-{index}-{repeat}"
                    out = Path(tmp) / run
                    results.setdefault((scenario, version), []).extend(
                        measure(root, scenario, gateway.url, run, out))
    header = ["scenario", "hooks", "steps / truth", "samples / truth", "micro-batches / truth",
              "loading share - truth", "eval seconds / truth", "checkpoint seconds / truth"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ratio, share = (lambda v: f"{v:.3f}"), (lambda v: f"{v:+.3f}")
    for (scenario, version), rows in results.items():
        cells = [spread([row[key] for row in rows], show) for key, show in (
            ("steps", ratio), ("samples", ratio), ("micro_batches", ratio), ("share_error", share),
            ("eval", ratio), ("checkpoint", ratio))]
        lines.append(f"| {scenario} ({SCENARIOS[scenario]} rank{'s' * (SCENARIOS[scenario] > 1)}) | {version} | "
                     + " | ".join(cells) + " |")
    table = "\n".join(lines)
    load = os.getloadavg()[0]
    text = (
        "# Framework integrations against the truth\n\n"
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load:.1f} at the end; "
        f"total {time.monotonic() - started:.0f} s; {args.repeats} runs per scenario and hooks version, every "
        "rank a row. Median (min .. max) over them.\n\n"
        f"{table}\n\n"
        "Truth, measured in the same process without stepscope: optimizer steps from an optimizer step "
        "post-hook, micro-batches and samples from the model's training forwards, loading from the Dataset "
        "and the collate function, eval and checkpoint spans from the trainers' own methods "
        "(tests/support/framework_truth.py). 'not pushed': the hooks had no such counter.\n"
    )
    print(text)
    RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How true tracker.measure_limits' loader limit is, for DataLoaders whose cost per batch is known.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_limits.py       # ~1 minute

Each worker (or the training process, with 0 workers) sleeps a known time per batch, so the true
loader limit is workers x batch / sleep. Repeated measurements per layout; the error of each. Writes
benchmarks/results/limits.md.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from bench_hooks import table  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

from stepscope.hooks.limits import measure  # noqa: E402
from stepscope_testkit import results  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "limits.md"
BATCH = 8
REPEATS = 3


class Sleepy(IterableDataset):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __iter__(self):
        while True:
            time.sleep(self.seconds)
            yield torch.zeros(BATCH, 4)


def main() -> int:
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # more workers than cores: they sleep
    started = time.perf_counter()
    rows = []
    for seconds in (0.01, 0.03):
        for workers in (0, 2, 4):
            truth = max(1, workers) * BATCH / seconds
            errors = []
            for _ in range(REPEATS):
                loader = DataLoader(Sleepy(seconds), batch_size=None, num_workers=workers)
                limits = measure(loader, lambda batch: None, batches=50)
                errors.append(100 * (limits.loader_samples_per_second - truth) / truth)
            rows.append([f"{seconds * 1000:g}", str(workers), f"{truth:.0f}",
                         " / ".join(f"{error:+.1f} %" for error in errors)])
    text = (f"# Loader limit accuracy\n\n{results.machine(f'torch {torch.__version__}')}, "
            f"{results.load_average()} at the end (shared machine); total "
            f"{time.perf_counter() - started:.0f} s.\n\n"
            + table(["sleep per batch, ms", "DataLoader workers", "true loader limit, samples/s",
                     f"error of {REPEATS} measurements (batches=50)"], rows)
            + "\n\nEach worker sleeps per batch of 8 samples; the 'true' limit is workers x 8 / sleep. "
              "measure_limits skips the batches the workers prefetch, then times 50 arrivals. Errors below 0 "
              "are mostly cost the sleep does not count and a real loader pays as well: the sleep's own "
              "overshoot and, with workers, handing each batch across processes.\n")
    results.publish(RESULTS, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Records a GPU corpus: the exporter's scrapes while known workloads train on a real GPU, with their truth,
and, with --judge, what a live Prometheus running the shipped rules concluded meanwhile.

    PYTHONPATH=. python benchmarks/record_gpu_corpus.py --out benchmarks/corpus/h200-2026-11-26 \\
        --prefix h200 --judge mlp_bf16=120 conv_bf16=75 input_copy_bound=75 cpu_preprocess=75 ddp_two_ranks=75

One exporter with default flags, on the real NVML; one workload at a time, each in its own processes
(benchmarks/gpu_workloads.py) and run (`<prefix>-<workload>`); the full `/metrics` scraped every 2 s from
the moment a workload starts until 8 s after it ends, appended to `scrapes.jsonl.gz` (one gzip member
per workload, so a recording cut short keeps what it finished); `truth.json` holds what each loop
measured (rank 0's, with every rank's under `ranks`). The format is the one stepscope_testkit.replay
reads, so tests/test_corpus_verdicts.py and benchmarks/bench_verdicts.py judge it like the shared corpus.

--judge also runs Prometheus (from PATH) with the shipped rule files and their alerts at `for: 0s`,
scraping the exporter every second, and appends the run verdict and the alerts firing every 2 s to
`live.jsonl`: the live check that the replay only reproduces. --smoke trains tiny models on the CPU
(a check of the recorder itself, without a GPU).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_workloads import RANKS, WORKLOADS
from grafana.rules import RULE_FILES
from stepscope.contract import recordings
from stepscope_testkit.processes import free_port, running
from tests.support.prometheus import query, running_prometheus
from tests.support.replay_judge import alerts_without_for
from tests.support.victoria import alerts

SCRAPE_EVERY_S = 2.0
TAIL_S = 8.0  # scrapes after the workload ended: its final state and the rules' last readings


def plan(items: list[str], default_seconds: float) -> list[tuple[str, float]]:
    """`name` or `name=seconds` items as (workload, seconds of training), checked before anything starts."""
    planned = []
    for item in items:
        name, _, seconds = item.partition("=")
        if name not in WORKLOADS:
            raise SystemExit(f"record_gpu_corpus: unknown workload {name!r} (known: {', '.join(sorted(WORKLOADS))})")
        planned.append((name, float(seconds) if seconds else default_seconds))
    return planned


def device_name(smoke: bool) -> str:
    if smoke:
        return "CPU (smoke run: no GPU readings)"
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout.strip()


def child_env(**extra: str) -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH (`stepscope.*` importable from any directory)."""
    repo = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def start_workload(name: str, seconds: float, run: str, truth_dir: Path, push_url: str,
                   smoke: bool) -> list[subprocess.Popen]:
    """The workload's rank processes, pushing to the exporter."""
    port, env = free_port(), child_env(STEPSCOPE_PUSH_URL=push_url)
    script = Path(__file__).resolve().parent / "gpu_workloads.py"
    return [subprocess.Popen([sys.executable, str(script), name, "--seconds", str(seconds), "--run", run,
                              "--truth", str(truth_dir / f"{name}-{rank}.json"), "--rank", str(rank),
                              "--master-port", str(port), *(["--smoke"] if smoke else [])], env=env)
            for rank in range(RANKS.get(name, 1))]


def live_reading(prometheus_url: str, run: str) -> dict:
    """The run's verdict and the alerts firing for it (or for the node and its GPUs) right now."""
    verdict = [item["metric"]["verdict"] for item in query(prometheus_url, recordings.RUN_VERDICT)
               if item["metric"].get("run") == run]
    firing = sorted({labels["alertname"] for labels in alerts(prometheus_url)
                     if labels.get("run", run) == run})
    return {"verdict": verdict[0] if verdict else None, "firing": firing}


def record_one(name: str, seconds: float, args: argparse.Namespace, exporter_url: str,
               prometheus_url: str | None, truth_dir: Path) -> dict:
    """Trains one workload while scraping; its scrapes and live readings appended, its truth returned."""
    run = f"{args.prefix}-{name}"
    ranks = start_workload(name, seconds, run, truth_dir, exporter_url, args.smoke)
    started, ended_at = time.time(), None
    with gzip.open(args.out / "scrapes.jsonl.gz", "at") as scrapes, open(args.out / "live.jsonl", "a") as live:
        while ended_at is None or time.monotonic() - ended_at < TAIL_S:
            tick = time.monotonic()
            body = requests.get(f"{exporter_url}/metrics", timeout=10).text
            scrapes.write(json.dumps({"workload": name, "t": time.time(), "body": body}) + "\n")
            if prometheus_url:
                live.write(json.dumps({"workload": name, "t": time.time(), **live_reading(prometheus_url, run)}) + "\n")
                live.flush()
            if ended_at is None and all(rank.poll() is not None for rank in ranks):
                ended_at = time.monotonic()
            time.sleep(max(0.0, SCRAPE_EVERY_S - (time.monotonic() - tick)))
    if any(rank.returncode for rank in ranks):
        raise SystemExit(f"record_gpu_corpus: workload {name} failed (exit {[r.returncode for r in ranks]})")
    per_rank = [json.loads((truth_dir / f"{name}-{rank}.json").read_text()) for rank in range(len(ranks))]
    return {**per_rank[0], "started": started, "ranks": per_rank}


class ExporterCost:
    """The exporter's own CPU time per second of wall time since it started collecting (its cost on a real
    GPU node, scraped every second by Prometheus and every 2 s by the recorder)."""

    def __init__(self, process: psutil.Process) -> None:
        self.process = process
        self.began, self.cpu = time.monotonic(), self._cpu()

    def _cpu(self) -> float:
        times = self.process.cpu_times()
        return times.user + times.system

    def cpu_ms_per_second(self) -> float:
        return round(1e3 * (self._cpu() - self.cpu) / (time.monotonic() - self.began), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="+", help="workload or workload=seconds, in the order to record")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix", required=True, help="run names are <prefix>-<workload>")
    parser.add_argument("--seconds", type=float, default=90.0, help="training time of a workload without =seconds")
    parser.add_argument("--judge", action="store_true", help="a live Prometheus with the shipped rules too")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU")
    args = parser.parse_args()
    planned = plan(args.workloads, args.seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    truth = {"device": device_name(args.smoke), "scrape_every_s": SCRAPE_EVERY_S, "workloads": {}}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        port = free_port()
        exporter = stack.enter_context(running(
            [sys.executable, "-m", "stepscope.exporter", "--web.listen-address", f"127.0.0.1:{port}"],
            f"http://127.0.0.1:{port}/-/ready", args.out / "exporter.log", env=child_env()))
        cost = ExporterCost(psutil.Process(exporter.process.pid))
        exporter_url = f"http://127.0.0.1:{port}"
        prometheus_url = None
        if args.judge:
            rule_files = (*RULE_FILES, alerts_without_for(tmp))
            prometheus_url = stack.enter_context(
                running_prometheus(tmp, {"gpu-node": f"127.0.0.1:{port}"}, rule_files)).url
        for name, seconds in planned:
            truth["workloads"][name] = record_one(name, seconds, args, exporter_url, prometheus_url, tmp)
            truth["exporter_cpu_ms_per_s"] = cost.cpu_ms_per_second()
            (args.out / "truth.json").write_text(json.dumps(truth, indent=1) + "\n")
            print(f"record_gpu_corpus: {name}: {json.dumps(truth['workloads'][name]['ranks'])}", flush=True)


if __name__ == "__main__":
    main()

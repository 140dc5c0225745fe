"""Scrape latency and CPU cost: stepscope-exporter against Debian's prometheus-node-exporter.

Every target runs at once and is scraped round-robin (one scrape each per round) over keep-alive
connections with gzip, as Prometheus does, so machine noise hits all of them alike. Two tables:

1. Cached and cold scrapes (benchmarks/bench_ingest.py's rounds): a cold scrape follows a change of
   the content (a push to a one-counter group), the production case where collectors publish and
   ranks push more often than Prometheus scrapes; node_exporter reads everything on every scrape,
   so all its scrapes are cold. Server CPU per scrape, the scrape alone.
2. The whole process over the measured window, background collection included, per 1000 scrapes.
Prints markdown tables and writes benchmarks/results/scrape.md.

    python benchmarks/bench_scrape.py [--scrapes 300]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import psutil
import requests

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_ingest import Target, scrape_rounds  # noqa: E402
from stepscope_testkit.fake_nvml.scenario import make_scenario  # noqa: E402
from stepscope_testkit.ingest_bodies import counter  # noqa: E402
from stepscope_testkit.processes import free_port, running, running_exporter  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "scrape.md"
COLLECT_INTERVAL = 5  # the exporter's default


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(targets: dict[str, tuple[str, int]], scrapes: int) -> list[dict[str, object]]:
    sessions = {name: requests.Session() for name in targets}
    for name, (url, _) in targets.items():  # warm up: connections, first collections, caches
        for _ in range(20):
            sessions[name].get(url, headers={"Accept-Encoding": "gzip"}, timeout=10).raise_for_status()
    procs = {name: psutil.Process(pid) for name, (_, pid) in targets.items()}
    cpu_before = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
    latencies: dict[str, list[float]] = {name: [] for name in targets}
    sizes: dict[str, int] = {}
    for _ in range(scrapes):
        for name, (url, _) in targets.items():
            started = time.perf_counter()
            response = sessions[name].get(url, headers={"Accept-Encoding": "gzip"}, timeout=10)
            latencies[name].append(time.perf_counter() - started)
            response.raise_for_status()
            sizes[name] = len(response.content)
    cpu_after = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
    rows = []
    for name in targets:
        series = sum(1 for line in sessions[name].get(targets[name][0], timeout=10).text.splitlines()
                     if line and not line.startswith("#"))
        rows.append({
            "target": name,
            "series": series,
            "p50_ms": statistics.median(latencies[name]) * 1e3,
            "p99_ms": percentile(latencies[name], 0.99) * 1e3,
            "cpu_s_per_1000": (cpu_after[name] - cpu_before[name]) / scrapes * 1000,
        })
    return rows


def table(rows: list[dict[str, object]], baseline: str) -> str:
    base = next(r for r in rows if r["target"] == baseline)
    lines = [
        "| target | series | p50 ms | p99 ms | CPU s / 1000 scrapes | p50 vs node_exporter | CPU vs node_exporter |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['series']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['cpu_s_per_1000']:.2f} "
            f"| {r['p50_ms'] / base['p50_ms']:.2f}x | {r['cpu_s_per_1000'] / base['cpu_s_per_1000']:.2f}x |"
        )
    return "\n".join(lines)


def cold_table(results: dict[str, dict[str, float]], baseline: str) -> str:
    base = results[baseline]
    lines = [
        "| target | cold p50 / p90 ms | cold CPU ms | cached p50 / p90 ms | cached CPU ms | cold p50 vs node_exporter "
        "| cold CPU vs node_exporter |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['cold_p50']:.2f} / {r['cold_p90']:.2f} | {r['cold_cpu']:.2f} | {r['cached_p50']:.2f} / "
            f"{r['cached_p90']:.2f} | {r['cached_cpu']:.2f} | {r['cold_p50'] / base['cold_p50']:.2f}x "
            f"| {r['cold_cpu'] / base['cold_cpu']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=300, help="scrapes per target (at least 200)")
    args = parser.parse_args()
    if args.scrapes < 200:
        parser.error("--scrapes must be at least 200")
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        tmp_path = Path(tmp)
        scenario = tmp_path / "gpus8x8.json"
        scenario.write_text(json.dumps(make_scenario(gpus=8, processes_per_gpu=8)))
        port = free_port()
        node_exporter = stack.enter_context(running(
            ["prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{port}"],
            f"http://127.0.0.1:{port}/metrics", tmp_path / "node_exporter.log",
        ))
        default = stack.enter_context(running_exporter(tmp_path, "--collect-interval", str(COLLECT_INTERVAL)))
        gpus = stack.enter_context(running_exporter(
            tmp_path, "--collect-interval", str(COLLECT_INTERVAL), fake_nvml_scenario=scenario))
        targets = {
            "prometheus-node-exporter (Debian, default collectors)": (
                f"http://127.0.0.1:{port}/metrics", node_exporter.process.pid),
            "stepscope-exporter (defaults, no GPU)": (f"{default.url}/metrics", default.process.pid),
            "stepscope-exporter (fake NVML, 8 GPUs x 8 processes)": (f"{gpus.url}/metrics", gpus.process.pid),
        }
        time.sleep(2 * COLLECT_INTERVAL + 1)  # two cycles: GPM ratios and GPU-process series need a second one
        rows = measure(targets, args.scrapes)
        rounds = [Target(name, process, pushes=name.startswith("stepscope"))
                  for name, process in zip(targets, (node_exporter, default, gpus), strict=True)]
        for target in rounds[1:]:
            target.put("ticker", 0, counter("stepscope_steps_total", 0))
        cold = scrape_rounds(rounds, args.scrapes // 2)
    report = (
        f"Scrape benchmark, {args.scrapes} gzip scrapes per target, round-robin, "
        f"{psutil.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d')}\n\n"
        f"## Cold and cached scrapes ({args.scrapes // 2} rounds; the scrape alone)\n\n"
        + cold_table(cold, baseline=next(iter(targets)))
        + "\n\n## The whole process, background collection included\n\n"
        + table(rows, baseline=next(iter(targets)))
        + "\n"
    )
    print(report)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("# " + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

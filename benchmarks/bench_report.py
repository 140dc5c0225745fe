"""How long stepscope-report takes for a 1-hour run of 8 ranks and of 64 ranks, from a real Prometheus.

    PYTHONPATH=. python benchmarks/bench_report.py        # ~3 minutes

The runs are synthetic but go through the real pieces: synchronous ranks, 8 per node (one per GPU), for
one hour at a 15 s scrape (rank 5 slow in forward, the others waiting in backward; setup, two evals, a
checkpoint, idle at the end), each rank's histograms counted by the hooks' own `Histogram` (buckets
that follow the run) and rendered by their own renderer, next to node, GPU and process series as the
exporter publishes them. The samples are written as OpenMetrics and backfilled into a Prometheus TSDB
with `promtool tsdb create-blocks-from openmetrics`; the shipped recording rules are backfilled with
`promtool tsdb create-blocks-from rules`, one dependency level at a time (promtool cannot evaluate a
rule over another rule it is creating), restarting Prometheus between levels so it reads the new blocks.
Backfilled series have no staleness markers (a scraping Prometheus writes one when a series ends), so
Prometheus runs with a lookback of two scrape intervals instead of 5 minutes: an ended series (a rank's
state, a verdict) then stops where it would have with live data.

Then, in rounds, for each run in turn: the `stepscope-report` command as a user runs it (a fresh Python
process: imports, queries, plots, files), and the same stages in this process, timed one by one. The
first round follows a Prometheus start (cold). Writes benchmarks/results/report.md.
"""

from __future__ import annotations

import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from grafana.rules import RULE_FILES
from stepscope.hooks.render import Snapshot, render
from stepscope.hooks.timing import Histogram
from stepscope_testkit.processes import free_port, wait_http_ok

RESULTS = Path(__file__).resolve().parent / "results" / "report.md"
RUNS = {"bench-8": 8, "bench-64": 64}  # run -> ranks, 8 per node (one per GPU)
GPUS_PER_NODE = 8
SCRAPE, HOUR = 15, 3600
SLOW_RANK, SLOW_FORWARD = 5, 0.05
ROUNDS = 6
# (state, from second, to second) over the hour; train elsewhere after setup
SCHEDULE = (("setup", 0, 90), ("eval", 1200, 1320), ("checkpoint", 1800, 1860), ("eval", 2400, 2520),
            ("idle", 3480, HOUR))
PHASES = ("dataloader_next", "to_device", "forward", "backward", "optimizer_step")


def node_name(run: str, index: int) -> str:
    return f"{run}-node-{index + 1}"


def state_at(second: float) -> str:
    return next((state for state, start, end in SCHEDULE if start <= second < end), "train")


class Rank:
    """One rank's hooks state: the tracker's histograms and counters, stepped by the simulation."""

    def __init__(self, run: str, rank: int, world_size: int) -> None:
        self.run, self.rank, self.world_size = run, rank, world_size
        self.node = node_name(run, rank // GPUS_PER_NODE)
        self.step = Histogram.following()
        self.phases = {phase: Histogram(()) for phase in PHASES}
        self.steps = self.samples = 0
        self.state = "setup"

    def body(self) -> str:
        snapshot = Snapshot(
            phases=[(phase, "host", hist.snapshot()) for phase, hist in self.phases.items()], step=self.step.snapshot(),
            steps=self.steps, samples=self.samples, state=self.state,
            info={"local_rank": str(self.rank % GPUS_PER_NODE), "world_size": str(self.world_size),
                  "pid": str(40000 + self.rank), "framework": "torch"})
        return render(snapshot)


def simulate_interval(ranks: list[Rank], rng: random.Random, seconds: float) -> None:
    """Synchronous steps for `seconds`: each rank's local phases, then everyone waits in backward
    for the slowest rank's local phases (DDP's all-reduce)."""
    elapsed = 0.0
    while elapsed < seconds:
        local = {}
        for rank in ranks:
            forward = rng.gauss(0.06, 0.003) + (SLOW_FORWARD if rank.rank == SLOW_RANK else 0.0)
            local[rank.rank] = (rng.gauss(0.012, 0.002), rng.gauss(0.004, 0.0005), forward)
        slowest = max(sum(times) for times in local.values())
        step = 0.0
        for rank in ranks:
            loader, to_device, forward = local[rank.rank]
            backward = rng.gauss(0.09, 0.004) + slowest - sum(local[rank.rank])
            optimizer = rng.gauss(0.011, 0.001)
            for phase, duration in zip(PHASES, (loader, to_device, forward, backward, optimizer), strict=True):
                rank.phases[phase].observe_ns(int(duration * 1e9))
            step = loader + to_device + forward + backward + optimizer + 0.002
            rank.step.observe_ns(int(step * 1e9))
            rank.steps += 1
            rank.samples += 32
        elapsed += step


def node_and_gpu_lines(second: float, rng: random.Random, cpu: dict[str, float],
                       ranks: list[Rank]) -> list[tuple[str, dict, float]]:
    """(sample name, labels, value) of one node's node, GPU and process families at `second`, its GPUs
    held by `ranks`; `cpu` holds its CPU-seconds counters, advanced by a scrape interval at the load."""
    training = state_at(second) == "train"
    busy = (0.45 if training else 0.05) * 64
    for mode, rate in (("user", 0.8 * busy), ("system", 0.2 * busy), ("idle", 64 - busy), ("iowait", 0.1)):
        cpu[mode] = cpu.get(mode, 1e6) + rate * SCRAPE
    lines = [("stepscope_node_cpus", {}, 64.0)]
    lines += [("stepscope_node_cpu_seconds_total", {"mode": mode}, value) for mode, value in cpu.items()]
    lines += [("stepscope_node_memory_total_bytes", {}, 2.0e12),
              ("stepscope_node_memory_available_bytes", {}, 1.4e12 - rng.random() * 1e10)]
    lines += [("stepscope_node_disk_read_bytes_total", {"device": "nvme0n1"}, 1e12 + 8e8 * second),
              ("stepscope_node_disk_written_bytes_total", {"device": "nvme0n1"}, 1e11 + 2e7 * second),
              ("stepscope_node_network_receive_bytes_total", {"device": "eth0"}, 1e12 + 3e9 * second),
              ("stepscope_node_network_transmit_bytes_total", {"device": "eth0"}, 1e12 + 3e9 * second),
              ("stepscope_node_network_receive_bytes_total", {"device": "lo"}, 1e9 + 1e6 * second)]
    for rank in ranks:
        gpu = rank.rank % GPUS_PER_NODE
        labels = {"gpu": str(gpu), "uuid": f"GPU-{rank.rank:08x}-bench"}
        lines += [("stepscope_gpu_utilization_ratio", labels, 0.97 if training else 0.0),
                  ("stepscope_gpu_sm_active_ratio", labels,
                   (0.55 if rank.rank == SLOW_RANK else 0.62) + rng.random() * 0.02 if training else 0.0),
                  ("stepscope_gpu_tensor_active_ratio", labels, 0.3 if training else 0.0),
                  ("stepscope_gpu_memory_used_bytes", labels, 7.1e10),
                  ("stepscope_gpu_memory_total_bytes", labels, 8.5e10)]
        process = {"pid": str(40000 + rank.rank), "run": rank.run, "rank": str(rank.rank)}
        lines += [("stepscope_process_gpu_memory_bytes", {**process, "gpu": str(gpu)}, 6.9e10),
                  ("stepscope_process_cpu_seconds_total", process, 1.6 * second),
                  ("stepscope_process_resident_memory_bytes", process, 3.2e10),
                  ("stepscope_process_children", process, 8.0),
                  ("stepscope_process_io_read_bytes_total", process, 1e8 * second),
                  ("stepscope_process_io_write_bytes_total", process, 1e5 * second)]
    return lines


def generate(start: int, path: Path) -> int:
    """Writes the hour of every run in RUNS as OpenMetrics; returns the number of samples."""
    rng = random.Random(12)
    runs = {run: [Rank(run, rank, size) for rank in range(size)] for run, size in RUNS.items()}
    nodes = {node: [r for ranks in runs.values() for r in ranks if r.node == node]
             for node in dict.fromkeys(r.node for ranks in runs.values() for r in ranks)}
    cpu: dict[str, dict[str, float]] = defaultdict(dict)
    families: dict[str, str] = {}  # family -> type
    series: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))  # family -> series -> points
    for second in range(SCRAPE, HOUR + 1, SCRAPE):
        at = start + second
        for ranks in runs.values():
            for rank in ranks:
                rank.state = state_at(second - SCRAPE) if second > SCRAPE else "setup"
            if state_at(second - SCRAPE) == "train":
                simulate_interval(ranks, rng, SCRAPE)
            for rank in ranks:
                pushed = {"run": rank.run, "rank": str(rank.rank), "instance": rank.node}
                for family in text_string_to_metric_families(rank.body()):
                    if not family.samples:  # declared before the rank's first step, no sample yet
                        continue
                    kind = family.type if family.type == "histogram" else "unknown"
                    name = family.name if kind == "histogram" else family.samples[0].name
                    families[name] = kind
                    for sample in family.samples:
                        key = _series(sample.name, {**sample.labels, **pushed})
                        series[name][key].append(f"{sample.value:g} {at}")
        for node, ranks in nodes.items():
            for name, labels, value in node_and_gpu_lines(second, rng, cpu[node], ranks):
                families[name] = "unknown"
                series[name][_series(name, {**labels, "instance": node})].append(f"{value:.10g} {at}")
    count = 0
    with path.open("w") as out:
        for family, kind in families.items():
            out.write(f"# TYPE {family} {kind}\n")
            for key, points in series[family].items():
                out.writelines(f"{key} {point}\n" for point in points)
                count += len(points)
        out.write("# EOF\n")
    return count


def _series(name: str, labels: dict[str, str]) -> str:
    labels = {**labels, "job": "stepscope"}
    if "le" in labels:
        labels["le"] = _le(labels["le"])
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _le(value: str) -> str:
    return value if value == "+Inf" else repr(float(value))


def rule_levels() -> list[list[dict]]:
    """The recording rules by dependency level: level 0 reads raw series, level n rules of level < n. A rule's
    read of its own series (the carried GPU readings) is its previous value, no dependency."""
    rules = [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
             for rule in group["rules"] if "record" in rule]
    names = {rule["record"] for rule in rules}
    level: dict[str, int] = {}
    while len(level) < len(names):  # a name two groups record (one per rank parity) is one level
        placed = len(level)
        for rule in rules:
            deps = {name for name in re.findall(r"[\w:]+", rule["expr"]) if name in names} - {rule["record"]}
            if rule["record"] not in level and deps <= set(level):
                level[rule["record"]] = 1 + max((level[d] for d in deps), default=-1)
        if len(level) == placed:
            raise SystemExit(f"recording rules that read each other: {sorted(names - set(level))}")
    return [[rule for rule in rules if level[rule["record"]] == n] for n in range(max(level.values()) + 1)]


@contextmanager
def prometheus(data: Path, port: int) -> Iterator[str]:
    config = data.parent / "prometheus.yml"
    config.write_text("global: {evaluation_interval: 15s}\n")
    log = (data.parent / "prometheus.log").open("ab")
    process = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={data}", "--storage.tsdb.retention.time=30d",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn", f"--query.lookback-delta={2 * SCRAPE}s"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/-/ready", process, timeout=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def backfill(tmp: Path, start: int) -> tuple[Path, int, float]:
    data, blocks = tmp / "data", tmp / "blocks"
    openmetrics = tmp / "run.om"
    began = time.perf_counter()
    samples = generate(start, openmetrics)
    subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(openmetrics), str(data)],
                   check=True, capture_output=True)
    port = free_port()
    for index, rules in enumerate(rule_levels()):
        path = tmp / f"level{index}.rules.yml"
        # `+ 0` drops a metric name an `or` branch kept: a range query (promtool's backfill) returns the branches as
        # two series that the record's name makes one, their samples out of order (Prometheus' instant evaluation
        # never sees both at once)
        nameless = [{**rule, "expr": f"(\n{rule['expr']}\n) + 0"} for rule in rules]
        path.write_text(yaml.safe_dump({"groups": [{"name": f"level{index}", "interval": "15s", "rules": nameless}]}))
        shutil.rmtree(blocks, ignore_errors=True)
        with prometheus(data, port) as url:
            done = subprocess.run(["promtool", "tsdb", "create-blocks-from", "rules", f"--start={start}",
                                   f"--end={start + HOUR}", f"--url={url}", f"--output-dir={blocks}",
                                   "--eval-interval=15s", str(path)], capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"promtool could not backfill {path.name}: {done.stderr.strip()[-2000:]}")
        for block in blocks.iterdir():
            shutil.move(str(block), data / block.name)
    return data, samples, time.perf_counter() - began


def stages(url: str, run: str) -> dict[str, float]:
    """The report's stages in this process, timed one by one."""
    from stepscope.report import cli, collect, report

    timings: dict[str, float] = {}
    args = cli.parse_args(["--prometheus", url, "--run", run])
    prom = cli.Prometheus(url)
    began = time.perf_counter()
    window, nodes = cli._window(prom, args, time.time())
    timings["find the run and its window"] = time.perf_counter() - began
    began = time.perf_counter()
    data = collect.fetch(prom, run, window, nodes)
    timings["queries (totals and series)"] = time.perf_counter() - began
    began = time.perf_counter()
    built = report.build(data, url)
    timings["numbers, verdict, timelines"] = time.perf_counter() - began
    with tempfile.TemporaryDirectory() as out:
        began = time.perf_counter()
        report.write(built, Path(out))
        timings["plots, page and CSVs"] = time.perf_counter() - began
    timings["points fetched"] = sum(len(s.points) for found in data.over_time.values() for s in found)
    return timings


def command(url: str, run: str, out: Path) -> tuple[float, str]:
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "stepscope.report", "--prometheus", url, "--run", run,
                             "--out", str(out)],
                            capture_output=True, text=True, check=True)
    return time.perf_counter() - began, result.stdout.strip()


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="stepscope-bench-report-"))
    start = (int(time.time()) // HOUR - 26) * HOUR  # a day ago: well out of a fresh head block
    data, samples, setup_seconds = backfill(tmp, start)
    load_before = os.getloadavg()
    times: dict[str, list[float]] = defaultdict(list)
    breakdown: dict[str, list[dict[str, float]]] = defaultdict(list)
    said: dict[str, str] = {}
    with prometheus(data, free_port()) as url:
        for index in range(ROUNDS):
            for run in RUNS:  # interleaved: both runs see the same machine load
                seconds, said[run] = command(url, run, tmp / run)
                times[run].append(seconds)
                breakdown[run].append(stages(url, run))
                print(f"round {index + 1} {run}: {seconds:.2f} s  {said[run]}", flush=True)
    load_after = os.getloadavg()
    pages = {run: (tmp / run / "index.html").stat().st_size for run in RUNS}
    write_results(samples, setup_seconds, times, breakdown, (load_before[0], load_after[0]), pages, said)
    shutil.rmtree(tmp, ignore_errors=True)


def write_results(samples: int, setup: float, times: dict[str, list[float]],
                  breakdown: dict[str, list[dict[str, float]]], load: tuple[float, float],
                  pages: dict[str, int], said: dict[str, str]) -> None:
    runs = list(RUNS)
    lines = [
        "# stepscope-report: time to build a report for a 1-hour run of 8 and of 64 ranks",
        "",
        f"`PYTHONPATH=. python benchmarks/bench_report.py` on {platform.platform()}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, Debian's Prometheus; load average "
        f"{load[0]:.1f} before and {load[1]:.1f} after the timed rounds (the machine is shared with other jobs).",
        "",
        f"Each run: synchronous ranks, {GPUS_PER_NODE} per node, one hour at a {SCRAPE} s scrape (setup, two "
        f"evals, a checkpoint, idle at the end; rank {SLOW_RANK} slow in forward). {samples:,} raw samples in all, "
        "backfilled with promtool, plus the shipped recording rules backfilled over the same hour "
        f"(generation and backfill took {setup:.0f} s). {ROUNDS} rounds, the two runs interleaved in each; "
        "the first round follows a fresh Prometheus start (cold). No peer tool builds such a report from "
        "Prometheus, so the table holds the goal instead (under 10 s).",
        "",
        "| `stepscope-report` (fresh process, end to end), seconds | " + " | ".join(runs) + " |",
        "|---|" + "---|" * len(runs),
        "| first round (cold) | " + " | ".join(f"{times[r][0]:.2f}" for r in runs) + " |",
        f"| next {ROUNDS - 1} rounds: median | " + " | ".join(f"{statistics.median(times[r][1:]):.2f}" for r in runs)
        + " |",
        f"| next {ROUNDS - 1} rounds: min to max | "
        + " | ".join(f"{min(times[r][1:]):.2f} to {max(times[r][1:]):.2f}" for r in runs) + " |",
        "| page size | " + " | ".join(f"{pages[r] / 1024:.0f} KiB" for r in runs) + " |",
        "",
        "Stages, timed in one process after each command (median of the warm rounds, seconds):",
        "",
        "| stage | " + " | ".join(runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    for stage in breakdown[runs[0]][0]:
        values = {r: statistics.median(b[stage] for b in breakdown[r][1:]) for r in runs}
        if stage == "points fetched":
            lines.append(f"| {stage} (series over time) | " + " | ".join(f"{values[r]:,.0f}" for r in runs) + " |")
        else:
            lines.append(f"| {stage} | " + " | ".join(f"{values[r]:.3f}" for r in runs) + " |")
    lines += ["", "The rest of a command's time is Python start-up and imports (matplotlib, numpy, requests).", "",
              "What the reports said:", ""]
    lines += [f"- {run}: {said[run].split(': ', 1)[-1]}" for run in runs]
    RESULTS.write_text("\n".join(lines) + "\n")
    print(RESULTS.read_text())


if __name__ == "__main__":
    main()

"""Why single rule evaluations spike at scale: every evaluation of every group, with a timestamp, next
to what the Go runtime of Prometheus did in the same second (garbage collections, heap, page faults,
CPU). bench_scale.py gives each group's median and worst; this says what the worst ones coincided with.

    PYTHONPATH=. .venv/bin/python benchmarks/trace_scale.py --nodes 1000            # ~7 minutes
    PYTHONPATH=. .venv/bin/python benchmarks/trace_scale.py --nodes 1000 --gogc 200
    PYTHONPATH=. .venv/bin/python benchmarks/trace_scale.py --render benchmarks/results/scale-trace.json

The cluster, the rules and the Prometheus are bench_scale.py's. Each second it reads Prometheus' own
/metrics (group evaluation times, go_gc_duration_seconds_count, heap) and /proc/PID/stat (CPU, minor
and major page faults). A spike is an evaluation over twice its group's median; the report counts the
spikes that fell within 2 s of a collection or of a page-fault burst (over 20,000 faults a second).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale as bench

RESULTS = bench.REPO_ROOT / "benchmarks" / "results" / "scale-trace"
FAULT_BURST = 20_000  # minor page faults a second
NEAR_SECONDS = 2.0


def _faults(pid: int) -> tuple[int, int]:
    """(minor, major) page faults of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7]), int(fields[9])


def trace(nodes: int, gogc: int | None, warmup: float, window: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        scrape_text = bench.capture_node_scrape(Path(tmp), run=bench.CAPTURE_RUN,
                                                world_size=bench.GPUS * bench.NODES_PER_RUN)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        port, _ = stack.enter_context(bench.running_cluster(scrape_text, nodes))
        (Path(tmp) / "p").mkdir()
        url, pid = stack.enter_context(
            bench.running_prometheus(Path(tmp) / "p", port, nodes, list(bench.RULE_FILES), gogc))
        bench.wait_until_scraped(url, nodes)
        print(f"  {nodes} nodes up; warming up {warmup:.0f} s", flush=True)
        time.sleep(warmup)
        watched = bench.Watched(url, pid, bench.self_metrics(url), bench.cpu_seconds(pid))
        seconds = []
        started = time.monotonic()
        while time.monotonic() - started < window:
            watched.sample()
            metrics = bench.self_metrics(url)
            seconds.append([time.time(), bench.one(metrics, "go_gc_duration_seconds_count"),
                            bench.one(metrics, "go_memstats_heap_alloc_bytes"),
                            bench.one(metrics, "process_resident_memory_bytes"), bench.cpu_seconds(pid),
                            *_faults(pid)])
            time.sleep(1)
    return {"nodes": nodes, "gogc": gogc or bench.GO_DEFAULT_GOGC, "commit": bench.checkout(),
            "evaluations": {group: sorted(times.items()) for group, times in watched.evaluations.items()},
            "seconds": seconds}


def report(data: dict) -> str:
    seconds, evaluations = data["seconds"], data["evaluations"]
    start = seconds[0][0]
    pairs = list(pairwise(seconds))  # (a second before, that second), each [time, gcs, heap, rss, cpu, minor, major]
    gc_ends = [now[0] for before, now in pairs if now[1] != before[1]]
    bursts = [now[0] for before, now in pairs if (now[5] - before[5]) / (now[0] - before[0]) > FAULT_BURST]
    cores = [(now[4] - before[4]) / (now[0] - before[0]) for before, now in pairs]
    spikes = []
    for group, timed in evaluations.items():
        median = statistics.median(duration for _, duration in timed)
        spikes += [(at, duration, median, group) for at, duration in timed
                   if at >= start and duration > 2 * median]
    spikes.sort()

    def near(at: float, duration: float, moments: list[float]) -> bool:
        return any(at - NEAR_SECONDS <= moment <= at + duration + NEAR_SECONDS for moment in moments)

    rows = [f"| {at - start:.1f} | {group} | {duration:.2f} | {median:.2f} | "
            f"{'yes' if near(at, duration, gc_ends) else ''} | {'yes' if near(at, duration, bursts) else ''} |"
            for at, duration, median, group in spikes]
    explained = sum(near(at, d, gc_ends) or near(at, d, bursts) for at, d, _, _ in spikes)
    worst = max(((d, g) for g, timed in evaluations.items() for at, d in timed if at >= start), default=(0, "-"))
    return "\n".join([
        f"# Evaluation spikes at {data['nodes']} nodes (GOGC {data['gogc']}, commit {data['commit']})", "",
        f"{seconds[-1][0] - start:.0f} s traced: {len(gc_ends)} garbage collections, {len(bursts)} seconds with over "
        f"{FAULT_BURST:,} page faults, Prometheus at {statistics.mean(cores):.2f} cores on average "
        f"({max(cores):.2f} at most), peak RSS {max(s[3] for s in seconds) / 2**30:.2f} GiB. Worst evaluation "
        f"{worst[0]:.2f} s ({worst[1]}). **{explained} of {len(spikes)} spikes** (over twice the group's median) "
        f"fell within {NEAR_SECONDS:.0f} s of a collection or a page-fault burst.", "",
        "| second | group | seconds | group median | near a collection | near a fault burst |",
        "|---|---|---|---|---|---|", *rows, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gogc", type=int, default=None, help="GOGC of the Prometheus (default: not set)")
    parser.add_argument("--warmup", type=float, default=150)
    parser.add_argument("--measure", type=float, default=240)
    parser.add_argument("--render", type=Path, help="render a trace kept earlier instead of taking one")
    parser.add_argument("--out", type=Path, default=RESULTS, help="OUT.json and OUT.md are written")
    args = parser.parse_args(argv)
    if args.render:
        try:
            data = json.loads(args.render.read_text())
        except (OSError, ValueError) as error:
            parser.error(f"--render {args.render}: {error}")
    else:
        if args.nodes < 1 or (args.gogc is not None and args.gogc < 1):
            parser.error("--nodes and --gogc must be positive")
        data = trace(args.nodes, args.gogc, args.warmup, args.measure)
        args.out.with_suffix(".json").write_text(json.dumps(data))
    text = report(data)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

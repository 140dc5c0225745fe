"""Push and scrape cost of the exporter's push API against Debian's Pushgateway and node_exporter, one run.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_ingest.py [--rounds 60] [--skip-loop]   # ~10 min, 2 cores

1. The parser alone, in this process: CPU per parse of the 9-phase body the hooks push (14 KB with
   16 buckets per histogram; also with 40), and of 1 MiB bodies of every hostile shape
   (stepscope_testkit/ingest_bodies.py).
2. For 8, 64, 256 and 512 stored groups (9-phase bodies from stepscope.hooks.render, added to a fresh
   exporter and a fresh Pushgateway alike), interleaved round by round:
   - push: server CPU per PUT re-pushing an existing group with new counts (200 per target, alternating);
   - memory: RSS per group, (RSS with N groups - RSS before the first push) / N, after scrapes;
   - scrapes with gzip over keep-alive connections, as Prometheus does: cached (nothing changed
     since the last scrape) and cold (a push to a one-counter group changed the content just
     before, the production case: ranks push more often than Prometheus scrapes), client latency
     and server CPU per scrape; node_exporter (default collectors, which read everything on every
     scrape) is scraped in the same rounds as the reference. Cold CPU = CPU of (push + scrape)
     minus CPU of the same push alone, both measured in the same rounds.
3. The hooks' pusher: benchmarks/bench_hooks.py's CPU training loop (~5 ms steps, 6 phases) with and
   without hooks, pushing every 1 s to a stepscope exporter on this machine; then the same with the
   hooks not pushing, which shows what the pushes add beyond the machine's noise.
Server CPU is the target process's user+system time (clock ticks, summed over many requests).
Writes benchmarks/results/ingest.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psutil
import requests

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from stepscope.exporter.ingest.errors import Rejected  # noqa: E402
from stepscope.exporter.ingest.parser import PushLimits, parse_push  # noqa: E402
from stepscope_testkit import results  # noqa: E402
from stepscope_testkit.ingest_bodies import HOSTILE_SHAPES, counter, hooks_body  # noqa: E402
from stepscope_testkit.processes import Running, free_port, running, running_exporter  # noqa: E402
from stepscope_testkit.pushgateway import running_pushgateway  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "ingest.md"
GROUP_COUNTS = (8, 64, 256, 512)
VARIANTS = 16  # distinct realistic bodies, cycled over ranks
PUSHES = 200  # per target and group count: CPU is counted in 10 ms clock ticks
LIMITS = PushLimits(max_label_length=128, max_series=2000, max_phases=32)
GZIP = {"Accept-Encoding": "gzip"}


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def cpu_of(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def rss_of(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


# -- 1. the parser alone --------------------------------------------------------------------------

def bench_parser(body: bytes, wide_body: bytes) -> str:
    def cpu_ms(data: bytes, repeats: int) -> float:
        best = []
        for _ in range(5):
            started = time.process_time()
            for _ in range(repeats):
                with contextlib.suppress(Rejected):
                    parse_push(data, "resnet-a", "12", LIMITS)
            best.append((time.process_time() - started) / repeats * 1e3)
        return statistics.median(best)

    rows = [[f"9-phase hooks body, 16 buckets ({len(body) / 1000:.1f} KB)", f"{cpu_ms(body, 200):.3f}", ""],
            [f"9-phase hooks body, 40 buckets ({len(wide_body) / 1000:.1f} KB)", f"{cpu_ms(wide_body, 100):.3f}", ""]]
    for shape, make in HOSTILE_SHAPES.items():
        hostile = make(1024 * 1024).encode()
        try:
            parse_push(hostile, "r", "0", LIMITS)
            outcome = "accepted"
        except Rejected as rejected:
            outcome = f"{rejected.status} {rejected.reason}"
        rows.append([f"1 MiB: {shape}", f"{cpu_ms(hostile, 1):.1f}", outcome])
    return table(["body", "CPU ms per parse (median of 5)", "outcome"], rows)


# -- 2. push and scrape cost by group count ---------------------------------------------------------

class Target:
    """One server under test: its URL, process and the measurements taken in the rounds."""

    def __init__(self, name: str, running_process: Running, pushes: bool) -> None:
        self.name = name
        self.url = running_process.url
        self.pid = running_process.process.pid
        self.pushes = pushes
        self.session = requests.Session()
        self.baseline_rss = rss_of(self.pid)
        self.samples: dict[str, list[float]] = {}
        self.cpu: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.gzip_bytes = 0

    def group_url(self, run: str, rank: int) -> str:
        return f"{self.url}/metrics/job/stepscope/run/{run}/rank/{rank}"

    def put(self, run: str, rank: int, body: str) -> None:
        response = self.session.put(self.group_url(run, rank), data=body, timeout=120)
        response.raise_for_status()

    def measured(self, kind: str, action: Callable[..., object], *args: object, latency: bool = False) -> None:
        """Runs one action, adding its server CPU (and client latency) to `kind`."""
        before, started = cpu_of(self.pid), time.perf_counter()
        action(*args)
        elapsed = time.perf_counter() - started
        self.cpu[kind] = self.cpu.get(kind, 0.0) + cpu_of(self.pid) - before
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if latency:
            self.samples.setdefault(kind, []).append(elapsed)

    def scrape(self) -> None:
        """One gzip scrape, read to its last byte but not decompressed (this client's zlib is no part of the
        server's latency; Prometheus decompresses in Go)."""
        response = self.session.get(f"{self.url}/metrics", headers=GZIP, timeout=120, stream=True)
        response.raise_for_status()
        self.gzip_bytes = len(response.raw.read(decode_content=False))

    def reset(self) -> None:
        self.samples, self.cpu, self.counts = {}, {}, {}

    def cpu_ms(self, kind: str) -> float:
        return self.cpu[kind] / self.counts[kind] * 1e3

    def p50_ms(self, kind: str) -> float:
        return statistics.median(self.samples[kind]) * 1e3

    def p90_ms(self, kind: str) -> float:
        return statistics.quantiles(self.samples[kind], n=10)[-1] * 1e3


def measure_pushes(targets: list[Target], bodies: list[str], groups: int) -> None:
    """Re-pushes of existing groups, the push targets alternating; adds "push" to each target's counts."""
    pushers = [t for t in targets if t.pushes]
    for i in range(PUSHES):
        rank = i * 7 % groups
        for target in (pushers if i % 2 == 0 else pushers[::-1]):
            target.measured("push", target.put, "bench", rank, bodies[(rank + i + 1) % len(bodies)])


def scrape_rounds(targets: list[Target], rounds: int) -> dict[str, dict[str, float]]:
    """Cached and cold gzip scrapes, every target once per round (order alternating).

    A cold scrape follows a push to the one-counter group "ticker" (targets that take pushes); its CPU
    is that of push + scrape minus that of the same push alone, measured in the same rounds.
    """
    for target in targets:
        for _ in range(3):
            target.scrape()
    for i in range(rounds):
        for target in (targets if i % 2 == 0 else targets[::-1]):
            if target.pushes:
                target.measured("ticker", target.put, "ticker", 0, counter("stepscope_steps_total", i))
                target.measured("cached", target.scrape, latency=True)
                target.measured("ticker+cold", target.put, "ticker", 0, counter("stepscope_steps_total", i + 0.5))
                target.measured("cold", target.scrape, latency=True)
            else:
                target.measured("cached", target.scrape, latency=True)
    results: dict[str, dict[str, float]] = {}
    for target in targets:
        row = {"cached_p50": target.p50_ms("cached"), "cached_p90": target.p90_ms("cached"),
               "cached_cpu": target.cpu_ms("cached"), "gzip_kib": target.gzip_bytes / 1024}
        if target.pushes:
            cold_cpu = (target.cpu["ticker+cold"] + target.cpu["cold"] - target.cpu["ticker"]) / rounds * 1e3
            row.update(cold_p50=target.p50_ms("cold"), cold_p90=target.p90_ms("cold"), cold_cpu=max(cold_cpu, 0.0))
        else:  # it reads everything on every scrape: each one is cold
            row.update(cold_p50=row["cached_p50"], cold_p90=row["cached_p90"], cold_cpu=row["cached_cpu"])
        results[target.name] = row
    return results


def measure_at(targets: list[Target], bodies: list[str], groups: int, rounds: int) -> dict[str, dict[str, float]]:
    for target in targets:
        target.reset()
    measure_pushes(targets, bodies, groups)
    results = scrape_rounds(targets, rounds)
    for target in targets:
        if target.pushes:
            results[target.name].update(push_cpu=target.cpu_ms("push"),
                                        rss_per_group=(rss_of(target.pid) - target.baseline_rss) / groups)
    return results


def fill(targets: list[Target], bodies: list[str], start: int, stop: int) -> None:
    for rank in range(start, stop):
        for target in targets:
            if target.pushes:
                target.put("bench", rank, bodies[rank % len(bodies)])


def bench_groups(rounds: int, tmp_path: Path) -> tuple[str, str]:
    # One process's identity in every variant: a re-push carries another variant's body, and the exporter takes a
    # group's pushes from the process that holds it only (409 otherwise).
    bodies = [hooks_body(seed=seed, steps=10_000 + 97 * seed) for seed in range(VARIANTS)]
    with ExitStack() as stack:
        port = free_port()
        node_exporter = stack.enter_context(running(
            ["prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{port}"],
            f"http://127.0.0.1:{port}/metrics", tmp_path / "node_exporter.log", base_url=f"http://127.0.0.1:{port}",
        ))
        # one group more than the default 512: the one-counter group whose pushes make scrapes cold
        exporter = stack.enter_context(running_exporter(tmp_path, "--collectors", "", "--ingest-max-groups", "513"))
        gateway = stack.enter_context(running_pushgateway(tmp_path))
        targets = [Target("stepscope-exporter", exporter, True), Target("Pushgateway 1.5.1 (Debian)", gateway, True),
                   Target("node_exporter (Debian)", node_exporter, False)]
        targets[0].put("ticker", 0, counter("stepscope_steps_total", 0))
        targets[1].put("ticker", 0, counter("stepscope_steps_total", 0))
        results = {}
        stored = 0
        for groups in GROUP_COUNTS:
            fill(targets, bodies, stored, groups)
            stored = groups
            results[groups] = measure_at(targets, bodies, groups, max(20, rounds * 64 // max(groups, 64)))
    return push_table(results), scrape_table(results)


def push_table(results: dict[int, dict[str, dict[str, float]]]) -> str:
    rows = []
    for groups, by_target in results.items():
        ours, gateway = by_target["stepscope-exporter"], by_target["Pushgateway 1.5.1 (Debian)"]
        rows.append([
            str(groups), f"{ours['push_cpu']:.2f}", f"{gateway['push_cpu']:.2f}",
            f"{ours['push_cpu'] / gateway['push_cpu']:.2f}x",
            f"{ours['rss_per_group'] / 1024:.1f}", f"{gateway['rss_per_group'] / 1024:.1f}",
            f"{ours['rss_per_group'] / gateway['rss_per_group']:.2f}x",
        ])
    headers = ["groups", "push CPU ms, ours", "push CPU ms, Pushgateway", "ratio", "RSS KiB/group, ours",
               "RSS KiB/group, Pushgateway", "ratio"]
    return table(headers, rows)


def scrape_table(results: dict[int, dict[str, dict[str, float]]]) -> str:
    rows = []
    for groups, by_target in results.items():
        node = by_target["node_exporter (Debian)"]
        for name, row in by_target.items():
            if name.startswith("node_exporter") and groups != GROUP_COUNTS[0]:
                continue
            rows.append([
                str(groups), name,
                f"{row['cold_p50']:.2f} / {row['cold_p90']:.2f}", f"{row['cold_cpu']:.2f}",
                f"{row['cold_p50'] / node['cold_p50']:.2f}x", f"{row['cold_cpu'] / node['cold_cpu']:.2f}x",
                f"{row['cached_p50']:.2f}", f"{row['cached_cpu']:.2f}", f"{row['gzip_kib']:.0f}",
            ])
    headers = ["groups", "target", "cold p50 / p90 ms", "cold CPU ms", "cold p50 vs node_exporter",
               "cold CPU vs node_exporter", "cached p50 ms", "cached CPU ms", "gzip KiB"]
    return table(headers, rows)


# -- 3. the hooks' pusher against this exporter ----------------------------------------------------

@contextmanager
def stepscope_exporter() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as logs, running_exporter(Path(logs), "--collectors", "") as exporter:
        yield exporter.url


def bench_pusher(pairs: int) -> str:
    import torch

    from benchmarks.bench_hooks import bench_training_loop

    torch.set_num_threads(1)  # as bench_hooks.py: one training thread, so the other core serves the exporter
    pushing = bench_training_loop(pairs=pairs, target=stepscope_exporter,
                                  target_name="a stepscope exporter on this machine")
    silent = bench_training_loop(pairs=pairs, target=no_push_target, target_name="nowhere")
    return (f"Pushing to the exporter:\n\n{pushing}\n\nThe same hooks not pushing at all (the machine's noise "
            f"floor for the comparison above):\n\n{silent}")


@contextmanager
def no_push_target() -> Iterator[str]:
    yield ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60, help="measured rounds at 64 groups (fewer above)")
    parser.add_argument("--skip-loop", action="store_true", help="skip the training-loop measurement")
    args = parser.parse_args()
    started = time.monotonic()
    body = hooks_body().encode()
    sections = ["## The parser alone (in process)\n\n" + bench_parser(body, hooks_body(buckets=40).encode())]
    with tempfile.TemporaryDirectory() as tmp:
        pushes, scrapes = bench_groups(args.rounds, Path(tmp))
    sections.append("## Push CPU and memory per stored group\n\n" + pushes)
    sections.append("## Scrapes (gzip, keep-alive)\n\n" + scrapes)
    if not args.skip_loop:
        sections.append("## The hooks' pusher: CPU training loop, hooks vs none, pushing every 1 s\n\n"
                        + bench_pusher(pairs=100))
    report = (f"# Ingest benchmark\n\n{results.machine()}, {results.load_average()} at the end; total "
              f"{time.monotonic() - started:.0f} s; {args.rounds} rounds at 64 groups. "
              f"{time.strftime('%Y-%m-%d')}.\n\n" + "\n\n".join(sections) + "\n")
    results.publish(RESULTS, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The exporter's own CPU at a 1 s interval on fake H100s, and where it goes (issue 20, "The exporter's own cost").

Each tree's exporter (default collectors, `--collect-interval 1`) reads 8 fake H100s x 8 processes whose
NVML calls take the H100's latencies (`scenario.H100_LATENCY_MS`: busy-waited below 10 ms, slept from there
up, so the fake's calls cost CPU as the driver's did on an H100), is scraped every second with gzip over a
keep-alive connection (as Prometheus does) and receives 8 ranks' pushes every 5 s from real trackers
(`stepscope.hooks`) stepping every 50 ms. Every tree runs at the same time under the same load, so
the windows are interleaved by construction; each window's CPU ms per second and the end RSS go into
a table of medians and spread.

    PYTHONPATH=. python benchmarks/bench_exporter_cpu.py [--baseline-rev REV [--baseline-paths P,..]
        [--whole-process-table]] [--windows 8] [--window 15] [--no-latency]
    PYTHONPATH=. python benchmarks/bench_exporter_cpu.py --profile 60   # this tree: by thread and category
    PYTHONPATH=. python benchmarks/bench_exporter_cpu.py --profile 60 --one-gpu   # bench_gpu's side-by-side load
    PYTHONPATH=. python benchmarks/bench_exporter_cpu.py --process-table 300   # children map, whole vs kept
    PYTHONPATH=. python benchmarks/bench_exporter_cpu.py --exited-registered 300   # a finished rank's pid lookup
    PYTHONPATH=. python benchmarks/bench_exporter_cpu.py --worker-tree 300 --baseline-rev e5c55cb [--workers 64]
    PYTHONPATH=. python benchmarks/bench_exporter_cpu.py --render 200 --no-latency   # busy GPU's render
    PYTHONPATH=. python benchmarks/bench_exporter_cpu.py --collector-sets   # one H100: each collector's share
    PYTHONPATH=. python benchmarks/bench_exporter_cpu.py --node-cycle 300 --baseline-rev c22a304   # cold cycles

Each run appends its section to benchmarks/results/exporter_cpu.md.

The side by side with nvitop-exporter needs a GPU: `benchmarks/bench_gpu.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import requests

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(Path(__file__).resolve().parent)]

from bench_gpu import baseline_tree, commit_of, cpu_by_part  # noqa: E402
from exporter_profile import cpu_seconds, profile_pid, scraping  # noqa: E402
from pushing_ranks import PUSH_INTERVAL, RANKS, PushingRanks  # noqa: E402

from stepscope_testkit.fake_nvml.scenario import H100_LATENCY_MS, make_scenario, write_scenario  # noqa: E402
from stepscope_testkit.processes import FAKE_NVML_DIR, free_port, running  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "exporter_cpu.md"



class BusyGpus:
    """Rewrites the scenario every second with new readings, as a busy GPU gives: without it every
    gauge of the fake reads the same each cycle and the renderer's cache would look better than it is."""

    def __init__(self, path: Path, scenario: dict) -> None:
        self.path, self.scenario = path, scenario
        self.gpm = [dict(gpu["gpm"]) for gpu in scenario["gpus"]]
        self.random = random.Random(20)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            for gpu, gpm in zip(self.scenario["gpus"], self.gpm, strict=True):
                gpu["utilization"] = {"gpu": self.random.randint(90, 100), "memory": self.random.randint(30, 45)}
                gpu["power_usage_mw"] = self.random.randint(600_000, 700_000)
                gpu["temperature_c"] = self.random.randint(58, 66)
                gpu["clocks_mhz"]["sm"] = self.random.choice((1650, 1665, 1680, 1695, 1710))
                gpu["memory"]["used"] = 61 * 2**30 + self.random.randint(0, 2**28)
                gpu["gpm"] = {key: value * self.random.uniform(0.9, 1.1) for key, value in gpm.items()}
            write_scenario(self.path, self.scenario)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def exporter_argv(port: int) -> list[str]:
    # -P: the tree on PYTHONPATH, not the working directory
    return [sys.executable, "-P", "-m", "stepscope.exporter", "--listen-address", f"127.0.0.1:{port}",
            "--collect-interval", "1"]


@contextlib.contextmanager
def exporter(tree: Path, scenario: Path, log_dir: Path, *flags: str) -> Iterator[tuple[str, int]]:
    """The tree's exporter on fake NVML, with `flags` added: (base URL, pid)."""
    port = free_port()
    env = {"PYTHONPATH": f"{FAKE_NVML_DIR}{os.pathsep}{tree}", "STEPSCOPE_FAKE_NVML_SCENARIO": str(scenario)}
    with running([*exporter_argv(port), *flags], f"http://127.0.0.1:{port}/-/ready", log_dir / f"exporter-{port}.log",
                 env=env, base_url=f"http://127.0.0.1:{port}") as proc:
        yield proc.url, proc.process.pid


class Load:
    """A Prometheus-like scraper (gzip, keep-alive) and RANKS trackers pushing every 5 s, for one exporter."""

    def __init__(self, url: str, scrape_interval: float) -> None:
        self.url = url
        self.scrape_interval = scrape_interval
        self.ranks = PushingRanks(url)
        self.scrapes = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._scrape, daemon=True)
        self.thread.start()

    def _scrape(self) -> None:
        session = requests.Session()
        while not self.stop.wait(self.scrape_interval):
            session.get(f"{self.url}/metrics", headers={"Accept-Encoding": "gzip"}, timeout=10).raise_for_status()
            self.scrapes += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=15)
        self.ranks.close()


def measure(pids: dict[str, int], windows: int, window: float) -> dict[str, list[float]]:
    """CPU ms per second of each exporter, window by window, all measured over the same windows."""
    per_window: dict[str, list[float]] = {name: [] for name in pids}
    for _ in range(windows):
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        started = time.monotonic()
        time.sleep(window)
        wall = time.monotonic() - started
        for name, pid in pids.items():
            per_window[name].append((cpu_seconds(pid) - before[name]) / wall * 1e3)
    return per_window


def cpu_table(per_window: dict[str, list[float]], rss: dict[str, float]) -> str:
    """Medians and spread per exporter; the ratio to the first one window by window (same load, same time)."""
    lines = ["| exporter | CPU ms/s median | min-max | IQR | vs first, window by window: median (min-max) | RSS MiB |",
             "|---|---:|---:|---:|---:|---:|"]
    first = next(iter(per_window.values()))
    for name, values in per_window.items():
        quartiles = statistics.quantiles(values, n=4)
        # a window where the first used no CPU tick (10 ms) has no ratio: an idle exporter can read 0
        ratios = [value / base for value, base in zip(values, first, strict=True) if base > 0]
        ratio = (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios
                 else "no ratio (the first read 0)")
        lines.append(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} | "
                     f"{quartiles[0]:.2f}-{quartiles[2]:.2f} | {ratio} | {rss[name]:.1f} |")
    return "\n".join(lines)


def profile(seconds: float, tmp: Path, scenario: Path, raw: Path | None, scrape_interval: float,
            pushes: bool) -> str:
    """py-spy of this tree's exporter under the load, or under scrapes alone without `pushes`
    (exporter_profile.profile_pid; stacks kept in `raw`)."""
    with exporter(REPO_ROOT, scenario, tmp) as (url, pid), (
            contextlib.closing(Load(url, scrape_interval)) if pushes else scraping(url, scrape_interval)):
        time.sleep(2 * PUSH_INTERVAL)
        return profile_pid(pid, seconds, raw or tmp / "pyspy.txt")


def this_tree_with(rev: str, paths: list[str], tmp: Path) -> Path:
    """A copy of this working tree (tracked and untracked files, not the ignored) with `paths` as at `rev`."""
    root = tmp / "baseline"
    listed = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_symlink() or source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name, follow_symlinks=False)
    for path in paths:
        shown = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{rev}:{path}"], capture_output=True, check=True)
        (root / path).write_bytes(shown.stdout)
    return root


def whole_process_table(tree: Path) -> str:
    """Makes the tree's process collector read every process's parent each cycle (the code before the kept
    table) and says so for the label."""
    path = tree / "exporter" / "collectors" / "process.py"
    text = path.read_text()
    kept = "children_of = self._children.get()"
    if kept not in text:
        raise SystemExit(f"--whole-process-table: {path} has no {kept!r}")
    path.write_text(text.replace(kept, "children_of = _children_of(psutil._ppid_map())"))
    return ", process table read whole each cycle"


def alternating(calls: dict[str, Callable[[], object]], rounds: int, what: str) -> str:
    """Markdown: the CPU time of each call (µs, median and p90), the calls taken in turn `rounds` times,
    20 ms apart, so that both meet the same machine."""
    spent: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            started = time.process_time()
            call()
            spent[name].append((time.process_time() - started) * 1e6)
        time.sleep(0.02)
    lines = [f"| {what} | µs per cycle, median | p90 |", "|---|---:|---:|"]
    lines += [f"| {name} | {statistics.median(values):.0f} | {statistics.quantiles(values, n=10)[-1]:.0f} |"
              for name, values in spent.items()]
    return "\n".join(lines)


def process_table(rounds: int) -> str:
    """The process collector's children map per cycle: the whole table read (before) against the kept one
    (after), alternating in one loop on this machine's processes, CPU time of each call."""
    from stepscope.exporter.collectors.process import _children_of, _ChildrenMap

    kept = _ChildrenMap()
    kept.get()
    table = alternating({"whole table": lambda: _children_of(psutil._ppid_map()), "kept": kept.get}, rounds,
                        "children map")
    return (f"{len(psutil.pids())} processes on this machine, {rounds} rounds 20 ms apart (processes come and go "
            "here: other sessions run tests):\n\n" + table)


def module_at(rev: str, path: str, tmp: Path) -> ModuleType:
    """The module at `path` as it was at `rev`, loaded beside this tree's (it imports this tree's others)."""
    source = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{rev}:{path}"],
                            capture_output=True, text=True, check=True).stdout
    name = Path(path).stem + "_before"
    (tmp / f"{name}.py").write_text(source)
    spec = importlib.util.spec_from_file_location(name, tmp / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker_tree(rounds: int, rev: str, tmp: Path, workers: int = 16) -> str:
    """A rank with `workers` data-loader workers read as the process collector reads it each cycle, the
    collector at `rev` against this tree's, alternating in one loop, CPU time of each read."""
    from stepscope.exporter.collectors import process as this_tree

    before = module_at(rev, "exporter/collectors/process.py", tmp)
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"]) for _ in range(workers)]
    try:
        time.sleep(1)
        rank, kept = psutil.Process(), this_tree._ChildrenMap()
        table = alternating({f"before ({commit_of(rev)})": lambda: before._read_tree(rank, kept.get()),
                             f"this tree ({commit_of('HEAD')}+)": lambda: this_tree._read_tree(rank, kept.get())},
                            rounds, f"a rank and its {workers} workers")
    finally:
        for child in children:
            child.kill()
            child.wait()
    return f"{rounds} rounds 20 ms apart, the children map kept (read in each column):\n\n" + table


def exited_registered(rounds: int) -> str:
    """The pid lookup of a registered process that exited (its group stays until the ingest TTL): a /proc
    scan every cycle, as before (a fresh resolver each cycle), against this tree's resolver, alternating in
    one loop, CPU time of each call."""
    from stepscope.exporter.collectors.pid_namespaces import PidResolver

    report_and_exit = "import os, psutil; print(os.getpid(), psutil.Process().create_time())"
    ran = subprocess.run([sys.executable, "-c", report_and_exit], capture_output=True, text=True, check=True)
    pid, start_time = ran.stdout.split()
    exited, kept = (int(pid), float(start_time)), PidResolver()
    table = alternating({"scanned every cycle (before)": lambda: PidResolver().resolve([exited]),
                         "this tree": lambda: kept.resolve([exited])}, rounds,
                        "pid lookup of an exited registered process")
    return (f"{len(psutil.pids())} processes on this machine, {rounds} rounds 20 ms apart (one scan per "
            "RETRY_SECONDS in this tree's column):\n\n" + table)


class _Collected:
    """What generate_latest reads families from."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


def render_cost(rounds: int, scenario: Path) -> str:
    """The GPU collector's families with every value changed each cycle (a busy GPU), rendered by the
    CachedRenderer (kept prefixes), by exporter.metric_families' render per family, and by prometheus_client's
    generate_latest per family (the exporter's renderer before both), in turn; CPU time."""
    from prometheus_client.exposition import generate_latest

    from stepscope.exporter.collectors.gpu import GpuCollector
    from stepscope.exporter.exposition import CachedRenderer, render
    from stepscope.exporter.gpu_processes import GpuProcessTable

    os.environ["STEPSCOPE_FAKE_NVML_SCENARIO"] = str(scenario)
    spec = importlib.util.spec_from_file_location("fake_pynvml", FAKE_NVML_DIR / "pynvml.py")
    assert spec is not None and spec.loader is not None
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)  # by path: the real pynvml may be imported already (torch)
    collector = GpuCollector(GpuProcessTable(), nvml=fake, slow_interval=3600)
    collector.collect()
    families = collector.collect()
    renderer = CachedRenderer()
    spent: dict[str, list[float]] = {"kept prefixes (CachedRenderer)": [], "metric_families.render per family": [],
                                     "prometheus_client generate_latest per family": []}
    renderer.render(families)
    for cycle in range(1, rounds + 1):
        for family in families:
            family.samples = [sample._replace(value=sample.value + cycle) for sample in family.samples]
        started = time.process_time()
        body, _ = renderer.render(families)
        kept = time.process_time()
        ours = b"".join(render([family]) for family in families)
        rendered = time.process_time()
        theirs = b"".join(generate_latest(_Collected([family])) for family in families)  # type: ignore[arg-type]
        spent["kept prefixes (CachedRenderer)"].append((kept - started) * 1e3)
        spent["metric_families.render per family"].append((rendered - kept) * 1e3)
        spent["prometheus_client generate_latest per family"].append((time.process_time() - rendered) * 1e3)
        assert body == ours == theirs, "the renderers wrote different text"
    collector.close()
    lines = ["| renderer | ms per cycle, median | p90 |", "|---|---:|---:|"]
    lines += [f"| {name} | {statistics.median(values):.3f} | {statistics.quantiles(values, n=10)[-1]:.3f} |"
              for name, values in spent.items()]
    samples = sum(len(family.samples) for family in families)
    return (f"{len(families)} families, {samples} samples of 8 fake H100s x 8 processes, every value changed each "
            f"cycle, {rounds} cycles; the texts compared byte for byte each cycle:\n\n" + "\n".join(lines))


def compare(trees: dict[str, Path], windows: int, window: float, tmp: Path, scenario: Path,
            scrape_interval: float) -> str:
    with contextlib.ExitStack() as stack:
        pids, loads = {}, []
        for name, tree in trees.items():
            url, pid = stack.enter_context(exporter(tree, scenario, tmp))
            pids[name] = pid
            loads.append(Load(url, scrape_interval))
            stack.callback(loads[-1].close)
        time.sleep(2 * PUSH_INTERVAL)  # every rank pushed, GPM ratios and GPU-process series filled
        per_window = measure(pids, windows, window)
        rss = {name: psutil.Process(pid).memory_info().rss / 2**20 for name, pid in pids.items()}
        scrapes = [load.scrapes for load in loads]
    return (cpu_table(per_window, rss)
            + f"\n\n{windows} windows of {window:g} s, every exporter at once under its own load ({RANKS} ranks "
            f"pushing every {PUSH_INTERVAL:g} s, a gzip scrape every {scrape_interval:g} s; "
            f"{min(scrapes)}-{max(scrapes)} scrapes each); RSS at the end.")


def node_cycle(rounds: int, rev: str, tmp: Path) -> str:
    """The node collector's cycle at `rev` and in this tree, alternating in one process with 0.1 s between
    cycles (so each starts with its caches cold, as on the 1 s timer), CPU time of each cycle and render: the
    process's, so the threads a collector hands work to (a filesystem path's reader) count too."""
    from stepscope.exporter.collectors.node import NodeCollector
    from stepscope.exporter.exposition import ExpositionStore
    from stepscope.exporter.scheduler import Scheduler

    before_module = module_at(rev, "exporter/collectors/node.py", tmp)
    collectors = {f"before ({commit_of(rev)})": before_module.NodeCollector(["/"]),
                  f"this tree ({commit_of('HEAD')}+)": NodeCollector(["/"])}
    for name, collector in collectors.items():
        collector.name = name
    scheduler = Scheduler(list(collectors.values()), 1, ExpositionStore())
    spent: dict[str, list[float]] = {name: [] for name in collectors}
    for cycle in range(rounds):
        for collector in list(collectors.values())[:: 1 if cycle % 2 else -1]:
            time.sleep(0.1)
            started = time.process_time()
            scheduler.run_once(collector)
            spent[collector.name].append((time.process_time() - started) * 1e3)
    names = list(spent)
    ratios = [after / before for before, after in zip(spent[names[0]], spent[names[1]], strict=True)]
    lines = ["| node collector | ms per cycle, median | p10 | p90 |", "|---|---:|---:|---:|"]
    for name, values in spent.items():
        deciles = statistics.quantiles(values, n=10)
        lines.append(f"| {name} | {statistics.median(values):.3f} | {deciles[0]:.3f} | {deciles[-1]:.3f} |")
    return (f"{rounds} cycles each, alternating, 0.1 s apart, `--filesystem-paths /`; this tree over before, "
            f"cycle by cycle: median {statistics.median(ratios):.2f}x\n\n" + "\n".join(lines))


COLLECTOR_SETS = {"none": "", "node": "node", "process": "process", "gpu": "gpu", "all (the default)": None}


def collector_sets(windows: int, window: float, tmp: Path, scenario: Path, scrape_interval: float) -> str:
    """One exporter per collector set, side by side, each scraped with gzip and none pushed to (as beside
    nvitop-exporter in bench_gpu.py): what each collector adds, and the default one's CPU by part
    (its stepscope_exporter_cpu_seconds_total) over the same windows."""
    with contextlib.ExitStack() as stack:
        pids, urls = {}, {}
        for name, collectors in COLLECTOR_SETS.items():
            flags = () if collectors is None else ("--collectors", collectors)
            urls[name], pids[name] = stack.enter_context(exporter(REPO_ROOT, scenario, tmp, *flags))
        for url in urls.values():
            stack.enter_context(scraping(url, scrape_interval))
        time.sleep(10)
        default = f"{urls['all (the default)']}/metrics"
        parts_before, started = cpu_by_part(default), time.monotonic()
        per_window = measure(pids, windows, window)
        parts_after, wall = cpu_by_part(default), time.monotonic() - started
        rss = {name: psutil.Process(pid).memory_info().rss / 2**20 for name, pid in pids.items()}
    by_part = "\n".join(["| part | CPU ms/s |", "|---|---:|"] + [
        f"| {part} | {(seconds - parts_before.get(part, 0.0)) / wall * 1e3:.2f} |"
        for part, seconds in sorted(parts_after.items())])
    return (cpu_table(per_window, rss) + f"\n\n{windows} windows of {window:g} s, every exporter at once, a gzip "
            f"scrape every {scrape_interval:g} s each, no pushes; `--collectors` as named. The default exporter "
            f"by part over the same windows (10 ms ticks):\n\n{by_part}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", default=None, help="the 'before' tree (a git revision); none: this tree only")
    parser.add_argument("--baseline-paths", type=lambda text: text.split(","), default=None,
                        help="comma-separated paths: 'before' is this tree with only these at --baseline-rev "
                             "(when main's commits in between are not each a working tree)")
    parser.add_argument("--whole-process-table", action="store_true",
                        help="the 'before' tree reads the whole process table every cycle, as before 6278b2d "
                             "(which brought the kept table in one commit with pod labels)")
    parser.add_argument("--windows", type=int, default=8, help="measurement windows (at least 4)")
    parser.add_argument("--window", type=float, default=15.0, help="seconds per window")
    parser.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                        help="instead: py-spy this tree's exporter for SECONDS and print CPU by category")
    parser.add_argument("--process-table", type=int, default=0, metavar="ROUNDS",
                        help="instead: the process collector's children map, whole table against kept")
    parser.add_argument("--worker-tree", type=int, default=0, metavar="ROUNDS",
                        help="instead: a rank with --workers data-loader workers read by the process collector, "
                             "--baseline-rev's against this tree's (e5c55cb: before one /proc read per worker)")
    parser.add_argument("--workers", type=int, default=16, help="with --worker-tree: the rank's workers")
    parser.add_argument("--exited-registered", type=int, default=0, metavar="ROUNDS",
                        help="instead: the pid lookup of a registered process that exited, scanned every cycle "
                             "against this tree's")
    parser.add_argument("--no-latency", action="store_true",
                        help="NVML calls return at once: what is left is the exporter's Python (and the fake's)")
    parser.add_argument("--render", type=int, default=0, metavar="ROUNDS",
                        help="instead: the GPU families' render: kept prefixes, metric_families, generate_latest")
    parser.add_argument("--scrape-interval", type=float, default=1.0,
                        help="seconds between gzip scrapes (1: as bench_gpu.py beside nvitop; 15: Prometheus' usual)")
    parser.add_argument("--raw", type=Path, default=None, help="with --profile: keep py-spy's stacks in this file")
    parser.add_argument("--node-cycle", type=int, default=0, metavar="ROUNDS",
                        help="instead: the node collector's cold cycle, --baseline-rev's against this tree's")
    parser.add_argument("--collector-sets", action="store_true",
                        help="instead: one H100, an exporter per collector set side by side, the default's CPU by part")
    parser.add_argument("--one-gpu", action="store_true",
                        help="with --profile: one H100 and no pushes, bench_gpu.py --side-by-side's load, to set "
                             "beside the profile a GPU run prints")
    args = parser.parse_args()
    if args.windows < 4:
        parser.error("--windows must be at least 4")
    if args.one_gpu and not args.profile:
        parser.error("--one-gpu goes with --profile SECONDS")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        gpus = 1 if args.collector_sets or args.one_gpu else 8  # one: as the H100 beside nvitop-exporter
        readings = make_scenario(gpus, 8, latency_ms=None if args.no_latency else H100_LATENCY_MS)
        scenario = write_scenario(tmp / f"h100x{gpus}.json", readings)
        busy = BusyGpus(scenario, readings)
        nvml = "NVML without latency" if args.no_latency else "H100 NVML latencies"
        header = (f"{nvml}, {psutil.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start, "
                  f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        if args.render:
            report = f"## Rendering a busy GPU's families ({header})\n\n" + render_cost(args.render, scenario)
        elif args.process_table:
            report = f"## The process table ({header})\n\n" + process_table(args.process_table)
        elif args.worker_tree:
            report = (f"## A rank's data-loader workers ({header})\n\n"
                      + worker_tree(args.worker_tree, args.baseline_rev or "HEAD", tmp, args.workers))
        elif args.exited_registered:
            report = (f"## A registered process that exited ({header})\n\n"
                      + exited_registered(args.exited_registered))
        elif args.node_cycle:
            report = (f"## The node collector's cycle ({header})\n\n"
                      + node_cycle(args.node_cycle, args.baseline_rev or "HEAD", tmp))
        elif args.collector_sets:
            report = (f"## One H100: each collector's share ({header})\n\n"
                      + collector_sets(args.windows, args.window, tmp, scenario, args.scrape_interval))
        elif args.profile:
            load = "one H100, scrapes alone, " if args.one_gpu else ""
            report = f"## Where the CPU goes ({load}{header})\n\n" + profile(
                args.profile, tmp, scenario, args.raw, args.scrape_interval, pushes=not args.one_gpu)
        else:
            trees = {f"this tree ({commit_of('HEAD')}+)": REPO_ROOT}
            if args.baseline_rev:
                before = (this_tree_with(args.baseline_rev, args.baseline_paths, tmp) if args.baseline_paths
                          else baseline_tree(args.baseline_rev, tmp))
                if before is None:
                    return 1
                label = f"before ({commit_of(args.baseline_rev)}"
                if args.baseline_paths:
                    label = f"before (this tree, {', '.join(args.baseline_paths)} at {commit_of(args.baseline_rev)}"
                if args.whole_process_table:
                    label += whole_process_table(before)
                trees = {label + ")": before, **trees}
            report = f"## Before and after ({header})\n\n" + compare(trees, args.windows, args.window, tmp, scenario,
                                                                    args.scrape_interval)
        busy.close()
    print(report)
    with RESULTS.open("a") as results:
        results.write("\n" + report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

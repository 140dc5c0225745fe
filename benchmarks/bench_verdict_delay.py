"""How long a new run waits for its verdict, from its first push, on each engine and layout the rules ship
for, at the production intervals (scrape and evaluation every 15 s).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_verdict_delay.py                    # ~4 minutes
    PYTHONPATH=. .venv/bin/python benchmarks/bench_verdict_delay.py --baseline 196fea0^  # and those rules

A real exporter (fake NVML: one saturated H100 per run, held by a sleeping process that stands in for
the rank) takes the pushes of RUNS one-rank runs that train GPU-bound from their first push, a push every
5 s (the hooks' default), started STAGGER_S apart so that they meet the 15 s scrape and evaluation
cycles at different phases. Side by side, every layout reads that exporter:

- prometheus: one Prometheus with both rule files;
- prometheus-sharded: a shard Prometheus (node rules) remote_writing to a global Prometheus (run rules);
- victoriametrics: VictoriaMetrics scraping, vmalert evaluating both files against it;
- victoriametrics-global: the shard Prometheus remote_writing to VictoriaMetrics, vmalert on the run rules
  (tests/support/victoria.py has the settings).

Each run's verdict is read every second from each layout; the table gives the seconds from the run's
first push to its first verdict other than idle. The rules make a run wait until a rank has trained
the settle time (30 s), so that is the floor; the rest is the scrape, the evaluation phases and, on
VictoriaMetrics, ~10 s for each level of new recorded series to become visible (docs/engines.md).
--baseline runs the same layouts with the rule files of another commit, in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import requests
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from grafana.rules import NODE_RULES, RUN_RULES  # noqa: E402
from stepscope.contract import THRESHOLDS, recordings, verdicts  # noqa: E402
from stepscope_testkit import results  # noqa: E402
from stepscope_testkit.fake_nvml.scenario import make_scenario, write_scenario  # noqa: E402
from stepscope_testkit.ingest_bodies import counter, histogram, info_family, state_family  # noqa: E402
from stepscope_testkit.processes import Running, running_exporter  # noqa: E402
from tests.support.prometheus import query, running_prometheus_config  # noqa: E402
from tests.support.victoria import running_victoria, running_vmalert  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "verdict_delay.md"
INTERVAL = "15s"
RUNS = 5
STAGGER_S = 3.0
PUSH_S = 5.0
STEPS_PER_PUSH = 50
TIMEOUT_S = 220
LAYOUTS = ("prometheus", "prometheus-sharded", "victoriametrics", "victoriametrics-global")
# seconds per step by phase: a GPU-bound step (CUDA-event phases; the loader prefetched)
PHASES = {"dataloader_next": ("host", 0.001), "to_device": ("host", 0.002), "forward": ("cuda_event", 0.03),
          "backward": ("cuda_event", 0.06), "optimizer_step": ("cuda_event", 0.007)}


def body(steps: int, pid: int) -> str:
    """What a GPU-bound rank pushes after `steps` steps (cumulative)."""
    step_seconds = sum(seconds for _, seconds in PHASES.values())
    phases = "# TYPE stepscope_step_phase_seconds histogram\n" + "".join(
        histogram("stepscope_step_phase_seconds", [("+Inf", steps)], steps, seconds * steps,
                  f'phase="{phase}",timing="{timing}"') for phase, (timing, seconds) in PHASES.items())
    step = "# TYPE stepscope_step_seconds histogram\n" + histogram(
        "stepscope_step_seconds", [("0.1", steps), ("+Inf", steps)], steps, step_seconds * steps)
    return (phases + step + counter("stepscope_steps_total", steps) + counter("stepscope_samples_total", 32 * steps)
            + info_family(pid) + state_family("train"))


class Run(threading.Thread):
    """One rank of one run: its first push at `start` (time.time()), then every PUSH_S."""

    def __init__(self, name: str, exporter: str, pid: int, start: float, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.name, self.exporter, self.pid, self.start_at, self.stop = name, exporter, pid, start, stop
        self.first_push: float | None = None

    def run(self) -> None:
        self.stop.wait(max(0.0, self.start_at - time.time()))
        steps = 0
        while not self.stop.is_set():
            steps += STEPS_PER_PUSH
            try:
                requests.put(f"{self.exporter}/metrics/job/stepscope/run/{self.name}/rank/0",
                             data=body(steps, self.pid), timeout=5).raise_for_status()
            except requests.RequestException:
                if self.stop.is_set():
                    return  # the exporter stops at the end
                raise
            self.first_push = self.first_push or time.time()
            self.stop.wait(PUSH_S)


def rules_of(commit: str, folder: Path) -> tuple[Path, Path]:
    """The generated node and run rule files as they were at `commit`."""
    paths = []
    for path in (NODE_RULES, RUN_RULES):
        text = subprocess.run(["git", "show", f"{commit}:{path.relative_to(REPO_ROOT)}"], cwd=REPO_ROOT,
                              capture_output=True, text=True, check=True).stdout
        paths.append(folder / path.name)
        paths[-1].write_text(text)
    return paths[0], paths[1]


def _scrape(address: str) -> list[dict]:
    return [{"job_name": "stepscope", "static_configs": [{"targets": [address], "labels": {"instance": "node-0"}}]}]


def _alive(running: Running) -> str:
    """`running`'s URL once its process has outlived a second: free_port() can hand two servers started
    together the same port, and the one that loses it would otherwise pass for the other."""
    time.sleep(1)
    if running.process.poll() is not None:
        raise SystemExit(f"bench_verdict_delay: a server exited at start (port taken?):\n{running.log()[-2000:]}")
    return running.url


def _prometheus(stack: ExitStack, tmp: Path, address: str, rule_files: list[Path], write_to: str = "") -> str:
    config: dict = {"global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL},
                    "rule_files": [str(path) for path in rule_files],
                    "scrape_configs": _scrape(address) if address else []}
    if write_to:
        config["global"]["external_labels"] = {"stepscope_shard": "0"}
        shard = yaml.safe_load((REPO_ROOT / "docker" / "prometheus" / "sharded" / "shard.yml").read_text())
        config["remote_write"] = [{**shard["remote_write"][0], "url": f"{write_to}/api/v1/write"}]
    flags = () if address else ("--web.enable-remote-write-receiver",)
    tmp.mkdir(parents=True, exist_ok=True)
    return _alive(stack.enter_context(running_prometheus_config(tmp, config, *flags)))


@contextmanager
def layout(name: str, tmp: Path, address: str, node: Path, run: Path) -> Iterator[str]:
    """The URL where `name` answers queries for the run verdict."""
    tmp.mkdir(parents=True)
    with ExitStack() as stack:
        if name == "prometheus":
            yield _prometheus(stack, tmp, address, [node, run])
        elif name == "prometheus-sharded":
            top = _prometheus(stack, tmp / "global", "", [run])
            _prometheus(stack, tmp / "shard", address, [node], write_to=top)
            yield top
        elif name == "victoriametrics":
            victoria = _alive(stack.enter_context(running_victoria(tmp / "victoria", _scrape(address), INTERVAL)))
            _alive(stack.enter_context(running_vmalert(tmp / "vmalert", victoria, [node, run], INTERVAL)))
            yield victoria
        else:
            victoria = _alive(stack.enter_context(running_victoria(tmp / "victoria")))
            _alive(stack.enter_context(running_vmalert(tmp / "vmalert", victoria, [run], INTERVAL)))
            _prometheus(stack, tmp / "shard", address, [node], write_to=victoria)
            yield victoria


def measure(rule_sets: dict[str, tuple[Path, Path]], layouts: list[str],
            tmp: Path) -> dict[tuple[str, str], list[float]]:
    """(rules, layout) -> seconds from each run's first push to its first verdict."""
    sleepers = [subprocess.Popen(["sleep", str(TIMEOUT_S + 120)]) for _ in range(RUNS)]
    stop = threading.Event()
    try:
        pids = [proc.pid for proc in sleepers]
        scenario = write_scenario(tmp / "nvml.json", make_scenario(gpus=RUNS, processes_per_gpu=1, pids=pids))
        with running_exporter(tmp, fake_nvml_scenario=scenario) as exporter, ExitStack() as stack:
            address = exporter.url.removeprefix("http://")
            urls = {(label, name): stack.enter_context(layout(name, tmp / f"{label}-{name}", address, *files))
                    for label, files in rule_sets.items() for name in layouts}
            start = time.time() + 5
            runs = [Run(f"delay-{i}", exporter.url, pid, start + i * STAGGER_S, stop) for i, pid in enumerate(pids)]
            for run in runs:
                run.start()
            first: dict[tuple[str, str], dict[str, float]] = {key: {} for key in urls}
            while time.time() < start + TIMEOUT_S and any(len(seen) < RUNS for seen in first.values()):
                for key, url in urls.items():
                    for item in query(url, recordings.RUN_VERDICT):
                        run_name, verdict = item["metric"]["run"], item["metric"]["verdict"]
                        if verdict != verdicts.IDLE:
                            first[key].setdefault(run_name, time.time())
                time.sleep(1)
            pushed = {run.name: run.first_push for run in runs}
            return {key: sorted(seen[name] - pushed[name] for name in seen) for key, seen in first.items()}
    finally:
        stop.set()
        for proc in sleepers:
            proc.kill()
            proc.wait()


def table(delays: dict[tuple[str, str], list[float]]) -> str:
    rows = ["| layout | rules | runs with a verdict | median s | min-max s | each run, s |",
            "|---|---|---|---|---|---|"]
    for (label, name), seconds in sorted(delays.items(), key=lambda kv: (LAYOUTS.index(kv[0][1]), kv[0][0])):
        spread = f"{min(seconds):.0f}-{max(seconds):.0f}" if seconds else "-"
        median = f"{statistics.median(seconds):.0f}" if seconds else "-"
        rows.append(f"| {name} | {label} | {len(seconds)}/{RUNS} | {median} | {spread} | "
                    f"{', '.join(f'{s:.0f}' for s in seconds)} |")
    return "\n".join(rows)


def version(package: str) -> str:
    """The Debian package's version (what the tests install)."""
    out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
    return out.stdout or "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", help="the rule files of this git commit (default: the working tree's)")
    parser.add_argument("--baseline", help="also measure the rule files of this git commit")
    parser.add_argument("--out", type=Path, default=RESULTS, help="markdown file to write")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    args = parser.parse_args(argv)
    if not args.layouts or not set(args.layouts.split(",")) <= set(LAYOUTS):
        parser.error(f"--layouts: a comma-separated list of {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        rule_sets = {"this checkout": (NODE_RULES, RUN_RULES)}
        for index, commit in enumerate(filter(None, (args.rules, args.baseline))):
            folder = tmp / f"rules-{index}"
            folder.mkdir()
            try:
                files = rules_of(commit, folder)
            except subprocess.CalledProcessError:
                parser.error(f"no rule files at commit {commit!r}")
            if commit == args.rules:
                rule_sets = {}
            rule_sets[commit] = files
        delays = measure(rule_sets, args.layouts.split(","), tmp)
    settle = THRESHOLDS["verdict_settle_seconds"].number
    text = (f"# From a run's first push to its verdict\n\n{results.machine()}, {results.load_average()}; "
            f"Prometheus {version('prometheus')}, VictoriaMetrics and vmalert {version('victoria-metrics')}. "
            f"Scrape and evaluation every {INTERVAL}; {RUNS} one-rank GPU-bound runs started {STAGGER_S:.0f} s "
            f"apart, a push every {PUSH_S:.0f} s; the rules wait until a rank has trained {settle} s. "
            f"benchmarks/bench_verdict_delay.py.\n\n{table(delays)}\n")
    results.publish(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How many nodes one Prometheus with the shipped rules carries: head series, memory, CPU and the
evaluation time of every rule group, at 100, 250, 500 and 1,000 simulated nodes.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py                  # ~30 minutes
    PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py --nodes 50 --warmup 90 --measure 60
    PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py --nodes 1000 --append  # one size, added to
        # the results kept in benchmarks/results/scale.json (--nodes "" --append: render them again)
    git show 46cf0c3:grafana/rules/stepscope.rules.yml > /tmp/before.yml   # the rules before the split
    PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py --nodes 250 --baseline /tmp/before.yml \
        --out benchmarks/results/scale-vs-before.md                          # side by side, one run
    PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py --engine victoriametrics --nodes 250
        # the same nodes and rules on VictoriaMetrics + vmalert (benchmarks/results/scale-victoriametrics.md)

One node is a REAL exporter scrape: the exporter with the fake NVML's 8 H100s (GPM on), 8 ranks of
one run, each holding memory on its GPU (8 sleeping processes stand in for their pids), each pushing
the body the real hooks render after 300 steps of 9 phases (stepscope_testkit/node_scrape.py). A
synthetic target, its own process, serves N copies of that scrape on /metrics/<instance>: runs of 8
nodes (64 ranks), rank labels renumbered, the GPU readings of one of four run profiles, counters
advancing from the scraped values (training families at the captured step rate, others at their
average rate since boot), timestamps at now. Bodies are pre-parsed; a scrape formats only the
counters, and the table reports the target's own CPU so it is seen not to be the bottleneck.

A real Prometheus (Debian's 2.42) scrapes every target and evaluates the rule files every 15 s (as
in production), with Go's default GC target unless --gogc sets one (column GOGC). After
a warm-up (rate windows full, recordings present) the measured window collects, from Prometheus'
own /metrics, every evaluation of every group (prometheus_rule_group_last_duration_seconds,
deduplicated by the group's last evaluation time) and the missed iterations; head series, RSS and
CPU of the Prometheus process; and at the end the costliest rules (/api/v1/rules evaluationTime) and
what the rules found (verdicts, alerts).

Run profiles (one in four runs each), the readings of the H100 recordings in benchmarks/corpus
(steady medians): gpu_bound (NVML 98%, SM active 73%, tensor 58%); data_bound (93% of the step in
dataloader_next, NVML 0%, SM active 0.04%); busy_idle (NVML 100%, SM active 0.8%); host_bound
(launch-bound: NVML 14%, SM active 0.09%). Rank 3 of each run's first node is a straggler (forward
3x). Three runs in four keep a GPU alert pending on all their GPUs: the bookkeeping of a bad day,
not of an idle cluster.

The machine's other load is reported (cores busy outside Prometheus and the target): evaluation
times grow with it, so compare runs made under similar load. --baseline runs a second Prometheus
with other rule files side by side, against the same nodes, in the same run: its ratios survive a
busy machine.

--engine victoriametrics measures the second engine the rules run on (docs/engines.md): VictoriaMetrics
single-node scrapes the same targets every 15 s (`-promscrape.config`) and vmalert evaluates the rule
files every 15 s against it, both started by tests/support/victoria.py with the settings the tests use.
vmalert 1.79 keeps no last duration per group: a group's evaluations are the steps of its
vmalert_iteration_duration_seconds_count, each taking the step of _sum (sampled every 3 s, one
evaluation per step; a gap of k evaluations counts k at their mean). Missed iterations are
vmalert_iteration_missed_total, failures vmalert_execution_errors_total and the rows of recordings and
alerts vmalert could not write back; RSS and CPU come from /proc for VictoriaMetrics and vmalert each,
the series from VictoriaMetrics' /api/v1/series/count, the costliest rules from vmalert's
/api/v1/rules (each rule's own time, vmalert_own_seconds), the findings from the same queries against
VictoriaMetrics.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import psutil
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from grafana.rules import RULE_FILES, RUN_RULES, rules  # noqa: E402
from stepscope_testkit.node_scrape import GPUS, capture_node_scrape  # noqa: E402
from stepscope_testkit.processes import free_port, running  # noqa: E402
from stepscope_testkit.sharded import shard_write_filter  # noqa: E402
from tests.support.victoria import running_victoria, running_vmalert  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "scale.md"
NODES_PER_RUN = 8
INTERVAL_SECONDS = 15
# Go's GC target when GOGC is not set, which Debian's Prometheus 2.42 keeps (2.53 and newer default to
# 75); --gogc tries others: at 1,000 nodes the worst single evaluations come from the Go runtime
# (collections, and page faults while the heap grows back), docs/deployment.md, "Scaling".
GO_DEFAULT_GOGC = 100
VICTORIA_GOGC = 30  # what VictoriaMetrics and vmalert set when GOGC is not in their environment
CAPTURE_RUN = "capture"
STRAGGLER_LOCAL_RANK = 3
STRAGGLER_FORWARD = 3.0
PROFILES = {  # run profile -> (NVML utilization, SM active, tensor active, data-loading share or None)
    # benchmarks/corpus/h100-2026-11-24: mlp_bf16, data_bound, busy_idle, host_launch_bound
    "gpu_bound": (0.98, 0.725, 0.575, None),
    "data_bound": (0.00, 0.0004, 0.0001, 0.93),
    "busy_idle": (1.00, 0.0076, 0.0, None),
    "host_bound": (0.14, 0.0009, 0.0, None),
}
CPU_MODE_SHARES = {"idle": 0.5, "user": 0.4, "system": 0.1}  # node CPUs half busy
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{.*\})? (?P<value>\S+)$")
TRAINING_PREFIXES = ("stepscope_step_", "stepscope_steps_", "stepscope_samples_")


@dataclasses.dataclass(frozen=True)
class Engine:
    """What differs in a report between the engines: names, and the counters each reports."""

    server: str  # the processes measured, in the report's words
    title: str
    default_gogc: int
    results: Path
    missed: str
    failures: str


ENGINES = {
    "prometheus": Engine("Prometheus", "one Prometheus", GO_DEFAULT_GOGC, RESULTS,
                         "prometheus_rule_group_iterations_missed_total", "prometheus_rule_evaluation_failures_total"),
    "victoriametrics": Engine("VictoriaMetrics + vmalert", "VictoriaMetrics + vmalert", VICTORIA_GOGC,
                              RESULTS.with_name("scale-victoriametrics.md"),
                              "vmalert_iteration_missed_total", "vmalert_execution_errors_total"),
}


# ---- the synthetic cluster -------------------------------------------------------------------------

@dataclasses.dataclass
class NodeBody:
    """One node's exposition: static text between the values that move, and how they move."""

    segments: list[str]  # text before each moving value (segments[-1] is the tail)
    base: np.ndarray
    rate: np.ndarray
    integer: list[bool]

    def render(self, now: float) -> bytes:
        values = (self.base + self.rate * now).tolist()
        out = []
        for segment, value, integer in zip(self.segments, values, self.integer, strict=False):
            out.append(segment)
            out.append(str(int(value)) if integer else repr(value))
        out.append(self.segments[-1])
        return "".join(out).encode()


def _kinds(text: str) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def _kind(kinds: dict[str, str], name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count", "_total", ""):
        if name.endswith(suffix) and name.removesuffix(suffix) in kinds:
            return kinds[name.removesuffix(suffix)]
    return kinds.get(name, "untyped")


def _uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def run_of(node: int) -> tuple[str, str, int]:
    """(run name, profile, position of the node in the run)."""
    index, position = divmod(node, NODES_PER_RUN)
    return f"run-{index:04d}", list(PROFILES)[index % len(PROFILES)], position


class ClusterTemplate:
    """Builds the N node bodies from one real scrape."""

    def __init__(self, scrape_text: str, started: float) -> None:
        self.lines = scrape_text.splitlines()
        self.kinds = _kinds(scrape_text)
        self.started = started
        self.uptime = _uptime()
        sums = [float(m.group("value")) for m in map(SAMPLE.match, self.lines)
                if m and m.group("name") == "stepscope_step_seconds_sum"]
        self.trained_seconds = statistics.fmean(sums)  # each rank's counters grew over this time
        cpus = [float(m.group("value")) for m in map(SAMPLE.match, self.lines)
                if m and m.group("name") == "stepscope_node_cpus"]
        self.cpus = cpus[0]
        self.dataloader_per_step_share = self._captured_share()

    def _captured_share(self) -> float:
        values = defaultdict(float)
        for match in map(SAMPLE.match, self.lines):
            if match and match.group("name") == "stepscope_step_phase_seconds_sum" \
                    and 'phase="dataloader_next"' in (match.group("labels") or ""):
                values["dataloader"] += float(match.group("value"))
            elif match and match.group("name") == "stepscope_step_seconds_sum":
                values["step"] += float(match.group("value"))
        return values["dataloader"] / values["step"]

    def node(self, node: int) -> NodeBody:
        run, profile, position = run_of(node)
        utilization, sm_active, tensor_active, dataloader_share = PROFILES[profile]
        gauges = {"stepscope_gpu_utilization_ratio": utilization, "stepscope_gpu_sm_active_ratio": sm_active,
                  "stepscope_gpu_tensor_active_ratio": tensor_active}
        segments, base, rate, integer = [], [], [], []
        pending = []
        for line in self.lines:
            match = SAMPLE.match(line)
            if not match:
                pending.append(line + "\n")
                continue
            name, labels, value = match.group("name"), match.group("labels") or "", float(match.group("value"))
            local_rank = None
            if f'run="{CAPTURE_RUN}"' in labels:
                local_rank = int(re.search(r'rank="(\d+)"', labels).group(1))
                labels = labels.replace(f'run="{CAPTURE_RUN}"', f'run="{run}"').replace(
                    f'rank="{local_rank}"', f'rank="{position * GPUS + local_rank}"')
            moving = self._movement(name, labels, value, local_rank, node, dataloader_share)
            if moving is None:
                value = gauges.get(name, value)
                pending.append(f"{name}{labels} {value!r}\n")
                continue
            pending.append(f"{name}{labels} ")
            segments.append("".join(pending))
            pending = ["\n"]
            base.append(moving[0])
            rate.append(moving[1])
            integer.append(value.is_integer() and name.endswith(("_bucket", "_count", "steps_total", "samples_total")))
        segments.append("".join(pending))
        return NodeBody(segments, np.array(base), np.array(rate), integer)

    def _movement(self, name: str, labels: str, value: float, local_rank: int | None, node: int,
                  dataloader_share: float | None) -> tuple[float, float] | None:
        """(value at `started`, per second) for a moving value; None for a static gauge."""
        if name.endswith("_timestamp_seconds") and "xid" not in name:
            return self.started, 1.0  # now
        if _kind(self.kinds, name) not in ("counter", "histogram"):
            return None
        if name.startswith(TRAINING_PREFIXES):
            factor = 1.0
            if name == "stepscope_step_phase_seconds_sum":
                if dataloader_share is not None and 'phase="dataloader_next"' in labels:
                    factor = dataloader_share / self.dataloader_per_step_share
                straggler = node % NODES_PER_RUN == 0 and local_rank == STRAGGLER_LOCAL_RANK
                if straggler and 'phase="forward"' in labels:
                    factor = STRAGGLER_FORWARD
            return value, value / self.trained_seconds * factor
        if name == "stepscope_node_cpu_seconds_total":
            mode = re.search(r'mode="(\w+)"', labels).group(1)
            return value, self.cpus * CPU_MODE_SHARES.get(mode, 0.0)
        return value, value / self.uptime


def serve_cluster(scrape_text: str, nodes: int, port: int, started: float) -> None:
    """The synthetic target (a process of its own): GET /metrics/<instance> -> that node's body."""
    template = ClusterTemplate(scrape_text, started)
    bodies = {instance_name(node): template.node(node) for node in range(nodes)}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                body = bodies.get(path.rsplit("/", 1)[-1])
                if body is None:
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                else:
                    payload = body.render(time.time() - started)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def instance_name(node: int) -> str:
    return f"node-{node:04d}"


# ---- Prometheus and its own metrics ----------------------------------------------------------------

@contextmanager
def running_cluster(scrape_text: str, nodes: int) -> Iterator[tuple[int, multiprocessing.Process]]:
    port = free_port()
    process = multiprocessing.Process(target=serve_cluster, args=(scrape_text, nodes, port, time.time()),
                                      daemon=True)
    process.start()
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                requests.get(f"http://127.0.0.1:{port}/metrics/{instance_name(0)}", timeout=5).raise_for_status()
                break
            except requests.RequestException:
                if time.monotonic() > deadline or not process.is_alive():
                    raise RuntimeError("the synthetic target did not start") from None
                time.sleep(0.5)
        yield port, process
    finally:
        process.terminate()
        process.join(10)


@contextmanager
def running_prometheus(workdir: Path, port: int, nodes: int, rule_files: Sequence[Path],
                       gogc: int | None = None) -> Iterator[tuple[str, int]]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("bench_scale: prometheus is not installed (apt-get install prometheus)")
    config = {
        "global": {"scrape_interval": f"{INTERVAL_SECONDS}s", "evaluation_interval": f"{INTERVAL_SECONDS}s",
                   "scrape_timeout": "10s"},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [scrape_job(port, nodes)],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    web = free_port()
    argv = [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{web}", "--log.level=warn"]
    with running(argv, f"http://127.0.0.1:{web}/-/ready", workdir / "prometheus.log", timeout=120,
                 base_url=f"http://127.0.0.1:{web}", env={"GOGC": str(gogc)} if gogc else None) as proc:
        yield proc.url, proc.process.pid


def scrape_job(port: int, nodes: int) -> dict:
    """The synthetic target's N nodes as one scrape job, in the format both engines read."""
    return {
        "job_name": "stepscope",
        "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {"instance": instance_name(node)}}
                           for node in range(nodes)],
        "relabel_configs": [{"source_labels": ["instance"], "target_label": "__metrics_path__",
                             "replacement": "/metrics/$1"}],
    }


@contextmanager
def running_victoria_pair(workdir: Path, port: int, nodes: int,
                          rule_files: Sequence[Path]) -> Iterator[WatchedVictoria]:
    """VictoriaMetrics scraping the nodes and vmalert evaluating `rule_files` against it, both every 15 s,
    with the settings the tests use (tests/support/victoria.py); yields them to be watched."""
    interval = f"{INTERVAL_SECONDS}s"
    job = {**scrape_job(port, nodes), "scrape_timeout": "10s"}  # Prometheus' global one above
    with running_victoria(workdir, [job], scrape_interval=interval) as victoria, \
            running_vmalert(workdir, victoria.url, rule_files, interval=interval) as vmalert:
        yield WatchedVictoria(victoria.url, vmalert.url, victoria.process.pid, vmalert.process.pid)


def self_metrics(url: str) -> dict[tuple[str, frozenset], float]:
    text = requests.get(f"{url}/metrics", timeout=30).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def by_group(metrics: dict[tuple[str, frozenset], float], name: str) -> dict[str, float]:
    return {dict(labels)["rule_group"].split(";", 1)[1]: value
            for (sample, labels), value in metrics.items() if sample == name}


def one(metrics: dict[tuple[str, frozenset], float], name: str) -> float:
    return next(value for (sample, _), value in metrics.items() if sample == name)


def instant(url: str, expr: str) -> list[dict]:
    body = requests.get(f"{url}/api/v1/query", params={"query": expr}, timeout=60).json()
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('error')}")
    return body["data"]["result"]


def machine_busy_seconds() -> float:
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system + times.children_user + times.children_system


# ---- one measurement -------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    rules: str  # which rule set: "shipped" or "baseline"
    nodes: int
    scrape_series: int
    head_series: float
    recorded_series: float
    rss_bytes: float
    prometheus_cores: float
    other_cores: float  # the machine's busy cores outside every Prometheus, the target and this script
    target_cores: float
    load: tuple[float, float]
    groups: dict[str, list[float]]  # group -> seconds of each evaluation seen
    missed: float
    failures: float
    costliest: list[tuple[str, str, float]]  # (group, rule, seconds) of the last evaluation
    findings: dict[str, str]
    commit: str = ""  # the checkout measured: short hash, "+changes" when the tree differed from it
    gogc: int = GO_DEFAULT_GOGC  # the GOGC the Prometheus servers ran with
    gc_cycles: float | None = None  # Go garbage collections in the measured window (None: not counted)
    engine: str = "prometheus"  # a key of ENGINES; prometheus_cores and rss_bytes are all its processes'
    rss_parts: dict[str, float] = dataclasses.field(default_factory=dict)  # process -> peak RSS
    cores_parts: dict[str, float] = dataclasses.field(default_factory=dict)  # process -> cores
    unwritten_rows: float | None = None  # rows of recordings and alerts vmalert could not write back

    def cycle_seconds(self) -> float:
        """Median evaluation seconds of all groups added up: the work of one evaluation cycle."""
        return sum(statistics.median(times) for times in self.groups.values())


@dataclasses.dataclass
class Watched:
    """One Prometheus during the measured window."""

    url: str
    pid: int
    before: dict[tuple[str, frozenset], float]
    cpu_before: float
    evaluations: dict[str, dict[float, float]] = dataclasses.field(default_factory=lambda: defaultdict(dict))
    peak_rss: float = 0.0

    def sample(self) -> None:
        metrics = self_metrics(self.url)
        last = by_group(metrics, "prometheus_rule_group_last_evaluation_timestamp_seconds")
        for group, duration in by_group(metrics, "prometheus_rule_group_last_duration_seconds").items():
            if last.get(group, 0) > 0:
                self.evaluations[group][last[group]] = duration
        self.peak_rss = max(self.peak_rss, one(metrics, "process_resident_memory_bytes"))

    @property
    def rules_url(self) -> str:
        return self.url

    def begin(self) -> None:
        """The start of the measured window: the counters and CPU time the window is measured from."""
        self.before, self.cpu_before = self_metrics(self.url), cpu_seconds(self.pid)

    def processes(self) -> dict[str, tuple[str, int]]:
        """Each process measured: its own /metrics and its pid."""
        return {"Prometheus": (self.url, self.pid)}

    def before_by_process(self) -> dict[str, dict[tuple[str, frozenset], float]]:
        return {"Prometheus": self.before}

    def cores(self, elapsed: float) -> dict[str, float]:
        return {"Prometheus": (cpu_seconds(self.pid) - self.cpu_before) / elapsed}

    def rss_parts(self) -> dict[str, float]:
        return {"Prometheus": self.peak_rss}

    def series(self, after: dict[str, dict[tuple[str, frozenset], float]]) -> float:
        return one(after["Prometheus"], "prometheus_tsdb_head_series")


@dataclasses.dataclass
class WatchedVictoria:
    """VictoriaMetrics and its vmalert during the measured window (the same methods as Watched)."""

    url: str  # VictoriaMetrics: it holds the data and answers the queries
    rules_url: str  # vmalert
    victoria_pid: int
    vmalert_pid: int
    before: dict[str, dict[tuple[str, frozenset], float]] = dataclasses.field(default_factory=dict)
    cpu_before: dict[str, float] = dataclasses.field(default_factory=dict)
    totals: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)  # group -> (count, sum)
    evaluations: dict[str, dict[float, float]] = dataclasses.field(default_factory=lambda: defaultdict(dict))
    peak_parts: dict[str, float] = dataclasses.field(default_factory=dict)
    peak_rss: float = 0.0  # of both processes together

    def processes(self) -> dict[str, tuple[str, int]]:
        return {"VictoriaMetrics": (self.url, self.victoria_pid), "vmalert": (self.rules_url, self.vmalert_pid)}

    def begin(self) -> None:
        self.before = {name: self_metrics(url) for name, (url, _) in self.processes().items()}
        self.cpu_before = {name: cpu_seconds(pid) for name, (_, pid) in self.processes().items()}
        self.totals = iteration_totals(self.before["vmalert"])

    def sample(self) -> None:
        """New evaluations since the last sample, each the step of the group's duration sum over the
        step of its count (vmalert 1.79 keeps no last duration per group)."""
        for group, (count, seconds) in iteration_totals(self_metrics(self.rules_url)).items():
            seen_count, seen_seconds = self.totals.get(group, (0.0, 0.0))
            for evaluation in range(int(seen_count) + 1, int(count) + 1):
                self.evaluations[group][evaluation] = (seconds - seen_seconds) / (count - seen_count)
            self.totals[group] = (count, seconds)
        rss = {name: psutil.Process(pid).memory_info().rss for name, (_, pid) in self.processes().items()}
        self.peak_parts = {name: max(self.peak_parts.get(name, 0.0), value) for name, value in rss.items()}
        self.peak_rss = max(self.peak_rss, sum(rss.values()))

    def before_by_process(self) -> dict[str, dict[tuple[str, frozenset], float]]:
        return self.before

    def cores(self, elapsed: float) -> dict[str, float]:
        return {name: (cpu_seconds(pid) - self.cpu_before[name]) / elapsed
                for name, (_, pid) in self.processes().items()}

    def rss_parts(self) -> dict[str, float]:
        return self.peak_parts

    def series(self, after: dict[str, dict[tuple[str, frozenset], float]]) -> float:
        """Series VictoriaMetrics stores (a fresh database: the scraped ones, the recordings, ALERTS)."""
        body = requests.get(f"{self.url}/api/v1/series/count", timeout=60).json()
        return float(body["data"][0])


def iteration_totals(metrics: dict[tuple[str, frozenset], float]) -> dict[str, tuple[float, float]]:
    """Group -> (evaluations, seconds spent in them) since vmalert started."""
    def per_group(name: str) -> dict[str, float]:
        return {dict(labels)["group"]: value for (sample, labels), value in metrics.items() if sample == name}
    seconds = per_group("vmalert_iteration_duration_seconds_sum")
    return {group: (count, seconds[group])
            for group, count in per_group("vmalert_iteration_duration_seconds_count").items()}


@contextmanager
def running_engine(engine: str, workdir: Path, port: int, nodes: int, rule_files: Sequence[Path],
                   gogc: int | None) -> Iterator[Watched | WatchedVictoria]:
    """The engine that scrapes the nodes and evaluates `rule_files`, ready to be watched."""
    if engine == "victoriametrics":
        with running_victoria_pair(workdir, port, nodes, rule_files) as watched:
            yield watched
        return
    with running_prometheus(workdir, port, nodes, rule_files, gogc) as (url, pid):
        yield Watched(url, pid, {}, 0.0)


def wait_until_scraped(url: str, nodes: int) -> None:
    deadline = time.monotonic() + 3 * INTERVAL_SECONDS + 120
    while time.monotonic() < deadline:
        up = instant(url, 'count(up{job="stepscope"} == 1)')
        if up and int(float(up[0]["value"][1])) == nodes:
            return
        time.sleep(5)
    raise RuntimeError(f"not every target of {url} is up")


def measure(scrape_text: str, nodes: int, rule_sets: dict[str, list[Path]], warmup: float,
            window: float, gogc: int | None, engine: str = "prometheus") -> list[Result]:
    """Every rule set in an engine of its own, side by side, scraping the same synthetic nodes."""
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        port, target = stack.enter_context(running_cluster(scrape_text, nodes))
        watched = {}
        for label, files in rule_sets.items():
            (Path(tmp) / label).mkdir()
            watched[label] = stack.enter_context(running_engine(engine, Path(tmp) / label, port, nodes, files, gogc))
        for server in watched.values():
            wait_until_scraped(server.url, nodes)
        print(f"  {nodes} nodes up; warming up {warmup:.0f} s", flush=True)
        time.sleep(warmup)
        for server in watched.values():
            server.begin()
        machine_before, target_before = machine_busy_seconds(), cpu_seconds(target.pid)
        own_before = cpu_seconds(os.getpid())
        started = time.monotonic()
        while time.monotonic() - started < window:
            for server in watched.values():
                server.sample()
            time.sleep(3)
        elapsed = time.monotonic() - started
        cores = {label: w.cores(elapsed) for label, w in watched.items()}
        target_cores = (cpu_seconds(target.pid) - target_before) / elapsed
        other = (machine_busy_seconds() - machine_before - (cpu_seconds(os.getpid()) - own_before)) / elapsed \
            - target_cores - sum(sum(parts.values()) for parts in cores.values())
        return [result(label, nodes, scrape_text, w, cores[label], other, target_cores, gogc, engine)
                for label, w in watched.items()]


def result(label: str, nodes: int, scrape_text: str, watched: Watched | WatchedVictoria, cores: dict[str, float],
           other: float, target_cores: float, gogc: int | None, engine: str = "prometheus") -> Result:
    url, kind = watched.url, ENGINES[engine]
    after = {name: self_metrics(metrics_url) for name, (metrics_url, _) in watched.processes().items()}
    before = watched.before_by_process()

    def delta(name: str) -> float:
        """A counter's growth in the window, added up over the engine's processes."""
        return sum(sum(v for (s, _), v in after[process].items() if s == name)
                   - sum(v for (s, _), v in before[process].items() if s == name) for process in after)

    if engine == "victoriametrics":
        own = [(group["name"], name, seconds) for group in settled_vmalert_groups(watched.rules_url)
               for name, seconds in vmalert_own_seconds(group["rules"])]
    else:
        own = [(group["name"], rule.get("name", ""), rule["evaluationTime"])
               for group in requests.get(f"{url}/api/v1/rules", timeout=120).json()["data"]["groups"]
               for rule in group["rules"]]
    costliest = sorted(own, key=lambda r: -r[2])[:12]
    return Result(
        rules=label, nodes=nodes,
        scrape_series=sum(1 for line in scrape_text.splitlines() if line and not line.startswith("#")),
        head_series=watched.series(after),
        recorded_series=float(instant(url, 'count({__name__=~".+:.+"})')[0]["value"][1]),
        rss_bytes=watched.peak_rss, prometheus_cores=sum(cores.values()), other_cores=other,
        target_cores=target_cores, load=os.getloadavg()[:2],
        groups={group: sorted(times.values()) for group, times in watched.evaluations.items()},
        missed=delta(kind.missed), failures=delta(kind.failures),
        gc_cycles=delta("go_gc_duration_seconds_count"),
        costliest=costliest, findings=findings(url), commit=checkout(), gogc=gogc or kind.default_gogc,
        engine=engine, rss_parts=watched.rss_parts(), cores_parts=cores,
        unwritten_rows=delta("vmalert_remotewrite_errors_total") + delta("vmalert_remotewrite_dropped_rows_total")
        if engine == "victoriametrics" else None,
    )


def settled_vmalert_groups(url: str, tries: int = 20) -> list[dict]:
    """vmalert's groups, read when no group is halfway through an evaluation (all its recording rules
    from one evaluation), so that vmalert_own_seconds compares marks of the same evaluation."""
    for _ in range(tries):
        groups = requests.get(f"{url}/api/v1/rules", timeout=120).json()["data"]["groups"]
        if all(len({r["lastEvaluation"] for r in g["rules"] if r["type"] == "recording"}) <= 1 for g in groups):
            return groups
        time.sleep(0.5)
    raise RuntimeError(f"{url}: a group was always halfway through an evaluation")


def vmalert_own_seconds(rules: list[dict]) -> list[tuple[str, float]]:
    """Each rule's own seconds in its group's last evaluation. vmalert 1.79 reports a recording rule's
    evaluationTime as the time since the evaluation began (recording.go: time.Since(ts)), an alerting
    rule's as its own; a group runs its rules one after another in file order (concurrency 1), so a
    recording rule's own time is its mark minus where the rule before it ended (an alerting rule's
    sending, not in its own time, is counted in the next recording rule's). The marks count from the
    evaluation's timestamp, which runs ahead of the group's ticker by the group's first evaluation (at
    start-up, on a still empty database): a group's first recording rule carries that too."""
    ended, own = 0.0, []
    for rule in rules:
        seconds = rule["evaluationTime"] if rule["type"] == "alerting" else rule["evaluationTime"] - ended
        ended += seconds
        own.append((rule.get("name", ""), seconds))
    return own


def checkout() -> str:
    """Which rules a row measured: the commit, marked when the working tree had changes (other than
    the results this script writes, which an earlier size of the same run has already changed)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "?"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", f":!{display(RESULTS.parent)}")
    return head + ("+changes" if changed else "")


def findings(url: str) -> dict[str, str]:
    """What the rules computed at this scale: they must still be right, not only fast."""
    def count(expr: str) -> str:
        found = instant(url, f"count({expr})")
        return str(int(float(found[0]["value"][1]))) if found else "0"

    def counts(expr: str, label: str) -> str:
        return ", ".join(f"{item['metric'][label]}: {int(float(item['value'][1]))}"
                         for item in sorted(instant(url, f"count by ({label}) ({expr})"),
                                            key=lambda item: item["metric"][label]))
    keep, drop = shard_write_filter()
    computed_globally = [rule["record"] for rule in rules((RUN_RULES,)) if "record" in rule]
    not_sent = "|".join([*computed_globally, *([drop] if drop else [])])
    return {
        "series a shard would send the global layer, per node": str(round(
            float(count(f'{{__name__=~"{keep}"}} unless {{__name__=~"{not_sent}"}}'))
            / len(instant(url, 'up{job="stepscope"}')))),
        "runs by verdict": counts("run:stepscope_bottleneck:verdict", "verdict"),
        "ranks with a mean step time": count("run_rank:stepscope_step_seconds:mean_rate1m"),
        "runs with a run p95": count("run:stepscope_step_seconds:p95_rate1m"),
        "alerts pending or firing": counts('ALERTS{alertname=~"Stepscope.*"}', "alertname"),
        f"straggler alerts on local rank {STRAGGLER_LOCAL_RANK} of a run's first node": count(
            f'ALERTS{{alertname="StepscopeStragglerRank",rank="{STRAGGLER_LOCAL_RANK}"}}'),
    }


# ---- report ----------------------------------------------------------------------------------------

def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def parts(total: str, values: dict[str, float], unit: str) -> str:
    """A total, and what each process took of it where there are several (VictoriaMetrics + vmalert)."""
    if len(values) < 2:
        return total
    return f"{total} ({', '.join(f'{name} {value:.2f}{unit}' for name, value in values.items())})"


def report(results: list[Result], rule_sets: dict[str, list[Path]], warmup: float, window: float) -> str:
    sizes = sorted({r.nodes for r in results})
    kind = ENGINES[results[0].engine]
    victoria = results[0].engine == "victoriametrics"
    summary = table(
        ["nodes", "rules", "GOGC", "commit", "series per node scrape",
         "stored series" if victoria else "head series", "recorded series",
         f"{kind.server} RSS (peak)", f"{kind.server} CPU (cores)", "slowest group: worst evaluation",
         "all groups, one cycle (sum of medians)", "missed iterations", "rule failures", "GC cycles",
         "target CPU (cores)",
         "other load (cores)"],
        [[str(r.nodes), r.rules, str(r.gogc), r.commit or "?", str(r.scrape_series), f"{r.head_series / 1000:.0f}k",
          f"{r.recorded_series / 1000:.1f}k",
          parts(f"{r.rss_bytes / 2**30:.2f} GiB", {k: v / 2**30 for k, v in r.rss_parts.items()}, " GiB"),
          parts(f"{r.prometheus_cores:.2f}", r.cores_parts, ""),
          "{} {:.2f} s".format(*max(((g, max(v)) for g, v in r.groups.items()), key=lambda gv: gv[1])),
          f"{r.cycle_seconds():.2f} s", f"{r.missed:.0f}",
          f"{r.failures:.0f}" + ("" if r.unwritten_rows is None else f" (+{r.unwritten_rows:.0f} rows not written)"),
          "-" if r.gc_cycles is None else f"{r.gc_cycles:.0f}", f"{r.target_cores:.2f}",
          f"{r.other_cores:.2f}"]
         for r in results])
    sections = [
        f"# Scale: {kind.title} with the stepscope rules",
        "",
        f"{engine_version(results[0].engine)}, scrape and evaluation every {INTERVAL_SECONDS} s; "
        f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; warm-up {warmup:.0f} s, "
        f"measured {window:.0f} s per size. Rules: "
        + "; ".join(f"{label} = {', '.join(display(path) for path in files)}" for label, files in rule_sets.items())
        + (f" (each in a {kind.server} of its own, side by side, scraping the same nodes)"
           if len(rule_sets) > 1 else "")
        + ". Load average after "
        "each size: " + "; ".join(f"{r.nodes}: {r.load[0]:.2f}/{r.load[1]:.2f}" for r in results
                                   if r.rules == next(iter(rule_sets))) + ".",
        "",
        summary,
    ]
    for label in rule_sets:
        ours = [r for r in results if r.rules == label]
        groups = sorted({group for r in ours for group in r.groups})
        sections += ["", f"## Evaluation time per rule group: {label}", "", table(
            ["group", *(f"{size_name(r, ours)}: median / worst s (evaluations)" for r in ours)],
            [[group, *(f"{statistics.median(r.groups[group]):.3f} / {max(r.groups[group]):.3f} "
                       f"({len(r.groups[group])})" if r.groups.get(group) else "-" for r in ours)]
             for group in groups])]
        largest = ours[-1]
        sections += ["", f"## Costliest rules at {size_name(largest, ours)}: {label}", "", table(
            ["group", "rule", "seconds (last evaluation)"],
            [[group, f"`{rule}`", f"{seconds:.3f}"] for group, rule, seconds in largest.costliest])]
    sections += ["", "## What the rules found", "",
                 table(["nodes", "rules", *results[0].findings],
                       [[str(r.nodes), r.rules + (f", GOGC {r.gogc}" if len({x.gogc for x in results}) > 1 else ""),
                         *r.findings.values()] for r in results]),
                 "",
                 f"Sizes: {', '.join(map(str, sizes))} nodes. Runs of {NODES_PER_RUN} nodes "
                 f"({NODES_PER_RUN * GPUS} ranks), profiles in turn: {', '.join(PROFILES)}; the straggler "
                 "alert waits 10 minutes (`for`), so it shows as pending. Other load is the machine's busy "
                 f"CPU minus the {kind.server} servers, the target and this script: other work on the machine "
                 "slows evaluation, so read wall times with it, and compare rule sets within a size.",
                 ""]
    if victoria:
        sections[-1:-1] = [
            "", "VictoriaMetrics and vmalert run with the tests' settings (tests/support/victoria.py; "
            "docs/engines.md). vmalert 1.79 keeps no last duration per group: each evaluation is a step of "
            "`vmalert_iteration_duration_seconds_count` and the step of its `_sum`; missed iterations are "
            "`vmalert_iteration_missed_total` (vmalert adds 1 however many a late tick skipped), rule failures "
            "`vmalert_execution_errors_total`, rows not written the recordings and alerts vmalert could not "
            "queue (`vmalert_remotewrite_errors_total`, queue full) or send "
            "(`vmalert_remotewrite_dropped_rows_total`), GC cycles both processes', stored series "
            "VictoriaMetrics' /api/v1/series/count (a fresh database: scraped, recorded, ALERTS), RSS and CPU "
            "from /proc for each process. Costliest rules: vmalert 1.79's /api/v1/rules `evaluationTime` is "
            "an alerting rule's own time but a recording rule's time since the group's evaluation began, so "
            "a recording rule's own time is its mark minus the end of the rule before it (the rules of a group "
            "run in file order); a group's first recording rule also carries the group's start offset (its "
            "first evaluation, at start-up on an empty database)."]
    return "\n".join(sections)


def size_name(result: Result, results: list[Result]) -> str:
    """A row's size, with its GOGC where rows of the same size differ in it."""
    same_size = {r.gogc for r in results if r.nodes == result.nodes}
    return f"{result.nodes} nodes" + (f", GOGC {result.gogc}" if len(same_size) > 1 else "")


def load_results(path: Path) -> list[Result]:
    """The results an earlier run kept (--append); none when there is no such file."""
    if not path.is_file():
        return []
    try:
        return [Result(**{**item, "load": tuple(item["load"]),
                          "costliest": [tuple(row) for row in item["costliest"]]})
                for item in json.loads(path.read_text())]
    except (ValueError, TypeError, KeyError) as error:
        raise SystemExit(f"bench_scale: {path} does not hold results of this script: {error}") from None


def display(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else str(path)


def prometheus_version() -> str:
    out = subprocess.run(["prometheus", "--version"], capture_output=True, text=True).stdout
    return out.split()[2] if out else "?"


def engine_version(engine: str) -> str:
    """The engine and its version, as the report's first line names it (Debian's VictoriaMetrics
    binaries print no version of their own; the package has it)."""
    if engine == "prometheus":
        return f"Prometheus {prometheus_version()}"
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "victoria-metrics"], capture_output=True, text=True)
    return f"VictoriaMetrics and vmalert {out.stdout.strip() or '?'} (Debian's victoria-metrics)"


def check_engine(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The engine's binaries are installed, and the options asked for apply to it."""
    binaries = ["prometheus"] if args.engine == "prometheus" else ["victoria-metrics", "vmalert"]
    missing = [name for name in binaries if shutil.which(name) is None]
    if missing:
        parser.error(f"--engine {args.engine}: {', '.join(missing)} not installed "
                     f"(apt-get install {'prometheus' if args.engine == 'prometheus' else 'victoria-metrics'})")
    if args.engine == "victoriametrics" and args.gogc is not None:
        parser.error(f"--gogc: Prometheus only; VictoriaMetrics and vmalert set their own ({VICTORIA_GOGC})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,250,500,1000",
                        help="comma-separated cluster sizes (empty with --append: re-render the kept results)")
    parser.add_argument("--warmup", type=float, default=150, help="seconds after every target is up")
    parser.add_argument("--measure", type=float, default=180, help="seconds of measured evaluations")
    parser.add_argument("--rules", type=Path, nargs="+", default=list(RULE_FILES), help="rule files to load")
    parser.add_argument("--baseline", type=Path, nargs="+", default=[],
                        help="rule files for a second Prometheus side by side, e.g. the rules before a change: "
                             "git show REV:grafana/rules/stepscope.rules.yml > before.yml")
    parser.add_argument("--engine", choices=list(ENGINES), default="prometheus",
                        help="what scrapes and evaluates the rules: Prometheus, or VictoriaMetrics + vmalert")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"markdown file to write (default: {display(RESULTS)}, or "
                             f"{display(ENGINES['victoriametrics'].results)} for --engine victoriametrics)")
    parser.add_argument("--gogc", type=int, default=None,
                        help=f"GOGC of the Prometheus servers (default: not set, Go's {GO_DEFAULT_GOGC}; "
                             "Prometheus 2.53+ default to 75)")
    parser.add_argument("--append", action="store_true",
                        help="add these sizes to the results kept next to --out (OUT.json) from earlier runs, "
                             "so that sizes can be measured one at a time on a shared machine")
    args = parser.parse_args(argv)
    try:
        sizes = [int(n) for n in args.nodes.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--nodes: not a comma-separated list of integers: {args.nodes!r}")
    if any(n < 1 for n in sizes):
        parser.error("--nodes: sizes must be positive")
    if args.gogc is not None and args.gogc < 1:
        parser.error("--gogc: must be a positive percentage")
    if not sizes and not args.append:
        parser.error("--nodes: no sizes (an empty list only re-renders the kept results, with --append)")
    check_engine(parser, args)
    args.out = args.out or ENGINES[args.engine].results
    for path in [*args.rules, *args.baseline]:
        if not path.is_file():
            parser.error(f"{path} does not exist")
    rule_sets = {"shipped": [p.resolve() for p in args.rules]}
    if args.baseline:
        rule_sets["baseline"] = [p.resolve() for p in args.baseline]
    kept = args.out.with_suffix(".json")
    results = load_results(kept) if args.append else []
    if any(r.engine != args.engine for r in results):
        parser.error(f"--append: {kept} holds results of another engine than {args.engine}; choose another --out")
    if not sizes:
        if not results:
            parser.error(f"--append: no kept results in {kept} to render")
        args.out.write_text(report(results, rule_sets, args.warmup, args.measure))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        scrape_text = capture_node_scrape(Path(tmp), run=CAPTURE_RUN, world_size=GPUS * NODES_PER_RUN)
    for nodes in sizes:
        print(f"measuring {nodes} nodes", flush=True)
        results = [r for r in results if (r.nodes, r.gogc) != (nodes, args.gogc or ENGINES[args.engine].default_gogc)]
        results += measure(scrape_text, nodes, rule_sets, args.warmup, args.measure, args.gogc, args.engine)
        results.sort(key=lambda r: (r.nodes, r.gogc))
        text = report(results, rule_sets, args.warmup, args.measure)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        kept.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

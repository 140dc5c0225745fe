"""A real alerting path for tests and benchmarks: exporters (fake NVML), training-hook processes, a
real Prometheus with the generated rules (every `for` a sixtieth, so minutes become seconds and the
alerts keep their order), a real Alertmanager (Debian's prometheus-alertmanager) with a given config
whose receivers point at a webhook server run here.

Runs (RANKS): `databound` (its loader holds the step; its GPU waits), `gpubound` (busy GPU, quick
loader), `stalled` (three steps, then hangs in dataloader_next: critical) on node-a, and `spread`,
data-bound with rank 0 on node-a and rank 1 on node-b.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import requests
import yaml

from grafana.rules import RULE_FILES
from stepscope.contract import THRESHOLDS
from stepscope.contract.recordings import SHARD_RUN_STALLED
from stepscope_testkit.fake_nvml.scenario import write_scenario
from stepscope_testkit.loopback import LoopbackServer, serving
from stepscope_testkit.processes import REPO_ROOT, free_port, running, running_exporter
from tests.support.demos import gpus_for_runs
from tests.support.prometheus import running_prometheus_config

DOCKER = REPO_ROOT / "docker"
ALERTMANAGER_DIR = DOCKER / "alertmanager"
SHIPPED_PROMETHEUS = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
TRAINER = """
import sys, time, stepscope.hooks as th
run, rank, world, url, loader_s, compute_s = sys.argv[1:7]
tracker = th.init(run=run, rank=int(rank), world_size=int(world), push_url=url, push_interval=0.5)
if float(loader_s) < 0:  # stalled: steps, then hangs fetching a batch, alive and pushing in state train
    with tracker.state("train"):
        for _ in range(3):
            tracker.step(samples=8)
        with tracker.phase("dataloader_next"):
            time.sleep(3600)
def batches():
    while True:
        time.sleep(float(loader_s))
        yield 8
for batch in tracker.loader(batches()):
    with tracker.phase("forward"):
        time.sleep(float(compute_s))
    tracker.step(samples=batch)
"""
# (run, rank) -> (node, loader seconds, compute seconds); loader < 0: stalled after three steps
RANKS = {
    ("databound", 0): ("node-a", 0.06, 0.01),
    ("gpubound", 0): ("node-a", 0.0, 0.05),
    ("stalled", 0): ("node-a", -1, 0),
    ("spread", 0): ("node-a", 0.06, 0.01),
    ("spread", 1): ("node-b", 0.06, 0.01),
}
# node -> GPU index -> (NVML utilization %, SM active %, the (run, rank) holding memory on it)
GPUS = {
    "node-a": {0: (25, 10, ("databound", 0)), 1: (98, 73, ("gpubound", 0)), 2: (0, 0, ("stalled", 0)),
               3: (25, 10, ("spread", 0))},
    "node-b": {0: (25, 10, ("spread", 1))},
}


def seconds(duration: str) -> int:
    return int(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


@dataclass
class Notification:
    """One POST Alertmanager made: which receiver, when, and its JSON body."""
    path: str
    at: float  # time.monotonic()
    wall: float  # time.time(), to compare with Prometheus' timestamps
    body: dict


@dataclass
class Inbox:
    """What the webhook server received, in order."""
    received: list[Notification] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, path: str, body: dict) -> None:
        with self.lock:
            self.received.append(Notification(path, time.monotonic(), time.time(), body))

    def webhooks(self, run: str, status: str | None = None, path: str = "/webhook") -> list[Notification]:
        """Notifications of the webhook receiver (`/page`: the pager's) for `run`'s groups (any status unless
        given)."""
        with self.lock:
            return [n for n in self.received if n.path == path
                    and n.body["commonLabels"].get("run") == run and status in (None, n.body["status"])]

    def slack(self, run: str) -> list[dict]:
        with self.lock:
            return [n.body for n in self.received if n.path == "/slack" and f"run {run}" in json.dumps(n.body)]


@contextmanager
def webhook_server() -> Iterator[tuple[str, Inbox]]:
    """An HTTP server on a free loopback port recording every POST: (its URL, the inbox)."""
    inbox = Inbox()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers["Content-Length"])
            inbox.add(self.path, json.loads(self.rfile.read(length)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with serving(LoopbackServer(Handler)) as server:
        yield server.url, inbox


def alertmanager_binary() -> str:
    found = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if found is None:
        raise RuntimeError("Alertmanager is not installed (apt-get install prometheus-alertmanager)")
    return found


def example_receivers() -> list[dict]:
    return yaml.safe_load((ALERTMANAGER_DIR / "receivers.example.yml").read_text())["receivers"]


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["amtool", *args], capture_output=True, text=True)


def receivers(url: str) -> list[dict]:
    """The shipped example receivers' Slack and webhook configs as `default`, pointed at `url`, and a webhook
    to `url`/page as the pager `page`."""
    examples = {r["name"]: r for r in example_receivers()}
    slack = {**examples["default"]["slack_configs"][0], "api_url": f"{url}/slack"}
    hook = {**examples["webhook"]["webhook_configs"][0], "url": f"{url}/webhook"}
    pager = {**hook, "url": f"{url}/page"}
    return [{"name": "default", "slack_configs": [slack], "webhook_configs": [hook]},
            {"name": "page", "webhook_configs": [pager]}]


def alertmanager_config(tmp: Path, url: str, config: dict, group_wait: float, group_interval: float) -> Path:
    """`config` (an alertmanager.yml) with `url`'s receivers as `default` and `page` and the given group
    timings, next to the shipped templates."""
    ours = receivers(url)
    names = {r["name"] for r in ours}
    config = {**config, "receivers": ours + [r for r in config["receivers"] if r["name"] not in names]}
    config["route"] = {**config["route"], "group_wait": f"{group_wait}s", "group_interval": f"{group_interval}s"}
    directory = tmp / "alertmanager"
    shutil.copytree(ALERTMANAGER_DIR / "templates", directory / "templates")
    (directory / "alertmanager.yml").write_text(yaml.safe_dump(config))
    return directory / "alertmanager.yml"


@contextmanager
def running_alertmanager(tmp: Path, config_file: Path) -> Iterator[str]:
    """A real Alertmanager (no cluster) on a free loopback port: its URL."""
    port = free_port()
    argv = [alertmanager_binary(), f"--config.file={config_file}", f"--storage.path={tmp / 'alertmanager-data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
            f"--web.external-url=http://alertmanager.example:{port}"]
    base = f"http://127.0.0.1:{port}"
    with running(argv, f"{base}/-/ready", tmp / "alertmanager.log", base_url=base):
        yield base


STALL_SECONDS = int(THRESHOLDS["stall_seconds"].value)
# longer than a push (0.5 s) and a scrape (1 s) apart, and than a busy 2-core machine starves a demo: at 5 s, a
# clean-clone run on a slower machine paged StepscopeTrainingStalled for the steadily training gpubound and
# spread runs; the 60 s floor as `for` shrinks
STALL_SECONDS_HERE = 15


def shorter_for(tmp: Path) -> list[Path]:
    """The generated rule files with every alert's `for` a sixtieth (10m -> 10s): same order, seconds.
    The stall alert's floor (its `for`, in effect) shrinks to STALL_SECONDS_HERE."""
    paths = []
    for source in RULE_FILES:
        document = yaml.safe_load(source.read_text())
        for group in document["groups"]:
            for rule in group["rules"]:
                if "for" in rule:
                    rule["for"] = f"{seconds(rule['for']) // 60}s"
                if rule.get("record") == SHARD_RUN_STALLED:  # StepscopeTrainingStalled's expression
                    shipped = rule["expr"]
                    clamp = re.compile(rf",\s*{STALL_SECONDS}\)")  # clamp_min's floor, on its own line or not
                    floor = f"{STALL_SECONDS} + 0 *"
                    assert len(clamp.findall(shipped)) == shipped.count(floor) == 1, f"the stall floor moved: {shipped}"
                    shorter = clamp.sub(f", {STALL_SECONDS_HERE})", shipped)
                    rule["expr"] = shorter.replace(floor, f"{STALL_SECONDS_HERE} + 0 *")
        paths.append(tmp / source.name)
        paths[-1].write_text(yaml.safe_dump(document))
    return paths


def prometheus_config(tmp: Path, exporters: dict[str, str], alertmanager: str, grafana_url: str) -> dict:
    """Scrapes and evaluates every second, alerts to `alertmanager`, with the shipped prometheus.yml's
    alert relabelling and grafana_url external label (set to `grafana_url`)."""
    external = {**SHIPPED_PROMETHEUS["global"]["external_labels"], "grafana_url": grafana_url}
    alerting = {"alert_relabel_configs": SHIPPED_PROMETHEUS["alerting"]["alert_relabel_configs"],
                "alertmanagers": [{"static_configs": [{"targets": [alertmanager.removeprefix("http://")]}]}]}
    targets = [{"targets": [address], "labels": {"instance": node}} for node, address in exporters.items()]
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "external_labels": external},
        "rule_files": [str(path) for path in shorter_for(tmp)],
        "alerting": alerting,
        "scrape_configs": [{"job_name": "stepscope", "static_configs": targets}],
    }


def start_trainer(run: str, rank: int, url: str, loader: float, compute: float,
                  world: int | None = None) -> subprocess.Popen:
    """One rank of `run` (its world size from RANKS unless given) pushing to `url` every 0.5 s."""
    world = world or sum(1 for other, _ in RANKS if other == run)
    argv = [sys.executable, "-c", textwrap.dedent(TRAINER), run, str(rank), str(world), url, str(loader), str(compute)]
    return subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


@dataclass
class TrainingStack:
    prometheus: str
    trainers: dict[tuple[str, int], subprocess.Popen]
    restart_exporter: Callable[[str, float], None]  # (node, seconds down): stop it, wait, start it on its port
    push_urls: dict[str, str]  # node -> its exporter's URL


@contextmanager
def running_training_stack(tmp: Path, alertmanager: str, grafana_url: str) -> Iterator[TrainingStack]:
    """Two exporters, Prometheus alerting to `alertmanager`, and the RANKS training on GPUS."""
    # the GPUs from the start (the fake's device count is read once), their processes once the trainers run
    scenarios = {node: write_scenario(tmp / f"{node}.json", gpus_for_runs(layout, {})) for node, layout in GPUS.items()}
    ports = {node: free_port() for node in GPUS}
    with ExitStack() as stack:
        exporters = {node: stack.enter_context(ExitStack()) for node in GPUS}  # one each, to restart it alone

        def start_exporter(node: str) -> None:
            exporters[node].enter_context(running_exporter(tmp, fake_nvml_scenario=scenarios[node], port=ports[node]))

        def restart_exporter(node: str, seconds_down: float) -> None:
            exporters[node].close()
            time.sleep(seconds_down)
            start_exporter(node)

        for node in GPUS:
            start_exporter(node)
        targets = {node: f"127.0.0.1:{port}" for node, port in ports.items()}
        prometheus = stack.enter_context(
            running_prometheus_config(tmp, prometheus_config(tmp, targets, alertmanager, grafana_url)))
        trainers = {key: start_trainer(*key, f"http://{targets[node]}", loader, compute)
                    for key, (node, loader, compute) in RANKS.items()}
        try:
            pids = {key: proc.pid for key, proc in trainers.items()}
            for node, layout in GPUS.items():  # now the trainers hold memory on their GPUs
                write_scenario(scenarios[node], gpus_for_runs(layout, pids))
            yield TrainingStack(prometheus.url, trainers, restart_exporter,
                                {node: f"http://{target}" for node, target in targets.items()})
        finally:
            for proc in trainers.values():
                proc.kill()
                proc.wait()


def firing_in_prometheus(base_url: str, name: str, run: str) -> list[dict]:
    response = requests.get(f"{base_url}/api/v1/alerts", timeout=10)
    response.raise_for_status()
    return [a for a in response.json()["data"]["alerts"]
            if a["labels"]["alertname"] == name and a["labels"].get("run") == run and a["state"] == "firing"]

"""Recorded exporter scrapes served again, at their recorded pace, to a real Prometheus.

A recording (`benchmarks/corpus/<name>/`, made on a real GPU) holds one `/metrics` body per scrape for
each workload, with the time it was taken, and the truth each training loop measured. Served back,
the same bodies reach the shipped rules as they reached them on the GPU machine: the verdicts and
alerts the rules conclude from real NVML/GPM readings can be checked on a machine without a GPU.

Each workload is a target of its own (`/<workload>/metrics`, instance = the workload), all served
from one loopback server and replayed side by side from the moment the server starts: body i is
served from its recorded offset until body i+1's, and the last one after the recording ends.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from bisect import bisect_right
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from stepscope_testkit.loopback import LoopbackServer, serving

CORPUS_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "corpus"
EXPOSITION = "text/plain; version=0.0.4; charset=utf-8"
# Samples that hold a Unix time (Prometheus' `_timestamp_seconds` convention): moved to the replay's
# clock, or every "last success" of the recording would read as a day old.
TIMESTAMP_SAMPLE = re.compile(r"^(\w+_timestamp_seconds(?:\{[^}]*\})?) (\S+)$", re.MULTILINE)


@dataclass(frozen=True)
class Workload:
    """One workload of a recording: its scrapes in time order and what its training loop measured."""

    name: str
    offsets: tuple[float, ...]  # seconds from the workload's first scrape
    bodies: tuple[str, ...]
    truth: dict
    started: float  # Unix time of the first scrape

    @property
    def run(self) -> str:
        return self.truth["run"]

    @property
    def expected_verdict(self) -> str:
        return self.truth["expected_verdict"]

    @property
    def duration(self) -> float:
        return self.offsets[-1]

    def body_at(self, elapsed: float, now: float) -> str:
        """The body that was current `elapsed` seconds after the workload's first scrape, its Unix
        times moved by as much as the replay's clock (`now`) is ahead of the recording's."""
        body = self.bodies[max(0, bisect_right(self.offsets, elapsed) - 1)]
        shift = now - elapsed - self.started
        return TIMESTAMP_SAMPLE.sub(lambda m: f"{m.group(1)} {float(m.group(2)) + shift:.3f}", body)

    def training_offsets(self) -> tuple[float, float]:
        """Offsets of the first and last scrape with the run in state train."""
        marker = f'stepscope_training_state{{rank="0",run="{self.run}",state="train"}} 1.0'
        training = [offset for offset, body in zip(self.offsets, self.bodies, strict=True) if marker in body]
        return training[0], training[-1]


def named_samples(body: str, names: Collection[str]) -> list[Sample]:
    """The samples of one recorded scrape whose names are in `names`, read by prometheus_client's parser
    from their own lines and their families' comments only: on a whole H100 scrape it takes ~1 ms, and
    the corpus checks read every scrape of every workload (the bulk of their CPU)."""
    kept = []
    for line in body.splitlines():
        if line.startswith("#"):
            fields = line.split(None, 3)  # '# TYPE family type': a histogram's family names its _bucket
            if len(fields) > 2 and any(name.startswith(fields[2]) for name in names):
                kept.append(line)
        elif line.partition("{")[0].partition(" ")[0] in names:
            kept.append(line)
    return [sample for family in text_string_to_metric_families("\n".join(kept) + "\n")
            for sample in family.samples if sample.name in names]


@dataclass(frozen=True)
class Recording:
    name: str
    device: str
    workloads: dict[str, Workload]


def recordings(corpus_dir: Path = CORPUS_DIR) -> list[Recording]:
    """Every recording under `corpus_dir`, by name."""
    return [load(path) for path in sorted(corpus_dir.iterdir()) if (path / "truth.json").is_file()]


def load(path: Path) -> Recording:
    """A recording folder: `scrapes.jsonl.gz` ({"workload", "t", "body"} per line) and `truth.json`."""
    truth = json.loads((path / "truth.json").read_text())
    scrapes: dict[str, list[tuple[float, str]]] = {}
    with gzip.open(path / "scrapes.jsonl.gz", "rt") as lines:
        for line in lines:
            row = json.loads(line)
            scrapes.setdefault(row["workload"], []).append((row["t"], row["body"]))
    workloads = {}
    for name, rows in scrapes.items():
        rows.sort()
        start = rows[0][0]
        workloads[name] = Workload(name, tuple(t - start for t, _ in rows), tuple(b for _, b in rows),
                                   truth["workloads"][name], start)
    return Recording(path.name, truth.get("device", ""), workloads)


class _Handler(BaseHTTPRequestHandler):
    server: _ReplayServer

    def do_GET(self) -> None:
        name, _, rest = self.path.strip("/").partition("/")
        workload = self.server.workloads.get(name)
        if workload is None or rest != "metrics":
            self.send_error(404, "unknown workload")
            return
        body = workload.body_at(time.monotonic() - self.server.started, time.time()).encode()
        self.send_response(200)
        self.send_header("Content-Type", EXPOSITION)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: Prometheus scrapes every second."""


class _ReplayServer(LoopbackServer):
    def __init__(self, workloads: dict[str, Workload]) -> None:
        super().__init__(_Handler)
        self.workloads = workloads
        self.started = time.monotonic()


@dataclass(frozen=True)
class Replay:
    address: str  # host:port
    started: float  # time.monotonic() at offset 0
    workloads: dict[str, Workload]

    def targets(self) -> list[dict]:
        """Prometheus static_configs: one target per workload, instance = the workload's name."""
        return [{"targets": [self.address], "labels": {"instance": name, "__metrics_path__": f"/{name}/metrics"}}
                for name in self.workloads]

    def elapsed(self) -> float:
        return time.monotonic() - self.started


@contextmanager
def replaying(workloads: dict[str, Workload]) -> Iterator[Replay]:
    """Serves every workload from now on, until the block ends."""
    with serving(_ReplayServer(workloads)) as server:
        host, port = server.server_address[:2]
        yield Replay(f"{host}:{port}", server.started, workloads)

"""A real VictoriaMetrics single-node server and a real vmalert (Debian's `victoria-metrics` package)
on free loopback ports: the second engine the shipped rules are proven on (docs/engines.md).

VictoriaMetrics stores what is remote-written to it (`/api/v1/write`, as a shard's remote_write sends)
and, given scrape configs, scrapes like Prometheus; it answers the Prometheus query API, so
tests.support.prometheus.query reads it. vmalert evaluates rule files against it and writes recordings
and ALERTS back to it; its own `/api/v1/alerts` lists the alerts. The settings below are the ones the
rules need (docs/engines.md says why each):

- `-search.latencyOffset=0s`: VictoriaMetrics answers an instant query as of 30 s ago by default, so
  each level of recordings would read data 30 s old;
- vmalert `-remoteWrite.flushInterval=1s`: recordings are sent every second, not every 5 s.

vmalert's `-datasource.queryStep` stays at its 5m default: set to the evaluation interval (1 s here),
an instant query finds no sample of a series scraped or written a little over a second ago, and the
verdict's evidence blinks.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import requests
import yaml

from stepscope_testkit.loopback import LoopbackServer, serving
from stepscope_testkit.processes import Running, free_port, running
from tests.support.prometheus import running_prometheus


def binary(name: str) -> str:
    """The path of an installed VictoriaMetrics program, or a one-line error saying what to install."""
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed (apt-get install victoria-metrics)")
    return found


@contextmanager
def running_victoria(tmp: Path, scrape_configs: Sequence[dict] = (), scrape_interval: str = "1s",
                     extra_args: Sequence[str] = ()) -> Iterator[Running]:
    """VictoriaMetrics with its data and log under `tmp`, scraping `scrape_configs` (Prometheus'
    format) every `scrape_interval` when there are any, with `extra_args` after the settings above."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [binary("victoria-metrics"), f"-httpListenAddr=127.0.0.1:{port}",
            f"-storageDataPath={tmp / 'victoria-data'}", "-search.latencyOffset=0s", "-loggerLevel=WARN", *extra_args]
    if scrape_configs:
        config = tmp / "scrape.yml"
        config.write_text(yaml.safe_dump({"global": {"scrape_interval": scrape_interval},
                                          "scrape_configs": list(scrape_configs)}))
        argv.append(f"-promscrape.config={config}")
    with running(argv, f"http://127.0.0.1:{port}/health", tmp / "victoria.log",
                 base_url=f"http://127.0.0.1:{port}") as proc:
        yield proc


class _Discard(BaseHTTPRequestHandler):
    """An Alertmanager that takes every notification and keeps none: vmalert 1.79 needs one to run
    alerting rules; the tests read the alerts from vmalert's API instead."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""


@contextmanager
def _notifier() -> Iterator[str]:
    with serving(LoopbackServer(_Discard)) as server:
        yield server.url


@contextmanager
def running_vmalert(tmp: Path, victoria_url: str, rule_files: Sequence[Path], interval: str = "1s",
                    external_labels: dict[str, str] | None = None) -> Iterator[Running]:
    """vmalert evaluating `rule_files` every `interval` against VictoriaMetrics at `victoria_url` and
    writing its recordings and ALERTS back there."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with _notifier() as notifier:
        argv = [binary("vmalert"), f"-httpListenAddr=127.0.0.1:{port}", f"-datasource.url={victoria_url}",
                f"-remoteWrite.url={victoria_url}", "-remoteWrite.flushInterval=1s", f"-notifier.url={notifier}",
                f"-evaluationInterval={interval}", "-loggerLevel=WARN",
                *(f"-rule={path}" for path in rule_files),
                *(f"-external.label={key}={value}" for key, value in (external_labels or {}).items())]
        with running(argv, f"http://127.0.0.1:{port}/health", tmp / "vmalert.log",
                     base_url=f"http://127.0.0.1:{port}") as proc:
            yield proc


@contextmanager
def running_engine(engine: str, tmp: Path, address: str, rule_files: Sequence[Path]) -> Iterator[str]:
    """The query URL of `engine` ("prometheus", or "victoriametrics" with vmalert) scraping the exporter at `address`
    (instance "node") and evaluating `rule_files`, every second, its files under `tmp`."""
    if engine == "victoriametrics":
        target = {"job_name": "stepscope", "static_configs": [{"targets": [address], "labels": {"instance": "node"}}]}
        with running_victoria(tmp / "victoria", [target]) as victoria, \
                running_vmalert(tmp / "vmalert", victoria.url, rule_files):
            yield victoria.url
        return
    (tmp / "prometheus").mkdir(parents=True, exist_ok=True)
    with running_prometheus(tmp / "prometheus", {"node": address}, rule_files) as prometheus:
        yield prometheus.url


def alerts(url: str, state: str = "firing") -> list[dict]:
    """The label sets (each with `alertname`) of the alerts in `state` that Prometheus or vmalert at `url`
    lists on /api/v1/alerts (vmalert answers null for none)."""
    response = requests.get(f"{url}/api/v1/alerts", timeout=10)
    response.raise_for_status()
    return [alert["labels"] for alert in response.json()["data"]["alerts"] or [] if alert["state"] == state]

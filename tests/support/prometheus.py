"""A real Prometheus (Debian's /usr/bin/prometheus) on a free loopback port, and its HTTP query API."""

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import requests
import yaml

from grafana.rules import groups
from stepscope_testkit.processes import Running, free_port, running

T = TypeVar("T")
# `promtool test rules` with Go's collector run a quarter as often: every file of grafana/rules/tests in one
# process took 66 s of CPU against 93 s at the default GOGC=100 (60 s of wall time against 78 s, 125 MB of
# memory at most against 66 MB), the same results. The suite runs them twice (plain and with pod labels):
# test_rules.py and test_pod_labels_rules.py together took 137 s of CPU against 153 s (-n 2, 90 s against 103 s).
PROMTOOL_TEST_ENV = {**os.environ, "GOGC": "400"}


# The shipped groups of the step-time quantile chain: raw buckets -> shard partial sums -> run buckets and quantiles.
# The chain reads no other recording.
QUANTILE_CHAIN = ("stepscope-shard-buckets-even", "stepscope-shard-buckets-odd", "stepscope-run-quantiles")


def shipped_groups(tmp_path: Path, *names: str) -> Path:
    """A rule file holding the shipped rule groups `names` as they are (grafana/rules_out), for a test whose claim
    is about a few chains: each engine evaluates every loaded group every second over every series, and the
    groups a test never reads are most of a Prometheus' or VictoriaMetrics' CPU. A name that is not a shipped
    group fails here, rather than leave its chain out."""
    shipped = {group["name"]: group for group in groups()}
    missing = [name for name in names if name not in shipped]
    assert not missing, f"not shipped rule groups: {missing}"
    path = tmp_path / "shipped-groups.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [shipped[name] for name in names]}, sort_keys=False))
    return path


@contextmanager
def running_prometheus(
    tmp_path: Path, targets: dict[str, str], rule_files: Sequence[Path] = ()
) -> Iterator[Running]:
    """Prometheus scraping `targets` ({instance label: host:port}) as job stepscope every second and
    evaluating `rule_files` every second."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [
            {
                "job_name": "stepscope",
                "static_configs": [
                    {"targets": [address], "labels": {"instance": instance}}
                    for instance, address in targets.items()
                ],
            }
        ],
    }
    with running_prometheus_config(tmp_path, config) as proc:
        yield proc


@contextmanager
def running_prometheus_config(tmp_path: Path, config: dict, *flags: str) -> Iterator[Running]:
    """Prometheus with `config` (a prometheus.yml as a dict) and extra command-line `flags`, its
    config, data and log under `tmp_path` (one directory per server)."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed (apt-get install prometheus)")
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    argv = [
        binary,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
        *flags,
    ]
    with running(
        argv,
        f"http://127.0.0.1:{port}/-/ready",
        tmp_path / "prometheus.log",
        base_url=f"http://127.0.0.1:{port}",
    ) as proc:
        yield proc


@contextmanager
def running_prometheus_holding(tmp_path: Path, samples: Sequence[tuple[str, float, float]]) -> Iterator[Running]:
    """Prometheus scraping nothing, its storage holding `samples` ((series as `name{labels}`, Unix seconds, value)),
    written as blocks by `promtool tsdb create-blocks-from openmetrics`: a history no live process has to wait for
    (a push that lands a minute late, an hour's gap)."""
    ordered = sorted(samples, key=lambda sample: (sample[0].split("{", 1)[0], sample[0], sample[1]))
    source = tmp_path / "samples.om"  # OpenMetrics: each family's samples together, each series in time order
    source.write_text("".join(f"{series} {value} {at}\n" for series, at, value in ordered) + "# EOF\n")
    result = subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(source),
                             str(tmp_path / "prometheus-data")], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"promtool could not write the blocks: {result.stdout}{result.stderr}")
    with running_prometheus_config(tmp_path, {"global": {"scrape_interval": "15s"}, "scrape_configs": []}) as proc:
        yield proc


def query(base_url: str, expr: str, at: float | None = None) -> list[dict]:
    """Instant query results ([{"metric": {...}, "value": [t, "v"]}]) now or at Unix time `at`; raises on a
    PromQL error."""
    params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
    response = requests.get(f"{base_url}/api/v1/query", params=params, timeout=10)
    body = response.json()
    if body.get("status") != "success":
        raise ValueError(f"query failed: {expr}\n{body.get('errorType')}: {body.get('error')}")
    return body["data"]["result"]


def series(base_url: str, selector: str) -> list[dict]:
    """Label sets of the series `selector` matches (what Grafana's label_values() reads)."""
    response = requests.get(f"{base_url}/api/v1/series", params={"match[]": selector}, timeout=10)
    body = response.json()
    if body.get("status") != "success":
        raise ValueError(f"series failed: {selector}\n{body.get('errorType')}: {body.get('error')}")
    return body["data"]


def rule_groups(base_url: str) -> list[dict]:
    response = requests.get(f"{base_url}/api/v1/rules", timeout=10)
    response.raise_for_status()
    return response.json()["data"]["groups"]


def wait_for(condition: Callable[[], T], timeout: float, interval: float = 1.0) -> T:
    """Calls `condition` until it returns something truthy; returns that or the last falsy value."""
    deadline = time.monotonic() + timeout
    result = condition()
    while not result and time.monotonic() < deadline:
        time.sleep(interval)
        result = condition()
    return result

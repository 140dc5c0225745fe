"""What the shipped rules conclude from a real-GPU recording: the recording replayed to a real Prometheus
running the rule files, and the verdict and alerts of every workload read once a second.

The shipped alerts wait minutes (`for`), longer than a recording lasts, so Prometheus also loads the
alerts with `for: 0s` (a group of their own): what that copy fires is what the shipped alerts fire
once the same readings last their `for`. tests/test_corpus_verdicts.py asserts on the result;
benchmarks/bench_verdicts.py tabulates it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import requests
import yaml

from grafana.rules import RULE_FILES, rules
from stepscope.contract import recordings
from stepscope_testkit.replay import Recording, Workload, replaying
from tests.support.prometheus import query, running_prometheus_config

SETTLE_MARGIN_S = 10.0  # after the last scrape: the rules' rate windows and recording chain catch up


@dataclass(frozen=True)
class Reading:
    offset: float  # seconds into the workload's recording
    verdict: str | None  # None: the rules give the run no verdict (yet)
    alerts: frozenset[str]  # alerts firing for the run, or for its node and GPU


@dataclass
class Judged:
    """What the rules said about one workload, second by second."""

    workload: Workload
    readings: list[Reading] = field(default_factory=list)

    def training(self) -> list[Reading]:
        """The readings while the run was in state train (as recorded)."""
        first, last = self.workload.training_offsets()
        return [reading for reading in self.readings if first <= reading.offset <= last]

    def shares(self) -> Counter[str]:
        """Each verdict's share of the readings while training ("none": no verdict yet)."""
        training = self.training()
        counts = Counter(reading.verdict or "none" for reading in training)
        return Counter({verdict: count / len(training) for verdict, count in counts.items()})

    def alerts_while_training(self) -> set[str]:
        return {alert for reading in self.training() for alert in reading.alerts}

    def seconds_to_first_verdict(self) -> float | None:
        """From the first scrape in state train to the first verdict other than idle."""
        first, _ = self.workload.training_offsets()
        spoken = [reading.offset for reading in self.training() if reading.verdict not in (None, "idle")]
        return spoken[0] - first if spoken else None


def alerts_without_for(tmp: Path, rule_files: tuple[Path, ...] = RULE_FILES) -> Path:
    """The alerts of `rule_files` with every `for` at 0s, in a group of their own."""
    alerts = [{**rule, "for": "0s"} for rule in rules(rule_files) if "alert" in rule]
    path = tmp / "alerts-now.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "stepscope-alerts-now", "rules": alerts}]}))
    return path


def judge(recording: Recording, tmp: Path, rule_files: tuple[Path, ...] = RULE_FILES) -> dict[str, Judged]:
    """Replays every workload of `recording` side by side and reads what `rule_files` conclude."""
    judged = {name: Judged(workload) for name, workload in recording.workloads.items()}
    loaded = [str(path) for path in rule_files] + [str(alerts_without_for(tmp, rule_files))]
    with replaying(recording.workloads) as replay:
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": loaded,
                  "scrape_configs": [{"job_name": "stepscope", "static_configs": replay.targets()}]}
        with running_prometheus_config(tmp, config) as prometheus:
            end = max(workload.duration for workload in recording.workloads.values()) + SETTLE_MARGIN_S
            while replay.elapsed() < end:
                tick = time.monotonic()
                _read(prometheus.url, replay.elapsed(), judged)
                time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    return judged


def _read(base_url: str, offset: float, judged: dict[str, Judged]) -> None:
    verdicts = {item["metric"]["run"]: item["metric"]["verdict"] for item in query(base_url, recordings.RUN_VERDICT)}
    firing = _firing(base_url)
    for name, result in judged.items():
        alerts = frozenset(firing.get(name, set()) | firing.get(result.workload.run, set()))
        result.readings.append(Reading(offset, verdicts.get(result.workload.run), alerts))


def _firing(base_url: str) -> dict[str, set[str]]:
    """Firing alerts by the run they name, and by instance (the workload) for node and GPU alerts."""
    response = requests.get(f"{base_url}/api/v1/alerts", timeout=10)
    response.raise_for_status()
    by_key: dict[str, set[str]] = {}
    for alert in response.json()["data"]["alerts"]:
        if alert["state"] != "firing":
            continue
        labels = alert["labels"]
        key = labels.get("run") or labels.get("instance", "")
        by_key.setdefault(key, set()).add(labels["alertname"])
    return by_key

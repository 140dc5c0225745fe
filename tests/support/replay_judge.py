"""What the shipped rules conclude from a real-GPU recording: the recording replayed to a real Prometheus
running the rule files, and the verdict and alerts of every workload read once a second.

The shipped alerts wait minutes (`for`), longer than a recording lasts, so Prometheus also loads the
alerts with `for: 0s` (a group of their own): what that copy fires is what the shipped alerts fire
once the same readings last their `for`. tests/test_corpus_verdicts.py asserts on the result;
benchmarks/bench_verdicts.py tabulates it.

The engine is Prometheus, or VictoriaMetrics scraping the replay with vmalert evaluating the same files
(tests/support/victoria.py). There each level of new recorded series takes ~10 s to become visible
(docs/engines.md), so a verdict comes later than a recorded run of a minute trains: `stretch` serves
every scrape that many times as long (a longer run, the same readings; rates fall by the factor, the
shares and readings the verdict reads do not).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path

import requests
import yaml

from grafana.rules import RULE_FILES, rules
from stepscope.contract import recordings
from stepscope_testkit.replay import TIMESTAMP_SAMPLE, Recording, Replay, Workload, replaying
from tests.support.prometheus import query, running_prometheus_config
from tests.support.victoria import alerts, running_victoria, running_vmalert

ENGINES = ("prometheus", "victoriametrics")

SETTLE_MARGIN_S = 10.0  # after the last scrape: the rules' rate windows and recording chain catch up
# Seconds after a missed iteration whose readings Judged.paced leaves out: the rules' shortest windows
# (gpu_reading_lag_seconds, 10 s) and a new series' ~10 s on VictoriaMetrics see the gap that long
PACE_MARGIN_S = 12.0
# The engines' own count of rule-group iterations missed because the one before overran the interval
MISSED_ITERATIONS = ("prometheus_rule_group_iterations_missed_total", "vmalert_iteration_missed_total")
GROUP_LABEL = re.compile(r'(?:rule_)?group="([^"]*)"')


@dataclass(frozen=True)
class Reading:
    offset: float  # seconds into the workload's recording
    verdict: str | None  # None: the rules give the run no verdict (yet)
    alerts: frozenset[str]  # alerts firing for the run, or for its node and GPU
    missed: tuple[tuple[str, int], ...] = ()  # (group, iterations the engine had missed so far) per rule group


@dataclass
class Judged:
    """What the rules said about one workload, second by second."""

    workload: Workload
    readings: list[Reading] = field(default_factory=list)
    failed_scrapes: int = 0  # of the workload's target over the replay: each blanks its series for a moment

    def training(self) -> list[Reading]:
        """The readings while the run was in state train (as recorded)."""
        first, last = self.workload.training_offsets()
        return [reading for reading in self.readings if first <= reading.offset <= last]

    def shares(self) -> Counter[str]:
        """Each verdict's share of the readings while training ("none": no verdict yet)."""
        training = self.training()
        counts = Counter(reading.verdict or "none" for reading in training)
        return Counter({verdict: count / len(training) for verdict, count in counts.items()})

    def paced(self) -> list[Reading]:
        """The training readings taken while every rule group evaluated within two intervals of the one before:
        none from a gap's start to PACE_MARGIN_S after it. On a loaded 2-core machine vmalert evaluated the GPU
        groups every 5-9 s instead of every second (the recordings' sample times in a failed run's
        VictoriaMetrics data) and the verdicts and alerts of all ten workloads went out for the same 1-4
        readings; what the rules conclude from evaluations that far apart is not what they conclude at their
        interval. An engine counts the iterations a late evaluation skipped (k of them: it came k + 1 intervals
        after the one before); a single one, an evaluation a little over its second, changes nothing here."""
        gaps = [(now.offset, skipped + 1) for before, now in pairwise(self.readings)
                for skipped in _skipped(dict(before.missed), dict(now.missed)) if skipped >= 2]
        return [reading for reading in self.training()
                if not any(at - seconds - 1 <= reading.offset <= at + PACE_MARGIN_S for at, seconds in gaps)]

    def missed_iterations(self) -> int:
        """Iterations the engine missed while this workload trained, all groups together."""
        training = self.training()
        return sum(_skipped(dict(training[0].missed), dict(training[-1].missed))) if training else 0

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


def stretched(workload: Workload, factor: float) -> Workload:
    """`workload` served `factor` times as long: each scrape from factor x its offset, the Unix times in
    it moved so that they stay as far behind the replay's clock as in the recording."""
    if factor == 1:
        return workload
    bodies = tuple(TIMESTAMP_SAMPLE.sub(lambda m, o=offset: f"{m.group(1)} {float(m.group(2)) + (factor - 1) * o:.3f}",
                                        body) for offset, body in zip(workload.offsets, workload.bodies, strict=True))
    return replace(workload, offsets=tuple(factor * offset for offset in workload.offsets), bodies=bodies)


@contextmanager
def _engine(engine: str, replay: Replay, loaded: list[str], tmp: Path) -> Iterator[tuple[str, str]]:
    """(query URL, alerts URL) of `engine` scraping the replay and evaluating `loaded` every second."""
    targets = [{"job_name": "stepscope", "static_configs": replay.targets()}]
    if engine == "victoriametrics":
        with running_victoria(tmp / "victoria", targets) as victoria, \
                running_vmalert(tmp / "vmalert", victoria.url, [Path(path) for path in loaded]) as vmalert:
            yield victoria.url, vmalert.url
        return
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": loaded,
              "scrape_configs": targets}
    with running_prometheus_config(tmp, config) as prometheus:
        yield prometheus.url, prometheus.url


def judge(recording: Recording, tmp: Path, rule_files: tuple[Path, ...] = RULE_FILES,
          engine: str = "prometheus", stretch: float = 1.0) -> dict[str, Judged]:
    """Replays every workload of `recording` side by side, each scrape `stretch` times as long, and
    reads what `rule_files` conclude on `engine` (ENGINES)."""
    workloads = {name: stretched(workload, stretch) for name, workload in recording.workloads.items()}
    judged = {name: Judged(workload) for name, workload in workloads.items()}
    loaded = [str(path) for path in rule_files] + [str(alerts_without_for(tmp, rule_files))]
    with replaying(workloads) as replay, _engine(engine, replay, loaded, tmp) as (url, alerts_url):
        end = max(workload.duration for workload in workloads.values()) + SETTLE_MARGIN_S
        while replay.elapsed() < end:
            tick = time.monotonic()
            _read(url, alerts_url, replay.elapsed(), judged, _missed_iterations(alerts_url))
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
        _count_failed_scrapes(url, round(replay.elapsed()) + 10, judged)
    return judged


def _count_failed_scrapes(base_url: str, seconds: int, judged: dict[str, Judged]) -> None:
    """Each workload's failed scrapes (`up` 0) over the last `seconds`: said beside a failed assertion."""
    for item in query(base_url, f"count_over_time(up[{seconds}s]) - sum_over_time(up[{seconds}s])"):
        name = item["metric"].get("instance", "")
        if name in judged:
            judged[name].failed_scrapes = round(float(item["value"][1]))


def _read(base_url: str, alerts_url: str, offset: float, judged: dict[str, Judged],
          missed: tuple[tuple[str, int], ...] = ()) -> None:
    verdicts = {item["metric"]["run"]: item["metric"]["verdict"] for item in query(base_url, recordings.RUN_VERDICT)}
    firing = _firing(alerts_url)
    for name, result in judged.items():
        alerts = frozenset(firing.get(name, set()) | firing.get(result.workload.run, set()))
        result.readings.append(Reading(offset, verdicts.get(result.workload.run), alerts, missed))


def _missed_iterations(rules_url: str) -> tuple[tuple[str, int], ...]:
    """Per rule group, the iterations Prometheus or vmalert at `rules_url` has missed since it started (its
    /metrics)."""
    text = requests.get(f"{rules_url}/metrics", timeout=10).text
    return tuple((GROUP_LABEL.search(line).group(1), round(float(line.rsplit(" ", 1)[1])))
                 for line in text.splitlines() if line.startswith(MISSED_ITERATIONS) and GROUP_LABEL.search(line))


def _skipped(before: dict[str, int], now: dict[str, int]) -> list[int]:
    """The iterations each group skipped between two readings."""
    return [count - before.get(group, 0) for group, count in now.items()]


def _firing(alerts_url: str) -> dict[str, set[str]]:
    """Firing alerts by the run they name, and by instance (the workload) for node and GPU alerts
    (Prometheus' and vmalert's /api/v1/alerts differ in shape: alerts reads both)."""
    by_key: dict[str, set[str]] = {}
    for labels in alerts(alerts_url):
        key = labels.get("run") or labels.get("instance", "")
        by_key.setdefault(key, set()).add(labels["alertname"])
    return by_key

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

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from grafana.rules import RULE_FILES, rules
from stepscope.contract import recordings
from stepscope_testkit.replay import TIMESTAMP_SAMPLE, Recording, Replay, Workload, replaying
from tests.support.prometheus import query, running_prometheus_config
from tests.support.victoria import alerts, running_victoria, running_vmalert

ENGINES = ("prometheus", "victoriametrics")

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
            _read(url, alerts_url, replay.elapsed(), judged)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    return judged


def _read(base_url: str, alerts_url: str, offset: float, judged: dict[str, Judged]) -> None:
    verdicts = {item["metric"]["run"]: item["metric"]["verdict"] for item in query(base_url, recordings.RUN_VERDICT)}
    firing = _firing(alerts_url)
    for name, result in judged.items():
        alerts = frozenset(firing.get(name, set()) | firing.get(result.workload.run, set()))
        result.readings.append(Reading(offset, verdicts.get(result.workload.run), alerts))


def _firing(alerts_url: str) -> dict[str, set[str]]:
    """Firing alerts by the run they name, and by instance (the workload) for node and GPU alerts
    (Prometheus' and vmalert's /api/v1/alerts differ in shape: alerts reads both)."""
    by_key: dict[str, set[str]] = {}
    for labels in alerts(alerts_url):
        key = labels.get("run") or labels.get("instance", "")
        by_key.setdefault(key, set()).add(labels["alertname"])
    return by_key

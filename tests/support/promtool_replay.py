"""What the shipped rules conclude from a real-GPU recording at the scrape and evaluation interval users run
(15 s as shipped, 30 s), where tests/support/replay_judge.py serves it to a real Prometheus every second.

A real Prometheus at 15 s would take the recording's own minute or two per workload; promtool evaluates
the same rules over the same scrapes in about a second. Each workload's body current at every multiple of
the interval (stepscope_testkit.replay.Workload.body_at, its Unix times moved onto promtool's clock) becomes
one sample of each series, with the `instance` and `job` a scrape adds and an `up` of 1 (the rules' held()
reads both); a series a body no longer holds gets a staleness marker, as a scrape writes. The alerts are
evaluated with `for: 0s` in place (the mutes that read ALERTS see them under their own names): what they
fire is what the shipped alerts fire once the readings last their `for`. The files are written as JSON (YAML
to promtool): yaml's dump took 1.7 s of a workload's 3.8.

promtool only says what a query returned where it differs from what a test expects, so every evaluation
time asks for nothing and the answer is read from the failure it reports.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from grafana.rules import RULE_FILES, groups
from stepscope.contract import recordings
from stepscope.contract.exposition import escape_label_value
from stepscope_testkit.replay import Workload

JOB = "stepscope"
ANSWER = re.compile(r"time: (?P<time>[0-9hms]+),\s*exp: .*\n\s*got: (?P<got>.*)")
SERIES = re.compile(r"\{([^}]*)\}")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
DURATION_PART = re.compile(r"(\d+)([hms])")
SECONDS = {"h": 3600, "m": 60, "s": 1}
# Every run's verdict and every firing alert: each workload takes those of its run and its instance
QUESTION = f'{recordings.RUN_VERDICT} or ALERTS{{alertstate="firing"}}'


@dataclass(frozen=True)
class Evaluation:
    at: int  # seconds from the workload's first scrape
    training: bool  # the body current then has the run in state train
    verdict: str | None
    alerts: frozenset[str]  # firing for the run, or for its node and GPU


def evaluations(workload: Workload, interval: int, rule_files: list[Path], tmp: Path,
                tail_s: int = 20) -> list[Evaluation]:
    """The verdict and firing alerts of `workload`'s run at every `interval` from its first scrape to `tail_s`
    after its last, `rule_files` (alerts_at_once) evaluated and the workload scraped every `interval` seconds.
    One workload a run: side by side, a body's earlier runs (state idle on its instance) read beside the same
    run training on its own, and the verdict read idle while it trained."""
    times = list(range(0, int(workload.duration) + tail_s + 1, interval))
    samples = [_samples(workload.body_at(at, at), workload.name) for at in times]
    test = {
        "rule_files": [str(path) for path in rule_files],
        "evaluation_interval": f"{interval}s",
        "tests": [{
            "interval": f"{interval}s",
            "input_series": [{"series": key, "values": _values(key, samples)}
                             for key in sorted(set().union(*samples))],
            "promql_expr_test": [{"expr": QUESTION, "eval_time": f"{at}s", "exp_samples": []} for at in times],
        }],
    }
    path = tmp / f"{workload.run}-{interval}s.yml"  # the recordings name their workloads alike, not their runs
    path.write_text(json.dumps(test))
    done = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    answers = {_seconds(match["time"]): _series(match["got"]) for match in ANSWER.finditer(done.stdout + done.stderr)}
    if done.returncode != 0 and not answers:
        raise RuntimeError(f"promtool on {path}: {(done.stdout + done.stderr)[-2000:]}")
    return [_evaluation(workload, at, answers.get(at, [])) for at in times]


def alerts_at_once(tmp: Path) -> list[Path]:
    """The shipped rule files with every alert's `for` at 0s."""
    paths = []
    for source in RULE_FILES:
        rule_groups = groups((source,))
        for group in rule_groups:
            group["rules"] = [{**rule, "for": "0s"} if "alert" in rule else rule for rule in group["rules"]]
        path = tmp / source.name
        path.write_text(json.dumps({"groups": rule_groups}))
        paths.append(path)
    return paths


def _samples(body: str, instance: str) -> dict[str, float]:
    """One scrape of `body` as promtool series names, with the labels a scrape of `instance` adds."""
    scraped = {f'up{{instance="{instance}",job="{JOB}"}}': 1.0}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            labels = {**sample.labels, "instance": instance, "job": JOB}
            scraped[sample.name + "{" + ",".join(f'{name}="{escape_label_value(value)}"'
                                                 for name, value in sorted(labels.items())) + "}"] = sample.value
    return scraped


def _values(key: str, samples: list[dict[str, float]]) -> str:
    """promtool's values of series `key`: `_` before it exists, `stale` where a scrape stops holding it."""
    values, present = [], False
    for scraped in samples:
        value = scraped.get(key)
        if value is None:
            values.append("stale" if present else "_")
        else:
            values.append(repr(value).replace("nan", "NaN").replace("inf", "Inf"))
        present = value is not None
    return " ".join(values)


def _seconds(duration: str) -> int:
    return sum(int(count) * SECONDS[unit] for count, unit in DURATION_PART.findall(duration))


def _series(got: str) -> list[dict[str, str]]:
    return [dict(LABEL.findall(labels)) for labels in SERIES.findall(got)]


def _evaluation(workload: Workload, at: int, answer: list[dict[str, str]]) -> Evaluation:
    """What `answer` says of the workload's run: its verdict, the alerts naming it or (without a run) its node."""
    marker = f'stepscope_training_state{{rank="0",run="{workload.run}",state="train"}} 1.0'
    verdicts = [series["verdict"] for series in answer if "verdict" in series and series.get("run") == workload.run]
    alerts = frozenset(series["alertname"] for series in answer if "alertname" in series
                       and (series.get("run") == workload.run or ("run" not in series
                                                                  and series.get("instance") == workload.name)))
    return Evaluation(at, marker in workload.body_at(at, at), verdicts[0] if verdicts else None, alerts)

"""The shipped rules evaluated over backfilled history on a real VictoriaMetrics with real vmalert, an
evaluation at a time, as a running vmalert would have evaluated them while it happened.

Alerts with a `for` of 10-15 minutes cannot be watched in real time in a test, so a promtool file's
input series are imported into VictoriaMetrics with timestamps in the past and vmalert's replay mode
(`vmalert -replay.timeFrom=... -replay.timeTo=...`) evaluates the rules over them. Replay alone does not
evaluate them as a running vmalert does (measured with vmalert 1.79.5, docs/engines.md):

- it evaluates each rule once as a range query over the whole range, one rule after the other, so a
  recording that reads its own previous value (the GPU readings carried through a break) finds none:
  the carried recording is empty in every break. `-replay.maxDatapointsPerQuery=1` splits the range
  into one query per point but sends them back to back, so nothing written is visible yet;
- a recording that another reads must be visible first: `-replay.rulesDelay` (1 s) waits between rules,
  but VictoriaMetrics shows a new series ~10 s after it is written, so chained rules come out empty.
  Its `/internal/force_flush` makes written series visible at once;
- its queries' `step` is `-datasource.queryStep` (5m by default), so the rules are evaluated every 5
  minutes unless it is set to the evaluation interval;
- an alert annotation calling `query` fails the replay (vmalert's templates have no `query` there).

So `replay_history` runs one short `vmalert -replay` of every recording rule (about 20 ms) per
evaluation time, with a force-flush after each: at each time a rule reads the raw series as of that time
and every recording, its own included, as of the evaluation before, as a running vmalert does when its
evaluation interval outlasts VictoriaMetrics' visibility lag. A recording that vanished is gone at the
next evaluation, as with the staleness markers a running vmalert writes: VictoriaMetrics looks back 1.25
intervals for a plain selector, so it finds the evaluation before, not the one before that. The alerting
rules (their annotations left off) are then replayed once over the whole range, which runs vmalert's own
`for` over every evaluation, each reading the recordings of its own time (an alert group evaluated after
the recording groups).

Not so: evaluating each rule after the recordings it reads, at the same time (Prometheus' order within a
group). Replayed recordings get no staleness markers, so one that vanished is still found an evaluation
later, and the training flag of a GPU lingered into a rank's first evaluation in `eval`, letting that
evaluation's GPU reading into the training average, which no running engine does.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import requests
import yaml

from tests.support.victoria import binary, running_victoria

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_TERM = re.compile(rf"^(?P<start>_|{_NUMBER})(?:(?P<sign>[-+])(?P<step>{_NUMBER}))?(?:x(?P<times>\d+))?$")
_SERIES = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)?\s*\{(?P<labels>.*)\}$")
_LABEL = re.compile(r'(\w+)\s*=\s*"((?:[^"\\]|\\.)*)"')
Samples = list[tuple[dict[str, str], list[tuple[float, float]]]]
TIMES = re.compile(r"_(?:timestamp|time)_seconds$")  # the families whose values are Unix times


def expand_values(text: str) -> list[float | None]:
    """promtool's expanding notation (`a+bxn`: n+1 values from a by b; `axn`: a n+1 times; `_xn`: n none) as
    one value per interval, None where there is no sample. `stale` (a staleness marker) is no sample too: the
    JSON import drops NaN, so a series that ends there is read for VictoriaMetrics' lookback after its last
    sample (1.25 intervals), an evaluation longer than on Prometheus or behind a vmagent, which writes the
    markers."""
    values: list[float | None] = []
    for term in text.split():
        if term == "stale":
            values.append(None)
            continue
        match = _TERM.match(term)
        if match is None:
            raise ValueError(f"unsupported series value {term!r} (numbers, _, a+bxn, a-bxn, axn)")
        times = int(match["times"]) + 1 if match["times"] else 1
        if match["start"] == "_":  # `_xn` is n blanks, not n+1 (promtool's expansion)
            values += [None] * (times - 1 if match["times"] else 1)
            continue
        step = float(match["step"] or 0) * (-1 if match["sign"] == "-" else 1)
        values += [float(match["start"]) + step * i for i in range(times)]
    return values


def parse_series(text: str) -> dict[str, str]:
    """`name{label="value",...}` (or `{...}`) as a label set, with `__name__` where it has a name."""
    match = _SERIES.match(text.strip())
    if match is None:
        raise ValueError(f"unsupported series {text!r}")
    name = {"__name__": match["name"]} if match["name"] else {}
    return {**name, **dict(_LABEL.findall(match["labels"]))}


def import_series(url: str, input_series: Iterable[dict], start: int, interval: int) -> None:
    """A promtool test's input series into VictoriaMetrics at `url`, the first sample at `start` (Unix
    seconds), one every `interval` seconds, visible to queries on return. A series of times (a push's, an
    exporter's start) moves with them: promtool's clock starts at 0, so its values are seconds from the start."""
    lines = []
    for item in input_series:
        labels = parse_series(item["series"])
        moved = start if TIMES.search(labels.get("__name__", "")) else 0
        points = [(start + i * interval, value + moved) for i, value in enumerate(expand_values(item["values"]))
                  if value is not None]
        lines.append(json.dumps({"metric": labels, "values": [v for _, v in points],
                                 "timestamps": [t * 1000 for t, _ in points]}))
    requests.post(f"{url}/api/v1/import", data="\n".join(lines), timeout=30).raise_for_status()
    force_flush(url)


def import_samples(url: str, samples: Iterable[tuple[str, float, float]]) -> None:
    """Samples ((series as `name{labels}`, Unix seconds, value)), the shape running_prometheus_holding takes,
    into VictoriaMetrics at `url`, visible to queries on return: one history on both engines."""
    points: dict[str, list[tuple[float, float]]] = {}
    for series, at, value in samples:
        points.setdefault(series, []).append((at, value))
    lines = [json.dumps({"metric": parse_series(series), "values": [value for _, value in sorted(held)],
                         "timestamps": [round(at * 1000) for at, _ in sorted(held)]})
             for series, held in points.items()]
    requests.post(f"{url}/api/v1/import", data="\n".join(lines), timeout=30).raise_for_status()
    force_flush(url)


def force_flush(url: str) -> None:
    """Make everything written to VictoriaMetrics visible to queries now (a new series otherwise
    waits ~10 s)."""
    requests.get(f"{url}/internal/force_flush", timeout=30).raise_for_status()


@dataclass(frozen=True)
class Rule:
    """One rule and the group it sits in (the group's name, interval and labels)."""

    group: dict
    rule: dict


def shipped_rules(files: Sequence[Path]) -> list[Rule]:
    """Every rule of `files`, in order."""
    return [Rule({key: value for key, value in group.items() if key != "rules"}, rule)
            for path in files for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def _write_rules(path: Path, rules: Sequence[Rule]) -> Path:
    groups: list[dict] = []
    for rule in rules:
        if not groups or groups[-1]["name"] != rule.group["name"]:
            groups.append({**rule.group, "rules": []})
        groups[-1]["rules"].append(rule.rule)
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def _iso(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def replay(url: str, rule_file: Path, start: int, end: int, interval: int) -> None:
    """One `vmalert -replay` of `rule_file` over [start, end] against VictoriaMetrics at `url`, its
    output visible on return. vmalert writes it all when it ends (no batch fills, no flush interval
    passes), so no rule of the run reads another's output of the same run."""
    argv = [binary("vmalert"), f"-rule={rule_file}", f"-datasource.url={url}", f"-remoteWrite.url={url}",
            f"-evaluationInterval={interval}s", f"-datasource.queryStep={interval}s", "-replay.rulesDelay=0s",
            f"-replay.timeFrom={_iso(start)}", f"-replay.timeTo={_iso(end)}", "-replay.disableProgressBar",
            "-remoteWrite.maxBatchSize=1000000", "-remoteWrite.flushInterval=1h", "-loggerLevel=ERROR"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"vmalert replay of {rule_file} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    force_flush(url)


ALERTS_SELECTOR = re.compile(r"ALERTS\{[^}]*\}")


def replay_history(url: str, rules: Sequence[Rule], start: int, evaluations: int, interval: int, tmp: Path) -> None:
    """Evaluate `rules` at `evaluations` times `interval` seconds apart from `start`: the recordings an
    evaluation at a time, then the alerts (without annotations) over the whole range, causes before the alerts
    they mute (`_by_causes`)."""
    tmp.mkdir(parents=True, exist_ok=True)
    records = _write_rules(tmp / "recordings.yml", [rule for rule in rules if "record" in rule.rule])
    for at in range(start, start + evaluations * interval, interval):
        replay(url, records, at, at + 1, interval)
    alerts = [Rule(rule.group, {k: v for k, v in rule.rule.items() if k != "annotations"})
              for rule in rules if "alert" in rule.rule]
    for layer, batch in enumerate(_by_causes(alerts)):
        replay(url, _write_rules(tmp / f"alerts-{layer}.yml", batch), start, start + (evaluations - 1) * interval,
               interval)


def _by_causes(alerts: Sequence[Rule]) -> list[list[Rule]]:
    """`alerts` in layers, each replayed after the ones before: an alert its cause mutes in the rules reads the
    cause's ALERTS series (StepscopeGpuUnderutilized those of StepscopeDataLoadingBottleneck, which reads those of
    StepscopeLoaderBelowCompute), which one replay over the whole range writes only for the alerts before it."""
    causes = {rule.rule["alert"]: set(re.findall(r"Stepscope\w+", " ".join(ALERTS_SELECTOR.findall(rule.rule["expr"]))))
              for rule in alerts}
    layers: list[list[Rule]] = []
    done: set[str] = set()
    while len(done) < len(alerts):
        ready = [rule for rule in alerts if rule.rule["alert"] not in done and causes[rule.rule["alert"]] <= done]
        assert ready, f"alerts muting each other: {sorted(set(causes) - done)}"
        layers.append(ready)
        done |= {rule.rule["alert"] for rule in ready}
    return layers


def samples(url: str, match: str, start: int, end: int) -> Samples:
    """The raw samples of the series `match` selects between `start` and `end`: (labels, [(t, value)])
    per series. Raw, not a query: an instant query would also find the sample of the evaluation before
    (VictoriaMetrics looks back 1.25 intervals, and replayed series get no staleness markers)."""
    response = requests.get(f"{url}/api/v1/export", params={"match[]": match, "start": start, "end": end}, timeout=30)
    response.raise_for_status()
    series = [json.loads(line) for line in response.text.splitlines() if line]
    return [(item["metric"], sorted(zip((t / 1000 for t in item["timestamps"]), item["values"], strict=True)))
            for item in series]


@contextmanager
def replayed_case(case: dict, rule_files: Sequence[Path], interval: int, tmp: Path) -> Iterator[tuple[str, int, int]]:
    """A promtool test case's input series in a real VictoriaMetrics, `rule_files` evaluated over them by vmalert
    at every `interval` of the case: (its URL, the first evaluation's and the last's Unix seconds)."""
    evaluations = max(len(expand_values(item["values"])) for item in case["input_series"])
    start = (int(time.time()) // 3600 - 2) * 3600  # in the past, on the grid of every rule's interval
    with running_victoria(tmp / "victoria", extra_args=["-search.disableCache"]) as victoria:
        import_series(victoria.url, case["input_series"], start, interval)
        replay_history(victoria.url, shipped_rules(rule_files), start, evaluations, interval, tmp / "replay")
        yield victoria.url, start, start + (evaluations - 1) * interval

"""The shipped rules give the same recordings and alerts when stepscope's series carry pod labels.

With pod attribution on, every GPU, process and pushed run series carries `namespace`, `pod` and `container`.
A rule that aggregates `by (...)` drops them, but a binary operation without `on (...)`, an `unless`, a
`group_left` join or a `label_replace` can lose its match (or split a series in two) when only one side
keeps them. So every promtool case in grafana/rules/tests runs on the generated rules from a copy of its
file made here: every expression's result and expectation read without the pod labels (each alert read as
its firing `ALERTS` series), and the pod labels put on the input series the exporter labels: a rank's
pushed and process series get its pod container (the file's stepscope_process_pod_info where it has one,
else `ml/<run>-<rank>/main`), a GPU's series the pod of the GPU (its stepscope_gpu_pod_info, else the
container of the rank holding memory on it, else none), as the exporter does on a node.

A recording or alert that comes out different (a series lost, duplicated or valued differently) fails it.
Shown able to fail: the node rules' `run_rank:stepscope_training_settled:bool` with its `and on (run,
rank, instance)` turned into a plain `and` against `group without (namespace, pod, container) (...)`
passes the file without pod labels and fails it with them.
"""

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from grafana.rules import RULES_DIR
from tests.support.prometheus import PROMTOOL_TEST_ENV

pytestmark = pytest.mark.background  # promtool's simulated time: scripts/test.sh runs it at idle CPU priority

TEST_FILES = sorted((RULES_DIR / "tests").glob("*.yml"))
POD = ("namespace", "pod", "container")
SERIES = re.compile(r"^(?P<name>(?:[A-Za-z_:][\w:]*)?)\s*(?:\{(?P<labels>.*)\})?$")
LABEL = re.compile(r'(\w+)\s*=\s*"((?:[^"\\]|\\.)*)"')
Labels = dict[str, str]
Pod = tuple[str, str, str]

promtool = shutil.which("promtool") or "promtool"


class _Int(str):
    """An integer scalar as written: YAML 1.1 would read a series' `0x40` (0 for 40 steps) as hex 64."""


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


_Loader.add_constructor("tag:yaml.org,2002:int", lambda loader, node: _Int(node.value))
_Dumper.add_representer(_Int, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:int", str(value)))


def parse(series: str) -> tuple[str, Labels]:
    match = SERIES.match(series.strip())
    assert match, series
    return match["name"], dict(LABEL.findall(match["labels"] or ""))


def written(name: str, labels: Labels) -> str:
    return name + "{" + ",".join(f'{key}="{value}"' for key, value in labels.items()) + "}"


def without_pod(expr: str) -> str:
    """The expression's result read without the three labels (a series they split shows as a duplicate)."""
    for label in POD:
        expr = f'label_replace({expr}, "{label}", "", "{label}", ".*")'
    return expr


def _ranks_and_gpus(series: list[tuple[str, Labels]]) -> tuple[dict[tuple, Pod], dict[tuple, Pod]]:
    """The pod of each (instance, run, rank) and (instance, uuid or gpu index) the file's series imply."""
    ranks: dict[tuple, Pod] = {}
    gpus: dict[tuple, Pod] = {}
    for name, labels in series:
        if name == "stepscope_process_pod_info":
            pod = tuple(labels[key] for key in POD)
            ranks[labels.get("instance"), labels["run"], labels["rank"]] = pod  # type: ignore[assignment]
            gpus[labels.get("instance"), labels["uuid"]] = pod  # type: ignore[assignment]
        elif name == "stepscope_gpu_pod_info":
            gpus[labels.get("instance"), labels["uuid"]] = tuple(labels[key] for key in POD)  # type: ignore[assignment]
    for name, labels in series:
        if labels.get("run") and "rank" in labels and name.startswith("stepscope_"):
            ranks.setdefault((labels.get("instance"), labels["run"], labels["rank"]),
                             ("ml", f"{labels['run']}-{labels['rank']}", "main"))
    for name, labels in series:
        if name == "stepscope_process_gpu_memory_bytes" and labels.get("run"):
            gpus.setdefault((labels.get("instance"), labels["gpu"]),
                            ranks[labels.get("instance"), labels["run"], labels["rank"]])
    return ranks, gpus


def pod_labeller(series: list[tuple[str, Labels]]) -> Callable[[str, Labels], Labels]:
    """Adds the pod labels the exporter would put on a series of the file's families (none on others)."""
    ranks, gpus = _ranks_and_gpus(series)

    def label(name: str, labels: Labels) -> Labels:
        instance = labels.get("instance")
        if not name.startswith("stepscope_") or name.endswith("_pod_info") or set(POD) & set(labels):
            return labels
        if name.startswith("stepscope_gpu_") and "uuid" in labels:
            pod = gpus.get((instance, labels["uuid"])) or gpus.get((instance, labels.get("gpu")))
        elif labels.get("run") and "rank" in labels:
            pod = ranks.get((instance, labels["run"], labels["rank"]))
        elif name.startswith("stepscope_process_") and "gpu" in labels:
            pod = gpus.get((instance, labels["gpu"]))
        else:
            return labels
        return {**labels, **dict(zip(POD, pod, strict=True))} if pod else labels

    return label


def _expectation(sample: dict) -> dict:
    name, labels = parse(sample["labels"])
    return {**sample, "labels": written(name, {k: v for k, v in labels.items() if k not in POD})}


def _alerts_as_series(cases: list[dict]) -> list[dict]:
    """The alert_rule_tests as the firing ALERTS series they expect, annotations aside: one case per alert
    name and evaluation time, holding every alert its cases expect."""
    expected: dict[tuple[str, str], list[str]] = {}
    for case in cases:
        found = expected.setdefault((case["alertname"], case["eval_time"]), [])
        found += [written("ALERTS", {"alertname": case["alertname"], "alertstate": "firing",
                                     **{k: str(v) for k, v in alert.get("exp_labels", {}).items() if k not in POD}})
                  for alert in case.get("exp_alerts") or ()]
    return [{"expr": without_pod(f'ALERTS{{alertname="{name}",alertstate="firing"}}'), "eval_time": at,
             "exp_samples": [{"labels": labels, "value": 1} for labels in dict.fromkeys(found)]}
            for (name, at), found in expected.items()]


def transformed(path: Path, labelled: bool) -> dict:
    """The promtool test file read without pod labels, its inputs labelled when `labelled`."""
    spec = yaml.load(path.read_text(), Loader=_Loader)  # integers kept as written
    spec["rule_files"] = [str((path.parent / file).resolve()) for file in spec["rule_files"]]
    for group in spec["tests"]:
        inputs = [parse(item["series"]) for item in group.get("input_series", [])]
        label = pod_labeller(inputs) if labelled else (lambda _name, labels: labels)
        for item, (name, labels) in zip(group.get("input_series", []), inputs, strict=True):
            item["series"] = written(name, label(name, labels))
        cases = [{**case, "expr": without_pod(f"({case['expr']})"),
                  "exp_samples": [_expectation(sample) for sample in case.get("exp_samples") or ()]}
                 for case in group.get("promql_expr_test", [])]
        group["promql_expr_test"] = cases + _alerts_as_series(group.pop("alert_rule_test", []))
    return spec


def _promtool(path: Path, labelled: bool, tmp_path: Path) -> subprocess.CompletedProcess:
    out = tmp_path / f"{path.stem}-{'labelled' if labelled else 'plain'}.yml"
    out.write_text(yaml.dump(transformed(path, labelled), Dumper=_Dumper, sort_keys=False))
    return subprocess.run([promtool, "test", "rules", str(out)], capture_output=True, text=True, env=PROMTOOL_TEST_ENV)


@pytest.mark.parametrize("path", TEST_FILES, ids=[path.stem for path in TEST_FILES])
def test_pod_labels_change_no_recording_and_no_alert(path: Path, tmp_path: Path) -> None:
    """The labelled copy passes; where it does not, the plain copy says whether the pod labels or this
    module's reading of the file is at fault (run only then: each run costs seconds of promtool)."""
    result = _promtool(path, True, tmp_path)
    if result.returncode != 0:
        plain = _promtool(path, False, tmp_path)
        assert plain.returncode == 0, "this module misreads the file (fails without pod labels too):\n" + \
            plain.stdout[-6000:] + plain.stderr
    assert result.returncode == 0, "with pod labels on the inputs:\n" + result.stdout[-6000:] + result.stderr

"""The chart's VictoriaMetrics global layer and the compose profile (docs/engines.md): the shards
remote_write to VictoriaMetrics and a VMAlert evaluates the per-run rules, with the settings
tests/support/victoria.py proves the rules with."""

from typing import Any

import pytest
import yaml

from grafana.rules import OUT_DIR, RULE_FILES
from tests.support.helm_chart import CHART, NAMESPACE, REPO, lint, objects, render

VICTORIA = "http://victoria-metrics.monitoring.svc:8428"
NOTIFIER = "http://alertmanager-operated.monitoring.svc:9093"
VALUES: dict[str, Any] = {
    "prometheusRule": {"enabled": True},
    "serviceMonitor": {"enabled": True},
    "sharding": {"enabled": True, "global": {"create": False},
                 "remoteWrite": {"url": f"{VICTORIA}/api/v1/write"},
                 "vmalert": {"create": True, "url": VICTORIA, "notifierURL": NOTIFIER}},
}


def _kind(objs: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objs if obj["kind"] == kind]


def test_vmalert_reads_and_writes_back_to_victoriametrics_and_loads_the_run_rules() -> None:
    objs = objects(render(CHART, VALUES))
    (vmalert,) = _kind(objs, "VMAlert")
    spec = vmalert["spec"]
    assert vmalert["metadata"]["namespace"] == NAMESPACE
    assert spec["datasource"]["url"] == spec["remoteWrite"]["url"] == spec["remoteRead"]["url"] == VICTORIA
    assert spec["remoteWrite"]["flushInterval"] == "1s" and spec["evaluationInterval"] == "15s"
    assert spec["notifier"]["url"] == NOTIFIER
    run_rules = [rule for rule in _kind(objs, "PrometheusRule") if rule["metadata"]["name"].endswith("-run")]
    (run,) = run_rules
    assert spec["ruleSelector"]["matchLabels"].items() <= run["metadata"]["labels"].items()
    (shards,) = _kind(objs, "Prometheus")  # no global Prometheus: VictoriaMetrics is the global layer
    assert shards["spec"]["remoteWrite"][0]["url"] == f"{VICTORIA}/api/v1/write"


def test_no_vmalert_unless_asked() -> None:
    values = {**VALUES, "sharding": {**VALUES["sharding"], "vmalert": {"create": False}}}
    assert not _kind(objects(render(CHART, values)), "VMAlert")


@pytest.mark.parametrize("missing", ["url", "notifierURL"])
def test_vmalert_without_its_urls_fails_with_one_line(missing: str) -> None:
    vmalert = {**VALUES["sharding"]["vmalert"], missing: ""}
    with pytest.raises(Exception, match=r"sharding\.vmalert\.create needs sharding\.vmalert\.url"):
        render(CHART, {**VALUES, "sharding": {**VALUES["sharding"], "vmalert": vmalert}})


def test_the_chart_lints_with_vmalert() -> None:
    report = lint(CHART, VALUES)
    assert not [m for m in report["messages"] if m["severity"] >= 2] and not report["errors"], report


def test_compose_runs_victoriametrics_and_vmalert_with_the_tested_settings() -> None:
    """The compose profile `victoriametrics` starts them with what tests/support/victoria.py proves the
    rules with, on the shipped rule files."""
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]
    victoria, vmalert = compose["victoria-metrics"], compose["vmalert"]
    assert victoria["profiles"] == vmalert["profiles"] == ["victoriametrics"]
    assert "-search.latencyOffset=0s" in victoria["command"]
    flags = dict(flag.split("=", 1) for flag in vmalert["command"] if not flag.startswith("-rule="))
    assert flags["-datasource.url"] == flags["-remoteWrite.url"] == "http://victoria-metrics:8428"
    assert flags["-remoteWrite.flushInterval"] == "1s" and "-datasource.queryStep" not in flags
    (mount,) = vmalert["volumes"]
    source, target = mount.split(":")[:2]
    rules = {flag.removeprefix(f"-rule={target}/") for flag in vmalert["command"] if flag.startswith("-rule=")}
    assert (REPO / "docker" / source).resolve() == OUT_DIR and rules == {path.name for path in RULE_FILES}

"""Grafana provisioning: files parse, point at things that exist, and the alerts match the rules file."""

import re
from pathlib import Path

import yaml

from grafana import generate
from grafana.alerting import generate as alerting
from grafana.rules import rules
from tests.support.dashboard_queries import DASHBOARDS_DIR, load_dashboards, panels

REPO = Path(__file__).resolve().parents[1]
PROVISIONING = REPO / "grafana" / "provisioning"
TEMPLATE = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)


def load(relative: str) -> dict:
    return yaml.safe_load((PROVISIONING / relative).read_text())


def prometheus_alerts() -> dict[str, dict]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def grafana_rules() -> dict[str, dict]:
    groups = yaml.safe_load((REPO / generate.ALERTS_OUT).read_text())["groups"]
    return {rule["title"]: rule for group in groups for rule in group["rules"]}


def test_datasource_has_a_fixed_uid_and_the_url_from_the_environment() -> None:
    document = load("datasources/stepscope.yml")
    assert document["apiVersion"] == 1
    (datasource,) = document["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["uid"] == "stepscope-prometheus"
    assert datasource["url"] == "${PROMETHEUS_URL}"


def test_dashboard_provider_loads_the_generated_dashboards_into_the_alert_folder() -> None:
    document = load("dashboards/stepscope.yml")
    assert document["apiVersion"] == 1
    (provider,) = document["providers"]
    assert provider["type"] == "file"
    assert provider["folder"] == alerting.FOLDER
    assert provider["options"]["path"].startswith("/")
    assert set(load_dashboards(DASHBOARDS_DIR)) == {
        "stepscope-training.json",
        "stepscope-node.json",
        "stepscope-cluster.json",
    }


def test_alert_list_panels_show_the_provisioned_folder() -> None:
    alert_lists = [
        panel
        for model in load_dashboards(DASHBOARDS_DIR).values()
        for panel in panels(model)
        if panel["type"] == "alertlist"
    ]
    assert alert_lists
    for panel in alert_lists:
        assert panel["options"]["folder"]["title"] == alerting.FOLDER


def test_every_prometheus_alert_is_a_grafana_rule_with_the_same_meaning() -> None:
    prometheus = prometheus_alerts()
    grafana = grafana_rules()
    assert prometheus and set(grafana) == set(prometheus)
    for name, rule in grafana.items():
        source = prometheus[name]
        query = next(item for item in rule["data"] if item["refId"] == "A")
        assert query["model"]["expr"] == source["expr"].strip(), name
        assert rule["for"] == source.get("for", "0s"), name
        assert rule["labels"] == source["labels"], name
        assert set(rule["annotations"]) == set(source["annotations"]), name


def test_grafana_rules_reference_the_provisioned_datasource_and_their_own_condition() -> None:
    datasource_uid = load("datasources/stepscope.yml")["datasources"][0]["uid"]
    uids = set()
    for name, rule in grafana_rules().items():
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", rule["uid"]), name
        uids.add(rule["uid"])
        ref_ids = {item["refId"] for item in rule["data"]}
        assert rule["condition"] in ref_ids, name
        for item in rule["data"]:
            assert item["datasourceUid"] in (datasource_uid, "__expr__"), name
            if item["datasourceUid"] == "__expr__":
                expression = item["model"]["expression"]
                referenced = set(re.findall(r"\$(\w+)", expression)) or {expression}
                assert referenced <= ref_ids - {item["refId"]}, f"{name}: {expression}"
        assert rule["noDataState"] == "OK", f"{name}: a healthy cluster returns no series"
    assert len(uids) == len(grafana_rules())


def test_annotations_use_grafana_template_variables() -> None:
    prometheus = prometheus_alerts()
    for name, rule in grafana_rules().items():
        for key, text in rule["annotations"].items():
            if re.search(r"\$value\b", prometheus[name]["annotations"][key]):
                assert "$values.B.Value" in text, f"{name}.{key}: the alert's value was lost"
            assert not re.search(r"\{\{-?\s*if\b[^}]*\}\}\{\{-?\s*end", text), f"{name}.{key}: an empty if"
            for template in TEMPLATE.findall(text):
                assert not re.search(r"\$value\b", template), f"{name}.{key}: $value is a string in Grafana"
                for variable in re.findall(r"\$\w+", template):
                    assert variable in ("$labels", "$values"), f"{name}.{key}: {variable}"


def test_annotations_run_no_prometheus_query() -> None:
    """Grafana's templates have no `query`: an annotation that still calls it fails to render in Grafana. Before,
    StepscopeTrainingStalled kept its `range ... | query | sortByLabel "rank"` block (the pids to dump)."""
    for name, rule in grafana_rules().items():
        for key, text in rule["annotations"].items():
            for template in TEMPLATE.findall(text):
                assert not re.search(r"\|\s*query\b", template), f"{name}.{key}: {template}"


# What a Grafana copy cannot say once its query blocks are gone: a pid "above" (StepscopeTrainingStalled's runbook
# sent the person to "py-spy dump --pid above" and no description listed a pid), and a query's `else` that left a
# gap in its sentence ("the loader can deliver (see the Training run dashboard) samples/s").
DROPPED = re.compile(r"pid above|rank\s+named above|\(see the [^)]*\) (samples/s|of the time)")


def test_grafana_copies_say_nothing_only_their_queries_gave() -> None:
    for name, rule in grafana_rules().items():
        for key, text in rule["annotations"].items():
            assert not DROPPED.search(text), f"{name}.{key}: {DROPPED.search(text).group()}"
    loader = grafana_rules()["StepscopeLoaderBelowCompute"]["annotations"]["description"]
    assert "its loader can deliver fewer samples/s than training consumes (the Training run dashboard's" in loader


def test_a_slower_run_is_told_its_own_unit_in_both_copies() -> None:
    """StepscopeRunSlowerThanItself compares tokens per second where a run counts tokens, else samples. Its Grafana
    copy lost the query that chose the word and said "samples per second" of every run; both copies now read the
    alert's `unit` label, which the rule sets (promtool: pace_change.yml tokens, goodput.yml samples)."""
    unit_per_second = "{{ $labels.unit }} per second of training"
    prometheus = prometheus_alerts()["StepscopeRunSlowerThanItself"]
    grafana = grafana_rules()["StepscopeRunSlowerThanItself"]
    assert unit_per_second in " ".join(prometheus["annotations"]["description"].split())
    assert unit_per_second in grafana["annotations"]["description"]
    assert '"unit", "tokens"' in prometheus["expr"] and '"unit", "samples"' in prometheus["expr"]

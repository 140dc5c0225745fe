"""The Prometheus rule files pass promtool, every alert is tested both firing and silent, and the split
into per-node and per-run rules holds: each file reads only what its layer has."""

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from grafana.rules import NODE_RULES, RULE_FILES, RULES_DIR, RUN_RULES
from grafana.rules import rules as rules_of
from stepscope.contract import SAMPLE_NAMES as EXPORTER_METRICS
from stepscope.contract import recordings, verdicts
from stepscope_testkit.sharded import shard_write_filter
from tests.support.dashboard_queries import panel_queries
from tests.support.readme import doc_section

TEST_FILES = sorted((RULES_DIR / "tests").glob("*.yml"))
REQUIRED_ANNOTATIONS = ("summary", "description", "runbook")
# Up/down conditions: their value is always 0, so the description states the fact instead.
BOOLEAN_ALERTS = {"StepscopeGpuDown", "StepscopeGpuCollectorDown", "StepscopeExporterDown"}
RULE_NAME = re.compile(r"\b\w+:\w+:\w+\b")
METRIC_NAME = re.compile(r"\bstepscope_\w+")

promtool = shutil.which("promtool") or "promtool"  # scripts/test.sh installs it


def rules() -> list[dict]:
    return rules_of(RULE_FILES)


def alerts() -> list[dict]:
    return [rule for rule in rules() if "alert" in rule]


def alert_cases() -> list[tuple[str, bool]]:
    """(alertname, fires) for every alert_rule_test case in the promtool test files."""
    return [
        (case["alertname"], bool(case.get("exp_alerts")))
        for path in TEST_FILES
        for group in yaml.safe_load(path.read_text())["tests"]
        for case in group.get("alert_rule_test", [])
    ]


def test_promtool_check_rules() -> None:
    result = subprocess.run([promtool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    result = subprocess.run(
        [promtool, "test", "rules", *map(str, TEST_FILES)], capture_output=True, text=True, cwd=RULES_DIR
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    cases = set(alert_cases())
    missing = [
        f"{rule['alert']} ({'firing' if fires else 'silent'})"
        for rule in alerts()
        for fires in (True, False)
        if (rule["alert"], fires) not in cases
    ]
    assert not missing, f"alerts without a promtool case: {missing}"


def verdicts_asserted(record: str) -> set[str]:
    """Values of `verdict` that some promql_expr_test expects of the recording `record`."""
    return {
        match
        for path in TEST_FILES
        for group in yaml.safe_load(path.read_text())["tests"]
        for case in group.get("promql_expr_test", [])
        if record in case["expr"]
        for sample in case.get("exp_samples") or []
        for match in re.findall(r'verdict="(\w+)"', sample["labels"])
    }


def test_every_bottleneck_verdict_has_a_case() -> None:
    """Each value the verdict rule can conclude is expected somewhere (a branch no input reaches is
    a branch no test checks)."""
    assert verdicts_asserted(recordings.RUN_VERDICT) >= set(verdicts.BOTTLENECK_VERDICTS)


def test_test_cases_name_existing_alerts() -> None:
    names = {rule["alert"] for rule in alerts()}
    assert {name for name, _ in alert_cases()} <= names


def test_every_alert_has_severity_and_annotations() -> None:
    for rule in alerts():
        assert rule.get("labels", {}).get("severity") in ("info", "warning", "critical"), rule["alert"]
        for key in REQUIRED_ANNOTATIONS:
            assert rule.get("annotations", {}).get(key, "").strip(), f"{rule['alert']} lacks {key}"
        if rule["alert"] not in BOOLEAN_ALERTS:
            assert "$value" in rule["annotations"]["description"], f"{rule['alert']} hides the live value"


def test_rules_read_only_published_metrics_and_recording_rules() -> None:
    """A misspelt metric passes promtool's unit tests when the test series repeat the typo; the names
    must be the exporter's (stepscope_contract, checked against a real scrape by the e2e test)."""
    records = {rule["record"] for rule in rules() if "record" in rule}
    read = set()
    for rule in rules():
        read |= set(RULE_NAME.findall(rule["expr"])) - records
        read |= set(METRIC_NAME.findall(RULE_NAME.sub("", rule["expr"])))
    assert "stepscope_steps_total" in read
    assert read <= EXPORTER_METRICS, f"neither published nor recorded: {sorted(read - EXPORTER_METRICS)}"


def names_read(expr: str) -> set[str]:
    """Recording rules and exporter metrics an expression reads."""
    return set(RULE_NAME.findall(expr)) | set(METRIC_NAME.findall(RULE_NAME.sub("", expr)))


def records_of(path: Path) -> set[str]:
    return {rule["record"] for rule in rules_of((path,)) if "record" in rule}


def test_node_rules_read_only_the_node_series_and_their_own_recordings() -> None:
    """A shard has its nodes' series and nothing else: no per-run recording may feed a per-node rule."""
    allowed = EXPORTER_METRICS | records_of(NODE_RULES)
    for rule in rules_of((NODE_RULES,)):
        assert names_read(rule["expr"]) <= allowed, f"{rule.get('record') or rule['alert']} reads a run rule"


def test_node_recordings_keep_the_node_or_are_shard_partials() -> None:
    """Per-node outputs keep `instance` (their level names it, or run_rank, which a node carries); the
    shard_* partial sums are the only ones the run file adds up across shards."""
    for record in records_of(NODE_RULES):
        level = record.split(":")[0]
        assert level.startswith(("instance", "run_rank", "shard_run")), record


def test_run_rules_read_only_what_the_shards_send() -> None:
    """The global layer gets what the shards' write filter keeps: every name a per-run rule reads
    (other than its own recordings) must pass that filter and be recorded or published by a node."""
    keep, drop = shard_write_filter()
    run_records = records_of(RUN_RULES)
    for rule in rules_of((RUN_RULES,)):
        for name in names_read(rule["expr"]) - run_records:
            assert re.fullmatch(keep, name) and not re.fullmatch(drop, name), f"shards do not send {name}"
            assert name in records_of(NODE_RULES) | EXPORTER_METRICS, name


def test_the_cluster_dashboard_reads_only_what_the_shards_send() -> None:
    """The Cluster dashboard is the fleet view a global layer serves (docs/deployment.md): every name its
    queries read must pass the shards' write filter (the per-namespace panels read the pod info)."""
    keep, drop = shard_write_filter()
    read = {name for q in panel_queries() if q.dashboard == "stepscope-cluster.json" for name in names_read(q.expr)}
    assert read, "no Cluster dashboard queries found"
    assert sorted(name for name in read if not re.fullmatch(keep, name) or re.fullmatch(drop, name)) == []


def test_the_write_filter_sends_every_node_recording_and_no_raw_bucket() -> None:
    keep, drop = shard_write_filter()
    sent = {name for name in records_of(NODE_RULES) if re.fullmatch(keep, name) and not re.fullmatch(drop, name)}
    assert sent == records_of(NODE_RULES)
    assert not re.fullmatch(keep, "stepscope_step_seconds_bucket")


def test_the_alert_table_lists_every_alert_and_marks_the_critical_ones() -> None:
    section = doc_section("alerts")
    rows = dict(re.findall(r'^\| (?:<a id="[a-z]+"></a>)?`(Stepscope\w+)`( \(critical\))? \|', section, re.M))
    assert rows.keys() == {rule["alert"] for rule in alerts()}
    for rule in alerts():
        marked = rows[rule["alert"]] == " (critical)"
        assert marked == (rule["labels"]["severity"] == "critical"), f"docs/alerts.md row of {rule['alert']}"


def test_recording_rule_names_follow_level_metric_operations() -> None:
    for rule in rules():
        if "record" in rule:
            level, metric, operations = rule["record"].split(":")
            assert level and metric.startswith("stepscope_") and operations, rule["record"]

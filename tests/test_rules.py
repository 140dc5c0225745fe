"""The Prometheus rules file passes promtool, and every alert is tested both firing and silent."""

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from stepscope_contract import SAMPLE_NAMES as EXPORTER_METRICS

RULES_DIR = Path(__file__).resolve().parents[1] / "grafana" / "rules"
RULES_FILE = RULES_DIR / "stepscope.rules.yml"
TEST_FILES = sorted((RULES_DIR / "tests").glob("*.yml"))
REQUIRED_ANNOTATIONS = ("summary", "description", "runbook")
# Up/down conditions: their value is always 0, so the description states the fact instead.
BOOLEAN_ALERTS = {"StepscopeGpuDown", "StepscopeGpuCollectorDown", "StepscopeExporterDown"}
RULE_NAME = re.compile(r"\b\w+:\w+:\w+\b")
METRIC_NAME = re.compile(r"\bstepscope_\w+")

promtool = shutil.which("promtool") or "promtool"  # scripts/test.sh installs it


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES_FILE.read_text())["groups"] for rule in group["rules"]]


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
    result = subprocess.run([promtool, "check", "rules", str(RULES_FILE)], capture_output=True, text=True)
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


def test_readme_alert_table_lists_every_alert_and_marks_the_critical_ones() -> None:
    readme = (RULES_DIR.parents[1] / "README.md").read_text()
    section = readme[readme.index("<!-- section: dashboards -->"):readme.index("<!-- /section: dashboards -->")]
    rows = dict(re.findall(r"^\| `(Stepscope\w+)`( \(critical\))? \|", section, re.M))
    assert rows.keys() == {rule["alert"] for rule in alerts()}
    for rule in alerts():
        marked = rows[rule["alert"]] == " (critical)"
        assert marked == (rule["labels"]["severity"] == "critical"), f"README row of {rule['alert']}"


def test_recording_rule_names_follow_level_metric_operations() -> None:
    for rule in rules():
        if "record" in rule:
            level, metric, operations = rule["record"].split(":")
            assert level and metric.startswith("stepscope_") and operations, rule["record"]

"""The Prometheus rule files pass promtool, every alert is tested both firing and silent, and the split
into per-node and per-run rules holds: each file reads only what its layer has."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from grafana.rules import NODE_RULES, RULE_FILES, RULES_DIR, RUN_RULES, SOURCES_DIR
from grafana.rules import rules as rules_of
from grafana.rules.render import UnknownPlaceholder, dcgm_node, fill_placeholders, held, render
from stepscope.contract import SAMPLE_NAMES as EXPORTER_METRICS
from stepscope.contract import recordings, verdicts
from stepscope_testkit.sharded import shard_write_filter
from tests.support.dashboard_queries import panel_queries
from tests.support.prometheus import PROMTOOL_TEST_ENV
from tests.support.readme import doc_section

pytestmark = pytest.mark.background  # promtool's simulated time: scripts/test.sh runs it at idle CPU priority

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


@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda path: path.stem)
def test_promtool_unit_tests_pass(test_file: Path) -> None:
    """One promtool run per test file: all of them in one run took 110 s of wall time at load 9 and hit the
    300 s timeout beside busy neighbours; per file, the workers share them and each file has the timeout."""
    result = subprocess.run(
        [promtool, "test", "rules", str(test_file)], capture_output=True, text=True, cwd=RULES_DIR,
        env=PROMTOOL_TEST_ENV,
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


FOR_WORDS = {"s": "second", "m": "minute", "h": "hour"}
STATED_FOR = re.compile(r"\bfor (at least )?(an hour|\d+ (?:second|minute|hour)s?)\b")


def for_in_words(duration: str) -> str:
    """An alert's `for` as its description writes it: 15m -> "15 minutes", 1h -> "an hour"."""
    count, unit = int(duration[:-1]), FOR_WORDS[duration[-1]]
    return f"an {unit}" if (count, unit) == (1, "hour") else f"{count} {unit}{'s' if count != 1 else ''}"


def test_an_alert_states_its_for_as_a_minimum() -> None:
    """"has been held for 30 minutes" (StepscopeGpuHeldIdle), "could not scrape ... for 5 minutes"
    (StepscopeExporterDown): the `for`, stated as how long the problem has lasted, which Alertmanager's repeat
    4 hours later still said. A description says "for at least" its alert's `for`; stepscope.tmpl says since when."""
    stated = [(rule["alert"], rule.get("for"), match[0]) for rule in alerts()
              for match in STATED_FOR.finditer(rule["annotations"]["description"])]
    assert stated, "no alert states its for: the pattern is stale"
    assert [(name, said) for name, duration, said in stated
            if said != f"for at least {for_in_words(duration or '0s')}"] == []


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


# Rules that read a target's series at the evaluation without held(...) (stepscope_contract/scrape_gaps.py),
# and why: a gap must end them, or holding would lie.
UNHELD = {
    # time() minus a held push or success time grows through the gap: the rank or collector would look lost
    recordings.RANK_LOST_LAST_PUSH: "time() - the last push: held, every rank of a down exporter would look lost; "
                                    "it keeps the ranks that were lost when last seen itself (last_over_time of "
                                    "the record below, and of its own earlier values)",
    "run_rank:stepscope_training_since_last_push:seconds": "StepscopeRankLost's test as it is seen now",
    "run_rank_cause:stepscope_time_seconds:rate1m": "goodput's lost and stalled time count from time() too",
    "run_rank:stepscope_training_stalled:seconds": "goodput's stalled time counts from time() too",
    "StepscopeExporterCollectionStale": "time() - the last success: held, it would read stale in a gap",
    "StepscopeExporterDown": "reads `up`, the gap itself",
    "instance:stepscope_node_clock_offset:seconds": "a clock less its scrape's timestamp(): held, timestamp() would be "
                                                    "the evaluation's; it keeps its own last value through a gap",
    "shard_run_le:stepscope_step_seconds_bucket:rate1m": "`and` the buckets scraped now, so a bound its rank dropped "
                                                         "leaves the quantiles at once; the quantiles feed no alert, "
                                                         "and held would re-read a minute of every bucket series",
    # dcgm-exporter's own target health, built on `up` and last_over_time already
    "instance_gpu:stepscope_gpu_up:dcgm": "up == 1 and last_over_time over 1h",
    "instance_gpu_xid:stepscope_gpu_xid_last_seen_timestamp_seconds:dcgm": "an XID is a change against 1m before",
}
# stepscope-gpu-readings: dcgm-exporter's fill-ins for the Node dashboard's panels, read by no alert
UNHELD_GROUPS = {"stepscope-gpu-readings"}
INSTANT_READ = re.compile(r'(?<![\w:("|])(?<!held\()'
                          r'((?:stepscope_[a-z_]+|DCGM_FI_\w+)(?:\{[^{}]*\})?|\{__name__=~"DCGM[^"]*"\})(?!\s*\[|[\w:])')


def test_every_instant_read_of_a_target_is_held_through_a_scrape_gap() -> None:
    """A failed scrape or an exporter restart empties every instant read of the target's series for an
    evaluation: a firing alert would resolve and a pending one start its `for` again
    (grafana/rules/tests/scrape_gaps.yml shows it). Each such read is held(...) but those UNHELD says why."""
    unheld = []
    for source in sorted(SOURCES_DIR.glob("*.rules.yml")):
        document = yaml.safe_load(fill_placeholders(source.read_text(), source.name))
        for group in document["groups"]:
            for rule in group["rules"]:
                name = rule.get("record") or rule["alert"]
                reads = INSTANT_READ.findall(rule["expr"])
                if reads and group["name"] not in UNHELD_GROUPS and name not in UNHELD:
                    unheld.append(f"{name}: {sorted(set(reads))}")
    assert not unheld, "instant reads without held(...):\n" + "\n".join(unheld)
    held_rules = {rule.get("record") or rule["alert"] for rule in rules() if "last_over_time(" in rule["expr"]}
    assert {"StepscopeGpuUnderutilized", recordings.SHARD_RUN_STALLED, recordings.RUN_TRAINING_RANKS} <= held_rules


def test_held_expands_a_selector_and_its_offset_and_refuses_anything_else() -> None:
    expr = render('held(<<family:TRAINING_STATE>>{state="train"} offset 1m) == held({__name__=~"DCGM_X"})\n', "f")
    selector, dcgm = 'stepscope_training_state{state="train"}', '{__name__=~"DCGM_X"}'
    assert expr == f"{held(selector, 60)} == {held(dcgm)}\n"
    assert held(selector, 60).startswith(f"({selector} offset 60s or (last_over_time({selector}[60s] offset 60s) ")
    assert "up offset 60s == 1" in held(selector, 60) and "time() - 60 -" in held(selector, 60)
    with pytest.raises(UnknownPlaceholder, match=r"f: held\(\.\.\.\) near rendered line 2 must hold one selector"):
        render("a\nheld(rate(m[1m]))\n", "f")


def test_node_join_puts_a_node_recording_beside_a_series_of_that_node() -> None:
    expr = render("time() - m + <<node_join:NODE_CLOCK_OFFSET>>\n", "f")
    assert expr == f"time() - m + on (instance, job) group_left () {recordings.NODE_CLOCK_OFFSET}\n"
    with pytest.raises(UnknownPlaceholder, match=r"f:1: unknown placeholder <<node_join:NO_SUCH>>"):
        render("<<node_join:NO_SUCH>>\n", "f")


def test_dcgm_node_takes_its_node_from_either_label_around_any_expression() -> None:
    """The call runs to its own closing parenthesis, past the parentheses of a quoted regex and of a nested call."""
    expr = render('max(dcgm_node(rate(DCGM_X{a="(b)"}[1m]) * dcgm_node(held(DCGM_Y)))) > 0\n', "f")
    outer = dcgm_node('rate(DCGM_X{a="(b)"}[1m]) * ' + dcgm_node(held("DCGM_Y")))
    assert expr == f"max({outer}) > 0\n"
    assert dcgm_node("m") == ('label_replace(label_replace(max without (instance) (m), "instance", "$1", "Hostname", '
                              '"(.+)"), "instance", "$1", "hostname", "(.+)")')
    with pytest.raises(UnknownPlaceholder, match=r"f: dcgm_node\( near rendered line 2 is never closed"):
        render("a\ndcgm_node(rate(m[1m])\n", "f")


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

"""stepscope_contract is the one source of the metric contract: every consumer agrees with it, and a rename
there is followed by every consumer that reads it (proved on a copy of the repository).

The rules are generated from sources that name the contract through placeholders (grafana/rules/src ->
grafana/rules_out); their outputs are still checked against it (names, phases, states, thresholds, the
recorded series the dashboards and the report read), so a name typed into a source is caught too.
"""

import ast
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import stepscope.contract as contract
from grafana.dashboards import training
from grafana.rules import RULE_FILES
from stepscope.contract import recordings, verdicts
from stepscope.contract.exposition import escape_label_value
from stepscope.exporter.ingest.families import FAMILIES as INGESTED
from stepscope.exporter.ingest.parser import PushLimits, parse_push
from stepscope.hooks.cuda_memory import AllocatorMemory
from stepscope.hooks.limits import Limits
from stepscope.hooks.profiling import TraceOutcome
from stepscope.hooks.render import Snapshot, render
from stepscope.hooks.timing import HistogramSnapshot
from stepscope.report.page import VERDICT_BORDERS
from stepscope.report.plots import VERDICT_COLORS
from stepscope.report.verdict import FIXES, HEADLINES
from tests.support.dashboard_queries import panel_queries

REPO = Path(__file__).resolve().parents[1]
# Sources that must spell no metric name, recorded series or phase: they read them from the contract.
CONTRACT_READERS = sorted([*(REPO / "grafana" / "dashboards").glob("*.py"), *(REPO / "run_report").glob("*.py")])
SPELLED = re.compile(r"\bstepscope_(?!contract\b)\w+|\b\w+:stepscope_\w+:\w+\b|\b(?:"
                     + "|".join(phase for phase in contract.STANDARD_PHASES if "_" in phase) + r")\b")
RULE_NAME = re.compile(r"\b\w+:\w+:\w+\b")
METRIC_NAME = re.compile(r"\bstepscope_\w+")
PHASE_SELECTOR = re.compile(r'\bphase=~?"([^"$]*)"')
STATE_SELECTOR = re.compile(r'\bstate=~?"([^"$]*)"')
PUSHED = {name: spec for name, spec in contract.FAMILIES.items() if spec.pushed}
LIMITS = PushLimits(max_label_length=128, max_series=2000, max_phases=32)


def full_push() -> str:
    """What the hooks push when every optional part is there: phases, limits, a trace, an open phase, tokens,
    model FLOPs, a stated peak and (on CUDA) the allocator's memory."""
    hist = HistogramSnapshot((0.1, 1.0), (1, 2, 3), 1.5)
    phases = [(phase, "host", hist) for phase in contract.STANDARD_PHASES]
    info = {"local_rank": "0", "world_size": "8", "pid": "42", "framework": "torch", "start_time": "1712345678.25",
            "pid_namespace": "4026531836"}
    return render(Snapshot(phases, hist, 3, 24, "train", info, Limits(10.0, 20.0, 8, 2, 2),
                           TraceOutcome("t", True, 1, 1, "/tmp/trace.json.gz", 5, 1.5),
                           last_step_time=1712345700.5, open_phase=("forward", 1712345700.75),
                           tokens=4096, flops=6 * 10**12, flops_dtype="bf16", peak_flops=989.4e12, global_step=1200,
                           global_step_start=1100,
                           allocator=AllocatorMemory(2**30, 2**31, 3 * 2**29, 2**20, 4, 0)))


def exposed_name(name: str, type_: str) -> str:
    return name + "_total" if type_ == "counter" else name


def test_the_hooks_push_every_pushed_family_as_the_contract_says() -> None:
    seen = set()
    for parsed in text_string_to_metric_families(full_push()):
        name = exposed_name(parsed.name, parsed.type)
        spec = PUSHED[name]
        assert (parsed.type, parsed.documentation) == (spec.type, spec.help), name
        labels = {k for sample in parsed.samples for k in sample.labels} - {"le"}
        body = set(spec.labels + spec.optional) - set(contract.PATH_LABELS)
        assert labels == body, name
        seen.add(name)
    assert seen == set(PUSHED)


def test_the_hooks_state_set_is_the_contract_states() -> None:
    states = re.findall(r'stepscope_training_state\{state="(\w+)"\} ([01])', full_push())
    assert [state for state, _ in states] == list(contract.STATES)
    assert [state for state, value in states if value == "1"] == ["train"]


def test_the_ingest_accepts_exactly_the_pushed_families_and_what_the_hooks_send() -> None:
    assert set(INGESTED) == set(PUSHED)
    for name, spec in INGESTED.items():
        assert (spec.type, spec.help) == (PUSHED[name].type, PUSHED[name].help)
    assert set(parse_push(full_push().encode(), "run", "0", LIMITS)) == set(PUSHED)


def rules() -> list[dict]:
    assert RULE_FILES, "no grafana/rules_out/*.rules.yml: run python -m grafana generate"
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"]]


def test_rules_use_only_contract_names_phases_and_states() -> None:
    records = {rule["record"] for rule in rules() if "record" in rule}
    for rule in rules():
        where = rule.get("record") or rule["alert"]
        raw = METRIC_NAME.findall(RULE_NAME.sub("", rule["expr"]))
        assert set(raw) <= contract.SAMPLE_NAMES, f"{where}: {sorted(set(raw) - contract.SAMPLE_NAMES)}"
        assert set(RULE_NAME.findall(rule["expr"])) <= records, where
        for phases in PHASE_SELECTOR.findall(rule["expr"]):
            assert set(phases.split("|")) <= set(contract.STANDARD_PHASES), f"{where}: phase {phases}"
        for states in STATE_SELECTOR.findall(rule["expr"]):
            assert set(states.split("|")) <= set(contract.STATES), f"{where}: state {states}"


def recording_names() -> set[str]:
    return {value for name, value in vars(recordings).items() if name.isupper() and isinstance(value, str)}


def test_every_recorded_series_the_contract_names_is_recorded_by_the_rules() -> None:
    """Whatever files the rules live in: each name in stepscope.contract.recordings has a `record:`."""
    records = {rule["record"] for rule in rules() if "record" in rule}
    assert recording_names() - records == set(), "recordings without a record: rule in grafana/rules/src/*.rules.yml"


def test_the_rules_conclude_the_contract_verdicts_and_the_report_explains_each() -> None:
    concluded = {rule["record"]: set(re.findall(r'"verdict", "(\w+)"', rule["expr"]))
                 for rule in rules() if rule.get("record") in (recordings.RUN_VERDICT, recordings.RUN_LIMITS_VERDICT)}
    assert concluded == {recordings.RUN_VERDICT: set(verdicts.BOTTLENECK_VERDICTS),
                         recordings.RUN_LIMITS_VERDICT: set(verdicts.LIMITS_VERDICTS)}
    for explained in (HEADLINES, FIXES, VERDICT_COLORS, VERDICT_BORDERS):
        assert set(explained) == set(verdicts.BOTTLENECK_VERDICTS)


def test_the_per_rank_step_quantiles_come_from_one_helper() -> None:
    """Dashboards ask rank_step_seconds_quantile, so moving them to query time is one edit: the time series of the
    drawn ranks (named by node where a rank moved), the per-rank table of every rank."""
    queries = {q.raw_expr for q in panel_queries()}
    asked = [recordings.rank_step_seconds_quantile(quantile, training.RANKS, training.DRAWN_SCORED)
             for quantile in (0.5, 0.95)]
    asked.append(recordings.rank_step_seconds_quantile(0.95, training.RANKS))
    for query in asked:  # as asked, or inside the label naming a rank that moved by its node
        assert contract.STEP_SECONDS in query and any(query in panel for panel in queries), query


def string_literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant and f-string part of a module, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


@pytest.mark.parametrize("path", CONTRACT_READERS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_dashboards_and_report_spell_no_metric_recording_or_phase_name(path: Path) -> None:
    spelled = [f"{path.name}:{line}: {match}" for line, text in string_literals(path)
               for match in SPELLED.findall(text)]
    assert spelled == [], "use stepscope_contract (families, recordings, phases) instead"


@pytest.mark.parametrize("name", contract.THRESHOLDS)
def test_rules_compare_with_the_contract_thresholds(name: str) -> None:
    threshold = contract.THRESHOLDS[name]
    number = re.compile(rf"(?<![\w.]){re.escape(threshold.number)}(?:s\b|(?![\w.]))")  # 30, or 30s in a range
    by_name = {rule.get("record") or rule["alert"]: rule for rule in rules()}
    for user in threshold.used_by:
        assert number.search(by_name[user]["expr"]), f"{user} does not compare with {name} = {threshold.number}"


STATED_THRESHOLD = re.compile(r"\bthreshold ([^;),{]+)")


def test_alert_texts_state_the_thresholds_the_contract_gives_them() -> None:
    """StepscopeExporterCollectionStale said "(threshold 2 minutes)" as fixed text, so collector_stale_seconds
    changed in the contract moved its expression and not its words. Each "threshold X" an alert states is one of
    the contract thresholds it compares with, as a number, a share or seconds."""
    said = {}
    for rule in rules():
        if "alert" in rule:
            written = {form for threshold in contract.THRESHOLDS.values() if rule["alert"] in threshold.used_by
                       for form in (threshold.number, threshold.percent, f"{threshold.number} s")}
            said[rule["alert"]] = [(stated.strip(), stated.strip() in written)
                                   for stated in STATED_THRESHOLD.findall(rule["annotations"]["description"])]
    assert any(said.values()), "no alert states a threshold: the pattern is stale"
    assert {name: stated for name, stated in said.items() if not all(known for _, known in stated)} == {}


def test_a_forgotten_lost_rank_is_kept_as_long_as_the_exporter_keeps_a_group() -> None:
    """StepscopeRankLost keeps a rank that a restarted exporter forgot for the exporter's own --ingest-ttl."""
    from stepscope.exporter.cli import build_parser

    assert contract.THRESHOLDS["rank_lost_kept_seconds"].value == build_parser().parse_args([]).ingest_ttl


def test_the_exporter_says_a_ttl_too_short_for_rank_lost_by_the_alerts_own_for() -> None:
    """The exporter warns of a --ingest-ttl that drops a killed rank before StepscopeRankLost pages it: its sum must
    follow the shipped alert's `for`."""
    from stepscope.exporter.ingest import RANK_LOST_FOR_SECONDS, short_ttl_warning

    (rank_lost,) = [rule for rule in rules() if rule.get("alert") == "StepscopeRankLost"]
    assert rank_lost["for"] == f"{RANK_LOST_FOR_SECONDS}s"
    assert short_ttl_warning(60) is not None and short_ttl_warning(61) is None


def test_dashboards_select_only_contract_phases_and_states() -> None:
    for query in panel_queries():
        for phases in PHASE_SELECTOR.findall(query.raw_expr):
            assert set(phases.split("|")) <= set(contract.STANDARD_PHASES), f"{query.panel}: {phases}"
        for states in STATE_SELECTOR.findall(query.raw_expr):
            assert set(states.split("|")) <= set(contract.STATES), f"{query.panel}: {states}"



# ---- one label-value escaper: the hooks' push body, the exporter's ingest and its own families ----------

ESCAPER_SOURCES = ("stepscope_contract", "training_hooks", "exporter", "run_report", "grafana", "stepscope_testkit",
                   "tests", "benchmarks")
QUOTE_REPLACES = (".replace('\"'", '.replace("\\""')  # how a replace of '"' is spelled: only those files are parsed
LABEL_VALUE_CHARACTERS = '\\"\n\r\t a\u00fc\u2028{},=\'#'


def escapes_a_quote(node: ast.AST) -> bool:
    """Whether `node` is `<text>.replace('"', '\\"')`: the step only a label-value escaper has (help text has none)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "replace"
            and [getattr(argument, "value", None) for argument in node.args] == ['"', '\\"'])


def test_no_writer_keeps_its_own_copy_of_the_label_value_escaper() -> None:
    """The hooks, the ingest parser and the exporter's families each had one; a copy is free to drift from what
    the others write and Prometheus reads."""
    texts = {path: path.read_text() for folder in ESCAPER_SOURCES for path in (REPO / folder).rglob("*.py")}
    replacing_quotes = {path: text for path, text in texts.items() if any(call in text for call in QUOTE_REPLACES)}
    copies = {str(path.relative_to(REPO)) for path, text in replacing_quotes.items()
              for node in ast.walk(ast.parse(text)) if escapes_a_quote(node)}
    assert copies == {"stepscope_contract/exposition.py"}


def test_escaped_label_values_read_back_unchanged_by_prometheus_client() -> None:
    rng = random.Random(20)
    values = ["", "0", "train-llama-7b", 'quo"te', "back\\slash\\n", "line\nend", "\\\"\n"]
    values += ["".join(rng.choice(LABEL_VALUE_CHARACTERS) for _ in range(rng.randrange(1, 12))) for _ in range(300)]
    for value in values:
        (read,) = text_string_to_metric_families(f'stepscope_x{{phase="{escape_label_value(value)}"}} 1\n')
        assert read.samples[0].labels == {"phase": value}, repr(value)


# ---- a rename is one edit plus `python -m grafana generate` --------------------------------------------

COPIED = ("stepscope", "stepscope_contract", "training_hooks", "exporter", "run_report", "grafana", "helm", "tests",
          "docs", "docker")  # docker: the Alertmanager template the chart's notification texts are generated from


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for part in COPIED:
        source = REPO / part
        if source.is_dir():
            shutil.copytree(source, root / part, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, root / part)
    return root


def run_in(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A Python of the venv whose imports resolve to the copy (its directory comes first on sys.path)."""
    return subprocess.run([sys.executable, *args], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new))


FOLLOWS = """
from tests.test_contract import full_push
from stepscope.exporter.ingest.parser import parse_push
from tests.test_contract import LIMITS
import stepscope.hooks
body = full_push()
print("phase" if 'phase="fetch_batch"' in body and "dataloader_next" not in body else "no phase")
print("family" if "stepscope_profile_trace_step_count" in body and "trace_steps " not in body else "no family")
print(sorted(parse_push(body.encode(), "r", "0", LIMITS)))
print(stepscope.hooks.STANDARD_PHASES[0])
"""


def rename_in_contract(root: Path) -> None:
    """One family, one phase and one threshold changed where the contract says them, and nowhere else."""
    contract_dir = root / "stepscope_contract"
    edit(contract_dir / "families.py", '"stepscope_profile_trace_steps"', '"stepscope_profile_trace_step_count"')
    edit(contract_dir / "training.py", '"dataloader_next"', '"fetch_batch"')
    edit(contract_dir / "thresholds.py", "0.3, \"share of step time", "0.35, \"share of step time")


def generated_dashboards(root: Path) -> str:
    return "".join(path.read_text() for path in sorted((root / "grafana" / "dashboards_out").glob("*.json")))


def test_a_rename_in_the_contract_is_followed_by_hooks_ingest_report_dashboards_and_docs(copy: Path) -> None:
    """Renames one family and one phase in a copy: the renderer, the ingest, the report's queries and
    (after the one generate command) the dashboards, the metric table of docs/exporter.md and the alert table of
    docs/alerts.md all use the new names."""
    rename_in_contract(copy)
    follows = run_in(copy, "-c", FOLLOWS)
    assert follows.returncode == 0, follows.stderr
    lines = follows.stdout.splitlines()
    assert lines[:2] == ["phase", "family"]
    assert "stepscope_profile_trace_step_count" in lines[2] and "stepscope_profile_trace_steps'" not in lines[2]
    assert lines[3] == "fetch_batch"
    check = run_in(copy, "-m", "grafana", "generate", "--check")
    assert check.returncode == 1, check.stdout + check.stderr
    assert check.stdout.splitlines() == ["differs: grafana/dashboards_out/stepscope-training.json",
                                         "differs: grafana/rules_out/stepscope-node.rules.yml",
                                         "differs: grafana/rules_out/stepscope-run.rules.yml",
                                         "differs: grafana/alerting_out/stepscope-alerts.yml",
                                         "differs: docs/exporter.md",
                                         "differs: docs/alerts.md"], check.stdout
    assert run_in(copy, "-m", "grafana", "generate").returncode == 0
    metrics = (copy / "docs" / "exporter.md").read_text()
    assert "`stepscope_profile_trace_step_count`" in metrics and "`stepscope_profile_trace_steps`" not in metrics
    dashboards = generated_dashboards(copy)
    assert "stepscope_profile_trace_step_count{" in dashboards and "stepscope_profile_trace_steps" not in dashboards
    assert "fetch_batch" in dashboards and "dataloader_next" not in dashboards
    assert "above 35% the run is data bound" in dashboards and "above 30% the run is data bound" not in dashboards
    alerts = (copy / "docs" / "alerts.md").read_text()
    assert "> 35% of step time for 10m" in alerts and "> 30% of step time for 10m" not in alerts
    report = run_in(copy, "-c", "from stepscope.report.queries import PHASE_LOCAL; print(PHASE_LOCAL)")
    assert report.stdout == "fetch_batch|to_device|forward\n", report.stderr


def generated_rules(root: Path) -> list[dict]:
    """The rules of the copy's generated files (comments left out: they may still tell the old story)."""
    return [rule for path in sorted((root / "grafana" / "rules_out").glob("*.rules.yml"))
            for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def test_a_rename_in_the_contract_is_followed_by_the_generated_rules(copy: Path) -> None:
    """A family the rules read, a phase and a threshold changed in the copy's contract: after the one
    generate command the rules and the Grafana alerts use the new ones, and promtool accepts the rules."""
    rename_in_contract(copy)
    edit(copy / "stepscope_contract" / "families.py",
         '"stepscope_node_memory_total_bytes"', '"stepscope_node_memory_size_bytes"')
    assert run_in(copy, "-m", "grafana", "generate").returncode == 0
    rules = generated_rules(copy)
    text = "\n".join("\n".join([rule.get("record", ""), rule["expr"], *rule.get("annotations", {}).values()])
                     for rule in rules)
    names = set(METRIC_NAME.findall(text))
    assert "stepscope_node_memory_size_bytes" in names and "stepscope_node_memory_total_bytes" not in names
    assert 'phase="fetch_batch"' in text and "dataloader_next" not in text
    by_name = {rule.get("record") or rule["alert"]: rule for rule in rules}
    loading = by_name["StepscopeDataLoadingBottleneck"]
    assert re.search(r"> 0\.35\b", loading["expr"]) and "threshold 35%" in loading["annotations"]["description"]
    assert not re.search(r"(?<![\w.])0\.3(?![\w.])", by_name[recordings.RUN_VERDICT]["expr"])
    alerts = (copy / "grafana" / "alerting_out" / "stepscope-alerts.yml").read_text()
    assert "fetch_batch" in alerts and "dataloader_next" not in alerts
    outputs = sorted((copy / "grafana" / "rules_out").glob("*.rules.yml"))
    check = subprocess.run(["promtool", "check", "rules", *map(str, outputs)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

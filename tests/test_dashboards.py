"""The committed dashboards are exactly the generator's output and follow the bundle's rules."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from grafana.dashboards import generate
from grafana.dashboards.training import BETWEEN_PHASES
from grafana.rules import rules
from stepscope.contract import BACKWARD_PHASE, DATA_LOADING_PHASE, IDLE_STATE, STATES, TRAIN_STATE
from stepscope.contract import SAMPLE_NAMES as EXPORTER_METRICS
from stepscope.contract import families as fam
from stepscope.contract import recordings as rec
from tests.support.dashboard_queries import (
    DASHBOARDS_DIR,
    grafana_interpolate,
    load_dashboards,
    panel_queries,
    panels,
    variable_queries,
)

RECORDING_RULE = re.compile(r"\b[a-z_]+:stepscope_\w+:\w+\b")
ANY_RULE_NAME = re.compile(r"\b\w+:\w+:\w+\b")
EXPORTER_NAME = re.compile(r"\bstepscope_\w+")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
EXPECTED = {"stepscope-training.json", "stepscope-node.json", "stepscope-cluster.json"}
PANEL_UNIT_TYPES = {"timeseries", "stat", "bargauge"}


def recording_rules() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def dashboards() -> dict[str, dict]:
    return load_dashboards(DASHBOARDS_DIR)


def promtool_expressions(spec_file: Path, inputs: list[dict], tests: list[dict], interval: str = "15s") -> str:
    """promtool's word on `tests` (expressions with their expected samples) over `inputs`, written to `spec_file`:
    its output where a test failed, "" where all passed."""
    spec = {"rule_files": [], "evaluation_interval": interval,
            "tests": [{"interval": interval, "input_series": inputs, "promql_expr_test": tests}]}
    spec_file.write_text(yaml.safe_dump(spec))
    result = subprocess.run(["promtool", "test", "rules", str(spec_file)], capture_output=True, text=True)
    return result.stdout + result.stderr if result.returncode else ""


def test_the_generator_builds_the_three_dashboards_and_nothing_else() -> None:
    """That the committed JSON is the generator's output is tests/test_generate.py's job."""
    assert set(generate.BUILDERS) == EXPECTED == set(dashboards())


def test_no_inputs_and_stable_uids() -> None:
    for name, model in dashboards().items():
        assert "__inputs" not in json.dumps(model), name
        assert model["uid"] == name.removesuffix(".json")


def test_datasource_variable_feeds_every_panel_and_variable() -> None:
    for name, model in dashboards().items():
        variables = model["templating"]["list"]
        assert variables[0] == {
            **variables[0],
            "name": "datasource",
            "type": "datasource",
            "query": "prometheus",
        }
        for variable in variables[1:]:
            if variable["type"] == "query":  # a `custom` variable is a fixed list, asking no data source
                assert variable["datasource"] == DATASOURCE, f"{name}: variable {variable['name']}"
        for panel in panels(model):
            assert panel.get("datasource") == DATASOURCE, f"{name}: {panel['title']}"
            for target in panel.get("targets", []):
                assert target.get("datasource") == DATASOURCE, f"{name}: {panel['title']}"


def test_every_panel_has_a_description_and_a_unit() -> None:
    for name, model in dashboards().items():
        for panel in panels(model):
            assert panel.get("description", "").strip(), f"{name}: {panel['title']} has no description"
            if panel["type"] in PANEL_UNIT_TYPES:
                assert panel["fieldConfig"]["defaults"].get("unit"), f"{name}: {panel['title']} has no unit"


def test_every_panel_fits_the_24_column_grid() -> None:
    overflowing = [
        (name, panel.get("title"), panel["gridPos"])
        for name, board in dashboards().items()
        for panel in panels(board)
        if panel["gridPos"]["x"] + panel["gridPos"]["w"] > 24
    ]
    assert not overflowing


def test_panel_ids_are_unique() -> None:
    for name, model in dashboards().items():
        ids = [panel["id"] for panel in model["panels"]]
        assert len(ids) == len(set(ids)), name


def test_queries_use_known_metrics_and_recording_rules() -> None:
    rules = recording_rules()
    texts = [(q.dashboard, q.panel, q.raw_expr) for q in panel_queries()]
    texts += [(v.dashboard, v.variable, v.raw_query) for v in variable_queries()]
    assert texts
    for dashboard, where, expr in texts:
        for name in ANY_RULE_NAME.findall(expr):
            assert name in rules, f"{dashboard} / {where}: {name} is not a recording rule"
        for name in EXPORTER_NAME.findall(RECORDING_RULE.sub("", expr)):
            assert name in EXPORTER_METRICS, f"{dashboard} / {where}: {name} is not an exporter metric"


GRAFANA_GLOBALS = {"__range", "__interval"}  # Grafana's own variables the panels use (the time range, its steps)


def test_variables_are_defined_and_matched_as_grafana_writes_them() -> None:
    """A multi-value variable is matched as a regex (Grafana escapes each value and joins them with |), a
    single-value one exactly: Grafana writes its value as it is, so `=~` read a run "exp.1" as a regex."""
    for name, model in dashboards().items():
        variables = {variable["name"]: variable for variable in model["templating"]["list"]}
        queries = [(q.panel, q.raw_expr) for q in panel_queries() if q.dashboard == name]
        queries += [(f"${v.variable}", v.raw_query) for v in variable_queries() if v.dashboard == name]
        for where, expr in queries:
            used = {a or b for a, b in re.findall(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)", expr)}  # not `$1`
            assert used <= variables.keys() | GRAFANA_GLOBALS, f"{name} / {where}: undefined {used - variables.keys()}"
            for operator, variable in re.findall(r'\w+(=~|=|!=|!~)"\$\{?(\w+)', expr):
                several = variables[variable].get("multi") or variables[variable].get("includeAll")
                assert operator == ("=~" if several else "="), f"{name} / {where}: {operator} ${variable}"


# Runs whose names are regexes matching something else: "bert+lora" does not match itself, "exp.1" matches "expx1".
REGEX_LIKE_RUNS = {"bert+lora": 1, "exp.1": 2, "expx1": 4}


def test_a_run_named_with_regex_characters_reads_its_own_series_only(tmp_path: Path) -> None:
    """The Training dashboard's Throughput stat as Grafana sends it for each run, evaluated by promtool: each run's
    samples/s alone (matched as a regex, "bert+lora" read nothing and "exp.1" read expx1's too)."""
    model = dashboards()["stepscope-training.json"]
    (expr,) = [target["expr"] for panel in panels(model) if (panel["type"], panel["title"]) == ("stat", "Throughput")
               for target in panel["targets"]]
    inputs = [{"series": f'{rec.RUN_SAMPLES_RATE}{{run="{run}"}}', "values": f"{rate}x10"}
              for run, rate in REGEX_LIKE_RUNS.items()]
    tests = [{"expr": grafana_interpolate(expr, model, {"run": run}), "eval_time": "1m",
              "exp_samples": [{"labels": f'{rec.RUN_SAMPLES_RATE}{{run="{run}"}}', "value": rate}]}
             for run, rate in REGEX_LIKE_RUNS.items()]
    assert not promtool_expressions(tmp_path / "runs.yml", inputs, tests)


def test_recording_rules_are_used_by_the_dashboards() -> None:
    """Dashboards prefer the recording rules; one no panel shows and no other rule reads (an
    intermediate computed once for several rules) is dead weight. Whole names count:
    run:stepscope_gpu_utilization:avg_ratio is a substring of instance_gpu_run:stepscope_gpu_..."""
    used = {name for q in panel_queries() for name in ANY_RULE_NAME.findall(q.raw_expr)}
    assert used
    read_by_rules = {name for rule in rules() for name in ANY_RULE_NAME.findall(rule["expr"])}
    unused = {rule for rule in recording_rules() if rule not in used | read_by_rules}
    assert not unused, f"recording rules nothing reads: {sorted(unused)}"


def test_every_query_parses_as_promql(tmp_path: Path) -> None:
    """promtool check rules parses each expression, with variables filled in."""
    exprs = [q.expr for q in panel_queries()] + [v.selector for v in variable_queries() if v.selector]
    rules = [{"record": f"dashboard:check:expr{index}", "expr": expr} for index, expr in enumerate(exprs)]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_process_registered_within_the_rate_window_has_one_row_in_the_process_table(tmp_path: Path) -> None:
    """Every column of the Node dashboard's Processes table, evaluated by promtool: pid 41 registered by the
    hooks at 5m (its series before had no run) is one row at 5m30s, not two (one with 0 CPU, still in the 1m
    rate window); pid 42, never registered, keeps its one row."""
    before, after = 'pid="41",run="",rank=""', 'pid="41",run="r",rank="0"'
    inputs = []
    for family in ("stepscope_process_cpu_seconds_total", "stepscope_process_io_read_bytes_total",
                   "stepscope_process_io_write_bytes_total"):
        inputs += [{"series": f'{family}{{instance="n",{before}}}', "values": "0+15x20"},
                   {"series": f'{family}{{instance="n",{after}}}', "values": "_x20 300+15x10"},
                   {"series": f'{family}{{instance="n",pid="42",run="",rank=""}}', "values": "0+15x40"}]
    for family in ("stepscope_process_resident_memory_bytes", "stepscope_process_children"):
        inputs += [{"series": f'{family}{{instance="n",{after}}}', "values": "_x20 1x10"},
                   {"series": f'{family}{{instance="n",pid="42",run="",rank=""}}', "values": "1x40"}]
    gpu_memory = "stepscope_process_gpu_memory_bytes"  # held by the pid before it registered: foreign then
    inputs += [{"series": f'{gpu_memory}{{instance="n",{before},gpu="0",holder="foreign"}}', "values": "1x20"},
               {"series": f'{gpu_memory}{{instance="n",{after},gpu="0",holder="rank"}}', "values": "_x20 1x10"},
               {"series": f'{gpu_memory}{{instance="n",pid="42",run="",rank="",gpu="0",holder="foreign"}}',
                "values": "1x40"}]
    rows = [{"labels": '{pid="41",run="r",rank="0"}', "value": 1}, {"labels": '{pid="42"}', "value": 1}]
    columns = [query.expr for query in panel_queries() if (query.dashboard, query.panel) == (
        "stepscope-node.json", "Processes")]
    assert len(columns) == 6
    tests = [{"expr": f"count by (pid, run, rank) ({expr})", "eval_time": "5m30s", "exp_samples": rows}
             for expr in columns]  # the rows (partial rates where a series begins or ends in the window)
    assert not promtool_expressions(tmp_path / "processes.yml", inputs, tests)


def test_the_process_table_says_who_holds_each_pids_gpu_memory(tmp_path: Path) -> None:
    """The Processes table's GPU memory column keeps `holder`, which Grafana's merge adds to the pid's row (it merges
    on the labels all columns share): a notebook (pid 77, foreign) beside a rank (pid 41) on the same GPU, a row
    each. Before, `sum by (pid, run, rank)` summed the label away and pid 77 read only `{pid="77"}` on a real
    Prometheus: nothing told it from a rank's process."""
    (gpu_memory,) = [query.expr for query in panel_queries() if (query.dashboard, query.panel, query.ref_id) == (
        "stepscope-node.json", "Processes", "F")]
    inputs = [{"series": f'{fam.PROCESS_GPU_MEMORY}{{instance="n",pid="{pid}",run="{run}",rank="{rank}",gpu="{gpu}",'
                         f'holder="{holder}"}}', "values": "1e9x10"}
              for pid, run, rank, gpu, holder in (("41", "r", "0", "0", "rank"), ("41", "r", "0", "1", "rank"),
                                                  ("77", "", "", "0", "foreign"))]
    rows = [{"labels": '{pid="41",run="r",rank="0",holder="rank"}', "value": 2e9},
            {"labels": '{pid="77",holder="foreign"}', "value": 1e9}]
    assert not promtool_expressions(tmp_path / "holders.yml", inputs,
                                    [{"expr": gpu_memory, "eval_time": "5m", "exp_samples": rows}])


def _field_links(panel: dict, field: str) -> list[dict]:
    """The data links a panel's override by name gives the column `field`."""
    return [link for override in panel["fieldConfig"].get("overrides", [])
            if override["matcher"] == {"id": "byName", "options": field}
            for prop in override["properties"] if prop["id"] == "links" for link in prop["value"]]


def test_every_dashboard_links_to_the_others_by_tag() -> None:
    """One link set on each dashboard: the dashboards tagged stepscope (all three), keeping the time range and
    the variables (the data source among them)."""
    for name, model in dashboards().items():
        assert "stepscope" in model["tags"], name
        links = [link for link in model.get("links", []) if link.get("type") == "dashboards"]
        assert [(link["tags"], link["keepTime"], link["includeVars"]) for link in links] == [
            (["stepscope"], True, True)], name


def test_training_tables_link_a_ranks_node_to_the_node_dashboard() -> None:
    """The Straggler scores say to check a straggler's node on the Node dashboard: the instance of each per-rank
    table opens it on that node, with the time range and the data source picked."""
    models = dashboards()
    by_title = {panel["title"]: panel for panel in panels(models["stepscope-training.json"])}
    for table in ("Per-rank comparison", "Where each rank is"):
        (link,) = _field_links(by_title[table], "instance")
        path, _, query_string = link["url"].partition("?")
        assert path == "/d/stepscope-node"
        assert {"var-instance=${__value.raw}", "var-datasource=${datasource}", "${__url_time_range}"} == set(
            query_string.split("&"))


def test_cluster_tables_link_runs_and_nodes_to_their_dashboards() -> None:
    """The Runs table's run opens the Training dashboard on that run, the Nodes table's instance the Node
    dashboard on that node: real uids and variables, with the time range and the data source picked."""
    models = dashboards()
    by_title = {panel["title"]: panel for panel in panels(models["stepscope-cluster.json"])}
    for table, field, target, variable in (("Runs", "run", "stepscope-training", "run"),
                                           ("Nodes", "instance", "stepscope-node", "instance")):
        links = _field_links(by_title[table], field)
        assert len(links) == 1, (table, links)
        url = links[0]["url"]
        path, _, query_string = url.partition("?")
        assert path == f"/d/{target}", url
        assert f"{target}.json" in models
        params = query_string.split("&")
        assert f"var-{variable}=${{__value.raw}}" in params, url
        assert "var-datasource=${datasource}" in params and "${__url_time_range}" in params, url
        names = {v["name"] for v in models[f"{target}.json"]["templating"]["list"]}
        assert {variable, "datasource"} <= names, (target, names)


def score_bars(scores: dict[str, tuple[float, float]]) -> list[dict]:
    """The Straggler scores bars' rows of ranks on nodes of 8 (rank -> step and local score): one per rank and
    score, named by its `bar` label alone."""
    return [{"labels": f'{{bar="rank {rank} {kind} (n{int(rank) // 8})"}}', "value": value}
            for rank, pair in scores.items() for kind, value in zip(("step", "local"), pair, strict=True)]


def _training_panel_test(name: str, inputs: list[dict], panel: str, expected: dict[str, list[dict]], tmp: Path) -> str:
    """promtool's verdict on the Training dashboard's `panel` as Grafana sends it for run `big`, every rank picked and
    the ranks drawn at first, evaluated at the end of a 10m time range (Grafana's `$__interval` 1m): each target of
    `expected` (by refId) returns exactly its samples."""
    model = dashboards()["stepscope-training.json"]
    (targets,) = [target_list["targets"] for target_list in panels(model) if target_list["title"] == panel]
    values = {"run": "big", "rank": "$__all", "ranks_drawn": "5"}
    tests = [{"expr": grafana_interpolate(target["expr"].replace("$__range", "10m").replace("$__interval", "1m"),
                                          model, values),
              "eval_time": "10m", "exp_samples": expected[target["refId"]]}
             for target in targets if target["refId"] in expected]
    return promtool_expressions(tmp / f"{name}.yml", inputs, tests, interval="1m")


# Run `big` on 64 GPUs (8 nodes of 8), run `other` on node o's 8: GPU (node, index) -> its reading where not typical.
BIG_GPUS = [(f"n{node}", str(gpu)) for node in range(8) for gpu in range(8)]
LEAST_USED = {("n1", "2"): "0.1x10", ("n3", "0"): "0.2x10", ("n4", "7"): "0.3x10", ("n6", "6"): "0.4x10",
              ("n7", "1"): "0.1x4 0.9x6"}  # n7's GPU 1 was idle for the first 5 minutes: 0.5 over the range
FULLEST = {("n0", "0"): "0.99x10", ("n2", "3"): "0.98x10", ("n5", "5"): "0.97x10", ("n5", "6"): "0.96x10",
           ("n7", "7"): "0.95x4 0.1x6"}


def test_the_run_gpu_panels_draw_as_many_gpus_as_ranks_drawn(tmp_path: Path) -> None:
    """The Training dashboard's per-GPU panels of a run on 64 GPUs, evaluated by promtool: the utilization panel
    draws the 5 least used GPUs over the range, the memory panel the 5 fullest of the run's GPUs (not those of
    another run on node o), 5 lines each as for the ranks. Before: a line per GPU, 64 per query (512 for a run of
    256 GPUs, effective and NVML)."""
    inputs = []
    for instance, gpu in BIG_GPUS:
        where = f'instance="{instance}",gpu="{gpu}"'
        inputs += [
            {"series": f'{rec.RUN_GPU_EFFECTIVE_UTILIZATION_BY_GPU}{{{where},run="big",source="sm_active"}}',
             "values": LEAST_USED.get((instance, gpu), "0.8x10")},
            {"series": f'{rec.RUN_GPU_UTILIZATION_BY_GPU}{{{where},run="big"}}', "values": "0.9x10"},
            {"series": f'{rec.GPU_MEMORY_USED_RATIO}{{{where}}}', "values": FULLEST.get((instance, gpu), "0.5x10")},
            {"series": f'{rec.RANK_GPU_MEMORY}{{{where},run="big",rank="{BIG_GPUS.index((instance, gpu))}"}}',
             "values": "1e9x10"}]
    for gpu in range(8):
        where = f'instance="o",gpu="{gpu}"'
        inputs += [{"series": f'{rec.GPU_MEMORY_USED_RATIO}{{{where}}}', "values": "1x10"},
                   {"series": f'{rec.RANK_GPU_MEMORY}{{{where},run="other",rank="{gpu}"}}', "values": "1e9x10"}]

    def samples(name: str, readings: dict[tuple[str, str], str], extra: str, at_end: dict[str, float]) -> list[dict]:
        return [{"labels": f'{name}{{instance="{instance}",gpu="{gpu}"{extra}}}',
                 "value": at_end.get(values, float(values.rsplit(" ", 1)[-1].split("x")[0]))}
                for (instance, gpu), values in readings.items()]

    effective = samples(rec.RUN_GPU_EFFECTIVE_UTILIZATION_BY_GPU, LEAST_USED, ',run="big",source="sm_active"', {})
    nvml = samples(rec.RUN_GPU_UTILIZATION_BY_GPU, {gpu: "0.9x10" for gpu in LEAST_USED}, ',run="big"', {})
    memory = samples("", FULLEST, "", {})
    failed = _training_panel_test("utilization", inputs, "GPU utilization of the run's GPUs",
                            {"A": effective, "B": nvml}, tmp_path)
    failed += _training_panel_test("memory", inputs, "GPU memory used of the run's GPUs", {"A": memory}, tmp_path)
    assert not failed, failed


# 20 ranks pushing for 10 minutes: ranks 14-19 never stepped (still in setup) and have no score, the rest step in
# 0.1 s or less with a data-loading share of 0.1, 5 of them scored below 1 (step, local).
SCORED_LOW = {"3": ("0.5", "1"), "7": ("1", "0.6"), "1": ("0.8", "1"), "2": ("1", "0.85"), "4": ("0.9", "1")}
STEPPING = 14


def _pushing_with_six_unscored() -> list[dict]:
    inputs = []
    for rank in range(20):
        labels = f'run="big",rank="{rank}",instance="n{rank // 8}"'
        inputs.append({"series": f"{rec.RANK_STEPS_RATE}{{{labels}}}", "values": f"{10 * (rank < STEPPING)}x10"})
        if rank < STEPPING:
            step, local = SCORED_LOW.get(str(rank), ("1", "1"))
            inputs += [{"series": f"{rec.RANK_STRAGGLER_SCORE}{{{labels}}}", "values": f"{step}x10"},
                       {"series": f"{rec.RANK_STRAGGLER_LOCAL_SCORE}{{{labels}}}", "values": f"{local}x10"},
                       {"series": f"{rec.RANK_DATALOADER_SHARE}{{{labels}}}", "values": "0.1x10"}]
            inputs += [{"series": f'{fam.STEP_SECONDS}_bucket{{{labels},le="{le}"}}', "values": "0+600x10"}
                       for le in ("0.1", "+Inf")]
    return inputs


def test_the_panels_of_stepping_ranks_draw_the_lowest_scored_however_many_are_unscored(tmp_path: Path) -> None:
    """Straggler scores, Data-loading share and Step time per rank of a run whose 6 ranks pushed but have no score
    yet, evaluated by promtool: the 5 lowest scored ranks (bars of both scores, lines of their share, p50 and p95).
    Before, the unscored ranks counted as score 0 took all 5 places, and these panels, which have nothing to draw
    for a rank that never stepped, drew no rank at all (no series for any of the 5 queries)."""
    def scored(value: object) -> list[dict]:  # averaged over the range: the metric's name is gone
        return [{"labels": f'{{run="big",rank="{rank}",instance="n{int(rank) // 8}"}}',
                 "value": float(value(scores) if callable(value) else value)} for rank, scores in SCORED_LOW.items()]

    def lines(value: float) -> list[dict]:  # named for the legend: the metric's name is gone
        return [{"labels": f'{{run="big",rank="{rank}",instance="n{int(rank) // 8}",rank_shown="{rank}"}}',
                 "value": value} for rank in SCORED_LOW]

    expected = {
        "Straggler scores": {"A": score_bars({rank: tuple(map(float, scores)) for rank, scores in SCORED_LOW.items()})},
        "Data-loading share per rank": {"A": lines(0.1),
                                        "B": [{"labels": '{run="big"}', "value": 0.1}]},
        "Step time p50 / p95 per rank": {"A": lines(0.05), "B": lines(0.095), "C": [], "D": []},
    }
    failed = "".join(_training_panel_test(f"panel{index}", _pushing_with_six_unscored(), panel, targets, tmp_path)
                     for index, (panel, targets) in enumerate(expected.items()))
    assert not failed, failed


# 20 ranks stepping for 10 minutes, 1m apart: rank 17 slow in step time for the first 5 readings (0.5, then 1), ranks
# 3, 5, 9 and 11 a little below typical throughout (step, local), the rest at 1.
HALF_SLOW = "0.5x4 1x6"
SCORES = {"17": (HALF_SLOW, "1"), "3": ("0.9", "1"), "5": ("1", "0.92"), "9": ("1", "0.95"), "11": ("1", "0.97")}


def _scores_over_the_range() -> list[dict]:
    inputs = []
    for rank in range(20):
        labels = f'run="big",rank="{rank}",instance="n{rank // 8}"'
        step, local = SCORES.get(str(rank), ("1", "1"))
        inputs += [{"series": f"{rec.RANK_STEPS_RATE}{{{labels}}}", "values": "10x10"},
                   {"series": f"{rec.RANK_STRAGGLER_SCORE}{{{labels}}}",
                    "values": step if " " in step else f"{step}x10"},
                   {"series": f"{rec.RANK_STRAGGLER_LOCAL_SCORE}{{{labels}}}", "values": f"{local}x10"}]
    return inputs


def test_the_table_sorts_and_the_bars_show_the_figure_that_draws_the_ranks(tmp_path: Path) -> None:
    """Rank 17, slow for the first half of the range (0.5, then 1: 0.773 over it), is drawn everywhere for its range
    average. The Per-rank comparison sorts on the lower score over the range, and the Straggler scores bars show each
    score over the range: rank 17 reads 0.773 in both. Before, the table sorted on the score now, where rank 17 reads
    1, tied with 15 of 20 ranks (14th of 64 in an hour's test), and its step bar read 1 too."""
    over_the_range = (5 * 0.5 + 6) / 11  # the 11 readings of the 10m range at its end, both ends in

    def labelled(rank: str, value: float) -> dict:
        return {"labels": f'{{run="big",rank="{rank}",instance="n{int(rank) // 8}"}}', "value": value}

    def average(values: str) -> float:
        return over_the_range if values == HALF_SLOW else float(values)

    lowest = [labelled(str(rank), min(average(score) for score in SCORES.get(str(rank), ("1", "1"))))
              for rank in range(20)]
    bars = {"A": score_bars({rank: (average(step), average(local)) for rank, (step, local) in SCORES.items()})}
    failed = _training_panel_test("table", _scores_over_the_range(), "Per-rank comparison", {"A": lowest}, tmp_path)
    failed += _training_panel_test("bars", _scores_over_the_range(), "Straggler scores", bars, tmp_path)
    assert not failed, failed
    (table,) = [panel for panel in panels(dashboards()["stepscope-training.json"])
                if panel["title"] == "Per-rank comparison"]
    (organize,) = [step["options"] for step in table["transformations"] if step["id"] == "organize"]
    assert table["options"]["sortBy"] == [{"displayName": organize["renameByName"]["Value #A"], "desc": False}]


# 64 ranks scored for 10 minutes, 1m apart: rank -> (step, local) where not typical (1, 1). The lowest scores are
# those of ranks 3, 9, 17, 40 and 60, in label order 0.5, 0.65 (local), 0.6, 0.7, 0.9.
UNEVEN_SCORES = {"3": (0.5, 1.0), "9": (0.8, 0.65), "17": (0.6, 1.0), "40": (0.7, 0.95), "60": (0.9, 1.0)}
# Grafana's bar gauge draws 25 table rows unless told more; 512 ranks with a bar for each of 2 scores must fit.
ROWS_A_BAR_GAUGE_MUST_DRAW = 2 * 512


def _uneven_scores() -> list[dict]:
    inputs = []
    for rank in range(64):
        labels = f'run="big",rank="{rank}",instance="n{rank // 8}"'
        step, local = UNEVEN_SCORES.get(str(rank), (1.0, 1.0))
        inputs += [{"series": f"{rec.RANK_STEPS_RATE}{{{labels}}}", "values": "10x10"},
                   {"series": f"{rec.RANK_STRAGGLER_SCORE}{{{labels}}}", "values": f"{step}x10"},
                   {"series": f"{rec.RANK_STRAGGLER_LOCAL_SCORE}{{{labels}}}", "values": f"{local}x10"}]
    return inputs


def test_the_straggler_bars_are_one_list_lowest_first(tmp_path: Path) -> None:
    """Straggler scores of 64 ranks, the 5 drawn scoring 0.5-0.9: one instant table query returns a row per drawn
    rank and score (promtool), named "rank 17 step (n2)", and Grafana sorts the rows on their value, lowest first,
    drawing every row. Before, a query per score gave the bars in label order, query by query: rank 17's 0.6 third
    after rank 9's 0.8, rank 9's local 0.65 seventh."""
    failed = _training_panel_test("uneven", _uneven_scores(), "Straggler scores",
                                  {"A": score_bars(UNEVEN_SCORES)}, tmp_path)
    assert not failed, failed
    (bars,) = [panel for panel in panels(dashboards()["stepscope-training.json"])
               if panel["title"] == "Straggler scores"]
    (target,) = bars["targets"]
    assert (target["format"], target["instant"]) == ("table", True)
    assert [step for step in bars["transformations"] if step["id"] == "sortBy"] == [
        {"id": "sortBy", "options": {"fields": {}, "sort": [{"field": "Value", "desc": False}]}}]


def test_a_bar_gauge_of_table_rows_draws_every_row() -> None:
    """A bar gauge showing table rows ("All values") draws its first 25 unless its `limit` says more: the Cluster
    dashboard's GPU utilization per node, `all` nodes drawn, dropped every node after the 25th least used."""
    rows_panels = [(name, panel) for name, model in dashboards().items() for panel in panels(model)
                   if panel["type"] == "bargauge" and panel["options"]["reduceOptions"]["values"]]
    assert rows_panels
    for name, panel in rows_panels:
        assert panel["options"]["reduceOptions"].get("limit", 25) >= ROWS_A_BAR_GAUGE_MUST_DRAW, (name, panel["title"])


# 64 ranks training for 10 minutes, 1m apart, each pushing to its node: rank 50 hangs in a checkpoint from minute 6,
# ranks 60 and 61 evaluate at minutes 2-3 while the rest train; ranks 1, 2, 3, 4 and 7 score lowest.
TRAINING, EVALUATING, HUNG_IN_CHECKPOINT = ["train"] * 11, ["train"] * 2 + ["eval"] * 2 + ["train"] * 7, \
    ["train"] * 6 + ["checkpoint"] * 5
STATE_OF = {"50": HUNG_IN_CHECKPOINT, "60": EVALUATING, "61": EVALUATING}
LOW_SCORES = {"3": "0.5", "7": "0.6", "1": "0.8", "2": "0.85", "4": "0.9"}


def _states_of_64_ranks() -> list[dict]:
    inputs = []
    for rank in range(64):
        labels = f'run="big",rank="{rank}",instance="n{rank // 8}"'
        states = STATE_OF.get(str(rank), TRAINING)
        inputs += [{"series": f'{fam.TRAINING_STATE}{{{labels},state="{state}"}}',
                    "values": " ".join(str(int(now == state)) for now in states)} for state in STATES]
        score = LOW_SCORES.get(str(rank), "1")
        inputs += [{"series": f"{fam.TRAINING_LAST_PUSH}{{{labels}}}", "values": "1e9+60x10"},
                   {"series": f"{rec.RANK_STEPS_RATE}{{{labels}}}", "values": "10x10"},
                   {"series": f"{rec.RANK_STRAGGLER_SCORE}{{{labels}}}", "values": f"{score}x10"},
                   {"series": f"{rec.RANK_STRAGGLER_LOCAL_SCORE}{{{labels}}}", "values": "1x10"}]
    return inputs


def test_the_state_timeline_draws_the_ranks_in_another_state_and_the_drawn_ones_and_counts_the_rest(
        tmp_path: Path) -> None:
    """Training state per rank of 64 ranks, evaluated by promtool at the end of 10 minutes: a row for the rank hung in
    a checkpoint (50, checkpoint now), the two that evaluated while the others trained (60, 61), the 5 ranks drawn
    (1, 2, 3, 4, 7), and one row "56 other ranks" in the run's most common state, train. Before: 64 rows, one per
    rank, in a panel 8 units high."""
    shown = {rank: 2 for rank in ("1", "2", "3", "4", "7", "60", "61")} | {"50": 4}
    expected = {"A": [{"labels": f'{{rank="{rank}"}}', "value": code} for rank, code in shown.items()],
                "B": [{"labels": '{run="big",hidden="56"}', "value": 2}]}
    failed = _training_panel_test("states", _states_of_64_ranks(), "Training state per rank", expected, tmp_path)
    assert not failed, failed


def _stalled_by_one_rank(hung_in: str | None) -> list[dict]:
    """64 training ranks on 8 nodes whose run stalled at 4m: rank 50 hung since 240 s in phase `hung_in` (or between
    phases: None), the others entered backward 0.3 s later and wait in its all-reduce; all ended their last step at
    239.9 s. Rank 64 closed at 10 s (idle, its last step then)."""
    inputs = [{"series": f'{rec.NODE_CLOCK_OFFSET}{{instance="n{node}",job="stepscope"}}', "values": "0x10"}
              for node in range(8)]
    for rank in range(65):
        labels = f'run="big",rank="{rank}",instance="n{min(rank, 63) // 8}",job="stepscope"'
        training = rank < 64
        phase, entered = (hung_in, 240) if rank == 50 else (BACKWARD_PHASE, 240.3)
        inputs += [{"series": f"{fam.TRAINING_LAST_STEP}{{{labels}}}", "values": "239.9x10" if training else "10x10"},
                   {"series": f"{fam.TRAINING_LAST_PUSH}{{{labels}}}", "values": "0+60x10"}]
        inputs += [{"series": f'{fam.TRAINING_STATE}{{{labels},state="{state}"}}',
                    "values": f"{int(state == (TRAIN_STATE if training else IDLE_STATE))}x10"} for state in STATES]
        if training and phase is not None:
            inputs.append({"series": f'{fam.TRAINING_PHASE_ENTERED}{{{labels},phase="{phase}"}}',
                           "values": f"{entered}x10"})
    return inputs


@pytest.mark.parametrize(("hung_in", "shown_as", "seconds"), [(DATA_LOADING_PHASE, DATA_LOADING_PHASE, 360),
                                                               (None, BETWEEN_PHASES, 360.1)])
def test_where_each_rank_is_puts_the_rank_a_stalled_run_waits_for_on_top(
        hung_in: str | None, shown_as: str, seconds: float, tmp_path: Path) -> None:
    """Where each rank is, 64 ranks stalled by rank 50, evaluated by promtool at 10m: the table sorts on seconds in
    its phase, highest first, where rank 50 reads the most (360 s hung in its loader, the others 359.7 s). Before,
    the table had no sort: rows in label order, rank 50 the 51st of 64 on a real Prometheus. A rank hung between the
    timed phases had no figure and sorted last: now its seconds since its last step (360.1 s) stand in; rank 64,
    closed 590 s ago, has none and stays below."""
    (table,) = [panel for panel in panels(dashboards()["stepscope-training.json"])
                if panel["title"] == "Where each rank is"]
    (organize,) = [step["options"] for step in table["transformations"] if step["id"] == "organize"]
    assert table["options"].get("sortBy") == [{"displayName": organize["renameByName"]["Value #B"], "desc": True}]
    (in_its_phase,) = [target["expr"] for target in table["targets"] if target["refId"] == "B"]
    expr = grafana_interpolate(in_its_phase, dashboards()["stepscope-training.json"], {"run": "big", "rank": "$__all"})
    on_top = [{"labels": f'{{run="big",rank="50",instance="n6",job="stepscope",phase="{shown_as}"}}',
               "value": seconds}]
    assert not promtool_expressions(tmp_path / "stalled.yml", _stalled_by_one_rank(hung_in),
                                    [{"expr": f"topk(1, {expr})", "eval_time": "10m", "exp_samples": on_top},
                                     {"expr": f"count({expr})", "eval_time": "10m", "exp_samples": [{"value": 64}]}],
                                    interval="1m")


# 32 nodes of 8 GPUs for 10 minutes, 1m apart: node n17's GPUs idle for the first half (0.1, then 0.9: 0.536 over
# the range), n3, n8, n20 and n29 a little less used than the rest (0.9); n5 and four others busiest on the CPU; n11
# and four others slowest in samples per second.
NODES = [f"n{node}" for node in range(32)]
GPU_USE = {"n17": "0.1x4 0.9x6", "n3": "0.7x10", "n8": "0.75x10", "n20": "0.8x10", "n29": "0.85x10"}
CPU_USE = {"n5": "0.99x10", "n6": "0.95x10", "n7": "0.9x10", "n30": "0.85x10", "n31": "0.8x10"}
SAMPLES = {"n11": "100x10", "n12": "200x10", "n13": "300x10", "n14": "400x10", "n15": "450x10"}


def _cluster_panel_test(name: str, inputs: list[dict], panel: str, expected: dict[str, list[dict]], tmp: Path) -> str:
    """promtool's verdict on the Cluster dashboard's `panel` with its variables at their defaults, at the end of a
    10m time range: each target of `expected` (by refId) returns exactly its samples."""
    model = dashboards()["stepscope-cluster.json"]
    (targets,) = [found["targets"] for found in panels(model) if found["title"] == panel]
    tests = [{"expr": grafana_interpolate(target["expr"].replace("$__range", "10m"), model, {"nodes_drawn": "5"}),
              "eval_time": "10m", "exp_samples": expected[target["refId"]]}
             for target in targets if target["refId"] in expected]
    return promtool_expressions(tmp / f"{name}.yml", inputs, tests, interval="1m")


def test_the_cluster_per_node_panels_draw_the_nodes_that_stand_out_beside_the_median(tmp_path: Path) -> None:
    """The Cluster dashboard's per-node lines and bars at 32 nodes, evaluated by promtool: the 5 least used nodes
    over the range (n17, idle for half of it, among them though it reads 0.9 now), the 5 busiest on the CPU, the 5
    slowest in samples per second, each beside the median node. Before: 32 lines (bars) per panel."""
    inputs = []
    for node in NODES:
        inputs += [{"series": f'{rec.NODE_GPU_EFFECTIVE_UTILIZATION_IN_RUN}{{instance="{node}"}}',
                    "values": GPU_USE.get(node, "0.9x10")},
                   {"series": f'{rec.NODE_GPU_EFFECTIVE_UTILIZATION}{{instance="{node}"}}',
                    "values": GPU_USE.get(node, "0.9x10")},
                   {"series": f'{rec.NODE_CPU_UTILIZATION}{{instance="{node}"}}',
                    "values": CPU_USE.get(node, "0.3x10")},
                   {"series": f'{rec.RANK_SAMPLES_RATE}{{instance="{node}",run="big",rank="{node[1:]}"}}',
                    "values": SAMPLES.get(node, "500x10")}]

    def now(name: str, readings: dict[str, str]) -> list[dict]:
        return [{"labels": f'{name}{{instance="{node}"}}', "value": float(values.split()[-1].split("x")[0])}
                for node, values in readings.items()]

    over_the_range = {"n17": (5 * 0.1 + 6 * 0.9) / 11, "n3": 0.7, "n8": 0.75, "n20": 0.8, "n29": 0.85}
    expected = {
        "GPU utilization in runs per node": {"A": now(rec.NODE_GPU_EFFECTIVE_UTILIZATION_IN_RUN, GPU_USE),
                                             "B": [{"labels": "{}", "value": 0.9}]},
        "GPU utilization per node": {"A": [{"labels": f'{{instance="{node}"}}', "value": value}
                                           for node, value in over_the_range.items()]},
        "CPU utilization per node": {"A": now(rec.NODE_CPU_UTILIZATION, CPU_USE),
                                     "B": [{"labels": "{}", "value": 0.3}]},
        "Samples per second per node": {"A": [{"labels": f'{{instance="{node}"}}', "value": sample["value"]}
                                              for node, sample in zip(SAMPLES, now("", SAMPLES), strict=True)],
                                        "B": [{"labels": "{}", "value": 500}]},
    }
    failed = "".join(_cluster_panel_test(f"cluster{index}", inputs, panel, targets, tmp_path)
                     for index, (panel, targets) in enumerate(expected.items()))
    assert not failed, failed


def test_the_heat_map_draws_the_gpus_of_the_nodes_with_the_least_used_gpu(tmp_path: Path) -> None:
    """GPU utilization, node x GPU at 32 nodes of 8 GPUs, evaluated by promtool at the end of 10 minutes: the 8 GPUs
    of each of the 5 nodes whose least used GPU is lowest over the range, n8 among them for its one sick GPU (0.2
    among 0.9s), n17 for its GPU idle the first half (0.54 over the range though 0.9 now), not n30 (0.86): 40 rows.
    Before: 256 rows in a panel 10 units high, about a pixel each."""
    least_used_gpu = {"n17": {"5": "0.1x4 0.9x6"}, "n8": {"2": "0.2x10"}, "n3": dict.fromkeys("01234567", "0.7x10"),
                      "n20": dict.fromkeys("01234567", "0.8x10"), "n29": dict.fromkeys("01234567", "0.85x10"),
                      "n30": dict.fromkeys("01234567", "0.86x10")}
    inputs = [{"series": f'{rec.GPU_EFFECTIVE_UTILIZATION}{{instance="{node}",gpu="{gpu}",source="sm_active"}}',
               "values": least_used_gpu.get(node, {}).get(str(gpu), "0.9x10")} for node in NODES for gpu in range(8)]
    model = dashboards()["stepscope-cluster.json"]
    (heat_map,) = [panel for panel in panels(model) if panel["title"] == "GPU utilization, node x GPU"]
    (target,) = heat_map["targets"]
    expr = grafana_interpolate(target["expr"].replace("$__range", "10m"), model, {"nodes_drawn": "5"})
    rows = [{"labels": f'{{instance="{node}"}}', "value": 8} for node in ("n17", "n8", "n3", "n20", "n29")]
    test = {"expr": f"count by (instance) ({expr})", "eval_time": "10m", "exp_samples": rows}
    assert not promtool_expressions(tmp_path / "heatmap.yml", inputs, [test], interval="1m")


def test_the_gpu_utilization_bars_put_the_least_used_node_on_top() -> None:
    """GPU utilization per node: a bar gauge draws its series in the order they come, and a range query's come in
    label order (on a real Prometheus at 32 nodes: n17 0.61, n20 0.80, n29 0.85, n3 0.70, n8 0.75). Its one query is
    now an instant table whose rows Grafana's sortBy orders by value, lowest first, a bar per row (the values the
    promtool test above checks): n17, n3, n8, n20, n29."""
    (bars,) = [panel for panel in panels(dashboards()["stepscope-cluster.json"])
               if panel["title"] == "GPU utilization per node"]
    (target,) = bars["targets"]
    assert (target.get("instant"), target.get("format")) == (True, "table")
    assert bars["options"]["reduceOptions"]["values"] is True
    assert bars["transformations"] == [{"id": "sortBy",
                                        "options": {"fields": {}, "sort": [{"field": "Value", "desc": False}]}}]


def test_the_step_time_lines_match_the_drawn_ranks_before_the_buckets_still_exported() -> None:
    """The p50 / p95 lines keep the drawn ranks' bucket rates first, then match those to the buckets still exported:
    matching all 6,400 bucket rates of 256 ranks to all 6,400 buckets first took 8-38 s per line over 6 hours on
    Prometheus 2.42, 3-6 s this way round (benchmarks/bench_dashboard_queries.py), the same lines either way
    (tests/test_dashboards_ranks.py)."""
    model = dashboards()["stepscope-training.json"]
    (targets,) = [panel["targets"] for panel in panels(model) if panel["title"] == "Step time p50 / p95 per rank"]
    buckets = f"{fam.STEP_SECONDS}_bucket"
    rates = re.escape(f'rate({buckets}{{run="$run",rank=~"$rank"}}[1m])')
    quantiles = [target["expr"] for target in targets if "histogram_quantile" in target["expr"]]
    assert len(quantiles) == 2
    for expr in quantiles:
        assert re.findall(rf"{rates} and on \(run, rank\) bottomk", expr), expr
        assert not re.findall(rf"{rates} and {buckets}", expr), expr


def test_time_per_state_shows_the_time_ranges_seconds_at_every_step(tmp_path: Path) -> None:
    """The Training dashboard's Time per state over the last hour of two (rank 0 trained the first, idled the
    second), evaluated by promtool at the range's end and halfway through, as a range query evaluates it at each
    step (`end()` is the range's end there): the range's 0 s of train and 3,600 s of idle both times. Before, each
    step took the increase over the hour before it, 1,800 s of each halfway, and a range query re-read the whole range
    at each of its 1,000 steps."""
    model = dashboards()["stepscope-training.json"]
    (expr,) = [target["expr"] for panel in panels(model) if panel["title"] == "Time per state"
               for target in panel["targets"]]
    filled = grafana_interpolate(expr.replace("$__range", "1h"), model, {"run": "big", "rank": "$__all"})
    labels = 'run="big",rank="0",instance="n0",job="stepscope"'
    inputs = [{"series": f'{fam.STATE_SECONDS}{{{labels},state="train"}}', "values": "0+15x240 3600x240"},
              {"series": f'{fam.STATE_SECONDS}{{{labels},state="idle"}}', "values": "0x240 15+15x239"}]
    range_seconds = [{"labels": '{state="idle"}', "value": 3600}, {"labels": '{state="train"}', "value": 0}]
    tests = [{"expr": filled, "eval_time": "2h", "exp_samples": range_seconds},
             {"expr": filled.replace("@ end()", "@ 7200"), "eval_time": "90m", "exp_samples": range_seconds}]
    assert not promtool_expressions(tmp_path / "states.yml", inputs, tests)


def test_the_drawn_ranks_lines_read_their_series_once() -> None:
    """A per-rank line named for the legend ("rank 3", "rank 3 on n2") reads its series once: named in two branches
    (the moved ranks' lines and the others') it read them twice, and the step-time p50 of 256 ranks over 6 hours
    took 2.4-2.7 s instead of 1.1-1.2 s (benchmarks/bench_dashboard_queries.py), the same lines either way."""
    model = dashboards()["stepscope-training.json"]
    reads = {(panel["title"], target["refId"]): target["expr"] for panel in panels(model)
             for target in panel.get("targets", []) if "{{rank_shown}}" in target.get("legendFormat", "")}
    assert reads[("Throughput", "B")].count(f'{rec.RANK_SAMPLES_RATE}{{run="$run",rank=~"$rank"}}') == 1
    for ref_id in "AB":  # p50 and p95: the buckets' rates and the buckets still exported, once each
        assert reads[("Step time p50 / p95 per rank", ref_id)].count(f"{fam.STEP_SECONDS}_bucket{{") == 2

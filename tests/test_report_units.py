"""stepscope-report's parts without a Prometheus: its PromQL against the metric contract and promtool,
times, windows, the Gantt intervals and the critical path from series, CSV cells, the output
directory that is replaced only when a report is complete, and the verdict in words for the readings
of a real H100 (saturated bf16: NVML 0.98, SM active 0.73, tensor cores 0.58)."""

import dataclasses
import errno
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from html import escape
from pathlib import Path

import pytest
import yaml
from matplotlib.figure import Figure

from grafana.rules import RULE_FILES
from stepscope.contract import DATA_LOADING_PHASE, FORWARD_PHASE, THRESHOLDS, recordings, verdicts
from stepscope.contract import SAMPLE_NAMES as EXPORTER_METRICS
from stepscope.report import cli, collect, output, page, plots, queries, report, summary
from stepscope.report.collect import RunData
from stepscope.report.prometheus import Series
from stepscope.report.resize import Resize, resizes
from stepscope.report.summary import RankSummary, RunTotals
from stepscope.report.timeline import (
    SPELL_MIN_SECONDS,
    critical_path,
    labelled_intervals,
    state_intervals,
    straggler_spells,
)
from stepscope.report.times import iso, parse_time
from stepscope.report.verdict import FIXES, HEADLINES, NO_VERDICT, Assessment, Check, assess
from stepscope.report.window import Window, aligned, resolution, run_start

RULE_NAME = re.compile(r"\b\w+:\w+:\w+\b")
EXPORTER_NAME = re.compile(r"\bstepscope_\w+")
WINDOW = Window(1000.0, 1100.0, 10.0)


def _all_queries(step: float = 15.0) -> dict[str, str]:
    window = Window(1_700_000_000.0, 1_700_003_600.0, step)
    built = queries.build('we"ird\\run', window, ["node-a", "gpu.node+1"])
    run_quantiles = queries.run_quantiles('we"ird\\run', window, ["+Inf", "0.5", "1e-05"])
    resets = queries.counter_resets('we"ird\\run', window)
    steady = queries.build('we"ird\\run', window, [], set(resets)).totals
    at_first_points = queries.first_scrape_values('we"ird\\run', window)
    return {**{f"total {k}": v for k, v in (built.totals | run_quantiles | at_first_points).items()},
            **{f"total without resets {k}": v for k, v in steady.items()},
            **{f"resets of {k}": v for k, v in resets.items()},
            **{f"series {k}": v for k, v in built.over_time.items()}}


def test_queries_use_only_exported_metrics_and_shipped_recording_rules() -> None:
    rules = {rule["record"] for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
             for rule in group["rules"] if "record" in rule}
    for name, expr in _all_queries().items():
        for rule in RULE_NAME.findall(expr):
            assert rule in rules, f"{name}: {rule} is not a shipped recording rule"
        for metric in EXPORTER_NAME.findall(RULE_NAME.sub("", expr)):
            assert metric in EXPORTER_METRICS, f"{name}: {metric} is not an exporter metric"


# timestamp() of a plain selector: `timestamp(name{labels})`
TIMESTAMP_OF_SELECTOR = re.compile(r"timestamp\(\s*[A-Za-z_:][\w:]*\s*(\{[^{}]*\})?\s*\)")


def test_no_query_takes_the_timestamp_of_a_selector_point_by_point() -> None:
    """Prometheus (2.42) evaluates timestamp() of a selector at each point of a range query or subquery by seeking
    through the series's whole range again. The report's test for bucket bounds dropped before a rank's end took
    it over the window (last_over_time(timestamp(bucket)[window:step])): on a 3-day run of 16 ranks with two
    restarts, 10.5 s for that subquery alone, 90 s for each rank quantile query, and the run's p50 and p95 ran
    past Prometheus' 2-minute query timeout: the report ended with an error and nothing written."""
    for name, expr in _all_queries().items():
        assert not TIMESTAMP_OF_SELECTOR.search(expr), f"{name}: {TIMESTAMP_OF_SELECTOR.search(expr)[0]}"


def test_the_processes_first_points_are_searched_for_once() -> None:
    """Finding each process's first point costs Prometheus an aggregation and two vector matchings at every point
    of the window. Each of the five counts asked at them searched for them again, the restarts twice: on a 3 h run
    of 256 ranks, 9.1 s of Prometheus' time, 1.0 s for the search alone. The counts are now instant queries at
    the first points' times (collect.at_first_points)."""
    window = Window(1_700_000_000.0, 1_700_003_600.0, 15.0)
    search = f"[{round(window.seconds * 1000) + queries.BEFORE_MS}ms] offset {window.step_duration}"
    totals = queries.build("r", window, []).totals
    assert [name for name, expr in totals.items() if search in expr] == ["first_step_count"]
    assert all(":" not in expr.rsplit("[", 1)[-1] for expr in queries.first_scrape_values("r", window).values())


def test_the_counts_at_first_points_are_kept_for_the_ranks_starting_there_only() -> None:
    firsts = [Series({"run": "r", "rank": "0", "instance": "a"}, ((1000.0, 1.0), (2000.0, 2.0))),
              Series({"run": "r", "rank": "1", "instance": "a"}, ((2000.0, 1.0),))]

    def answered(*values: tuple[str, float]) -> Future[list[Series]]:
        answer: Future[list[Series]] = Future()
        answer.set_result([Series({"run": "r", "rank": rank, "instance": "a"}, ((0.0, value),))
                           for rank, value in values])
        return answer

    answers = {1000.0: {"first_samples": answered(("0", 32.0), ("1", 640.0))},
               2000.0: {"first_samples": answered(("0", 64.0), ("1", 32.0))}}
    kept = collect.at_first_points(firsts, answers, ["first_samples", "first_restarts"])
    assert kept["first_restarts"] == []
    assert {series.labels["rank"]: series.points for series in kept["first_samples"]} == {
        "0": ((1000.0, 32.0), (2000.0, 64.0)), "1": ((2000.0, 32.0),)}


@pytest.mark.parametrize("step", [15.0, 2.5, 0.5])
def test_every_query_parses_as_promql(tmp_path: Path, step: float) -> None:
    exprs = _all_queries(step).values()
    rules = [{"record": f"report:check:expr{index}", "expr": expr} for index, expr in enumerate(exprs)]
    path = tmp_path / "report-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "report", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_times_in_every_documented_form() -> None:
    now = 1_714_564_800.0
    assert parse_time("2024-05-01T12:00:00Z", now) == 1_714_564_800.0
    assert parse_time("2024-05-01T14:00:00+02:00", now) == 1_714_564_800.0
    assert parse_time("2024-05-01 12:00:00", now) == 1_714_564_800.0  # no zone: UTC
    assert parse_time("1714564800.5", now) == 1_714_564_800.5
    assert parse_time("now", now) == now and parse_time("now-90m", now) == now - 5400
    with pytest.raises(ValueError, match="RFC 3339"):
        parse_time("yesterday", now)
    assert iso(1_714_564_800.25) == "2024-05-01T12:00:00.250Z"


def test_a_time_in_grafanas_milliseconds_is_named_so() -> None:
    """Grafana's URLs (from=1714564800000) carry Unix milliseconds: the error said only that the time must lie
    between years 1 and 9999 in Unix seconds."""
    with pytest.raises(ValueError, match=r"looks like Unix milliseconds \(Grafana's URLs\): 1714564800 is "
                                         r"2024-05-01T12:00:00.000Z$"):
        parse_time("1714564800000", 0)
    with pytest.raises(ValueError, match=r"in Unix seconds$"):  # past what milliseconds could be: no such hint
        parse_time("1e20", 0)


def test_resolution_is_the_scrape_interval_until_the_window_needs_fewer_points() -> None:
    assert resolution(0, 600, 1.0) == 1
    assert resolution(0, 3600, 15.0) == 15
    assert resolution(0, 86400, 15.0) == 120  # 86400 / 1200 = 72 -> the next nice step
    assert resolution(0, 30, 0.2) == 1
    window = aligned(1001.5, 1093.2, 5)
    assert (window.start, window.end, window.step) == (1000, 1095, 5)


def _state(rank: str, state: str, times: list[float]) -> Series:
    return Series({"rank": rank, "instance": "n", "state": state}, tuple((t, 1.0) for t in times))


def test_state_intervals_end_where_the_next_state_is_seen_or_at_a_gap() -> None:
    series = [
        _state("0", "setup", [1000, 1010]),
        _state("0", "train", [1020, 1030, 1040]),
        _state("0", "idle", [1050, 1060]),
        _state("1", "train", [1000, 1010, 1050]),  # a gap of 40 s: the exporter was down
    ]
    got = [(i.rank, i.state, i.start, i.end) for i in state_intervals(series, WINDOW)]
    assert got == [
        ("0", "setup", 1000, 1020), ("0", "train", 1020, 1050), ("0", "idle", 1050, 1070),
        ("1", "train", 1000, 1020), ("1", "train", 1050, 1060),
    ]


def test_ranks_sort_by_number() -> None:
    series = [_state(rank, "train", [1000]) for rank in ("10", "2", "1")]
    assert [i.rank for i in state_intervals(series, WINDOW)] == ["1", "2", "10"]


def test_verdict_intervals() -> None:
    series = [Series({"verdict": "data_bound"}, ((1000, 1), (1010, 1))), Series({"verdict": "idle"}, ((1020, 1),))]
    assert labelled_intervals(series, "verdict", WINDOW) == [("data_bound", 1000, 1020), ("idle", 1020, 1030)]


def test_critical_path_takes_the_lowest_of_either_score() -> None:
    step = [Series({"rank": "0", "instance": "n"}, ((1000, 1.0), (1010, 0.6))),
            Series({"rank": "1", "instance": "n"}, ((1000, 1.0), (1010, 1.4)))]
    local = [Series({"rank": "0", "instance": "n"}, ((1000, 1.7),)),
             Series({"rank": "1", "instance": "n"}, ((1000, 0.3),))]
    path = critical_path(step, local)
    assert [(b.time, b.rank, b.kind, b.score) for b in path] == [
        (1000, "1", "local_phases", 0.3), (1010, "0", "step_time", 0.6)]


def test_a_straggler_spell_is_one_as_long_as_the_straggler_alert_waits_and_bridges_only_short_breaks() -> None:
    """Rank 1 below 0.75 for 9 minutes (not named: the alert would not have paged), then for 12 minutes across a
    2-minute eval without scores (one spell of 12 minutes), then typical; rank 0 typical throughout."""
    below = [*range(0, 540, 60), *range(600, 900, 60), *range(1020, 1440, 60)]  # 9 points, then 5 + 7 after the eval
    times = sorted({*below, *range(540, 600, 60), *range(1440, 1800, 60)})
    local = [Series({"rank": "1", "instance": "n"}, tuple((t, 0.5 if t in below else 1.0) for t in times)),
             Series({"rank": "0", "instance": "n"}, tuple((t, 1.0) for t in times))]
    rules = [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
             for rule in group["rules"] if rule.get("alert") == "StepscopeStragglerRank"]
    assert [rule["for"] for rule in rules] == [f"{SPELL_MIN_SECONDS // 60}m"]
    spells = straggler_spells([], local, set(times), 60.0)
    assert [(s.rank, s.start, s.end, s.slow_seconds, s.score, s.kind, s.recovered) for s in spells] == [
        ("1", 600, 1440, 720, 0.5, "local_phases", True)]
    assert straggler_spells([], local, set(times) - set(range(1020, 1440)), 60.0) == []  # outside training: out


def test_a_straggler_spell_at_a_coarse_resolution_is_one_and_needs_two_points() -> None:
    """At a 12-day window's 900 s resolution, rank 1 below 0.75 at three points in a row is one spell of 45
    minutes, not three (its points were further apart than a 10-minute break), and one point below (a 1m score
    sampled once) is none."""
    def local(below: set[int]) -> list[Series]:
        return [Series({"rank": "1", "instance": "n"}, tuple((t, 0.5 if t in below else 1.0) for t in times)),
                Series({"rank": "0", "instance": "n"}, tuple((t, 1.0) for t in times))]

    times = list(range(0, 9000, 900))
    spells = straggler_spells([], local({1800, 2700, 3600}), set(times), 900.0)
    assert [(s.start, s.end, s.slow_seconds) for s in spells] == [(1800, 4500, 2700)]
    assert straggler_spells([], local({1800}), set(times), 900.0) == []


def _report_dir(path: Path, content: str = "old") -> Path:
    path.mkdir()
    (path / "index.html").write_text(f"{output.MARKER}\n{content}")
    return path


def test_a_failed_report_leaves_the_previous_one_and_no_partial_directory(tmp_path: Path) -> None:
    out = _report_dir(tmp_path / "report")
    with pytest.raises(RuntimeError), output.staged(out) as staging:
        (staging / "index.html").write_text("half")
        raise RuntimeError("Prometheus went away")
    assert [p.name for p in tmp_path.iterdir()] == ["report"]
    assert (out / "index.html").read_text().endswith("old")


def test_a_complete_report_replaces_the_previous_one(tmp_path: Path) -> None:
    out = _report_dir(tmp_path / "report")
    with output.staged(out) as staging:
        (staging / "index.html").write_text(f"{output.MARKER}\nnew")
    assert [p.name for p in tmp_path.iterdir()] == ["report"]
    assert (out / "index.html").read_text().endswith("new")
    assert out.stat().st_mode & 0o777 != 0o700  # not mkdtemp's private mode


def test_a_killed_reports_staging_is_removed_by_the_next_report_and_a_recent_one_kept(tmp_path: Path) -> None:
    """A report killed while writing into an existing --out (SIGKILL, OOM) left its hidden staging directory there
    for good; the next report into it removes one untouched for an hour, not one another report may be writing."""
    out = _report_dir(tmp_path / "report")
    abandoned, recent = out / f"{output.STAGING_PREFIX}killed", out / f"{output.STAGING_PREFIX}writing"
    for staging in (abandoned, recent):
        staging.mkdir()
        (staging / "run_summary.csv").write_text("half")
    hour_ago = time.time() - output.ABANDONED_SECONDS - 60
    os.utime(abandoned, (hour_ago, hour_ago))
    with output.staged(out) as staging:
        (staging / "index.html").write_text(f"{output.MARKER}\nnew")
    assert sorted(p.name for p in out.iterdir()) == sorted(["index.html", recent.name])


def test_a_report_killed_in_an_empty_out_does_not_lock_the_next_one_out(tmp_path: Path) -> None:
    """SIGKILL while the first report into an existing empty --out (a mount point) was written left only its
    staging directory there, and every later report refused the directory: 'holds files that are not a
    stepscope report (.stepscope-partial-...)'."""
    out = tmp_path / "out"
    killed = out / f"{output.STAGING_PREFIX}killed"
    killed.mkdir(parents=True)
    (killed / "run_summary.csv").write_text("half")
    with output.staged(out) as staging:
        (staging / "index.html").write_text(f"{output.MARKER}\nnew")
    assert (out / "index.html").read_text().endswith("new")


def test_a_move_cut_short_leaves_no_page_and_no_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C between the renames into an existing --out: the earlier page is gone first, so no page stands over
    a mix of this run's and the earlier run's CSVs (before: the old page and half the new CSVs)."""
    out = _report_dir(tmp_path / "report")
    (out / "run_summary.csv").write_text("old")
    replace, moves = os.replace, []

    def cut_short(source: Path, target: Path) -> None:
        if len(moves) == 1:
            raise KeyboardInterrupt
        moves.append(target)
        replace(source, target)
    monkeypatch.setattr(os, "replace", cut_short)
    with pytest.raises(KeyboardInterrupt), output.staged(out) as staging:
        for name in ("goodput.csv", "run_summary.csv", "index.html"):
            (staging / name).write_text(f"{output.MARKER}\nnew" if name == "index.html" else "new")
    assert sorted(p.name for p in out.iterdir()) == ["goodput.csv", "run_summary.csv"]
    # the next report says what that is and what to do, not that they are some other program's files
    with pytest.raises(output.OutputError, match=r"holds a report's files without its page \(goodput.csv, "
                                                 r"run_summary.csv\): a report cut short as it moved them in; "
                                                 r"delete them, or choose another directory$"):
        output.check(out)


def test_an_out_under_a_file_names_the_file(tmp_path: Path) -> None:
    """--out afile/report said 'cannot write --out .../afile/report: File exists' (mkdir's word)."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(output.OutputError, match=r"afile is a file, not a directory$"), \
            output.staged(tmp_path / "afile" / "report"):
        pass


def _waits_on_a_lock(directory: Path) -> bool:
    """Whether a lock on `directory` has a waiter (/proc/locks marks one with `->`, the inode last of its id)."""
    inode = f":{directory.stat().st_ino} "
    return any("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux's /proc/locks")
def test_a_report_checks_an_out_another_report_is_moving_into_once_the_move_is_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two reports into one --out (a cron job's and a person's): the second's check, made while the first's moves
    were half done (its page removed first), refused the CSVs as 'files that are not a stepscope report
    (.stepscope-partial-..., critical_path.csv, goodput.csv and 7 more)'; 198 of 200 reports in a loop of two
    writers were refused. It now waits for the move and finds the first's whole report."""
    out = _report_dir(tmp_path / "report")
    (out / "run_summary.csv").write_text("old")
    replace, second_check, outcome = os.replace, [], []

    def check_while_moving(source: Path, target: Path) -> None:
        if not second_check:
            second_check.append(threading.Thread(target=lambda: outcome.append(_checked(out))))
            second_check[0].start()
            while second_check[0].is_alive() and not _waits_on_a_lock(out):
                time.sleep(0.01)
        replace(source, target)
    monkeypatch.setattr(os, "replace", check_while_moving)
    with output.staged(out) as staging:
        for name in ("run_summary.csv", "index.html"):
            (staging / name).write_text(f"{output.MARKER}\nnew" if name == "index.html" else "new")
    second_check[0].join()
    assert outcome == ["a report"] and (out / "index.html").read_text().endswith("new")


def _checked(out: Path) -> str:
    try:
        output.check(out)
    except output.OutputError as exc:
        return str(exc)
    return "a report"


def test_a_write_that_fails_is_one_line_and_keeps_the_earlier_report(tmp_path: Path) -> None:
    out = _report_dir(tmp_path / "report")
    with pytest.raises(output.OutputError, match=r"^cannot write --out .*report: No space left on device$"), \
            output.staged(out) as staging:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(staging / "index.html"))
    assert [p.name for p in out.iterdir()] == ["index.html"] and (out / "index.html").read_text().endswith("old")


WRITE_OVER_A_MOUNT = """
import sys
import time
from pathlib import Path
from stepscope.report import output
out = Path(sys.argv[1])
for content in ("old", "new"):
    with output.staged(out) as staging:
        (staging / "index.html").write_text(f"{output.MARKER}\\n{content}")
print((out / "index.html").read_text().split()[-1], sorted(p.name for p in out.iterdir()))
"""


def test_a_report_into_a_mount_point_is_written_in_place(tmp_path: Path) -> None:
    """--out a mount point (`docker run -v $PWD/out:/out ... --out /out`): staged inside it, so on its own
    filesystem (before: staged in the parent, each rename failed, EXDEV 'Invalid cross-device link')."""
    out = tmp_path / "out"
    out.mkdir()
    mounted = subprocess.run(["unshare", "--mount", "sh", "-c", f'mount -t tmpfs tmpfs "{out}" && exec "$0" -c "$1" '
                              f'"{out}"', sys.executable, WRITE_OVER_A_MOUNT], capture_output=True, text=True,
                             timeout=60)
    if mounted.returncode and "mount" in mounted.stderr and "Traceback" not in mounted.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    assert mounted.returncode == 0, mounted.stderr
    assert mounted.stdout.split() == ["new", "['index.html']"]


def test_other_directories_and_files_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    for name in ("notes", "file"):
        with pytest.raises(output.OutputError), output.staged(tmp_path / name):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "notes"]
    (tmp_path / "empty").mkdir()
    with output.staged(tmp_path / "empty") as staging:
        (staging / "index.html").write_text("x")
    assert (tmp_path / "empty" / "index.html").exists()


def _promtool_totals(tmp_path: Path, window: Window, expected: dict[str, list[dict]]) -> None:
    """Evaluates the report's total queries with promtool's real PromQL engine on exact samples every
    15 s from t=0 to 300 s: rank 0 counts 50 steps before its first scrape, bucket le=0.5 appears at
    60 s and le=0.25 at 180 s (with the counts from before, as the hooks export them); rank 1's
    process restarts at 150 s."""
    def series(name: str, rank: str, values: str, le: str | None = None) -> dict:
        labels = f'run="r",rank="{rank}",instance="n"' + (f',le="{le}"' if le else "")
        return {"series": f"{name}{{{labels}}}", "values": values}

    steps0, steps1 = "50+10x20", "10+10x9 0+10x10"
    inputs = [
        series("stepscope_steps_total", "0", steps0), series("stepscope_steps_total", "1", steps1),
        series("stepscope_step_seconds_bucket", "0", steps0, "+Inf"),
        series("stepscope_step_seconds_bucket", "0", steps0, "1"),
        series("stepscope_step_seconds_bucket", "0", "_x4 72+8x16", "0.5"),
        series("stepscope_step_seconds_bucket", "0", "_x12 17+1x8", "0.25"),
        # 3 s in eval and 1 s in checkpoint every 15 s from t=0, both pushed as counters (hooks' state seconds)
        {"series": 'stepscope_state_seconds_total{run="r",rank="0",instance="n",state="eval"}', "values": "0+3x20"},
        {"series": 'stepscope_state_seconds_total{run="r",rank="0",instance="n",state="checkpoint"}',
         "values": "0+1x20"},
    ]
    _promtool_evaluates(tmp_path, window, inputs, expected)


def _promtool_evaluates(tmp_path: Path, window: Window, inputs: list[dict], expected: dict[str, list[dict]]) -> None:
    """The report's total queries over `window`, evaluated by promtool on `inputs` (samples every 15 s from t=0),
    answer `expected` (query name -> samples)."""
    built = queries.build("r", window, []).totals
    _promtool_evaluates_at(tmp_path, {(built[name], window.end): samples for name, samples in expected.items()}, inputs)


def test_a_rank_series_that_ended_without_a_staleness_marker_ends_a_step_and_a_half_later(tmp_path: Path) -> None:
    """Backfilled or imported history has no staleness markers. A rank lost at 600 s whose exporter group then
    expired: Prometheus showed its state and last push for its 5-minute lookback, and the report drew the rank
    lost 285 s longer than VictoriaMetrics (915 s for 630 s). Now a point shows a sample up to a step and a half
    old, and six scrape intervals where the scrape interval is known (late scrapes: the next test)."""
    labels = 'run="r",rank="0",instance="n"'
    inputs = [{"series": f'stepscope_training_state{{{labels},state="train"}}', "values": "1x40"},
              {"series": f"stepscope_training_last_push_timestamp_seconds{{{labels}}}", "values": "0+15x40"}]
    state = {"labels": f'stepscope_training_state{{{labels},state="train"}}', "value": 1}
    push = {"labels": f"stepscope_training_last_push_timestamp_seconds{{{labels}}}", "value": 600}
    for window, shown, gone in ((Window(0.0, 1200.0, 15.0), 615, 630),
                                (Window(0.0, 1200.0, 1.0, scrape_interval=15.0), 690, 705)):
        over_time = queries.build("r", window, []).over_time
        _promtool_evaluates_at(tmp_path, {
            (over_time["state"], shown): [state], (over_time["last_push"], shown): [push],
            (over_time["state"], gone): [], (over_time["last_push"], gone): []}, inputs)


def test_late_scrapes_of_a_live_run_leave_its_states_whole(tmp_path: Path) -> None:
    """1 s scrapes on a busy server, --step 1: two scrapes 2 s late left points with no sample a scrape interval
    and a half old, and the report cut the rank's train state in two (a clean-clone CI run's Gantt test)."""
    labels = 'run="r",rank="0",instance="n"'
    inputs = [{"series": f'stepscope_training_state{{{labels},state="train"}}', "values": "1x10 _x2 1x10"}]
    state = {"labels": f'stepscope_training_state{{{labels},state="train"}}', "value": 1}
    over_time = queries.build("r", Window(0.0, 30.0, 1.0, scrape_interval=1.0), []).over_time
    _promtool_evaluates_at(tmp_path, {(over_time["state"], at): [state] for at in (11, 12, 13)}, inputs,
                           interval="1s")


def _promtool_evaluates_at(tmp_path: Path, expected: dict[tuple[str, float], list[dict]], inputs: list[dict],
                           interval: str = "15s") -> None:
    """Each (expression, time) answers its samples, by promtool on `inputs` (samples every `interval` from t=0)."""
    tests = [{"expr": expr, "eval_time": f"{at:g}s", "exp_samples": samples}
             for (expr, at), samples in expected.items()]
    spec = {"rule_files": [], "evaluation_interval": interval,
            "tests": [{"interval": interval, "input_series": inputs, "promql_expr_test": tests}]}
    path = tmp_path / "series.yml"
    path.write_text(yaml.safe_dump(spec))
    result = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_totals_of_a_whole_run_count_from_zero_even_when_the_window_starts_on_its_first_sample(
        tmp_path: Path) -> None:
    _promtool_totals(tmp_path, Window(0, 300, 15), {
        "steps": [{"labels": '{rank="0",instance="n"}', "value": 250},
                  # restarted: 100 + 100 through its reset (increase() took its first sample, 10, for a base: 190)
                  {"labels": '{rank="1",instance="n"}', "value": 200}],
        # 250 steps: 25 <= 0.25 s, 200 <= 0.5 s; the 125th lies 100/175 into (0.25, 0.5]
        "p50": [{"labels": '{rank="0",instance="n"}', "value": 0.25 + 0.25 * 100 / 175}],
        "state_seconds": [{"labels": '{rank="0",instance="n",state="checkpoint"}', "value": 20},
                          {"labels": '{rank="0",instance="n",state="eval"}', "value": 60}],
    })


def test_totals_of_a_window_inside_the_run_keep_only_bounds_it_had_at_the_start(tmp_path: Path) -> None:
    # [120, 300]: rank 0 had 120 steps up to 105 s and 250 at the end; le=0.5: 96 -> 200; le=0.25
    # appeared inside the window (its count includes earlier steps) and is left out. Rank 1 restarted
    # inside: 80 (at 105 s) -> 100, then 0 -> 100 (increase() from the window's first sample, 90: 110).
    _promtool_totals(tmp_path, Window(120, 300, 15), {
        "steps": [{"labels": '{rank="0",instance="n"}', "value": 130},
                  {"labels": '{rank="1",instance="n"}', "value": 120}],
        "p50": [{"labels": '{rank="0",instance="n"}', "value": 0.5 * 65 / 104}],
        # [120, 300]: the eval seconds went from 21 (at 105 s) to 60
        "state_seconds": [{"labels": '{rank="0",instance="n",state="checkpoint"}', "value": 13},
                          {"labels": '{rank="0",instance="n",state="eval"}', "value": 39}],
    })


def test_the_runs_quantiles_take_the_bounds_every_rank_has_as_promqls_count_of_ranks_per_bound_does() -> None:
    def bucket(rank: str, instance: str, le: str) -> Series:
        return Series({"rank": rank, "instance": instance, "le": le}, ((0.0, 1.0),))

    # rank 1 on node b never had le=0.25; rank 1 on node a (another process under the same rank) had all three
    answer = [bucket(rank, node, le) for rank, node in (("0", "a"), ("1", "a")) for le in ("0.25", "0.5", "+Inf")]
    answer += [bucket("1", "b", "0.5"), bucket("1", "b", "+Inf")]
    assert collect.shared_bounds(answer) == ["+Inf", "0.5"]
    assert collect.shared_bounds([]) == []
    assert queries.run_quantiles("r", WINDOW, []) == {}
    assert set(queries.run_quantiles("r", WINDOW, ["+Inf", "0.5"])) == {"run_p50", "run_p95"}


def test_the_page_never_shows_credentials_of_the_prometheus_url() -> None:
    from stepscope.report.prometheus import without_credentials

    assert without_credentials("https://reader:s3cret@prom.example:9090/prometheus") == \
        "https://prom.example:9090/prometheus"
    assert without_credentials("http://localhost:9090") == "http://localhost:9090"


TIMES = tuple(1000.0 + 10 * i for i in range(10))  # the points of WINDOW


def _over_time(verdict: str | None, trained: bool = True, **gpu: float) -> dict[str, list[Series]]:
    """Every series the report reads, empty but for the run's verdict at every point of WINDOW (None: no
    verdict, as before a rank has trained long enough), rank 0 in state train and the run's GPU readings
    (keys of the queries: run_gpu_nvml, run_gpu_sm_active, ...) while it trained."""
    over: dict[str, list[Series]] = {name: [] for name in queries.build("r", WINDOW, []).over_time}
    if verdict is not None:
        over["verdict"] = [Series({"verdict": verdict}, tuple((t, 1.0) for t in TIMES))]
    if trained:
        over["state"] = [_state("0", "train", list(TIMES))]
    for name, value in gpu.items():
        over[name] = [Series({}, tuple((t, value) for t in TIMES))]
    return over


def _assess(over: dict[str, list[Series]], phases: dict[str, float] | None = None) -> Assessment:
    """The assessment of one rank that made 100 timed steps of 0.1 s with `phases` (seconds in each)."""
    data = RunData("r", WINDOW, ("n",), {}, over)
    totals = RunTotals(steps=100, samples=6400, step_seconds=10.0, steps_timed=100,
                       phase_seconds=phases or {}, p50=0.1, p95=0.12)
    return assess(data, totals, [])


def _gpu_check(assessment: Assessment) -> Check:
    return next(check for check in assessment.checks if check.rule == "GPU utilization close to 100%")


def test_a_saturated_gpu_with_sm_active_073_is_gpu_bound_healthy_and_graded() -> None:
    # an H100 at full bf16 load: NVML 0.98, SM active 0.73, tensor cores 0.58
    a = _assess(_over_time(verdicts.GPU_BOUND, run_gpu_nvml=0.98, run_gpu_sm_active=0.73,
                           run_gpu_tensor_active=0.58, run_gpu_effective=0.73),
                {DATA_LOADING_PHASE: 0.2, FORWARD_PHASE: 3.0})
    assert a.verdict == verdicts.GPU_BOUND
    assert a.headline == "GPU-bound: the GPUs are busy (SM active 0.73, tensor cores 0.58; 100% of the training time)"
    assert "kernels 98% of the time" in a.because and "(NVML utilization: busy)" in a.because
    assert "SM active 0.73" in a.because and "healthy" in a.because
    assert a.rule == verdicts.MEANINGS[verdicts.GPU_BOUND]
    check = _gpu_check(a)
    assert check.ok is True and "98%" in check.measured and "SM active 0.73" in check.measured


def test_a_verdicts_reasons_stay_the_windows_where_another_verdict_only_blipped() -> None:
    """One point of host_bound in ten (10 s, shorter than the rules' rate window: no period of its own) is the
    rate window catching up; the page said "While gpu_bound (1m 30s, 90% of the judged time)" for it."""
    over = _over_time(verdicts.GPU_BOUND, run_gpu_nvml=0.98)
    over["verdict"] = [Series({"verdict": verdicts.GPU_BOUND}, tuple((t, 1.0) for t in TIMES[:-1])),
                       Series({"verdict": verdicts.HOST_BOUND}, ((TIMES[-1], 1.0),))]
    because = _assess(over, {DATA_LOADING_PHASE: 0.2, FORWARD_PHASE: 3.0}).because
    assert because.startswith("Over the window data loading took"), because


def test_a_busy_gpu_whose_sms_idle_fails_the_utilization_check() -> None:
    # one single-SM kernel per step on an H100: NVML 1.00, SM active 0.008
    a = _assess(_over_time(verdicts.GPU_BUSY_IDLE, run_gpu_nvml=1.0, run_gpu_sm_active=0.008))
    assert a.headline == ("GPUs busy but idle: kernels run all the time yet the SMs do little "
                          "(SM active 0.008; 100% of the training time)")
    assert "(NVML utilization: busy)" in a.because and a.rule == verdicts.MEANINGS[verdicts.GPU_BUSY_IDLE]
    assert _gpu_check(a).ok is False


def test_waiting_gpus_of_a_host_bound_run_say_so() -> None:
    # a launch-bound loop on an H100: NVML 0.14, SM active 0.0009, the loader timed and short
    a = _assess(_over_time(verdicts.HOST_BOUND, run_gpu_nvml=0.14, run_gpu_sm_active=0.0009),
                {DATA_LOADING_PHASE: 0.1, FORWARD_PHASE: 8.0})
    assert a.headline.startswith("Host-bound")
    assert "kernels 14% of the time" in a.because and "(NVML utilization: waiting)" in a.because
    assert "the loader is not why" in a.because
    assert _gpu_check(a).ok is False


def test_a_cpu_run_is_host_bound_without_gpu_numbers() -> None:
    a = _assess(_over_time(verdicts.HOST_BOUND), {DATA_LOADING_PHASE: 0.1, FORWARD_PHASE: 8.0})
    assert "no GPU is mapped" in a.because and "trains on the CPU" in a.because
    assert _gpu_check(a).ok is None


def test_an_undetermined_run_names_what_to_instrument() -> None:
    a = _assess(_over_time(verdicts.UNDETERMINED))  # no loader, no phase, no GPU reading
    assert a.verdict == verdicts.UNDETERMINED
    assert a.headline == ("Undetermined: the run steps, but nothing measured says what limits it "
                          "(100% of the training time)")
    assert f"{DATA_LOADING_PHASE} is not timed" in a.because and "no GPU is mapped" in a.because
    assert "no phase is timed" in a.because
    assert a.rule == verdicts.MEANINGS[verdicts.UNDETERMINED]
    fixes = " ".join(a.fixes)
    assert "tracker.loader()" in fixes and "tracker.phase(" in fixes and "hostPID" in fixes


def test_a_run_that_never_trained_long_enough_has_no_verdict_yet_not_idle() -> None:
    a = _assess(_over_time(None))  # in state train, but the rules gave no verdict (not settled)
    assert a.verdict == NO_VERDICT and a.rule == ""
    settle = THRESHOLDS["verdict_settle_seconds"].number
    assert a.headline == f"No verdict yet: a rank must have started training {settle} s ago"
    assert a.gpus.nvml is None and "the rules gave no verdict" in a.because
    assert _assess(_over_time(None, trained=False)).verdict == verdicts.IDLE
    assert _assess(_over_time(verdicts.IDLE)).verdict == verdicts.IDLE  # in state train but stalled


def test_a_run_whose_verdict_changed_says_which_came_last_and_its_fix() -> None:
    """Measured on a real run (loader 2 ms, then 30 ms per batch after 150 s: storage slowed): the report said
    only "Host-bound ... (55% of the training time)" and host-bound fixes while the run ended data-bound."""
    window = Window(0.0, 300.0, 1.0)
    over: dict[str, list[Series]] = {name: [] for name in queries.build("r", window, []).over_time}
    over["verdict"] = [Series({"verdict": verdicts.IDLE}, tuple((float(t), 1.0) for t in range(0, 38))),
                       Series({"verdict": verdicts.HOST_BOUND}, tuple((float(t), 1.0) for t in range(38, 183))),
                       Series({"verdict": verdicts.UNDETERMINED}, tuple((float(t), 1.0) for t in range(183, 186))),
                       Series({"verdict": verdicts.DATA_BOUND}, tuple((float(t), 1.0) for t in range(186, 300)))]
    over["state"] = [_state("0", "train", [float(t) for t in range(300)])]
    data = RunData("r", window, ("n",), {name: [] for name in queries.build("r", window, []).totals}, over)
    built = report.build(data, "http://prometheus")
    a = built.assessment
    assert a.verdict == verdicts.HOST_BOUND
    assert a.headline == ("Host-bound: the time goes to work on the host (55% of the training time; then data-bound "
                          "for its last 1m 54s)")
    assert a.fixes[-len(FIXES[verdicts.DATA_BOUND]):] == FIXES[verdicts.DATA_BOUND]
    html = page.render(built, {}, [])
    assert ("In order: host_bound from 00:00:38 UTC for 2m 25s, then data_bound from 00:03:06 UTC for 1m 54s."
            in html), html
    steady = _assess(_over_time(verdicts.HOST_BOUND), {DATA_LOADING_PHASE: 0.1, FORWARD_PHASE: 8.0})
    assert steady.headline.endswith("(100% of the training time)") and "In order" not in page._periods(steady.periods,
                                                                                                       WINDOW)


def test_times_of_day_on_the_page_carry_their_date_where_the_window_spans_days() -> None:
    """A 3-day run data-bound for its first day: "data_bound from 00:00:00 UTC for 24h 00m 00s, then gpu_bound from
    00:00:00 UTC" said nothing of which day, and a straggler spell "between 04:35:00 and 05:35:00 UTC" neither."""
    day = 86400.0
    periods = (("data_bound", 0.0, day), ("gpu_bound", day, 3 * day))
    assert page._periods(periods, Window(0.0, 3 * day, 300.0)) == (
        " In order: data_bound from 1970-01-01 00:00:00 UTC for 24h 00m 00s, then gpu_bound from 1970-01-02 00:00:00 "
        "UTC for 48h 00m 00s.")
    assert page._periods(periods, Window(0.0, day - 1, 300.0)).startswith(" In order: data_bound from 00:00:00 UTC")
    times = [float(t) for t in range(0, int(3 * day), 300)]
    window = Window(0.0, 3 * day, 300.0)
    over: dict[str, list[Series]] = {name: [] for name in queries.build("r", window, []).over_time}
    over["state"] = [_state("0", "train", times), _state("1", "train", times), _state("2", "train", times)]
    over["local_score"] = [Series({"rank": rank, "instance": "n"},
                                  tuple((t, 0.5 if rank == "2" and day <= t < day + 3600 else 1.0) for t in times))
                           for rank in "012"]
    data = RunData("r", window, ("n",), {}, over)
    totals = RunTotals(steps=300, samples=19200, step_seconds=40.0, steps_timed=300, phase_seconds={}, p50=0.1,
                       p95=0.2)
    because = assess(data, totals, []).because
    assert "rank 2 on n for 1h 00m 00s between 1970-01-02 00:00:00 and 1970-01-02 01:00:00 UTC" in because, because


def test_every_verdict_has_a_colour_headline_and_fix() -> None:
    for explained in (plots.VERDICT_COLORS, page.VERDICT_BORDERS, HEADLINES, FIXES):
        assert set(explained) == set(verdicts.BOTTLENECK_VERDICTS)


def test_the_page_states_the_verdict_its_rule_and_the_gpm_grade() -> None:
    over = _over_time(verdicts.GPU_BOUND, run_gpu_nvml=0.98, run_gpu_sm_active=0.73, run_gpu_tensor_active=0.58)
    data = RunData("r", WINDOW, ("n",), {name: [] for name in queries.build("r", WINDOW, []).totals}, over)
    html = page.render(report.build(data, "http://prometheus"), {}, [])
    assert 'class="verdict v-gpu_bound"' in html and "GPU-bound: the GPUs are busy (SM active 0.73" in html
    assert escape(verdicts.MEANINGS[verdicts.GPU_BOUND]) in html
    assert "<td>0.73</td>" in html and "<td>0.58</td>" in html and "<td>98%</td>" in html


def test_the_gantt_chart_draws_a_run_without_a_critical_path() -> None:
    intervals = state_intervals([_state("0", "train", list(TIMES))], WINDOW)
    assert plots.gantt(WINDOW, intervals, [], []).startswith(b"\x89PNG")


def test_a_gantt_chart_of_many_ranks_labels_its_time_above_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """256 ranks drew a chart 8,972 px tall with its time labelled only below the last rank; 40 ranks (1,500 px) get
    it above too, 8 keep one."""
    drawn: list[Figure] = []
    real_png = plots._png

    def png(fig: Figure) -> bytes:
        drawn.append(fig)
        return real_png(fig)

    monkeypatch.setattr(plots, "_png", png)
    for ranks in (40, 8):
        intervals = state_intervals([_state(str(rank), "train", list(TIMES)) for rank in range(ranks)], WINDOW)
        plots.gantt(WINDOW, intervals, [], [])
    labelled_above = [fig.axes[0].xaxis.get_major_ticks()[0].label2.get_visible() for fig in drawn]
    assert labelled_above == [True, False]

def _rank(rank: str, mean: float, local: float, step_time_score: float, local_score: float) -> RankSummary:
    """A rank of 100 timed steps of `mean` seconds, `local` of them in forward, with its two scores."""
    return RankSummary(rank, "n", rank, "1", 100, 6400, 100 * mean, 100, mean, mean, {FORWARD_PHASE: 100 * local},
                       step_time_score=step_time_score, local_score=local_score)


def test_the_report_scores_stragglers_against_the_typical_rank_as_the_rules_do() -> None:
    """Of two ranks the faster is typical (grafana/rules/tests/pauses.yml, run pair): against their mean, the
    slower of two scored 0.75 only when 2x slower, and a rank 1.5x slower was no straggler (0.83)."""
    pair = summary._with_scores([_rank("0", 0.1, 0.02, 0, 0), _rank("1", 0.15, 0.03, 0, 0)])
    assert [(round(r.step_time_score, 2), round(r.local_score, 2)) for r in pair] == [(1.0, 1.0), (0.67, 0.67)]
    assert summary.stragglers(pair) == [pair[1]]
    three = summary._with_scores([_rank("0", 0.1, 0.02, 0, 0), _rank("1", 0.15, 0.03, 0, 0),
                                  _rank("2", 0.12, 0.02, 0, 0)])
    assert [round(r.step_time_score, 2) for r in three] == [1.2, 0.8, 1.0]  # the median rank's 0.12 s


@pytest.mark.parametrize(("ranks", "said", "not_said"), [
    # DDP: equal step times (the fast ranks wait in backward), rank 1 slow in its local phases
    ([_rank("0", 0.1, 0.02, 1.0, 1.0), _rank("1", 0.1, 0.05, 1.0, 0.4), _rank("2", 0.1, 0.02, 1.0, 1.0)],
     "every synchronised step waits for it", "do not wait"),
    # independent processes: rank 1's own steps are slower, nobody waits for it
    ([_rank("0", 0.1, 0.02, 1.0, 1.0), _rank("1", 0.2, 0.12, 0.5, 0.17), _rank("2", 0.1, 0.02, 1.0, 1.0)],
     "it steps slower than the other ranks, which do not wait for it", "synchronised"),
])
def test_the_straggler_sentence_says_others_wait_only_when_the_steps_are_synchronised(
        ranks: list[RankSummary], said: str, not_said: str) -> None:
    data = RunData("r", WINDOW, ("n",), {}, _over_time(verdicts.HOST_BOUND))
    totals = RunTotals(steps=300, samples=19200, step_seconds=40.0, steps_timed=300,
                       phase_seconds={FORWARD_PHASE: 10.0}, p50=0.1, p95=0.2)
    because = assess(data, totals, ranks).because
    assert "Straggler: rank 1 on n" in because and said in because and not_said not in because, because


def test_the_window_starts_where_the_step_counts_start() -> None:
    """The hooks count from their process's start, so a rank first scraped 9.5 s after it started already
    holds those steps: the window, and the page's header, start at the process's start (10 minutes at most
    before the first sample), not at the first sample."""
    def info(start_time: str | None) -> Series:
        return Series({"rank": "0"} | ({"start_time": start_time} if start_time else {}), ((1000.0, 1.0),))

    assert run_start(1000.0, [info("990.5"), info("995")]) == 990.5
    assert run_start(1000.0, [info(None)]) == 1000.0  # hooks that do not say when their process started
    assert run_start(1000.0, [info("300")]) == 1000.0  # older than 10 minutes before the first sample
    assert run_start(1000.0, [info("1000.5"), info("not a time")]) == 1000.0



def test_goodput_counts_across_a_scrape_gap_only_what_the_counter_added_and_a_reset_from_zero(
        tmp_path: Path) -> None:
    """Train seconds pushed cumulatively, 15 s every 15 s from t=0 to 300 s. Rank 0's exporter goes away
    (staleness marker at 165 s, no sample up to 225 s) and comes back with the process's count, 240 at
    240 s: it trained 300 s. Rank 1's process restarts at 165 s (its count resets): 150 + 135. Rank 2's
    process restarts during a gap and is back at 240 s with 30: 150 + 90."""
    _assert_train_seconds(tmp_path, Window(0, 300, 15), {"0": ("0+15x10 stale _x4 240+15x4", 300),
                                                          "1": ("0+15x10 0+15x9", 285),
                                                          "2": ("0+15x10 stale _x4 30+15x4", 240)})


def test_goodput_counts_across_a_scrape_gap_over_ten_minutes_only_what_the_counter_added(tmp_path: Path) -> None:
    """As above with 12.5 minutes without a sample (Prometheus down, the exporter down, or a closed tracker's group
    dropped at its TTL until the next fit reopens it): rank 0's count goes on, 915 at 915 s (it trained 1200 s);
    before, the step before 915 s found no sample in the 10 minutes before it and counted the whole 915 again
    (1,350 s of train for 1,200). Rank 1's process restarts in the gap: 150 + 285."""
    _assert_train_seconds(tmp_path, Window(0, 1200, 15), {"0": ("0+15x10 stale _x49 915+15x19", 1200),
                                                           "1": ("0+15x10 stale _x49 0+15x19", 435)})


def test_goodput_counts_a_restart_back_at_its_predecessors_count_within_one_coarse_step(tmp_path: Path) -> None:
    """A long run's window is read at 300 s (at most 1,200 points): rank 0's process spent 300 s in setup, was
    killed at 600 s, and the next one, started at 600 s, spent 300 s in setup again, all between two points of the
    window (600 and 900 s). Its count at 900 s equals its predecessor's: before, that step counted 300 - 300 = 0,
    300 s of setup for 600 (a 3-day run restarted twice read 900 s per rank for 1,200)."""
    _assert_train_seconds(tmp_path, Window(0, 1800, 300), {"0": ("0+15x20 300x19 15+15x19 300x59", 600)})


def _assert_train_seconds(tmp_path: Path, window: Window, ranks: dict[str, tuple[str, float]]) -> None:
    """The report's goodput train seconds per rank, by promtool, over `window` ending at its end: rank ->
    (promtool input series of stepscope_state_seconds_total{state="train"} every 15 s, what it must count)."""
    labels = 'rank="{}",instance="n",state="train"'
    inputs = [{"series": f'stepscope_state_seconds_total{{run="r",{labels.format(rank)}}}', "values": values}
              for rank, (values, _) in ranks.items()]
    expected = [{"labels": f"{{{labels.format(rank)}}}", "value": value} for rank, (_, value) in ranks.items()]
    expr = queries.build("r", window, []).totals["goodput_states"]
    spec = {"rule_files": [], "evaluation_interval": "15s", "tests": [{
        "interval": "15s", "input_series": inputs,
        "promql_expr_test": [{"expr": expr, "eval_time": f"{window.end:g}s", "exp_samples": expected}]}]}
    path = tmp_path / "gap.yml"
    path.write_text(yaml.safe_dump(spec))
    result = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _pushes(rank: str, points: list[tuple[float, float]]) -> Series:
    return Series({"rank": rank, "instance": "n"}, tuple(points))


def test_a_restarted_ranks_count_in_a_window_inside_the_run_starts_at_the_window_at_a_coarse_resolution(
        tmp_path: Path) -> None:
    """Window [120, 300] at 60 s points over 15 s samples: the rank counted 70 at 105 s and 100 at 150 s, its
    exporter kept that until a new process counted from 0 at 225 s up to 50 at 300 s: 30 + 50 in the window. Prometheus'
    subquery over the window took its point at 120 s too, whose increase since the point before (60 s) lay mostly
    before the window: 110 (a backfilled 3-day run of 16 ranks, --from 14 h to 56 h at 300 s points, read 297,720 steps
    per rank for 297,120, and 300 s more of train)."""
    rank = 'run="r",rank="2",instance="n"'
    inputs = [{"series": f"stepscope_steps_total{{{rank}}}", "values": "0+10x10 100x3 0+10x5"},
              {"series": f'stepscope_state_seconds_total{{{rank},state="train"}}', "values": "0+15x10 150x3 0+15x5"}]
    _promtool_evaluates(tmp_path, Window(120, 300, 60), inputs, {
        "steps": [{"labels": '{rank="2",instance="n"}', "value": 80}],
        "goodput_states": [{"labels": '{rank="2",instance="n",state="train"}', "value": 120}]})


def test_a_process_lost_and_replaced_within_a_step_keeps_its_last_steps(tmp_path: Path) -> None:
    """Window [0, 300] at 60 s points over 15 s samples: the first process counted up to 100 at 150 s, the next from 0
    at 165 s to 90 at 300 s: 190. The step (120 s, 180 s] that held the restart counted the new process's 10 only,
    not the first one's 20 since 120 s: 170."""
    rank = 'run="r",rank="3",instance="n"'
    inputs = [{"series": f"stepscope_steps_total{{{rank}}}", "values": "0+10x10 0+10x9"}]
    _promtool_evaluates(tmp_path, Window(0, 300, 60), inputs,
                        {"goodput_steps": [{"labels": '{rank="3",instance="n"}', "value": 190}]})


def test_a_windows_energy_is_its_watts_over_the_window_only(tmp_path: Path) -> None:
    """The run drew 100 W throughout; the window [120, 300] at 60 s points holds 180 s of it: 18,000 J. Prometheus'
    subquery over the window took the start's point too, a step of watts before the window: 24,000 J
    (VictoriaMetrics' leaves it out)."""
    inputs = [{"series": f'{recordings.RUN_ENERGY_RATE}{{run="r"}}', "values": "100x20"}]
    _promtool_evaluates(tmp_path, Window(120, 300, 60), inputs, {"energy_joules": [{"labels": "{}", "value": 18000}]})


def test_a_rank_killed_without_closing_is_lost_from_its_last_push_on_the_timeline_and_the_page() -> None:
    # rank 1 last pushed at 1012 and the exporter kept it in train; rank 0 pushed every 10 s
    over = _over_time(None, trained=False)
    over["state"] = [_state("0", "train", list(TIMES)), _state("1", "train", list(TIMES))]
    over["last_push"] = [_pushes("0", [(t, t) for t in TIMES]), _pushes("1", [(t, min(t, 1012.0)) for t in TIMES])]
    built = report.build(RunData("r", WINDOW, ("n",), {name: [] for name in queries.build("r", WINDOW, []).totals},
                                 over), "http://prometheus")
    # lost where the push is more than 45 s old (from 1060 on), drawn from the last push
    assert [(i.rank, i.state, i.start, i.end) for i in built.intervals] == [
        ("0", "train", 1000, 1100), ("1", "train", 1000, 1012), ("1", "lost", 1012, 1100)]
    html = page.render(built, {}, [])
    assert "Rank 1 on n lost</strong>: last push at 1970-01-01T00:16:52.000Z" in html
    assert plots.gantt(WINDOW, built.intervals, [], []).startswith(b"\x89PNG")


LOSSES_WINDOW = Window(0, 400, 10)


def _killed_and_requeued(rank: str, node: str, first_end: float, back: float | None, second_end: float) -> list[Series]:
    """A rank's state and last push at each point of LOSSES_WINDOW: its process killed after its push at `first_end`,
    a new one pushing from `back` (None: never) to `second_end`, killed too; the exporter kept it in train."""
    def push(t: float) -> float:
        return min(t, second_end) if back is not None and t >= back else min(t, first_end)

    points = range(0, 400, 10)
    return [Series({"rank": rank, "instance": node, "state": "train"}, tuple((t, 1.0) for t in points)),
            Series({"rank": rank, "instance": node}, tuple((t, push(t)) for t in points))]


def test_each_loss_of_a_rank_starts_at_its_own_last_push() -> None:
    """Killed after its push at 100, requeued at 200, killed again after its push at 280. The second loss was drawn
    from the first point that saw its push too old (330): 50 s of train the rank never did."""
    state, last_push = _killed_and_requeued("0", "n", 100, 200, 280)
    assert [(i.state, i.start, i.end) for i in state_intervals([state], LOSSES_WINDOW, [last_push])] == [
        ("train", 0, 100), ("lost", 100, 200), ("train", 200, 280), ("lost", 280, 400)]


def test_ranks_lost_together_are_one_line_and_every_loss_is_said() -> None:
    """A job of 4 ranks on 2 nodes killed whole (last pushes at 100 and 110) and requeued at 200, then n2's ranks
    lost for good (last push 280). Before: a line per rank for its first loss only (4 lines, as many as the job
    had ranks: 256 above the verdict for 256), and nothing said that n2's ranks were lost again."""
    over = _over_time(None, trained=False)
    histories = [_killed_and_requeued(str(rank), f"n{1 + rank // 2}", 100 + 10 * (rank % 2), 200,
                                      280 if rank >= 2 else 390) for rank in range(4)]
    over["state"], over["last_push"] = [h[0] for h in histories], [h[1] for h in histories]
    built = report.build(RunData("r", LOSSES_WINDOW, ("n1", "n2"),
                                 {name: [] for name in queries.build("r", LOSSES_WINDOW, []).totals}, over),
                         "http://prometheus")
    html = page.render(built, {}, [])
    assert re.findall(r'<p class="lost">(.*?)</p>', html) == [
        "<strong>Ranks 0-3 on n1, n2 lost</strong>: last push between 1970-01-01T00:01:40.000Z and "
        "1970-01-01T00:01:50.000Z, then none for more than 45 s without closing (as StepscopeRankLost fires); the "
        "Gantt chart and state_timeline.csv show them as lost from there until 1970-01-01T00:03:20.000Z, when they "
        "pushed again.",
        "<strong>Ranks 2-3 on n2 lost</strong>: last push at 1970-01-01T00:04:40.000Z, then none for more than 45 s "
        "without closing (as StepscopeRankLost fires); the Gantt chart and state_timeline.csv show them as lost from "
        "there."]


def test_a_lost_ranks_lingering_score_does_not_bound_the_run() -> None:
    """Rank 0 killed after its push at 100, rank 1 training on; rank 0's last score (0.5, a straggler) is read until
    150, as Prometheus' lookback holds a recording that ended without a staleness marker (backfilled history).
    Before, rank 0 bounded the run from 110 to 150 though lost from 100: on a 16-rank run killed at 09:30, 19
    points of critical path more on Prometheus than on VictoriaMetrics, none of them true."""
    over = _over_time(None, trained=False)
    histories = [_killed_and_requeued("0", "n1", 100, None, 0), _killed_and_requeued("1", "n1", 390, None, 0)]
    over["state"], over["last_push"] = [h[0] for h in histories], [h[1] for h in histories]
    over["local_score"] = [Series({"rank": "0", "instance": "n1"}, tuple((t, 0.5) for t in range(0, 160, 10))),
                           Series({"rank": "1", "instance": "n1"}, tuple((t, 1.0) for t in range(0, 400, 10)))]
    built = report.build(RunData("r", LOSSES_WINDOW, ("n1",),
                                 {name: [] for name in queries.build("r", LOSSES_WINDOW, []).totals}, over),
                         "http://prometheus")
    assert {bound.time: bound.rank for bound in built.path} == {t: "0" if t <= 100 else "1" for t in range(0, 400, 10)}


def test_a_lost_ranks_lingering_score_does_not_make_a_straggler_spell_of_a_short_one() -> None:
    """Rank 0 slow (0.5) from its start until it was killed after its push at 420 s, its score read on for
    Prometheus' 5-minute lookback (to 720 s): 7 minutes below the threshold, under the 10 the alert waits, read as a
    12-minute spell that the page named."""
    window, points = Window(0, 1200, 10), range(0, 1200, 10)
    over = _over_time(None, trained=False)
    over["state"] = [Series({"rank": rank, "instance": "n", "state": "train"}, tuple((t, 1.0) for t in points))
                     for rank in ("0", "1")]
    over["last_push"] = [Series({"rank": "0", "instance": "n"}, tuple((t, min(t, 420)) for t in points)),
                         Series({"rank": "1", "instance": "n"}, tuple((t, t) for t in points))]
    over["local_score"] = [Series({"rank": "0", "instance": "n"}, tuple((t, 0.5) for t in range(0, 730, 10))),
                           Series({"rank": "1", "instance": "n"}, tuple((t, 1.0) for t in points))]
    assessment = assess(RunData("r", window, ("n",), {}, over), RunTotals(
        steps=100, samples=6400, step_seconds=10.0, steps_timed=100, phase_seconds={}, p50=0.1, p95=0.12), [])
    assert assessment.spells == ()


class _PushesProm:
    """Prometheus answering every range query with the same last-push series."""

    def __init__(self, *series: Series) -> None:
        self.series = list(series)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        assert "stepscope_training_last_push_timestamp_seconds" in expr
        return self.series


def _window_end(prom: _PushesProm, start: float, end: float, step: float) -> float:
    last_active = cli._last_active(prom, "r", start, end, step)  # type: ignore[arg-type]
    assert last_active is not None
    return cli._idle_tail_cut(start, end, last_active, step)


def test_the_window_ends_after_the_last_real_activity_not_at_a_lost_ranks_ttl() -> None:
    """Rank 0 trained to 1100 and closed; rank 1 died at 1045 and the exporter showed it in train to 1600."""
    prom = _PushesProm(_pushes("0", [(t, t) for t in range(1000, 1101, 5)]),
                       _pushes("1", [(t, min(t, 1045)) for t in range(1000, 1601, 5)]))
    assert _window_end(prom, 1000, 1600, 5) == 1100 + 10  # a tenth of the run


def test_a_run_whose_only_rank_was_killed_is_reported_until_it_is_seen_lost() -> None:
    """The rank died at 1045 and the exporter showed it in train to 1600: the window reaches the first point
    where its push is over 45 s old (1095), so the timeline and the page show it lost from 1045, where before it
    ended at 1049.5 with the rank in train to the end and no word of it."""
    prom = _PushesProm(_pushes("0", [(t, min(t, 1045)) for t in range(1000, 1601, 5)]))
    assert _window_end(prom, 1000, 1600, 5) == 1095 + 10
    window = Window(1000, 1105, 5)
    state = Series({"rank": "0", "instance": "n", "state": "train"}, tuple((t, 1.0) for t in range(1000, 1106, 5)))
    last_push = _pushes("0", [(t, min(t, 1045)) for t in range(1000, 1106, 5)])
    assert [(i.state, i.start, i.end) for i in state_intervals([state], window, [last_push])] == [
        ("train", 1000, 1045), ("lost", 1045, 1105)]


@pytest.mark.parametrize(("argv", "text"), [
    (["--prometheus", "127.0.0.1:9090"],
     "--prometheus must be an http:// or https:// URL (http://prometheus:9090), got '127.0.0.1:9090'"),
    (["--prometheus", "https:///api"],
     "--prometheus must be an http:// or https:// URL (http://prometheus:9090), got 'https:///api'"),
    (["--prometheus", "http://h:9090?x=1"], "--prometheus must be a base URL without ?query or #fragment (a path "
                                            "prefix works: http://host/prometheus), got 'http://h:9090?x=1'"),
    (["--out", ""], "argument --out: an empty directory name: give one, or '.' for the working directory"),
    (["--prometheus", "http://[::1:9090"],
     "--prometheus must be a well-formed URL (Invalid IPv6 URL), got 'http://[::1:9090'"),
    (["--prometheus", "http://h:99999"],
     "--prometheus must be a well-formed URL (Port out of range 0-65535), got 'http://h:99999'"),
    (["--timeout", "1e10"], "--timeout must be at most 86400 seconds, got 1e+10"),
    (["--timeout", "inf"], "--timeout must be at most 86400 seconds, got inf"),
])
def test_a_prometheus_url_or_out_that_cannot_work_is_one_line_exit_2(
        argv: list[str], text: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: 'No connection adapters were found for ...', a query URL built as '...?x=1/api/v1/query_range',
    an empty --out (an unset variable) written into the working directory; an unclosed IPv6 bracket (ValueError)
    and a --timeout past what a socket can wait (1e10, inf: OverflowError) ended in tracebacks."""
    with pytest.raises(SystemExit) as exited:
        cli.parse_args(["--run", "r", *argv])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"stepscope-report: error: {text}"
    assert cli.parse_args(["--prometheus", "http://h:9090/prefix/", "--out", "."]).out == Path(".")


RUNS_ONE_DIRECTORY_BEFORE = (("exp/ablation/no-dropout", "exp ablation no-dropout", "exp_ablation_no-dropout"),
                             ("日本", "中文"), ("résumé-ü-日本", "résumé-ü-中文"), ("run.*", "run.?"), ("..", "..."))


@pytest.mark.parametrize("runs", RUNS_ONE_DIRECTORY_BEFORE, ids=ascii)
def test_runs_with_different_names_get_different_default_report_directories(runs: tuple[str, ...]) -> None:
    """Before: every character outside [A-Za-z0-9_.-] became `_`, so these runs each had one default --out
    (`stepscope-report-exp_ablation_no-dropout`, `stepscope-report-_` for every name in CJK) and the second
    run's report silently replaced the first's (an earlier report is written over)."""
    directories = {output.default_out(run) for run in runs}
    assert len(directories) == len(runs), directories
    assert all(directory.parent == Path(".") for directory in directories)


def test_a_default_report_directory_keeps_a_name_it_can_and_fits_a_file_name() -> None:
    """Names that are file names stay as they are; the longest run the exporter takes (128 characters of 4 bytes)
    still makes a directory name (at most 255 bytes)."""
    assert output.default_out("résumé-ü-日本") == Path("stepscope-report-résumé-ü-日本")
    assert output.default_out("llama-3.1-8b") == Path("stepscope-report-llama-3.1-8b")
    assert len(str(output.default_out("🚀" * 128)).encode()) <= 255


def test_missing_ranks_are_counted_not_listed_whatever_the_world_size() -> None:
    """A world size label of a billion (the label is the process's word) costs a few ranks' work, and the words
    name the lowest five missing."""
    from stepscope.report.summary import missing_ranks

    info = [Series({"rank": rank, "world_size": "1000000000"}, ((1.0, 1.0),)) for rank in ("0", "2")]
    totals: dict[str, list[Series]] = {name: [] for name in queries.build("r", WINDOW, []).totals} | {"info": info}
    missing = missing_ranks(RunData("r", WINDOW, ("n",), totals, {}))
    assert missing is not None and missing.words == (
        "world size 1000000000: 999999998 ranks never reported (1, 3, 4, 5, 6 and 999999993 more)")
    whole = [Series({"rank": rank, "world_size": "2"}, ((1.0, 1.0),)) for rank in ("0", "1")]
    assert missing_ranks(RunData("r", WINDOW, ("n",), totals | {"info": whole}, {})) is None


def test_a_step_time_plot_of_64_ranks_has_no_legend_over_its_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the legend named every line: 64 ranks and the run's p50 / p95 in 66 entries covered the step-time
    plot, its title and its lines (a 64-rank run's report); 8 ranks keep theirs."""
    from matplotlib.axes import Axes

    drawn: list[object] = []
    monkeypatch.setattr(Axes, "legend", lambda ax, *args, **kwargs: drawn.append(ax))
    for ranks, legends in ((64, 0), (8, 1)):
        drawn.clear()
        points = tuple((WINDOW.start + t, 0.1) for t in range(0, 100, 10))
        over = {"step_mean": [Series({"rank": str(rank)}, points) for rank in range(ranks)],
                "run_p50": [Series({}, points)], "run_p95": [Series({}, points)], "run_samples_rate": [],
                "dataloader_share": []}
        assert plots.step_time(WINDOW, over).startswith(b"\x89PNG")
        assert len(drawn) == legends, ranks


def test_a_rank_requeued_on_another_node_has_its_lines_from_both_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 ran on n1 to 1040 and, requeued, on n2 from 1050. The plot kept one series per rank: on a backfilled
    16-rank run requeued on other nodes at 2 h of 5, no rank's step time or loading share showed before the
    requeue."""
    from matplotlib.axes import Axes

    starts: list[float] = []  # where each line drawn begins
    real_plot = Axes.plot

    def plot(ax: Axes, xs: list[float], *args: object, **kwargs: object) -> object:
        starts.append(xs[0])
        return real_plot(ax, xs, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    first, second = ((t, 0.1) for t in range(1000, 1041, 10)), ((t, 0.1) for t in range(1050, 1091, 10))
    node_series = [Series({"rank": "0", "instance": "n1"}, tuple(first)),
                   Series({"rank": "0", "instance": "n2"}, tuple(second))]
    over = {"step_mean": node_series, "dataloader_share": node_series, "run_p50": [], "run_p95": [],
            "run_samples_rate": []}
    assert plots.step_time(WINDOW, over).startswith(b"\x89PNG")
    assert sorted(starts) == [0, 0, 50, 50]  # seconds since the window's start: both nodes in both panels


def _world_size(size: str, start: int, end: int) -> Series:
    """Processes stating world size `size` from `start` to `end` (Unix seconds) at a 10 s step."""
    return Series({"world_size": size}, tuple((float(t), 2.0) for t in range(start, end + 1, 10)))


def test_a_world_size_that_follows_another_is_a_resize_and_the_same_size_after_a_gap_is_not() -> None:
    """A run of 2 ranks requeued with 4 (its old groups kept 60 s), then requeued with 4 again after a 10-minute
    gap, then shrunk to 2 again: two resizes, each at the new size's first point; sizes stated side by side from
    the start (a rank launched with another WORLD_SIZE) are none, nor is the old size's kept group seen again after
    a minute of failed scrapes of its node."""
    grown = [_world_size("2", 1000, 1660), _world_size("4", 1600, 2000), _world_size("4", 2600, 3000),
             _world_size("2", 3010, 3500)]
    assert resizes(grown, 10.0) == [Resize(1600, 2, 4), Resize(3010, 4, 2)]
    assert resizes(grown, 10.0)[0].joined == range(2, 4) and not resizes(grown, 10.0)[0].ended
    assert resizes([_world_size("4", 1000, 2000), _world_size("1", 1000, 2000)], 10.0) == []
    kept = Series({"world_size": "4"}, (*_world_size("4", 1000, 1620).points, *_world_size("4", 1680, 1900).points))
    assert resizes([kept, _world_size("2", 1600, 3000)], 10.0) == [Resize(1600, 4, 2)]


def test_a_run_that_stalled_after_training_unjudged_is_idle_not_waiting_for_a_verdict() -> None:
    """Measured on VictoriaMetrics and Prometheus at a 30 s scrape: a rank that made three steps and hung in
    dataloader_next, in state train for 6 minutes, had no verdict for its first 2 minutes (the settle time and
    the stall threshold) and `idle` after; the report said "No verdict yet: a rank must have started training
    30 s ago" and that no rank had trained 30 s without a break."""
    over = _over_time(None)
    stalled_from = len(TIMES) // 2
    over["verdict"] = [Series({"verdict": verdicts.IDLE}, tuple((t, 1.0) for t in TIMES[stalled_from:]))]
    a = _assess(over)
    assert a.verdict == verdicts.IDLE
    assert a.headline == "Idle: a rank in state train stopped stepping (stalled)"
    assert "made no step while the rules judged the run idle" in a.because and "no verdict" not in a.because
    assert a.fixes == FIXES[verdicts.IDLE]
    ended = _over_time(verdicts.IDLE, trained=False)  # judged idle with no rank in train: nothing stalled
    assert _assess(ended).headline == HEADLINES[verdicts.IDLE]


def test_a_run_scraped_every_60_s_reads_no_verdict_for_its_scrape_interval_not_its_settle_time() -> None:
    """Measured on VictoriaMetrics + vmalert scraping every 60 s: a data-bound run that trained 6 minutes got rates
    but no verdict, and the page said "No verdict yet: a rank must have started training 30 s ago" and that no rank
    had trained 30 s without a break; only stderr named the interval."""
    sparse = Window(WINDOW.start, WINDOW.end, WINDOW.step, scrape_interval=60.0)
    data = RunData("r", sparse, ("n",), {}, _over_time(None))
    totals = RunTotals(steps=100, samples=6400, step_seconds=10.0, steps_timed=100, phase_seconds={}, p50=0.1, p95=0.12)
    a = assess(data, totals, [])
    assert a.verdict == NO_VERDICT
    assert a.headline == ("No verdict: the run's exporter was scraped every 60 s, and the rules need a scrape at "
                          "least every 30 s")
    assert "scraped every 60 s" in a.because and "without a break" not in a.because
    assert "scrape_interval" in a.fixes[0]
    at_30_s = assess(RunData("r", dataclasses.replace(sparse, scrape_interval=30.0), ("n",), {}, _over_time(None)),
                     totals, [])
    assert at_30_s.headline.startswith("No verdict yet") and "without a break" in at_30_s.because

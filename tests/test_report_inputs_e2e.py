"""Inputs the report's command line accepts, against a real exporter and Prometheus with the shipped rules:
a run pushed under each name the exporter accepts is found by the report's own queries (its run matcher),
and a window reaching back to 1970 or on to 9999 is cut to the run.
"""

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

import stepscope.hooks as hooks
from grafana.rules import RULE_FILES
from stepscope.contract.recordings import RUN_SAMPLES_RATE
from stepscope.hooks.config import Config
from stepscope.hooks.pusher import group_url
from stepscope.report import cli
from stepscope.report.prometheus import Prometheus
from stepscope.report.window import run_life, run_matcher, runs_seen
from stepscope_testkit.processes import running_exporter
from tests.support.prometheus import running_prometheus, wait_for

pytestmark = pytest.mark.timeout(90)

# the exporter refuses control characters (a newline, a tab) and quotes in a run name
HOOKED_NAMES = ("emoji🚀", "back\\slash", "héllo wörld", "日本語 run", "dollar$ {brace} (paren)|pipe.dot*")
# init refuses blanks at a name's ends, the exporter stores them from older hooks: pushed as those hooks did
OLDER_HOOKS_NAME = "lr=1e-3, bs=64 "
NAMES = (*HOOKED_NAMES, OLDER_HOOKS_NAME)


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    tmp = tmp_path_factory.mktemp("names")
    with running_exporter(tmp) as exporter, \
            running_prometheus(tmp, {"n": exporter.url.removeprefix("http://")}, RULE_FILES) as prometheus:
        trackers = [hooks.init(run=name, push_url=exporter.url, push_interval=1, handle_sigterm=False,
                               share_bounds=False) for name in HOOKED_NAMES]
        older_hooks = hooks.Tracker(Config.resolve(env={}, run=OLDER_HOOKS_NAME.strip(), push_url=""))
        until = time.monotonic() + 4  # a few pushes and scrapes: the rules record the runs' rates
        while time.monotonic() < until:
            for tracker in (*trackers, older_hooks):
                tracker.step(samples=1)
            requests.put(group_url(exporter.url, OLDER_HOOKS_NAME, 0), data=older_hooks.render(),
                         timeout=10).raise_for_status()
            time.sleep(0.05)
        older_hooks.close()
        for tracker in trackers:
            tracker.close()
        client = Prometheus(prometheus.url, timeout=10)
        assert wait_for(lambda: {s.run for s in runs_seen(client, 0, time.time())} >= set(NAMES) or None, 20)
        assert wait_for(lambda: client.query(f"{RUN_SAMPLES_RATE}{{{run_matcher(NAMES[0])}}}", time.time()), 20)
        yield client


@pytest.mark.parametrize("name", NAMES, ids=ascii)
def test_the_report_finds_a_run_by_any_name_the_exporter_accepts(prom: Prometheus, name: str) -> None:
    [info] = prom.query(f"stepscope_training_info{{{run_matcher(name)}}}", time.time())
    assert info.labels["run"] == name
    first, last, _ = run_life(prom, name, time.time() - 600, time.time())
    assert 0 < first <= last


@pytest.mark.parametrize("flags", [("--from", "0"), ("--from", "now-1000d"),
                                   ("--from", "2000-01-01T00:00:00Z", "--to", "9999-12-31T00:00:00Z"),
                                   ("--from", "0001-01-01T00:00:00Z")], ids=" ".join)
def test_a_window_from_1970_or_to_9999_is_cut_to_the_run(prom: Prometheus, tmp_path: Path, flags: tuple[str, ...],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    code = cli.main(["--prometheus", prom.base_url, "--run", NAMES[0], "--out", str(out), *flags])
    assert code == 0, capsys.readouterr().err
    assert f"for run {NAMES[0]} from " in capsys.readouterr().out
    [summary] = (out / "run_summary.csv").read_text().splitlines()[1:]
    assert "1970" not in summary and "9999" not in summary


def test_a_fractional_step_reports_and_a_step_longer_than_the_run_is_refused(
        prom: Prometheus, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--prometheus", prom.base_url, "--run", NAMES[0], "--out", str(tmp_path / "report")]
    assert cli.main([*argv, "--step", "0.5"]) == 0, capsys.readouterr().err
    assert "resolution 0.5 s" in (tmp_path / "report" / "index.html").read_text()
    capsys.readouterr()
    assert cli.main([*argv, "--step", "100000"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("stepscope-report: error: --step 100000 is longer than the window (")


def test_the_runs_a_report_lists_are_written_as_a_shell_takes_them_for_run(
        prom: Prometheus, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `runs seen in the last 30 days: back\\slash, dollar$ ..., lr=1e-3, bs=64 , ...`: the trailing space
    that made `--run 'lr=1e-3, bs=64'` miss was invisible, and that run read as two."""
    for argv in (["--run", "lr=1e-3, bs=64"], []):
        assert cli.main(["--prometheus", prom.base_url, *argv]) != 0
        [line] = capsys.readouterr().err.splitlines()
        assert "'lr=1e-3, bs=64 '" in line and "'back\\slash'" in line and "'héllo wörld'" in line, line

"""The report against a real Prometheus holding a crafted history (promtool's blocks, tests/support/prometheus.py):
runs whose timing no live test can hold still, read by the report's own command line."""

import csv
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepscope.contract import families as fam
from stepscope.contract.recordings import RUN_SAMPLES_RATE
from stepscope.report import cli
from stepscope.report.times import parse_time
from stepscope_testkit.processes import REPO_ROOT
from tests.support.prometheus import running_prometheus_holding

pytestmark = pytest.mark.timeout(120)

SCRAPE = 5  # seconds between the crafted scrapes
START = (int(time.time()) // 3600 - 2) * 3600  # two hours ago, on the hour
PAUSED_FROM, FINAL_PUSH, GROUP_DROPPED = 200, 260, 900  # seconds after START
FINAL_STEPS, TOKENS_PER_STEP, BATCH = 2600, 1000, 8
KILLED_AT = 60  # seconds after START


def _scrape_of(run: str, t: int, pushed: int, steps: int, training: bool, rank_number: int = 0,
               world_size: int = 1) -> list[tuple[str, float, float]]:
    """One scrape, `t` seconds after START, of a rank of `run` whose last push was at `pushed` with `steps` done,
    in train or idle; with what the rules recorded of a training run."""
    rank = f'job="stepscope",instance="n1",run="{run}",rank="{rank_number}"'
    at = START + t
    samples = [
        (f'{fam.TRAINING_INFO}{{{rank},pid="{7 + rank_number}",local_rank="{rank_number}",world_size="{world_size}",'
         'framework="x"}', at, 1),
        (f"{fam.TRAINING_LAST_PUSH}{{{rank}}}", at, START + pushed),
        (f'{fam.TRAINING_STATE}{{{rank},state="train"}}', at, int(training)),
        (f'{fam.TRAINING_STATE}{{{rank},state="idle"}}', at, int(not training)),
        (f"{fam.STEPS_TOTAL}{{{rank}}}", at, steps),
        (f"{fam.SAMPLES_TOTAL}{{{rank}}}", at, BATCH * steps),
        (f"{fam.TOKENS_TOTAL}{{{rank}}}", at, TOKENS_PER_STEP * steps),
    ]
    if training and t - pushed <= 45:
        samples.append((f'{RUN_SAMPLES_RATE}{{run="{run}"}}', at, 10 * BATCH))
    return samples


def paused_run() -> list[tuple[str, float, float]]:
    """Run "paused", one rank stepping 10 a second: on a loaded machine its pushes stop landing after 200 s
    (the exporter keeps the last one: train, 2,000 steps, pushed 60 s ago by 260 s) until its final push at
    260 s: idle, with every step it made (2,600). The exporter keeps the idle group until 900 s."""
    samples: list[tuple[str, float, float]] = []
    for t in range(0, GROUP_DROPPED + 1, SCRAPE):
        pushed = min(t, PAUSED_FROM) if t < FINAL_PUSH else FINAL_PUSH
        samples += _scrape_of("paused", t, pushed, FINAL_STEPS if t >= FINAL_PUSH else 10 * pushed, t < FINAL_PUSH)
    return samples


def killed_run() -> list[tuple[str, float, float]]:
    """Run "killed", one rank stepping 10 a second, killed (SIGKILL, no final push) at KILLED_AT: the exporter
    keeps its last push, in train, until it drops the group."""
    return [sample for t in range(0, GROUP_DROPPED + 1, SCRAPE)
            for sample in _scrape_of("killed", t, min(t, KILLED_AT), 10 * min(t, KILLED_AT), True)]


def gapped_run() -> list[tuple[str, float, float]]:
    """Run "gapped" of world size 3, each rank stepping 10 a second for 100 s: ranks 0 and 2 are scraped, rank 1
    never is (its node's exporter missing from the scrape config)."""
    return [sample for rank in (0, 2) for t in range(0, 121, SCRAPE)
            for sample in _scrape_of("gapped", t, min(t, 100), 10 * min(t, 100), t < 100, rank, world_size=3)]


SPARSE_SCRAPE = 60  # Prometheus' default interval: the rules' 1m windows hold one sample, the rules record nothing


def sparse_run(run: str, recorded: bool) -> list[tuple[str, float, float]]:
    """Run `run`, one rank stepping 10 a second for 10 minutes, its exporter scraped every 60 s: what Prometheus
    2.42 recorded of it (nothing: `recorded` False), or VictoriaMetrics, whose rates read the sample before the
    window (its samples rate, no verdict)."""
    return [sample for t in range(0, 601, SPARSE_SCRAPE) for sample in _scrape_of(run, t, t, 10 * t, True)
            if recorded or not sample[0].startswith(RUN_SAMPLES_RATE)]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    history = paused_run() + killed_run() + gapped_run() + sparse_run("sparse", False) + sparse_run("sparse_vm", True)
    with running_prometheus_holding(tmp_path_factory.mktemp("history"), history) as running:
        yield running.url


def test_a_final_push_that_lands_after_a_pause_is_counted_and_the_idle_tail_still_cut(
        prometheus: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The rank looked lost from 245 s (its push over 45 s old) and came back with its final push at 260 s.
    Before, the window ended at its last push before the pause plus a tenth of the run (220 s): 2,000 steps,
    16,000 samples and 2,000,000 tokens of 2,600, 20,800 and 2,600,000. The idle tail after the final push is
    still cut (a tenth of the run), not kept until the exporter dropped the group."""
    out = tmp_path / "report"
    assert cli.main(["--prometheus", prometheus, "--run", "paused", "--out", str(out)]) == 0, capsys.readouterr().err
    with (out / "run_summary.csv").open() as rows:
        summary = next(csv.DictReader(rows))
    totals = tuple(float(summary[name]) for name in ("steps", "samples", "tokens"))
    assert totals == (FINAL_STEPS, BATCH * FINAL_STEPS, TOKENS_PER_STEP * FINAL_STEPS)
    end = parse_time(summary["end"], 0) - START
    assert FINAL_PUSH <= end <= FINAL_PUSH + 0.1 * FINAL_PUSH + 2 * SCRAPE


def _report(prometheus: str, run: str, out: Path, *flags: str) -> dict[str, str]:
    assert cli.main(["--prometheus", prometheus, "--run", run, "--out", str(out), *flags]) == 0
    with (out / "run_summary.csv").open() as rows:
        return next(csv.DictReader(rows))


def test_a_killed_rank_is_shown_lost_in_the_default_report(prometheus: str, tmp_path: Path) -> None:
    """The window reaches the first scrape where the rank's push is over 45 s old, so the report says what
    StepscopeRankLost says: before, it ended 6 s after the last push, the rank in train to the end, no word of it."""
    summary = _report(prometheus, "killed", tmp_path / "report")
    assert parse_time(summary["end"], 0) - START >= KILLED_AT + 45
    with (tmp_path / "report" / "state_timeline.csv").open() as rows:
        states = [(row["state"], parse_time(row["start"], 0) - START, parse_time(row["end"], 0) - START)
                  for row in csv.DictReader(rows)]
    assert states[-2:] == [("train", states[-2][1], KILLED_AT), ("lost", KILLED_AT, states[-1][2])]
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Rank 0 on n1 lost</strong>: last push at " in page
    assert float(summary["steps"]) == 10 * KILLED_AT


def test_a_step_longer_than_the_runs_life_is_refused_not_its_idle_tails(
        prometheus: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run trained to its final push at 260 s and its idle group stayed on the exporter to 900 s. A --step
    of 300 s was checked against the 900 s and taken: its window reached 600 s past the run, and its points
    missed what the rules recorded of the run (no verdict, no shares)."""
    capsys.readouterr()
    argv = ["--prometheus", prometheus, "--run", "paused", "--out", str(tmp_path / "report")]
    assert cli.main([*argv, "--step", "300"]) == 2
    message = capsys.readouterr().err
    assert message.startswith("stepscope-report: error: --step 300 is longer than the window (260 s from "), message
    assert _report(prometheus, "paused", tmp_path / "report", "--step", "60")["steps"] == str(FINAL_STEPS)


def test_a_step_too_fine_for_the_server_names_the_flag(prometheus: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A --step of 0.01 s over the run's 260 s asks for 26,000 points; Prometheus refuses past 11,000, and the
    message named its `?step=` only."""
    capsys.readouterr()
    argv = ["--prometheus", prometheus, "--run", "paused", "--out", str(tmp_path / "report"), "--step", "0.01"]
    assert cli.main(argv) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "exceeded maximum resolution" in line and "give a larger --step or leave it out" in line, line


# The report's command line in a process of its own, sent SIGTERM by itself once its files are written into the
# staging directory and before they are moved to --out: the moment a `timeout` or a cancelled CI job can hit.
TERMINATED_WHILE_WRITING = """
import os, signal, sys
from stepscope.report import cli, report
real_write = report.write
def write_then_terminated(built, staging):
    written = real_write(built, staging)
    os.kill(os.getpid(), signal.SIGTERM)
    return written
report.write = write_then_terminated
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_while_the_report_is_written_leaves_nothing_behind(prometheus: str, tmp_path: Path) -> None:
    """Before, SIGTERM ended the report on the spot (exit -15) and left a hidden .report.*.partial directory
    holding 9 CSVs beside --out; it now ends as Ctrl-C does: its files removed, one line, exit 130."""
    result = subprocess.run([sys.executable, "-c", TERMINATED_WHILE_WRITING, "--prometheus", prometheus,
                             "--run", "paused", "--out", str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert (result.returncode, result.stderr) == (130, "stepscope-report: interrupted; nothing written\n")
    assert os.listdir(tmp_path) == []


def test_a_rank_of_the_world_size_that_never_reported_is_named(
        prometheus: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Ranks 0 and 2 of a world of 3 reported: before, the page said "2 ranks on n1" and its totals and verdict
    were those of 2 ranks of 3 without a word; the header and a warning now name rank 1."""
    out = tmp_path / "report"
    assert cli.main(["--prometheus", prometheus, "--run", "gapped", "--out", str(out)]) == 0
    assert capsys.readouterr().err == ("stepscope-report: warning: world size 3: rank 1 never reported: the report "
                                       "counts the other ranks only\n")
    assert ("2 ranks on n1; world size 3: rank 1 never reported, and every number here leaves it out"
            in (out / "index.html").read_text())
    assert cli.main(["--prometheus", prometheus, "--run", "paused", "--out", str(tmp_path / "whole")]) == 0
    assert "never reported" not in capsys.readouterr().err + (tmp_path / "whole" / "index.html").read_text()


def test_a_run_scraped_too_rarely_for_the_rules_is_told_so(prometheus: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Scraped every 60 s, the rules recorded nothing of a run on Prometheus 2.42 (real exporter and hooks), and
    the report said to load the rule files, which were loaded; on VictoriaMetrics they recorded its rates but no
    verdict, and the report's headline read "No verdict yet: a rank must have started training 30 s ago" with no
    word of why. Both now name the interval and the one the rules need."""
    capsys.readouterr()
    argv = ["--prometheus", prometheus, "--out", str(tmp_path / "report")]
    assert cli.main([*argv, "--run", "sparse"]) == 2
    [refused] = capsys.readouterr().err.splitlines()
    assert "load the rule files" not in refused, refused
    assert refused.endswith("its exporter was scraped every 60 s, and the rules' 1m windows need a scrape at least "
                            "every 30 s: set the stepscope job's scrape_interval to 15s (docs/deployment.md)"), refused
    assert cli.main([*argv, "--run", "sparse_vm"]) == 0
    warning = capsys.readouterr().err
    assert warning.startswith("stepscope-report: warning: its exporter was scraped every 60 s"), warning
    assert cli.main([*argv, "--run", "paused"]) == 0
    assert "scraped every" not in capsys.readouterr().err

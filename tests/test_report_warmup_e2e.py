"""End to end: `stepscope-report` on a real run whose first step is a long warm-up (a compile's worth of seconds
against 21 ms steps), read from a real Prometheus (the shipped rules, 1 s scrape) scraping the real exporter.

Two ranks of one run (`tests/support/warmup_run.py`), warming up 24 s and 18 s, then loader-limited: each
waits 12 ms for a batch and spends ~9 ms on the rest. The report's step time, phase shares and sample rates
must be the steady loop's, as the processes measured it, so that its I/O check judges the loop and fails;
counts stay whole, and the page says how long the first step took and that it is left out.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grafana.rules import RULE_FILES
from stepscope_testkit.processes import REPO_ROOT, running_exporter
from tests.support.prometheus import query, running_prometheus, wait_for
from tests.test_report_e2e import _csv, _report

pytestmark = pytest.mark.timeout(240)

NODE = "warmup-node"
WARMUPS = {0: 24.0, 1: 18.0}  # seconds of each rank's first step
STEPS = 1500  # ~32 s of steady steps


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, float]]]:
    """The report of the run and what each rank measured of its steady steps."""
    tmp = tmp_path_factory.mktemp("report-warmup")
    with running_exporter(tmp) as exporter, \
            running_prometheus(tmp, {NODE: exporter.url.removeprefix("http://")}, RULE_FILES) as prometheus:
        procs = {
            rank: subprocess.Popen(
                [sys.executable, "-m", "tests.support.warmup_run", "warm", str(rank), exporter.url, str(warmup),
                 str(STEPS), str(tmp / f"steady-{rank}.json")],
                cwd=REPO_ROOT, env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
                stdout=(tmp / f"rank-{rank}.log").open("wb"), stderr=subprocess.STDOUT)
            for rank, warmup in WARMUPS.items()
        }
        for rank, proc in procs.items():
            assert proc.wait(timeout=150) == 0, (tmp / f"rank-{rank}.log").read_text()
        assert wait_for(lambda: len(query(prometheus.url, 'stepscope_training_state{state="idle"} == 1')) == 2, 20)
        time.sleep(2)
        out = tmp / "report"
        result = _report(prometheus.url, "warm", out)
        assert result.returncode == 0, result.stderr
    steady = {rank: json.loads((tmp / f"steady-{rank}.json").read_text()) for rank in WARMUPS}
    return out, steady


def test_step_time_shares_and_rates_are_the_steady_loops(warmed: tuple[Path, dict[int, dict[str, float]]]) -> None:
    out, steady = warmed
    ranks = {int(row["rank"]): row for row in _csv(out / "rank_summary.csv")}
    for rank, truth in steady.items():
        row = ranks[rank]
        assert int(row["steps"]) == STEPS and int(row["samples"]) == STEPS * 32, row  # counts stay whole
        mean = truth["step"] / truth["steps"]
        assert float(row["mean_step_seconds"]) == pytest.approx(mean, rel=0.05), (row, truth)
        for phase in ("forward", "dataloader_next"):
            assert float(row[f"share_{phase}"]) == pytest.approx(truth[phase] / truth["step"], rel=0.05), (phase, row)
        assert float(row["first_step_seconds"]) == pytest.approx(WARMUPS[rank], rel=0.05), row
    run = _csv(out / "run_summary.csv")[0]
    samples = sum(truth["samples"] for truth in steady.values())
    loading = sum(truth["dataloader_next"] for truth in steady.values()) / len(steady)
    rest = sum(truth["step"] - truth["dataloader_next"] for truth in steady.values()) / len(steady)
    assert float(run["io_samples_per_second"]) == pytest.approx(samples / loading, rel=0.05), run
    assert float(run["training_samples_per_second"]) == pytest.approx(samples / rest, rel=0.05), run
    assert float(run["io_samples_per_second"]) < float(run["training_samples_per_second"])  # loader-limited
    assert float(run["first_step_seconds"]) == pytest.approx(max(WARMUPS.values()), rel=0.05), run
    assert int(run["steps"]) == 2 * STEPS and int(run["samples"]) == 2 * STEPS * 32, run


def test_the_page_says_the_first_step_is_left_out_and_the_io_check_fails(
        warmed: tuple[Path, dict[int, dict[str, float]]]) -> None:
    out, _ = warmed
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "first step 24" in page and "left out of the step time, phase shares and sample rates" in page, page
    check = page.split("I/O sample rate above training sample rate")[1].split("</tr>")[0]
    assert '<span class="bad">fail</span>' in check, check

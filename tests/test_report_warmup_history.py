"""The report's warm-up cut against a real Prometheus holding a crafted history (promtool's blocks): a 15 s
scrape that first saw each rank's steps a scrape after its long first step, hundreds of steady steps later,
which no live test can hold still. Two ranks of run "late" warm up 60 s and 45 s, then step every 25 ms
exactly: 80% in forward, 10% waiting for data.
"""

import csv
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepscope.contract import families as fam
from stepscope.contract.recordings import RUN_SAMPLES_RATE
from stepscope.report import cli
from tests.support.prometheus import running_prometheus_holding

pytestmark = pytest.mark.timeout(120)

SCRAPE = 15
START = (int(time.time()) // 3600 - 2) * 3600  # two hours ago, on the hour
END = 600  # the ranks' final push (idle), seconds after START; the groups stay until END + 60
WARMUPS = {"0": 60.0, "1": 45.0}  # each rank's first step; Prometheus first saw it at the next scrape after
STEP, FORWARD, LOADING, BATCH = 0.025, 0.8, 0.1, 8  # steady step seconds, shares, samples per step
# Run "requeued": one rank, warm-up 60 s, its process restarted (a requeue, a restore from a checkpoint) at 300 s
# with a first step of 40 s again (compilation anew)
REQUEUED, RESTART, RESTART_WARMUP = "requeued", 300.0, 40.0
MID_RUN = 120  # a window from here starts after the first process's warm-up
# Run "gapped": one rank, warm-up 60 s, trains to 1,500 s; its node's scrapes fail from 300 s for 11 minutes
GAPPED, GAPPED_END, SCRAPES_FAIL = "gapped", 1500, (300, 960)


def _rank(rank: str, warmup: float, run: str = "late", restarts: tuple[tuple[float, float], ...] = (),
          end: int = END) -> list[tuple[str, float, float]]:
    """The rank's pushes as scraped: a process from START whose first step takes `warmup`, then one per
    (seconds after START it starts, its first step) in `restarts`, each ending the one before (its counters
    start from 0, a new pid and process start time); every process pushes from its start, its step and phase
    histograms from its first step on."""
    labels = f'job="stepscope",instance="n1",run="{run}",rank="{rank}"'
    processes = ((0.0, warmup), *restarts)
    samples: list[tuple[str, float, float]] = []
    for t in range(0, end + 61, SCRAPE):
        at, now = START + t, min(t, end)
        number, (begun, first) = max((i, process) for i, process in enumerate(processes) if process[0] <= now)
        info = f'pid="{number + 1}{rank}",start_time="{START + begun:.3f}"'
        samples += [
            (f'{fam.TRAINING_INFO}{{{labels},{info},local_rank="{rank}",world_size="2",framework="x"}}', at, 1),
            (f"{fam.TRAINING_LAST_PUSH}{{{labels}}}", at, START + now),
            (f'{fam.TRAINING_STATE}{{{labels},state="train"}}', at, int(t < end)),
            (f'{fam.TRAINING_STATE}{{{labels},state="idle"}}', at, int(t >= end)),
        ]
        ran = now - begun  # seconds since the process started: all in steps, the first included
        steps = 1 + round((ran - first) / STEP) if ran >= first else 0  # the first step ends at `first`
        steady = max(0.0, ran - first)
        samples += [(f"{fam.STEPS_TOTAL}{{{labels}}}", at, steps),
                    (f"{fam.SAMPLES_TOTAL}{{{labels}}}", at, BATCH * steps)]
        if steps:  # the first step is all forward but 50 ms
            samples += [(f"{fam.STEP_SECONDS}_sum{{{labels}}}", at, ran),
                        (f"{fam.STEP_SECONDS}_count{{{labels}}}", at, steps),
                        (f'{fam.STEP_PHASE_SECONDS}_sum{{{labels},phase="forward"}}', at,
                         first - 0.05 + FORWARD * steady),
                        (f'{fam.STEP_PHASE_SECONDS}_sum{{{labels},phase="dataloader_next"}}', at,
                         0.05 + LOADING * steady)]
    return samples


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    samples = [sample for rank, warmup in WARMUPS.items() for sample in _rank(rank, warmup)]
    samples += _rank("0", WARMUPS["0"], REQUEUED, ((RESTART, RESTART_WARMUP),))
    samples += [sample for sample in _rank("0", WARMUPS["0"], GAPPED, end=GAPPED_END)
                if not SCRAPES_FAIL[0] <= sample[1] - START < SCRAPES_FAIL[1]]
    samples += [(f'{RUN_SAMPLES_RATE}{{run="{GAPPED}"}}', START + t, BATCH / STEP)
                for t in range(SCRAPE, GAPPED_END, SCRAPE) if not SCRAPES_FAIL[0] <= t < SCRAPES_FAIL[1]]
    samples += [(f'{RUN_SAMPLES_RATE}{{run="{run}"}}', START + t, ranks * BATCH / STEP)  # what the rules
                for run, ranks in (("late", len(WARMUPS)), (REQUEUED, 1))  # recorded while it trained
                for t in range(SCRAPE, END, SCRAPE)]
    with running_prometheus_holding(tmp_path_factory.mktemp("warmup-history"), samples) as running:
        yield running.url


def _summaries(prometheus: str, out: Path, capsys: pytest.CaptureFixture[str], *extra: str,
               run: str = "late") -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    code = cli.main(["--prometheus", prometheus, "--run", run, "--out", str(out), *extra])
    assert code == 0, capsys.readouterr().err
    with (out / "run_summary.csv").open() as run, (out / "rank_summary.csv").open() as ranks:
        return next(csv.DictReader(run)), {row["rank"]: row for row in csv.DictReader(ranks)}


def test_a_first_scrape_hundreds_of_steps_late_leaves_out_the_first_step_only_as_much_as_it_must(
        prometheus: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each rank's first step is read exactly (60 s, 45 s: its first scrape's seconds less its other steps at
    the steady mean), the mean step and the shares are the steady loop's, the counts whole; before, rank 0's
    mean read 31.7 ms and its forward share 83.7%."""
    run, ranks = _summaries(prometheus, tmp_path / "report", capsys)
    for rank, warmup in WARMUPS.items():
        row = ranks[rank]
        assert float(row["mean_step_seconds"]) == pytest.approx(STEP, rel=1e-6), row
        assert float(row["share_forward"]) == pytest.approx(FORWARD, rel=1e-6), row
        assert float(row["share_dataloader_next"]) == pytest.approx(LOADING, rel=1e-6), row
        assert float(row["first_step_seconds"]) == pytest.approx(warmup, rel=1e-6), row
        assert int(row["steps"]) == 1 + round((END - warmup) / STEP), row
    assert float(run["first_step_seconds"]) == pytest.approx(max(WARMUPS.values()), rel=1e-6), run
    ranks_n = len(WARMUPS)
    assert float(run["io_samples_per_second"]) == pytest.approx(ranks_n * BATCH / (LOADING * STEP), rel=1e-6), run
    assert float(run["training_samples_per_second"]) == pytest.approx(ranks_n * BATCH / ((1 - LOADING) * STEP),
                                                                      rel=1e-6), run


def test_a_window_that_starts_after_the_first_step_leaves_nothing_out(
        prometheus: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    window = ("--from", str(START + 300), "--to", str(START + END))
    run, ranks = _summaries(prometheus, tmp_path / "report", capsys, *window)
    assert run["first_step_seconds"] == "" and all(row["first_step_seconds"] == "" for row in ranks.values())
    for row in ranks.values():
        assert float(row["mean_step_seconds"]) == pytest.approx(STEP, rel=1e-6), row


@pytest.mark.parametrize("window", [(), ("--from", str(START + MID_RUN), "--to", str(START + END))],
                         ids=["whole run", "from mid-run"])
def test_a_restarted_processs_warm_up_is_left_out_too(
        prometheus: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], window: tuple[str, ...]) -> None:
    """A process restarted in the window compiles again: its first step (40 s) is left out as the first process's
    (60 s) is, over the whole run and over a window from mid-run (its first process's warm-up before it), and the
    page says each; the counts stay whole. Before, the whole run mixed the two processes' first scrapes (a 45 s
    first step, forward 100.2% of the step), and the window from mid-run left nothing out (a mean step of 27.4 ms for
    25 ms, forward 81.7%, 322 training samples/s for 356) and counted 17,001 steps for 17,601 (`increase()` took the
    first sample in the window for its base)."""
    out = tmp_path / "report"
    run, ranks = _summaries(prometheus, out, capsys, *window, run=REQUEUED)
    row = ranks["0"]
    assert float(row["mean_step_seconds"]) == pytest.approx(STEP, rel=1e-6), row
    assert float(row["share_forward"]) == pytest.approx(FORWARD, rel=1e-6), row
    assert float(row["share_dataloader_next"]) == pytest.approx(LOADING, rel=1e-6), row
    assert float(run["training_samples_per_second"]) == pytest.approx(BATCH / ((1 - LOADING) * STEP), rel=1e-6), run
    page = (out / "index.html").read_text(encoding="utf-8")
    restarted = f"{RESTART_WARMUP:g} s after a restart"
    first_warmup = WARMUPS["0"]

    def first_process_steps(t: float) -> int:  # as its push scraped at t counted them
        return 1 + round((t - first_warmup) / STEP)

    first_steps = first_process_steps(RESTART - SCRAPE)  # its last push scraped: killed before the next
    restarted_steps = 1 + round((END - RESTART - RESTART_WARMUP) / STEP)
    if window:  # the first process's warm-up is before the window
        assert float(row["first_step_seconds"]) == pytest.approx(RESTART_WARMUP, rel=1e-6), row
        assert f"first step {restarted} (warm-up" in page, page
        steps = first_steps - first_process_steps(MID_RUN - SCRAPE) + restarted_steps
        assert int(row["steps"]) == steps, row  # 17,601
        return
    assert float(row["first_step_seconds"]) == pytest.approx(first_warmup, rel=1e-6), row  # the longest
    assert float(run["first_step_seconds"]) == pytest.approx(first_warmup, rel=1e-6), run
    assert f"first steps {first_warmup:g} s and {restarted} (warm-up" in page, page
    steps = first_steps + restarted_steps
    assert int(row["steps"]) == steps and int(run["samples"]) == BATCH * steps, (row, run)


def test_scrapes_failing_for_longer_than_ten_minutes_are_no_restart(
        prometheus: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The rank's node was not scraped for 11 minutes and its process went on counting. Before, the first scrape
    after the gap was taken for a restarted process's first (nothing within 10 minutes before it): its counts since
    the process's start were a "first step" of 60 s "after a restart", and a 64-rank run whose node failed its
    scrapes for 20 minutes left 5 hours of that node's steps out of its means (851 s "first step", 4.4% low)."""
    out = tmp_path / "report"
    _, ranks = _summaries(prometheus, out, capsys, run=GAPPED)
    row = ranks["0"]
    assert float(row["first_step_seconds"]) == pytest.approx(WARMUPS["0"], rel=1e-6), row
    assert float(row["mean_step_seconds"]) == pytest.approx(STEP, rel=1e-6), row
    assert "after a restart" not in (out / "index.html").read_text(encoding="utf-8")

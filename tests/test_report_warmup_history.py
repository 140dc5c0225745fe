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


def _rank(rank: str, warmup: float) -> list[tuple[str, float, float]]:
    labels = f'job="stepscope",instance="n1",run="late",rank="{rank}"'
    samples: list[tuple[str, float, float]] = []
    for t in range(0, END + 61, SCRAPE):
        at, now = START + t, min(t, END)
        samples += [
            (f'{fam.TRAINING_INFO}{{{labels},pid="1{rank}",local_rank="{rank}",world_size="2",framework="x"}}', at, 1),
            (f"{fam.TRAINING_LAST_PUSH}{{{labels}}}", at, START + now),
            (f'{fam.TRAINING_STATE}{{{labels},state="train"}}', at, int(t < END)),
            (f'{fam.TRAINING_STATE}{{{labels},state="idle"}}', at, int(t >= END)),
        ]
        steps = 1 + round((now - warmup) / STEP) if t > warmup else 0  # the first step ends at `warmup`
        samples += [(f"{fam.STEPS_TOTAL}{{{labels}}}", at, steps),
                    (f"{fam.SAMPLES_TOTAL}{{{labels}}}", at, BATCH * steps)]
        if steps:  # the histograms are pushed from the first step on; the first step is all forward but 50 ms
            steady = now - warmup
            samples += [
                (f"{fam.STEP_SECONDS}_sum{{{labels}}}", at, now),
                (f"{fam.STEP_SECONDS}_count{{{labels}}}", at, steps),
                (f'{fam.STEP_PHASE_SECONDS}_sum{{{labels},phase="forward"}}', at, warmup - 0.05 + FORWARD * steady),
                (f'{fam.STEP_PHASE_SECONDS}_sum{{{labels},phase="dataloader_next"}}', at, 0.05 + LOADING * steady),
            ]
    return samples


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    samples = [sample for rank, warmup in WARMUPS.items() for sample in _rank(rank, warmup)]
    samples += [(f'{RUN_SAMPLES_RATE}{{run="late"}}', START + t, len(WARMUPS) * BATCH / STEP)  # what the rules
                for t in range(SCRAPE, END, SCRAPE)]  # recorded while it trained
    with running_prometheus_holding(tmp_path_factory.mktemp("warmup-history"), samples) as running:
        yield running.url


def _summaries(prometheus: str, out: Path, capsys: pytest.CaptureFixture[str],
               *extra: str) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    code = cli.main(["--prometheus", prometheus, "--run", "late", "--out", str(out), *extra])
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

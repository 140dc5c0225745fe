"""The report against a real Prometheus holding a crafted history (promtool's blocks, tests/support/prometheus.py):
runs whose timing no live test can hold still, read by the report's own command line."""

import csv
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepscope.contract import families as fam
from stepscope.contract.recordings import RUN_SAMPLES_RATE
from stepscope.report import cli
from stepscope.report.times import parse_time
from tests.support.prometheus import running_prometheus_holding

pytestmark = pytest.mark.timeout(120)

SCRAPE = 5  # seconds between the crafted scrapes
START = (int(time.time()) // 3600 - 2) * 3600  # two hours ago, on the hour
PAUSED_FROM, FINAL_PUSH, GROUP_DROPPED = 200, 260, 900  # seconds after START
FINAL_STEPS, TOKENS_PER_STEP, BATCH = 2600, 1000, 8


def paused_run() -> list[tuple[str, float, float]]:
    """Run "paused", one rank stepping 10 a second: on a loaded machine its pushes stop landing after 200 s
    (the exporter keeps the last one: train, 2,000 steps, pushed 60 s ago by 260 s) until its final push at
    260 s: idle, with every step it made (2,600). The exporter keeps the idle group until 900 s."""
    rank = 'job="stepscope",instance="n1",run="paused",rank="0"'
    samples: list[tuple[str, float, float]] = []
    for t in range(0, GROUP_DROPPED + 1, SCRAPE):
        pushed = min(t, PAUSED_FROM) if t < FINAL_PUSH else FINAL_PUSH
        steps = FINAL_STEPS if t >= FINAL_PUSH else 10 * pushed
        at = START + t
        samples += [
            (f'{fam.TRAINING_INFO}{{{rank},pid="7",local_rank="0",world_size="1",framework="x"}}', at, 1),
            (f"{fam.TRAINING_LAST_PUSH}{{{rank}}}", at, START + pushed),
            (f'{fam.TRAINING_STATE}{{{rank},state="train"}}', at, int(t < FINAL_PUSH)),
            (f'{fam.TRAINING_STATE}{{{rank},state="idle"}}', at, int(t >= FINAL_PUSH)),
            (f"{fam.STEPS_TOTAL}{{{rank}}}", at, steps),
            (f"{fam.SAMPLES_TOTAL}{{{rank}}}", at, BATCH * steps),
            (f"{fam.TOKENS_TOTAL}{{{rank}}}", at, TOKENS_PER_STEP * steps),
        ]
        if t < FINAL_PUSH:  # what the rules recorded while it trained
            samples.append((f'{RUN_SAMPLES_RATE}{{run="paused"}}', at, 10 * BATCH))
    return samples


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_prometheus_holding(tmp_path_factory.mktemp("history"), paused_run()) as running:
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

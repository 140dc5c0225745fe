"""The report on runs that change over time, against a real Prometheus holding a crafted history (promtool's
blocks, tests/support/prometheus.py): hours of training that no live test can wait for, read by the report's own
command line. The recording rules' series are written as the rules recorded them while the run trained.

Run "slowhour": four synchronous ranks (DDP) train for three hours at 5 steps a second, with an eval of two
minutes every half hour; rank 2's node slows it for the hour from 1h35m (thermal throttling, a noisy neighbour):
its local phases (`dataloader_next` + `to_device` + `forward`) take 1/SLOW_SCORE times the others', and the
others wait for it in backward, so every step time stays the same.

Run "requeued": rank 0 of two is killed (SIGKILL: no final push, the exporter keeps its group in train) at 30 min;
its job is requeued and a new process of it pushes from 35 min, trains again and ends at 1 h, as rank 1 does.

Runs "resized" and "shrunk": four ranks (0-1 on n1, 2-3 on n2) train for an hour and the job is killed (SIGKILL);
it is requeued 5 minutes later with world size 2 (ranks 0-1 on n1) and trains another hour. The exporter of n2 keeps
ranks 2-3 in train until its TTL, 10 minutes after their last push. In "shrunk" rank 3's node lost it at 40 min.

Run "phased": one rank, data-bound for its first hour (its loader holds 60% of a 250 ms step, the GPU busy 30% of
the time) and GPU-bound for the next two (the page cache warm: loading 5% of a 100 ms step, the GPU busy 97%).
"""

import csv
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepscope.contract import families as fam
from stepscope.contract.recordings import (
    RANK_DATALOADER_SHARE,
    RANK_STRAGGLER_LOCAL_SCORE,
    RANK_STRAGGLER_SCORE,
    RUN_GPU_UTILIZATION,
    RUN_SAMPLES_RATE,
    RUN_VERDICT,
)
from stepscope.report import cli
from stepscope.report.fmt import duration
from stepscope.report.times import clock, iso
from tests.support.prometheus import running_prometheus_holding

pytestmark = pytest.mark.timeout(120)

SCRAPE = 15
START = (int(time.time()) // 3600 - 5) * 3600  # five hours ago, on the hour
SETUP, END = 60, 3 * 3600  # seconds after START: training from SETUP, the final push (idle) at END
EVAL_EVERY, EVAL_SECONDS = 1800, 120
STEPS_PER_SECOND, BATCH = 5, 32
LOCAL = {"dataloader_next": 0.01, "to_device": 0.005, "forward": 0.065}  # seconds per step, typical rank
SLOW_RANK, SLOW_FROM, SLOW_TO, SLOW_SCORE = "2", 5700, 9300, 0.6  # its local phases: 1/0.6 of the others'


def _state(t: int) -> str:
    if t < SETUP:
        return "setup"
    if t >= END:
        return "idle"
    return "eval" if t % EVAL_EVERY < EVAL_SECONDS and t >= EVAL_EVERY else "train"


def _slow(rank: str, t: int) -> bool:
    return rank == SLOW_RANK and SLOW_FROM <= t < SLOW_TO


def _rank_history(rank: str) -> list[tuple[str, float, float]]:
    """One rank's pushes as scraped, and what the rules recorded of it, every SCRAPE seconds to END + 60."""
    labels = f'job="stepscope",instance="n{1 + int(rank) // 2}",run="slowhour",rank="{rank}"'
    samples: list[tuple[str, float, float]] = []
    steps, local, seconds_in = 0, dict.fromkeys(LOCAL, 0.0), {"setup": 0.0, "train": 0.0, "eval": 0.0, "idle": 0.0}
    for t in range(0, END + 61, SCRAPE):
        at = START + t
        state = _state(t)
        if t:
            before = _state(t - SCRAPE)
            seconds_in[before] += SCRAPE
            if before == "train":
                steps += STEPS_PER_SECOND * SCRAPE
                slower = 1 / SLOW_SCORE if _slow(rank, t - SCRAPE) else 1.0
                for phase, per_step in LOCAL.items():
                    local[phase] += STEPS_PER_SECOND * SCRAPE * per_step * slower
        samples += [
            (f'{fam.TRAINING_INFO}{{{labels},pid="4{rank}",local_rank="{int(rank) % 2}",world_size="4",'
             'framework="torch"}', at, 1),
            (f"{fam.TRAINING_LAST_PUSH}{{{labels}}}", at, START + min(t, END)),
            *((f'{fam.TRAINING_STATE}{{{labels},state="{name}"}}', at, int(name == state)) for name in seconds_in),
            *((f'{fam.STATE_SECONDS}{{{labels},state="{name}"}}', at, value) for name, value in seconds_in.items()),
            (f"{fam.STEPS_TOTAL}{{{labels}}}", at, steps),
            (f"{fam.SAMPLES_TOTAL}{{{labels}}}", at, BATCH * steps),
        ]
        if steps:
            samples += [(f"{fam.STEP_SECONDS}_sum{{{labels}}}", at, steps / STEPS_PER_SECOND),
                        (f"{fam.STEP_SECONDS}_count{{{labels}}}", at, steps),
                        *((f'{fam.STEP_PHASE_SECONDS}_sum{{{labels},phase="{phase}"}}', at, value)
                          for phase, value in local.items())]
        if state == "train" and t >= SETUP + 60:  # the rules' 1m rates, the ranks' step times all the same
            samples += [(f"{RANK_STRAGGLER_SCORE}{{{labels}}}", at, 1.0),
                        (f"{RANK_STRAGGLER_LOCAL_SCORE}{{{labels}}}", at, SLOW_SCORE if _slow(rank, t) else 1.0)]
    return samples


def slowhour_run() -> list[tuple[str, float, float]]:
    samples = [sample for rank in "0123" for sample in _rank_history(rank)]
    training = [START + t for t in range(SETUP + 60, END, SCRAPE) if _state(t) == "train"]
    return samples + [sample for at in training for sample in (
        (f'{RUN_VERDICT}{{run="slowhour",verdict="gpu_bound"}}', at, 1),
        (f'{RUN_SAMPLES_RATE}{{run="slowhour"}}', at, 4 * BATCH * STEPS_PER_SECOND))]


PHASES = ((3600, 0.25, 0.6, 0.3, "data_bound"), (7200, 0.1, 0.05, 0.97, "gpu_bound"))  # seconds, step, loading, NVML


def phased_run() -> list[tuple[str, float, float]]:
    """Run "phased" as scraped every SCRAPE seconds, with what the rules recorded of it while it trained."""
    labels = 'job="stepscope",instance="n1",run="phased",rank="0"'
    samples: list[tuple[str, float, float]] = []
    steps, step_seconds, loading, t = 0.0, 0.0, 0.0, 0
    for seconds, step, share, nvml, verdict in PHASES:
        for _ in range(seconds // SCRAPE):
            t += SCRAPE
            steps, step_seconds, loading = steps + SCRAPE / step, step_seconds + SCRAPE, loading + SCRAPE * share
            samples += [
                (f'{fam.TRAINING_INFO}{{{labels},pid="7",local_rank="0",world_size="1",framework="torch"}}',
                 START + t, 1),
                (f"{fam.TRAINING_LAST_PUSH}{{{labels}}}", START + t, START + t),
                (f'{fam.TRAINING_STATE}{{{labels},state="train"}}', START + t, 1),
                (f"{fam.STEPS_TOTAL}{{{labels}}}", START + t, round(steps)),
                (f"{fam.SAMPLES_TOTAL}{{{labels}}}", START + t, BATCH * round(steps)),
                (f"{fam.STEP_SECONDS}_sum{{{labels}}}", START + t, step_seconds),
                (f"{fam.STEP_SECONDS}_count{{{labels}}}", START + t, round(steps)),
                (f'{fam.STEP_PHASE_SECONDS}_sum{{{labels},phase="dataloader_next"}}', START + t, loading),
                (f"{RANK_DATALOADER_SHARE}{{{labels}}}", START + t, share),
                (f'{RUN_VERDICT}{{run="phased",verdict="{verdict}"}}', START + t, 1),
                (f'{RUN_GPU_UTILIZATION}{{run="phased"}}', START + t, nvml),
                (f'{RUN_SAMPLES_RATE}{{run="phased"}}', START + t, BATCH / step),
            ]
    return samples


KILLED, REQUEUED, REQUEUED_END = 1800, 2100, 3600


def requeued_run() -> list[tuple[str, float, float]]:
    """Run "requeued" as scraped: rank 0's pushes (its last push and state kept from KILLED to REQUEUED), rank 1's."""
    samples: list[tuple[str, float, float]] = []
    for rank in "01":
        labels = f'job="stepscope",instance="n1",run="requeued",rank="{rank}"'
        for t in range(0, REQUEUED_END + 61, SCRAPE):
            pushed = KILLED if rank == "0" and KILLED < t < REQUEUED else min(t, REQUEUED_END)
            state = "idle" if t >= REQUEUED_END else "train"
            new_process = rank == "0" and t >= REQUEUED
            steps = 10 * (pushed - REQUEUED if new_process else pushed)
            samples += [
                (f'{fam.TRAINING_INFO}{{{labels},pid="{8 if new_process else 7}{rank}",local_rank="{rank}",'
                 'world_size="2",framework="torch"}', START + t, 1),
                (f"{fam.TRAINING_LAST_PUSH}{{{labels}}}", START + t, START + pushed),
                *((f'{fam.TRAINING_STATE}{{{labels},state="{name}"}}', START + t, int(name == state))
                  for name in ("train", "idle")),
                (f"{fam.STEPS_TOTAL}{{{labels}}}", START + t, steps),
            ]
    return samples + [(f'{RUN_SAMPLES_RATE}{{run="requeued"}}', START + t, 20 * BATCH)
                      for t in range(SCRAPE, REQUEUED_END, SCRAPE)]


RESIZE_KILLED, RESIZED, RESIZED_END, EXPORTER_TTL, RANK_3_LOST = 3600, 3900, 7500, 600, 2400


def resized_run(run: str, rank_3_lost: int = RESIZE_KILLED) -> list[tuple[str, float, float]]:
    """Run `run` as scraped: world size 4 until RESIZE_KILLED (rank 3 until `rank_3_lost`), 2 from RESIZED."""
    samples: list[tuple[str, float, float]] = []
    for rank in "0123":
        labels = f'job="stepscope",instance="n{1 + int(rank) // 2}",run="{run}",rank="{rank}"'
        killed = rank_3_lost if rank == "3" else RESIZE_KILLED
        requeued = int(rank) < 2
        for t in range(0, (RESIZED_END + 61) if requeued else (killed + EXPORTER_TTL), SCRAPE):
            new_process = requeued and t >= RESIZED
            pushed = min(t, RESIZED_END) if new_process else min(t, killed)
            info = f'pid="{8 if new_process else 7}{rank}",world_size="{2 if new_process else 4}"'
            state = "idle" if t >= RESIZED_END else "train"
            samples += [
                (f'{fam.TRAINING_INFO}{{{labels},{info},local_rank="{int(rank) % 2}",framework="torch"}}',
                 START + t, 1),
                (f"{fam.TRAINING_LAST_PUSH}{{{labels}}}", START + t, START + pushed),
                *((f'{fam.TRAINING_STATE}{{{labels},state="{name}"}}', START + t, int(name == state))
                  for name in ("train", "idle")),
                (f"{fam.STEPS_TOTAL}{{{labels}}}", START + t, 10 * (pushed - RESIZED if new_process else pushed)),
            ]
    return samples + [(f'{RUN_SAMPLES_RATE}{{run="{run}"}}', START + t, 20 * BATCH)
                      for t in range(SCRAPE, RESIZED_END, SCRAPE) if not RESIZE_KILLED <= t < RESIZED]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    history = (slowhour_run() + phased_run() + requeued_run() + resized_run("resized")
               + resized_run("shrunk", RANK_3_LOST))
    with running_prometheus_holding(tmp_path_factory.mktemp("shifts-history"), history) as running:
        yield running.url


def _report(prometheus: str, run: str, out: Path) -> tuple[str, dict[str, dict[str, str]]]:
    """The page's text and rank_summary.csv's rows by rank."""
    assert cli.main(["--prometheus", prometheus, "--run", run, "--out", str(out)]) == 0
    with (out / "rank_summary.csv").open() as rows:
        return (out / "index.html").read_text(encoding="utf-8"), {row["rank"]: row for row in csv.DictReader(rows)}


def test_a_rank_that_straggled_for_an_hour_is_named_with_when_how_long_and_how_slow(
        prometheus: str, tmp_path: Path) -> None:
    """Over the three hours rank 2's local score reads 0.82, above the 0.75 of a straggler, so the page called the
    run free of stragglers ("No straggler rank: pass") while critical_path.csv and the Gantt chart held rank 2 for
    the hour. The page now names it: the hour it was slow less the evals inside it, from when to when, its score."""
    page, ranks = _report(prometheus, "slowhour", tmp_path / "report")
    assert 0.8 < float(ranks[SLOW_RANK]["local_score"]) < 0.85, ranks[SLOW_RANK]
    slow_seconds = sum(SCRAPE for t in range(SLOW_FROM, SLOW_TO, SCRAPE) if _state(t) == "train")  # 2 evals out
    start, end = (clock(START + t, START, START + END) for t in (SLOW_FROM, SLOW_TO))  # with a date past midnight
    assert (f"Straggler for part of the run: rank {SLOW_RANK} on n2 for {duration(slow_seconds)} between {start} "
            f"and {end} UTC (local phases score {SLOW_SCORE:.2f} at its median: {1 / SLOW_SCORE:.2f}x the typical "
            "rank&#x27;s time), typical again after it.") in page, page
    [check] = [row for row in page.split("<tr>") if "No straggler rank" in row]
    assert f"below it for part of the run: rank {SLOW_RANK} for {duration(slow_seconds)} ({SLOW_SCORE:.2f})" in check
    assert '<span class="bad">fail</span>' in check, check
    assert f"Open rank {SLOW_RANK}&#x27;s node n2 from {start} to {end} UTC" in page


def test_hours_in_a_state_read_in_whole_seconds(prometheus: str, tmp_path: Path) -> None:
    """Each rank trained 10,140 s of the three hours: the time-per-state table read "1.01e+04 s"."""
    page, ranks = _report(prometheus, "slowhour", tmp_path / "report")
    train = sum(SCRAPE for t in range(0, END, SCRAPE) if _state(t) == "train")
    assert float(ranks["0"]["train_seconds"]) == train == 10140
    table = page.split("<h2>Time per state</h2>")[1].split("<h2>")[0]
    assert "<td>10,140 s</td>" in table and "e+" not in table, table
    with (tmp_path / "report" / "run_summary.csv").open() as rows:  # never resized: the one world size
        assert next(csv.DictReader(rows))["world_sizes"] == "4"


def test_the_verdicts_reasons_are_measured_while_it_held_not_over_a_window_another_verdict_shares(
        prometheus: str, tmp_path: Path) -> None:
    """GPU-bound for two hours of three: over the window the GPUs ran kernels 75% of the time and loading took 23% of
    the step, and the page said "GPU-bound ... ran kernels 75% of the time while training (NVML utilization:
    waiting): the step's time is GPU work", its reasons the data-bound hour's. They are now the GPU-bound hours'."""
    page, _ = _report(prometheus, "phased", tmp_path / "report")
    assert ("While gpu_bound (2h 00m 00s, 67% of the judged time) data loading took 5% of step time and the run&#x27;s "
            "GPUs ran kernels 97% of the time while training (NVML utilization: busy): the step&#x27;s time is GPU "
            "work") in page, page


def test_a_lost_rank_that_a_requeued_process_brought_back_is_not_said_lost_for_good(
        prometheus: str, tmp_path: Path) -> None:
    """Rank 0 was lost at 30 min and a new process of it trained from 35 min to the end; the page said only "lost
    ... the Gantt chart and state_timeline.csv show it as lost from there", as for a rank gone for good."""
    page, _ = _report(prometheus, "requeued", tmp_path / "report")
    with (tmp_path / "report" / "state_timeline.csv").open() as rows:
        states = [(row["state"], row["start"]) for row in csv.DictReader(rows) if row["rank"] == "0"]
    assert [state for state, _ in states] == ["train", "lost", "train", "idle"], states
    assert (f"Rank 0 on n1 lost</strong>: last push at {iso(START + KILLED)}, then none for more than 45 s without "
            f"closing (as StepscopeRankLost fires); the Gantt chart and state_timeline.csv show it as lost from there "
            f"until {states[2][1]}, when the rank pushed again.") in page, page


def _state_timeline(out: Path) -> dict[str, list[tuple[str, str, str]]]:
    """state_timeline.csv's (state, start, end) by rank."""
    with (out / "state_timeline.csv").open() as rows:
        by_rank: dict[str, list[tuple[str, str, str]]] = {}
        for row in csv.DictReader(rows):
            by_rank.setdefault(row["rank"], []).append((row["state"], row["start"], row["end"]))
        return by_rank


def test_a_run_requeued_with_fewer_ranks_says_it_was_resized_and_that_its_other_ranks_ended_there(
        prometheus: str, tmp_path: Path) -> None:
    """Four ranks for an hour, killed, requeued with two: the page read "4 ranks on n1, n2", ranks 2-3 "lost" like
    a crash to look into, shown lost until the exporter dropped them (915 s, 10 minutes past the resize), and
    nothing said the run went on with world size 2. It now says when it was resized, from 4 to 2, and that ranks
    2-3 ended there with the job, lost in the timeline only while the whole job was down."""
    page, _ = _report(prometheus, "resized", tmp_path / "report")
    resized, last_push = iso(START + RESIZED), iso(START + RESIZE_KILLED)
    assert f"4 ranks on n1, n2, resized from world size 4 to 2 at {resized}</p>" in page, page
    assert (f"<strong>Resized at {resized}</strong>: the run went on with world size 2, where it had 4; ranks 2-3 "
            f"ended there, with the job that stopped at {last_push}: their last push; the Gantt chart and "
            "state_timeline.csv show them lost from it to the resize.") in page, page
    assert "Rank 2 on n2 lost" not in page and "Rank 3 on n2 lost" not in page, page
    timeline = _state_timeline(tmp_path / "report")
    for rank in "23":
        assert timeline[rank] == [("train", iso(START), last_push), ("lost", last_push, resized)], timeline[rank]
    assert [state for state, _, _ in timeline["0"]] == ["train", "lost", "train", "idle"], timeline["0"]
    # run_summary.csv said only "4" ranks: it now lists the world sizes the run had
    with (tmp_path / "report" / "run_summary.csv").open() as rows:
        (summary,) = csv.DictReader(rows)
    assert (summary["ranks"], summary["world_sizes"]) == ("4", "4 2"), summary


def test_a_rank_lost_before_its_job_was_requeued_smaller_stays_lost_until_the_resize(
        prometheus: str, tmp_path: Path) -> None:
    """Rank 3's node lost it 20 minutes before the job was killed: a loss to look into (maybe why the job was
    requeued), said as lost, until the resize; rank 2 ended with the job."""
    page, _ = _report(prometheus, "shrunk", tmp_path / "report")
    resized = iso(START + RESIZED)
    assert (f"Rank 3 on n2 lost</strong>: last push at {iso(START + RANK_3_LOST)}, then none for more than 45 s "
            "without closing (as StepscopeRankLost fires); the Gantt chart and state_timeline.csv show it as lost "
            f"from there until {resized}, when the run went on with world size 2 without it.") in page, page
    assert f"ranks 2-3 ended there, with the job that stopped at {iso(START + RESIZE_KILLED)} (rank 2)" in page, page
    assert "Rank 2 on n2 lost" not in page, page


def test_a_verdict_that_gave_way_is_not_counted_on_beside_the_next(prometheus: str, tmp_path: Path) -> None:
    """Data-bound for an hour of three, then GPU-bound. The history holds no staleness markers, so the data_bound
    series went on for Prometheus' 5-minute lookback beside gpu_bound: the page read data_bound 35%, gpu_bound 65%
    (a run data-bound for 10 minutes then GPU-bound for 6 read "While data_bound (15m 00s, 88% of the judged time)").
    At each point the report now reads the verdict written last."""
    page, _ = _report(prometheus, "phased", tmp_path / "report")
    judged = {verdict: seconds // SCRAPE for seconds, _, _, _, verdict in PHASES}
    shares = ", ".join(f"{verdict} {count / sum(judged.values()):.0%}"
                       for verdict, count in sorted(judged.items(), key=lambda item: -item[1]))
    assert f"run:stepscope_bottleneck:verdict</code>): {shares}" in page, page

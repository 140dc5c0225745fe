"""The ranks of a run agree on their step-time bounds through torch.distributed's store
(stepscope.hooks.run_bounds): real gloo process groups on the CPU, a real TCPStore that dies."""

import json
import logging
import os
import subprocess
import sys
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import stepscope.hooks as th
from stepscope.hooks.run_bounds import RUN_BOUNDS_HEADER, STEP_HISTOGRAM, RunBounds, run_store
from stepscope_testkit.processes import REPO_ROOT, running_exporter

RANK_SCRIPT = REPO_ROOT / "tests" / "support" / "run_bounds_rank.py"
PACES = (0.05, 0.15)  # seconds per step of rank 0 and rank 1: 1.6 octaves apart, no fine block in common


def _two_ranks(share: str, tmp_path: Path, exporter: str = "") -> list[dict]:
    """Runs the two ranks side by side (STEPSCOPE_SHARE_BOUNDS=`share`) and returns what each printed; with
    `exporter`, without a process group, pushing to it."""
    env = {**os.environ, "STEPSCOPE_SHARE_BOUNDS": share, "PYTHONPATH": str(REPO_ROOT)}
    rendezvous = tmp_path / "rendezvous"
    outputs = [(tmp_path / f"rank-{rank}.out", tmp_path / f"rank-{rank}.err") for rank in range(len(PACES))]
    with ExitStack() as files:
        ranks = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(rank), "2", str(rendezvous), str(pace),
                                   *([exporter] if exporter else [])],
                                  stdout=files.enter_context(out.open("w")), stderr=files.enter_context(err.open("w")),
                                  env=env)
                 for (rank, pace), (out, err) in zip(enumerate(PACES), outputs, strict=True)]
        _wait_for(ranks)
    errors = [err.read_text()[-2000:] for _, err in outputs]
    assert [rank.returncode for rank in ranks] == [0, 0], errors
    return [json.loads(out.read_text().strip().splitlines()[-1]) for out, _ in outputs]


def _wait_for(ranks: list[subprocess.Popen]) -> None:
    """Waits for both ranks; one that failed leaves the other waiting on it, so that one is killed soon after."""
    try:
        ranks[0].wait(timeout=120)
        ranks[1].wait(timeout=5 if ranks[0].returncode else 120)
    except subprocess.TimeoutExpired:
        pass
    for rank in ranks:
        rank.kill()
        rank.wait()


@pytest.fixture(scope="module")
def agreed(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _two_ranks("1", tmp_path_factory.mktemp("agreed"))


def test_ranks_at_different_paces_export_the_same_bounds(agreed: list[dict]) -> None:
    first, second = (rank["snapshots"][-1]["bounds"] for rank in agreed)
    assert first == second
    for pace in PACES:  # fine bounds around both paces, on both ranks
        assert sum(abs(bound / pace - 1) < 0.1 for bound in first) >= 2, (pace, first)


def test_bounds_taken_from_the_other_rank_hold_exact_counts(agreed: list[dict]) -> None:
    for rank in agreed:
        last = rank["snapshots"][-1]
        assert last["cumulative"][:-1] == rank["truth"]
        assert last["cumulative"][-1] == rank["steps"]


def test_without_the_agreement_each_rank_exports_its_own_bounds(tmp_path: Path) -> None:
    """What the agreement fixes: the ranks' bounds differ, so a run's bucket sum dips (docs/engines.md)."""
    first, second = (rank["snapshots"][-1]["bounds"] for rank in _two_ranks("0", tmp_path))
    assert first != second


def test_ranks_without_a_process_group_agree_through_their_exporter(tmp_path: Path) -> None:
    """Without a store, the ranks' pushes carry their wanted blocks and the exporter answers the run's
    (stepscope.exporter.ingest.node_bounds): both ranks export both paces' bounds, at their own exact counts.
    Before, each exported its own, and VictoriaMetrics read such a run's p95 +2,554% (docs/engines.md)."""
    with running_exporter(tmp_path, "--collectors", "") as exporter:
        ranks = _two_ranks("1", tmp_path, exporter.url)
    first, second = (rank["snapshots"][-1]["bounds"] for rank in ranks)
    assert first == second
    for pace in PACES:
        assert sum(abs(bound / pace - 1) < 0.1 for bound in first) >= 2, (pace, first)
    for rank in ranks:
        assert rank["snapshots"][-1]["cumulative"][:-1] == rank["truth"]


def test_a_store_that_dies_leaves_each_rank_its_own_bounds(caplog: pytest.LogCaptureFixture) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2))
    tracker = th.init(run="dies", rank=0, world_size=2, push_url="", push_interval=600.0,
                      handle_sigterm=False, store=client)
    try:
        for _ in range(20):
            tracker.step()
        tracker.snapshot()
        tracker.agree_on_bounds()
        assert client.get("stepscope/dies/keys").decode().startswith("step/")  # its blocks are out
        del server
        for _ in range(20):
            tracker.step()
        with caplog.at_level(logging.WARNING, logger="stepscope.hooks"):
            tracker.agree_on_bounds()
            tracker.agree_on_bounds()
        warnings = [r.getMessage() for r in caplog.records if "share step-time bounds" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert tracker.snapshot().step.bounds  # still exporting: its own bounds
    finally:
        tracker.close()


def test_a_round_before_any_rank_wants_a_block_does_not_wait(caplog: pytest.LogCaptureFixture) -> None:
    """A rank whose histograms want no fine block yet publishes nothing: reading the run must not wait for
    a counter list no rank has written (a store's get waits for its key)."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    bounds = RunBounds(run_store("quiet", store), interval=3600.0)
    bounds.publish(STEP_HISTOGRAM, frozenset())
    with caplog.at_level(logging.WARNING, logger="stepscope.hooks"):
        bounds.exchange()
        bounds.publish(STEP_HISTOGRAM, frozenset({70}))
        bounds.exchange()
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert bounds.wanted(STEP_HISTOGRAM) == {70: 1}


def test_an_answer_header_nested_too_deep_is_ignored() -> None:
    """An exporter's (or a proxy's) answer whose bounds header nests brackets past the stack: on_answer raised
    RecursionError, which the pusher logged as a warning at every push."""
    bounds = RunBounds(lambda: None, interval=3600.0)
    bounds.publish(STEP_HISTOGRAM, frozenset({70}))
    bounds.headers()
    bounds.on_answer({RUN_BOUNDS_HEADER: "[" * 60_000})
    bounds.on_answer({RUN_BOUNDS_HEADER: json.dumps({STEP_HISTOGRAM: {"70": 2}})})
    assert bounds.wanted(STEP_HISTOGRAM) == {70: 2}


def test_a_bad_share_bounds_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="STEPSCOPE_SHARE_BOUNDS must be one of"):
        th.Config.resolve(env={"STEPSCOPE_SHARE_BOUNDS": "sometimes"}, run="r")

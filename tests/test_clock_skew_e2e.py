"""End to end: nodes whose clocks are a minute off page nothing, and their ranks read as they are.

Two nodes, each a real exporter with one training process (the hooks, pushing every second), their wall clocks
60 s behind and 60 s ahead of Prometheus' (NTP broken, or not yet synced after a boot), and a real Prometheus
with the shipped rules scraping both every second. The system clock cannot be set in a test:
stepscope_testkit/skewed_clock moves time.time() and time.time_ns() in the exporter and training processes
alone, which is where every time they stamp comes from (a rank's last push, last step, phase entry).

Measured on the rules and exporter before: the node behind's rank read 60 s since its last push and
StepscopeRankLost fired for it 35 s in, though it trained (its data-loading alert left out as a lost rank's);
the node ahead's read -59 s, so a rank killed there was paged 120 s after SIGKILL, not 60.
grafana/rules/tests/clock_skew.yml has those cases, and the others the offset changes, in promtool.
"""

import csv
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from grafana.rules import RULE_FILES
from stepscope.contract import THRESHOLDS, recordings
from stepscope.report import cli
from stepscope_testkit.processes import running_exporter, skewed_clock_env
from tests.support.prometheus import query, running_prometheus, wait_for

pytestmark = pytest.mark.timeout(120)

SKEWS = {"behind": -60.0, "ahead": 60.0}  # node -> how far its clock is off Prometheus'
PUSH_SECONDS = 1.0
TRAINER = """
import os, sys, time
import stepscope.hooks as th
tracker = th.init(run=sys.argv[1], rank=0, world_size=1, push_url=os.environ["PUSH_URL"], push_interval=1)
def batches():
    while True:
        time.sleep(0.02)
        yield 1
for batch in tracker.loader(batches()):
    with tracker.phase("forward"):
        time.sleep(0.03)
    tracker.step(samples=8)
"""


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Prometheus scraping the two nodes, each training run `run-<node>` once its rank's age is recorded."""
    tmp = tmp_path_factory.mktemp("skew")
    with ExitStack() as stack:
        targets = {}
        for node, skew in SKEWS.items():
            (tmp / node).mkdir()
            exporter = stack.enter_context(running_exporter(tmp / node, "--collectors", "node",
                                                            env=skewed_clock_env(skew)))
            targets[node] = exporter.url.removeprefix("http://")
            log = stack.enter_context(open(tmp / f"trainer-{node}.log", "w"))
            trainer = subprocess.Popen([sys.executable, "-c", TRAINER, f"run-{node}"], stdout=log,
                                       stderr=subprocess.STDOUT,
                                       env={**os.environ, **skewed_clock_env(skew), "PUSH_URL": exporter.url})
            stack.callback(trainer.wait)
            stack.callback(trainer.kill)
        url = stack.enter_context(running_prometheus(tmp, targets, RULE_FILES)).url
        ages = wait_for(lambda: len(query(url, recordings.RANK_SINCE_LAST_PUSH)) == len(SKEWS), 60)
        assert ages, f"no age of every rank's last push: {query(url, recordings.RANK_SINCE_LAST_PUSH)}"
        yield url


def by_instance(url: str, expr: str) -> dict[str, float]:
    return {sample["metric"]["instance"]: float(sample["value"][1]) for sample in query(url, expr)}


def test_each_node_s_clock_offset_is_measured(prometheus: str) -> None:
    offsets = by_instance(prometheus, recordings.NODE_CLOCK_OFFSET)
    assert offsets.keys() == SKEWS.keys(), offsets
    for node, skew in SKEWS.items():
        assert offsets[node] == pytest.approx(skew, abs=1.0), offsets  # the scrape's latency on top


def test_a_training_rank_reads_its_true_age_and_is_not_lost(prometheus: str) -> None:
    """Read over five evaluations: a rank pushing every second is never more than a few seconds old."""
    assert THRESHOLDS["rank_lost_seconds"].value < abs(SKEWS["behind"]), "a skew the rules before read as lost"
    for _ in range(5):
        ages = by_instance(prometheus, recordings.RANK_SINCE_LAST_PUSH)
        print(f"\nseconds since each rank's last push: {ages}")
        assert ages.keys() == SKEWS.keys() and all(0 <= age <= 3 * PUSH_SECONDS for age in ages.values()), ages
        lost = query(prometheus, 'ALERTS{alertname="StepscopeRankLost"}')
        assert lost == [], lost
        time.sleep(1)


def test_the_report_shows_the_ranks_of_a_node_behind_training_not_lost(prometheus: str, tmp_path) -> None:
    """stepscope-report compared Prometheus' sample times with the node's push times too: the node behind's rank,
    pushing every second, was `lost` in its state timeline from its first point (a push 60 s old)."""
    out = tmp_path / "report"
    assert cli.main(["--prometheus", prometheus, "--run", "run-behind", "--out", str(out)]) == 0
    with (out / "state_timeline.csv").open(newline="", encoding="utf-8") as file:
        states = {row["state"] for row in csv.DictReader(file)}
    assert "train" in states and "lost" not in states, states

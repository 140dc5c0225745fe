"""The shared-GPU verdict on VictoriaMetrics + vmalert as on Prometheus.

grafana/rules/tests/shared_node_gpus.yml proves with promtool that runs time-sliced on one GPU are told it is
shared (`gpu_shared`) and that a run is judged by the GPUs it holds alone; foreign_gpu_holders.yml that a process
the hooks do not know (holder "foreign") shares a run's GPU while its worker, the MPS server and an unseen holder
do not, nor a rank that its restarted exporter reads as foreign until it pushes again. Here their input series
go into a real VictoriaMetrics and real vmalert evaluates the shipped rule files over them
(tests/support/victoria_replay.py), and every expectation of those cases holds at its evaluation time.
"""

import math
import re
from collections.abc import Iterator

import pytest
import yaml

from grafana.rules import RULE_FILES, RULES_DIR
from tests.support.victoria_replay import (
    parse_series,
    replayed_case,
    samples,
)

# (file under grafana/rules/tests, case name, its evaluation and samples' interval in seconds)
CASES = (
    ("shared_node_gpus.yml", "runs time-sliced on one GPU are told it is shared, and judged by the GPUs they hold "
     "alone", 15),
    ("foreign_gpu_holders.yml", "a GPU held by a foreign process is shared; a worker, the MPS server or an unseen "
     "holder does not share it", 30),
    ("foreign_gpu_holders.yml", "a rank read as foreign by its restarted exporter before its first push shares no GPU",
     15),
)

pytestmark = pytest.mark.timeout(180)


def _case(file: str, name: str, interval: int) -> dict:
    """The named case, whose samples are `interval` apart; vmalert evaluates at each sample, promtool at each of
    the file's evaluations, which fall on samples (a case of 15 s samples in a file evaluated every 30 s)."""
    document = yaml.load((RULES_DIR / "tests" / file).read_text(), Loader=yaml.BaseLoader)
    assert int(document["evaluation_interval"].removesuffix("s")) % interval == 0
    (case,) = [test for test in document["tests"] if test["name"] == name]
    assert case["interval"] == f"{interval}s"
    return case


@pytest.fixture(scope="module", params=CASES, ids=[file for file, _, _ in CASES])
def replayed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The case and what a selector reads at a number of seconds from the start, from the samples vmalert wrote."""
    case = _case(*request.param)
    interval = request.param[2]
    with replayed_case(case, RULE_FILES, interval, tmp_path_factory.mktemp("shared-vm")) as (url, start, _):

        def read(selector: str, at: int) -> set[tuple[frozenset, float]]:
            return {(frozenset((k, v) for k, v in labels.items() if k not in ("__name__", "alertgroup")), value)
                    for labels, points in samples(url, selector, start, start + at)
                    for t, value in points if round(t - start) == at and not math.isnan(value)}
        yield case, read


def test_every_expectation_of_the_shared_gpu_cases_holds_on_victoriametrics(replayed) -> None:
    case, read_at = replayed
    for test in case["promql_expr_test"]:
        minutes, seconds = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", test["eval_time"]).groups()
        at = int(minutes or 0) * 60 + int(seconds or 0)
        expected = {(frozenset((k, v) for k, v in parse_series(sample["labels"]).items() if k != "__name__"),
                     float(sample["value"])) for sample in test.get("exp_samples") or []}
        assert read_at(test["expr"], at) == expected, test["expr"]

"""The shared-GPU verdict on VictoriaMetrics + vmalert as on Prometheus.

grafana/rules/tests/shared_node_gpus.yml proves with promtool that runs time-sliced on one GPU are told it is
shared (`gpu_shared`) and that a run is judged by the GPUs it holds alone. Here its input series go into a real
VictoriaMetrics and real vmalert evaluates the shipped rule files over them (tests/support/victoria_replay.py), and
every expectation of that case holds at its evaluation time.
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

CASE = "runs time-sliced on one GPU are told it is shared, and judged by the GPUs they hold alone"
INTERVAL = 15  # the file's evaluation interval and its series' (asserted below)

pytestmark = pytest.mark.timeout(180)


def _case() -> dict:
    document = yaml.load((RULES_DIR / "tests" / "shared_node_gpus.yml").read_text(), Loader=yaml.BaseLoader)
    assert document["evaluation_interval"] == f"{INTERVAL}s"
    (case,) = [test for test in document["tests"] if test["name"] == CASE]
    assert case["interval"] == f"{INTERVAL}s"
    return case


@pytest.fixture(scope="module")
def read_at(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """What a selector reads at a number of seconds from the start, from the samples vmalert wrote."""
    with replayed_case(_case(), RULE_FILES, INTERVAL, tmp_path_factory.mktemp("shared-vm")) as (url, start, _):

        def read(selector: str, at: int) -> set[tuple[frozenset, float]]:
            return {(frozenset((k, v) for k, v in labels.items() if k not in ("__name__", "alertgroup")), value)
                    for labels, points in samples(url, selector, start, start + at)
                    for t, value in points if round(t - start) == at and not math.isnan(value)}
        yield read


@pytest.mark.parametrize("test", _case()["promql_expr_test"], ids=lambda test: test["expr"])
def test_every_expectation_of_the_shared_gpu_case_holds_on_victoriametrics(read_at, test: dict) -> None:
    minutes, seconds = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", test["eval_time"]).groups()
    at = int(minutes or 0) * 60 + int(seconds or 0)
    expected = {(frozenset((k, v) for k, v in parse_series(sample["labels"]).items() if k != "__name__"),
                 float(sample["value"])) for sample in test.get("exp_samples") or []}
    assert read_at(test["expr"], at) == expected

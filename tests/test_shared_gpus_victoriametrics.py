"""The shared-GPU verdict on VictoriaMetrics + vmalert as on Prometheus.

grafana/rules/tests/shared_node_gpus.yml proves with promtool that runs time-sliced on one GPU are told it is
shared (`gpu_shared`) and that a run is judged by the GPUs it holds alone. Here its input series go into a real
VictoriaMetrics and real vmalert evaluates the shipped rule files over them (tests/support/victoria_replay.py), and
every expectation of that case holds at its evaluation time.
"""

import math
import re
import time
from collections.abc import Iterator

import pytest
import yaml

from grafana.rules import RULE_FILES, RULES_DIR
from tests.support.victoria import running_victoria
from tests.support.victoria_replay import (
    expand_values,
    import_series,
    parse_series,
    replay_history,
    samples,
    shipped_rules,
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
    case = _case()
    evaluations = max(len(expand_values(item["values"])) for item in case["input_series"])
    start = (int(time.time()) // 3600 - 2) * 3600  # in the past, on the grid of every rule's interval
    tmp = tmp_path_factory.mktemp("shared-vm")
    with running_victoria(tmp / "victoria", extra_args=["-search.disableCache"]) as victoria:
        import_series(victoria.url, case["input_series"], start, INTERVAL)
        replay_history(victoria.url, shipped_rules(RULE_FILES), start, evaluations, INTERVAL, tmp / "replay")

        def read(selector: str, at: int) -> set[tuple[frozenset, float]]:
            return {(frozenset((k, v) for k, v in labels.items() if k not in ("__name__", "alertgroup")), value)
                    for labels, points in samples(victoria.url, selector, start, start + at)
                    for t, value in points if round(t - start) == at and not math.isnan(value)}
        yield read


@pytest.mark.parametrize("test", _case()["promql_expr_test"], ids=lambda test: test["expr"])
def test_every_expectation_of_the_shared_gpu_case_holds_on_victoriametrics(read_at, test: dict) -> None:
    minutes, seconds = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", test["eval_time"]).groups()
    at = int(minutes or 0) * 60 + int(seconds or 0)
    expected = {(frozenset((k, v) for k, v in parse_series(sample["labels"]).items() if k != "__name__"),
                 float(sample["value"])) for sample in test.get("exp_samples") or []}
    assert read_at(test["expr"], at) == expected

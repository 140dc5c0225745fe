"""A lost rank stays paged after its exporter drops it, or restarts and forgets it, on VictoriaMetrics + vmalert as
on Prometheus.

grafana/rules/tests/lost_rank_kept.yml proves with promtool that StepscopeRankLost carries a lost rank's last
push from one evaluation to the next (run_rank:stepscope_lost_last_push:timestamp_seconds, which reads its own
earlier values) while the rest of its run is there, and ends it when the run is started again, the rank pushes
again or the run is gone. Here its input series go into a real VictoriaMetrics and real vmalert evaluates the
shipped rule files over them (tests/support/victoria_replay.py: each evaluation reads the recordings, the carried
one included, as of the evaluation before, as a running vmalert does behind VictoriaMetrics' visibility lag), on
the cases' 1-minute grid. At each time the cases expect, the carried recording holds the ranks they expect
paged and no other, and each of those ranks' StepscopeRankLost fires. (The replayed alert reads a recording
that vanished an evaluation longer, since replayed recordings get no staleness markers: its end is read from
the recording it fires on.) lost_rank_restart.yml's case, a rank killed 20 s before its exporter restarts, is
replayed the same way on its 15 s grid.
"""

import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from grafana.rules import RULE_FILES, RULES_DIR
from stepscope.contract import recordings
from tests.support.victoria_replay import expand_values, parse_series, replayed_case, samples

KEPT = RULES_DIR / "tests" / "lost_rank_kept.yml"
RESTART = RULES_DIR / "tests" / "lost_rank_restart.yml"
CASES = ((KEPT, "a lost rank stays lost while its run is there"), (KEPT, "a lost rank whose run is gone ends with it"),
         (RESTART, "a rank killed before its exporter restarts is lost"))
FIRING = 'ALERTS{alertname="StepscopeRankLost",alertstate="firing"}'
CARRIED = recordings.RANK_LOST_LAST_PUSH

pytestmark = pytest.mark.timeout(180)

Firing = frozenset[tuple[str, str, str]]


def _case(path: Path, name: str) -> dict:
    """The named case of a promtool file, every scalar a string (YAML 1.1 would read 0x40 as hex)."""
    document = yaml.load(path.read_text(), Loader=yaml.BaseLoader)
    assert [(path.parent / rule_file).resolve() for rule_file in document["rule_files"]] == [RULE_FILES[0]]
    (case,) = [test for test in document["tests"] if test["name"] == name]
    return case


def _seconds(duration: str) -> int:
    """A promtool duration such as 12m15s in seconds."""
    minutes, seconds = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration).groups()
    return int(minutes or 0) * 60 + int(seconds or 0)


def _ranks(labels: dict[str, str]) -> tuple[str, str, str]:
    return labels["run"], labels["rank"], labels["instance"]


def _pending(test: dict) -> bool:
    """A check of the alert while pending: it proves the rule's `for`, which replayed alerts do not keep."""
    states = {parse_series(sample["labels"]).get("alertstate") for sample in test.get("exp_samples") or []}
    return "pending" in states


def _expected(case: dict, interval: int) -> dict[int, Firing]:
    """Seconds from the start -> the (run, rank, instance) the case expects firing, at its times on the grid."""
    expected: dict[int, Firing] = {}
    for test in case.get("promql_expr_test", []):
        assert parse_series(test["expr"]).get("alertname") == "StepscopeRankLost", test["expr"]
        if _pending(test):
            continue
        expected[_seconds(test["eval_time"])] = frozenset(
            _ranks(parse_series(sample["labels"])) for sample in test.get("exp_samples") or [])
    for test in case.get("alert_rule_test", []):
        expected[_seconds(test["eval_time"])] = frozenset(
            _ranks(alert["exp_labels"]) for alert in test.get("exp_alerts") or [])
    return {at: firing for at, firing in expected.items() if at % interval == 0}


Read = Callable[[str, int], Firing]


def test_the_replay_expands_blanks_and_staleness_markers_as_promtool_does() -> None:
    """promtool reads `_x2` as two blanks; the replay read three, and put the lost rank of lost_rank_kept.yml's
    run `back` a minute late, its push a minute old at every scrape: lost again, carried, paged at 30m."""
    assert expand_values("1 _x2 5+1x1 stale 2x1") == [1, None, None, 5, 6, None, 2, 2]


@pytest.fixture(scope="module", params=CASES, ids=[name for _, name in CASES])
def replayed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, Read]]:
    """The case and the ranks a selector's series name at a number of seconds from the start."""
    case = _case(*request.param)
    interval = _seconds(case["interval"])  # vmalert evaluates on the case's grid
    with replayed_case(case, RULE_FILES[:1], interval, tmp_path_factory.mktemp("lost-vm")) as (url, start, end):
        written = {selector: samples(url, selector, start, end) for selector in (FIRING, CARRIED)}

        def read(selector: str, at: int) -> Firing:
            return frozenset(_ranks(labels) for labels, points in written[selector]
                             for t, value in points if round(t - start) == at and not math.isnan(value))
        yield case, read


def test_every_lost_rank_expectation_holds_on_victoriametrics(replayed: tuple[dict, Read]) -> None:
    case, read = replayed
    expected = _expected(case, _seconds(case["interval"]))
    assert len(expected) >= 2, "no expectation on the grid: the case proves nothing"
    carried = {at: read(CARRIED, at) for at in expected}
    assert carried == expected, f"{CARRIED} on VictoriaMetrics + vmalert, by seconds from the start"
    not_firing = {at: ranks - read(FIRING, at) for at, ranks in expected.items() if ranks - read(FIRING, at)}
    assert not not_firing, "StepscopeRankLost not firing on VictoriaMetrics + vmalert for a rank it carries"

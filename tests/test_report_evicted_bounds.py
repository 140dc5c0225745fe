"""The report's step-time quantiles when a rank stopped exporting some of its bucket bounds before its end.

The hooks export the fine buckets around where the steps fall and drop a block left unused for
EVICT_IDLE_SECONDS when it needs the room (stepscope.hooks.timing.FollowingLayout): a run whose first steps
compiled (seconds each) exports blocks there, then drops them once its pace is steady. A dropped bound's
series ends with the count it had then, below the counts of the bounds under it at the run's end, and the
report's per-bound totals (each series' last value in the window) were not cumulative any more. Prometheus'
histogram_quantile repairs such buckets upward and read right; VictoriaMetrics' does not and read the
dropped bounds for every quantile. Both engines hold the same crafted history (promtool's blocks, and
VictoriaMetrics' import API), read by the report's own command line.
"""

import collections
import csv
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stepscope.contract import families as fam
from stepscope.contract.recordings import RUN_SAMPLES_RATE
from stepscope.report import cli, collect, queries
from stepscope.report.prometheus import Prometheus
from stepscope.report.window import aligned
from tests.support.prometheus import running_prometheus_holding
from tests.support.victoria import running_victoria
from tests.support.victoria_replay import import_samples

pytestmark = pytest.mark.timeout(180)

RUN = "compiled"
SCRAPE = 5
START = (int(time.time()) // 3600 - 2) * 3600  # two hours ago, on the hour
END = 600  # the final push (idle), seconds after START
WARMUP_STEPS, WARMUP_STEP = 20, 0.45  # compiling: in the bucket (0.4, 0.5]
STEADY_STEP = 0.045  # then in (0.04, 0.05]
DROPPED_AT = 120  # the warm-up blocks (0.4 and 0.5) are last exported here
LIVE_BOUNDS, DROPPED_BOUNDS = ("0.04", "0.05", "0.06"), ("0.4", "0.5")


def _steps(t: float) -> tuple[int, int]:
    """(warm-up steps, steady steps) done `t` seconds after START."""
    warmup = min(WARMUP_STEPS, int(t / WARMUP_STEP))
    steady = max(0, int((t - WARMUP_STEPS * WARMUP_STEP) / STEADY_STEP))
    return warmup, steady


def _history() -> list[tuple[str, float, float]]:
    labels = f'job="stepscope",instance="n1",run="{RUN}",rank="0"'
    samples: list[tuple[str, float, float]] = []
    for t in range(0, END + 61, SCRAPE):
        at, now = START + t, min(t, END)
        warmup, steady = _steps(now)
        steps = warmup + steady
        samples += [
            (f'{fam.TRAINING_INFO}{{{labels},pid="7",start_time="{START:.3f}",local_rank="0",world_size="1",'
             'framework="x"}', at, 1),
            (f"{fam.TRAINING_LAST_PUSH}{{{labels}}}", at, START + now),
            (f'{fam.TRAINING_STATE}{{{labels},state="train"}}', at, int(t < END)),
            (f'{fam.TRAINING_STATE}{{{labels},state="idle"}}', at, int(t >= END)),
            (f"{fam.STEPS_TOTAL}{{{labels}}}", at, steps),
            (f"{fam.SAMPLES_TOTAL}{{{labels}}}", at, 8 * steps),
        ]
        if t < END:  # what the rules recorded while it trained
            samples.append((f'{RUN_SAMPLES_RATE}{{run="{RUN}"}}', at, 8 / STEADY_STEP))
        if not steps:
            continue
        samples += [(f"{fam.STEP_SECONDS}_sum{{{labels}}}", at, warmup * WARMUP_STEP + steady * STEADY_STEP),
                    (f"{fam.STEP_SECONDS}_count{{{labels}}}", at, steps),
                    (f'{fam.STEP_SECONDS}_bucket{{{labels},le="+Inf"}}', at, steps)]
        bounds = LIVE_BOUNDS + (DROPPED_BOUNDS if t <= DROPPED_AT else ())
        samples += [(f'{fam.STEP_SECONDS}_bucket{{{labels},le="{le}"}}', at,
                     steps if float(le) >= WARMUP_STEP else steady if float(le) >= STEADY_STEP else 0)
                    for le in bounds]
    return samples


def _true_quantile(q: float) -> float:
    """The quantile of the whole run as histogram_quantile reads its true buckets: every steady step in
    (0.04, 0.05], linearly."""
    warmup, steady = _steps(END)
    return 0.04 + 0.01 * q * (warmup + steady) / steady


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """engine -> the URL of a server holding the history."""
    tmp = tmp_path_factory.mktemp("evicted-bounds")
    (tmp / "prometheus").mkdir()
    history = _history()
    with running_prometheus_holding(tmp / "prometheus", history) as prometheus, \
            running_victoria(tmp / "victoria") as victoria:
        import_samples(victoria.url, history)
        yield {"prometheus": prometheus.url, "victoriametrics": victoria.url}


@pytest.mark.parametrize("engine", ["prometheus", "victoriametrics"])
def test_bounds_dropped_before_the_end_leave_the_quantiles_right(engines: dict[str, str], engine: str,
                                                                tmp_path: Path) -> None:
    assert cli.main(["--prometheus", engines[engine], "--run", RUN, "--from", str(START - 60),
                     "--to", str(START + END + 120), "--out", str(tmp_path / "report")]) == 0
    with (tmp_path / "report" / "run_summary.csv").open(newline="", encoding="utf-8") as file:
        (row,) = csv.DictReader(file)
    assert float(row["p50_step_seconds"]) == pytest.approx(_true_quantile(0.5), rel=0.01), row
    assert float(row["p95_step_seconds"]) == pytest.approx(_true_quantile(0.95), rel=0.01), row


class CountingPrometheus(Prometheus):
    """The report's client, counting the expressions it sends (the queries still go to the server)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self.sent: collections.Counter[str] = collections.Counter()

    def _call(self, endpoint: str, form: dict[str, str], parse: Callable[[Any], Any]) -> Any:
        self.sent[form.get("query", "")] += 1
        return super()._call(endpoint, form, parse)


WINDOW = aligned(START - 60, START + END + 120, SCRAPE)


def test_each_query_is_sent_once_whatever_answers_it_gives(engines: dict[str, str]) -> None:
    """The goodput's counters are the summary's (the same PromQL for steps, tokens and state seconds): asked for
    twice, the state seconds alone cost Prometheus 8.7 s of a 3-hour, 256-rank run's 97 s."""
    prom = CountingPrometheus(engines["prometheus"])
    data = collect.fetch(prom, RUN, WINDOW, ["n1"])
    assert data.totals["goodput_states"] == data.totals["state_seconds"]
    assert data.totals["goodput_steps"] == data.totals["steps"] != []
    assert {expr: count for expr, count in prom.sent.items() if count > 1} == {}


@pytest.mark.parametrize("engine", ["prometheus", "victoriametrics"])
def test_no_query_evaluates_the_ranks_bucket_totals_more_than_once(engines: dict[str, str], engine: str) -> None:
    """The run's quantiles asked the server which bounds every rank exports inside the quantile query, which
    evaluated the ranks' bucket totals three times: 9.3 s of Prometheus' time per run quantile on a 3-hour run of
    256 ranks. The bounds are now read off the ranks' totals, asked once, and the quantiles stay right."""
    prom = CountingPrometheus(engines[engine])
    data = collect.fetch(prom, RUN, WINDOW, ["n1"])
    bucket = f"{fam.STEP_SECONDS}_bucket{{"
    once = queries.window_increase(f'{bucket}run="{RUN}"}}', WINDOW, f'{fam.STEPS_TOTAL}{{run="{RUN}"}}',
                                   born_per_rank=True).count(bucket)
    assert {expr[:60]: expr.count(bucket) for expr in prom.sent if expr.count(bucket) > once} == {}
    assert [series.last for series in data.totals["run_p50"]] == [pytest.approx(_true_quantile(0.5), rel=0.01)]
    assert [series.last for series in data.totals["run_p95"]] == [pytest.approx(_true_quantile(0.95), rel=0.01)]


@pytest.mark.parametrize("engine", ["prometheus", "victoriametrics"])
def test_counters_that_never_went_down_are_counted_without_asking_through_resets(engines: dict[str, str],
                                                                                 engine: str) -> None:
    """The counters' totals count through resets at every point of the window in a subquery that Prometheus
    evaluates whether or not a series went down: on a 3 h window of 256 ranks, 3.9 s for the steps, 0.3 s
    without it. A run whose counters never went down (this one) is answered the same without it."""
    prom = CountingPrometheus(engines[engine])
    data = collect.fetch(prom, RUN, WINDOW, ["n1"])
    sent = set(prom.sent)
    through_resets = queries.build(RUN, WINDOW, ["n1"]).totals
    for name in ("steps", "samples", "step_seconds", "step_count", "goodput_steps"):
        assert through_resets[name] not in sent, name
        assert data.totals[name] == prom.query(through_resets[name], WINDOW.end) != [], name

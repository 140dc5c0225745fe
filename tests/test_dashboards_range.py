"""The Training dashboard's figures of the whole time range (stats and bars that read `$__range`), queried as Grafana
queries them (a range query over the dashboard's time range) from a real Prometheus holding a stored 6-hour run:
every point is the range's figure, not the figure of the range before that point."""

import time
from pathlib import Path

import requests

from stepscope.contract import families as fam
from stepscope.contract import recordings as rec
from tests.support.dashboard_queries import DASHBOARDS_DIR, grafana_interpolate, load_dashboards, panels
from tests.support.prometheus import running_prometheus_holding

HOUR = 3600
RANGE_HOURS = 3  # the dashboard shows the last 3 of 6 hours, ending on a minute
STEP = 30  # Grafana's step for a stat 3 hours wide
# Run "big": productive 0.9 of its 8 rank-seconds per second at 700 W for 3 hours (a restore redid 500 steps between
# 1 h and 1 h 30), then productive 0.5 and waiting for data 0.5 at 350 W; rank 0 trained, then idled.
EARLY = {"productive": 0.9, "data_wait": 0.1}
LATE = {"productive": 0.5, "data_wait": 0.5}
WATTS = {False: 700.0, True: 350.0}
# (panel, legend) -> the last 3 hours' figure.
RANGE_FIGURES = {
    ("Goodput", "over the range"): {"": 0.5},
    ("Where the time went (range)", "{{cause}}"): {"productive": 0.5, "data_wait": 0.5},
    ("Energy over the range", "kWh"): {"": 350 * RANGE_HOURS / 1000},
    ("Steps redone after a restore (range)", "steps"): {"": 0.0},
    ("Time per state", "{{state}}"): {"train": 0.0, "idle": RANGE_HOURS * HOUR},
}


def _history(first: int) -> list[tuple[str, float, float]]:
    """(series, Unix seconds, value) a minute apart: the recordings the range panels read and rank 0's state
    seconds."""
    rank = 'run="big",rank="0",instance="n0"'
    samples = []
    for t in range(0, 6 * HOUR + 1, 60):
        late = t >= RANGE_HOURS * HOUR
        for cause, share in (LATE if late else EARLY).items():
            samples.append((f'{rec.RUN_TIME_BY_CAUSE}{{run="big",cause="{cause}"}}', first + t, 8 * share))
        samples += [(f'{rec.RUN_ENERGY_RATE}{{run="big"}}', first + t, WATTS[late]),
                    (f'{rec.RUN_STEPS_REDONE}{{run="big"}}', first + t, 500.0 if HOUR <= t < 1.5 * HOUR else 0.0),
                    (f'{fam.STATE_SECONDS}{{{rank},state="train"}}', first + t, min(t, RANGE_HOURS * HOUR)),
                    (f'{fam.STATE_SECONDS}{{{rank},state="idle"}}', first + t, max(0, t - RANGE_HOURS * HOUR))]
    return samples


def _range_targets() -> dict[tuple[str, str], str]:
    """(panel, legend) -> query of every stat and bar gauge target of the Training dashboard that reads the time
    range (not only to pick the ranks drawn), as Grafana sends it for run `big`, every rank, over the last
    RANGE_HOURS."""
    model = load_dashboards(DASHBOARDS_DIR)["stepscope-training.json"]
    values = {"run": "big", "rank": "$__all", "ranks_drawn": "5"}
    return {(panel["title"], target["legendFormat"]):
            grafana_interpolate(target["expr"].replace("$__range", f"{RANGE_HOURS * HOUR}s"), model, values)
            for panel in panels(model) if panel["type"] in {"stat", "bargauge"}
            for target in panel["targets"] if "$__range" in target["expr"] and "bottomk" not in target["expr"]}


def _every_point(url: str, expr: str, start: int, end: int) -> dict[str, set[float]]:
    """{the series' cause or state: the values of its points} of a range query."""
    response = requests.get(f"{url}/api/v1/query_range",
                            params={"query": expr, "start": start, "end": end, "step": STEP}, timeout=30)
    body = response.json()
    assert body["status"] == "success", f"{expr}: {body.get('error')}"
    return {series["metric"].get("cause", series["metric"].get("state", "")):
            {round(float(value), 6) for _, value in series["values"]} for series in body["data"]["result"]}


def test_every_range_figure_is_the_ranges_at_every_point(tmp_path: Path) -> None:
    """Over the last 3 of 6 hours, each range figure's every point: goodput 0.5 and the causes' shares, 1.05 kWh,
    no step redone, 10,800 s idle. Before, Goodput's sparkline began at 0.90 and Energy's at 2.1 kWh (the 3 hours
    before each point), Steps redone read 500 for a restore before the range, and Energy over the range ended at
    1.0558 kWh: Prometheus' subquery took the range's start and its end, 181 minutes of watts for 180."""
    first = int(time.time()) // HOUR * HOUR - 8 * HOUR
    start, end = first + RANGE_HOURS * HOUR, first + 2 * RANGE_HOURS * HOUR
    targets = _range_targets()
    assert set(targets) == set(RANGE_FIGURES)
    with running_prometheus_holding(tmp_path, _history(first)) as prometheus:
        drawn = {key: _every_point(prometheus.url, expr, start, end) for key, expr in targets.items()}
    assert drawn == {key: {name: {round(value, 6)} for name, value in figures.items()}
                     for key, figures in RANGE_FIGURES.items()}

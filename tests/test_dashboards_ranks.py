"""The Training dashboard at 64 ranks: its per-rank time series draw the few ranks with the lowest straggler score
(`Ranks drawn`, 5 at first) and the run's median rank, not a line per rank, the same ranks across the whole panel on
Prometheus and on VictoriaMetrics; the Per-rank comparison table still lists every rank, lowest score first. A rank
that moved to another node (a requeued pod) has a line per node, each named with its node.
"""

import re
import time
from pathlib import Path

import pytest
import requests

from grafana.dashboards.training import DRAWN_CHOICES, RANGE_SCORE_COLUMN
from grafana.rules import RULE_FILES
from stepscope.contract import families as fam
from stepscope.contract import recordings as rec
from stepscope_testkit.processes import running_exporter
from tests.support.dashboard_queries import DASHBOARDS_DIR, load_dashboards, panels
from tests.support.many_ranks import push_round, ranks_of
from tests.support.prometheus import running_prometheus, running_prometheus_holding, wait_for
from tests.support.victoria import running_victoria
from tests.support.victoria_replay import import_series

pytestmark = pytest.mark.timeout(240)
WORLD_SIZE = 64
SLOW_STEP, SLOW_LOADER, HUNG = 17, 40, 63
DRAWN_AT_FIRST = next(iter(DRAWN_CHOICES.values()))
BOARD = "stepscope-training.json"
BAR_OF_A_RANK = '"bar", "rank $1'  # a bar's name made from its rank, as the Straggler scores name theirs
VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\$([A-Za-z_]\w*)")  # not `$1`: a regex group

# A stored hour of 64 ranks' two straggler scores, 30 s apart: rank 17 slow in step time for the first half, rank
# 40 in its local phases for the second half, ranks 3, 5 and 9 a little below typical throughout, the rest at 1.
INTERVAL = 30
POINTS = 120
LOW = {(rec.RANK_STRAGGLER_SCORE, "3"): 0.9, (rec.RANK_STRAGGLER_LOCAL_SCORE, "5"): 0.92,
       (rec.RANK_STRAGGLER_LOCAL_SCORE, "9"): 0.95}
LOWEST_OVER_THE_RANGE = {"17", "40", "3", "5", "9"}


def _score(name: str, rank: int, point: int) -> float:
    first_half = point < POINTS // 2
    if (name, rank) == (rec.RANK_STRAGGLER_SCORE, SLOW_STEP) and first_half:
        return 0.5
    if (name, rank) == (rec.RANK_STRAGGLER_LOCAL_SCORE, SLOW_LOADER) and not first_half:
        return 0.45
    return LOW.get((name, str(rank)), 1.0)


def _history() -> dict[str, list[float]]:
    """{series: its values}: both scores and the data-loading share of every rank, on two nodes."""
    history = {}
    for rank in range(WORLD_SIZE):
        labels = f'run="big",rank="{rank}",instance="{"ab"[rank * 2 // WORLD_SIZE]}"'
        for name in (rec.RANK_STRAGGLER_SCORE, rec.RANK_STRAGGLER_LOCAL_SCORE):
            history[f"{name}{{{labels}}}"] = [_score(name, rank, point) for point in range(POINTS)]
        history[f"{rec.RANK_DATALOADER_SHARE}{{{labels}}}"] = [0.1 + rank / 1000] * POINTS
    return history


def _per_rank(target: dict) -> bool:
    """Whether a target's series are a rank's: its legend names the rank (`{{rank}}`, or `{{rank_shown}}`: with its
    node where it moved), or its rows name a bar after the rank (the Straggler scores: "rank 17 step (n2)")."""
    legend = target.get("legendFormat", "")
    return "{{rank}}" in legend or "{{rank_shown}}" in legend or BAR_OF_A_RANK in target["expr"]


def _rank_of(series: dict) -> str:
    """The rank a per-rank series is of: its label, or the second word of its bar's name."""
    labels = series["metric"]
    return labels["rank"] if "rank" in labels else labels["bar"].split()[1]


def _panel_targets(title: str) -> list[dict]:
    (panel,) = [panel for panel in panels(load_dashboards(DASHBOARDS_DIR)[BOARD]) if panel["title"] == title]
    return panel["targets"]


def _filled(expr: str, range_seconds: int) -> str:
    """The query Grafana sends for run `big`, every rank picked and the ranks drawn at first."""
    values = {"run": "big", "rank": ".*", "ranks_drawn": str(DRAWN_AT_FIRST), "__range": f"{range_seconds}s",
              "__interval": f"{INTERVAL}s"}
    return VARIABLE.sub(lambda match: values[match.group(1) or match.group(2)], expr)


def _query_range(url: str, expr: str, start: float, end: float, step: int) -> list[dict]:
    response = requests.get(f"{url}/api/v1/query_range",
                            params={"query": expr, "start": start, "end": end, "step": step}, timeout=30)
    body = response.json()
    assert body["status"] == "success", f"{expr}: {body.get('error')}"
    return body["data"]["result"]


def _drawn(url: str, start: int, end: int) -> tuple[dict[str, int], int]:
    """The Data-loading share panel over [start, end]: {rank: its points} and the number of median lines."""
    drawn: dict[str, int] = {}
    medians = 0
    for target in _panel_targets("Data-loading share per rank"):
        found = _query_range(url, _filled(target["expr"], end - start), start, end, INTERVAL)
        if _per_rank(target):
            drawn |= {series["metric"]["rank"]: len(series["values"]) for series in found}
        else:
            medians += len(found)
    return drawn, medians


def _expected(start: int, end: int) -> tuple[dict[str, int], int]:
    return {rank: (end - start) // INTERVAL + 1 for rank in LOWEST_OVER_THE_RANGE}, 1


def test_the_same_slowest_ranks_are_drawn_across_the_panel_on_prometheus(tmp_path: Path) -> None:
    """Rank 17 is slow in the first half and rank 40 in the second: both are drawn over the whole range, with the
    three a little below typical, and no other rank (a bottomk taken at each step drew others where one was 1)."""
    first = int(time.time()) // 60 * 60 - 3 * 3600
    samples = [(series, first + point * INTERVAL, value) for series, values in _history().items()
               for point, value in enumerate(values)]
    start, end = first + 20 * INTERVAL, first + (POINTS - 1) * INTERVAL
    with running_prometheus_holding(tmp_path, samples) as prometheus:
        assert _drawn(prometheus.url, start, end) == _expected(start, end)


def test_the_same_slowest_ranks_are_drawn_across_the_panel_on_victoriametrics(tmp_path: Path) -> None:
    first = int(time.time()) // 60 * 60 - 3 * 3600
    history = [{"series": series, "values": " ".join(map(str, values))} for series, values in _history().items()]
    start, end = first + 20 * INTERVAL, first + (POINTS - 1) * INTERVAL
    with running_victoria(tmp_path) as victoria:
        import_series(victoria.url, history, first, INTERVAL)
        assert _drawn(victoria.url, start, end) == _expected(start, end)


def _rank_panels() -> list[dict]:
    """The Training dashboard's time series and bars with a line or bar per rank."""
    return [panel for panel in panels(load_dashboards(DASHBOARDS_DIR)[BOARD])
            if panel["type"] in {"timeseries", "bargauge"}
            and any(_per_rank(target) for target in panel["targets"])]


def test_64_pushing_ranks_draw_the_slowest_five_and_the_table_lists_all(tmp_path: Path) -> None:
    """A real exporter holding 64 ranks' pushes, scraped by a real Prometheus with the shipped rules: every per-rank
    panel with data draws at most 5 ranks (before: 64 lines, 128 on the p50 / p95 panel), among them the
    step-time straggler (17), the slow loader (40) and, where it has a reading, the rank that never stepped (63,
    no score: drawn first); the table has every scored rank, 40 and 17 first."""
    ranks = ranks_of("big", WORLD_SIZE, SLOW_STEP, SLOW_LOADER, HUNG)
    with running_exporter(tmp_path) as exporter, \
            running_prometheus(tmp_path, {"node": exporter.url.removeprefix("http://")}, RULE_FILES) as prometheus:

        def every_stepping_rank_scored() -> bool:
            push_round(exporter.url, ranks)
            time.sleep(1)
            return (_scored(prometheus.url) == WORLD_SIZE - 1
                    and _lowest(prometheus.url, rec.RANK_STRAGGLER_SCORE) == str(SLOW_STEP)
                    and _lowest(prometheus.url, rec.RANK_STRAGGLER_LOCAL_SCORE) == str(SLOW_LOADER))

        assert wait_for(every_stepping_rank_scored, timeout=90, interval=0)
        table = _query_range(prometheus.url, _filled(_table_lowest_score(), 60), time.time(), time.time(), 1)
        end = time.time()
        drawn = {}
        for panel in _rank_panels():
            for target in panel["targets"]:
                if _per_rank(target):
                    found = _query_range(prometheus.url, _filled(target["expr"], 20), end - 20, end, 1)
                    drawn.setdefault(panel["title"], set()).update(_rank_of(series) for series in found)
    with_data = {title: found for title, found in drawn.items() if found}
    assert {"Step time p50 / p95 per rank", "Throughput", "Data-loading share per rank",
            "Straggler scores"} <= set(with_data)
    assert all(len(found) <= DRAWN_AT_FIRST for found in with_data.values()), with_data
    assert {str(SLOW_STEP), str(SLOW_LOADER)} <= with_data["Step time p50 / p95 per rank"]
    assert {str(SLOW_STEP), str(SLOW_LOADER), str(HUNG)} <= with_data["Throughput"]
    assert len(table) == WORLD_SIZE - 1 and _ordered(table)[:2] == [str(SLOW_LOADER), str(SLOW_STEP)]
    (comparison,) = [panel for panel in panels(load_dashboards(DASHBOARDS_DIR)[BOARD])
                     if panel["title"] == "Per-rank comparison"]
    assert comparison["options"]["sortBy"] == [{"displayName": RANGE_SCORE_COLUMN, "desc": False}]


def _scored(url: str) -> int:
    """How many ranks have both straggler scores now. A rank the rules have not scored yet counts as score 0 in the
    ranks drawn, beside the hung one: with a few of those the stragglers were not drawn, as the scrapes fell."""
    both = f'{rec.RANK_STRAGGLER_SCORE}{{run="big"}} and on (run, rank) {rec.RANK_STRAGGLER_LOCAL_SCORE}{{run="big"}}'
    found = _query_range(url, f"count({both})", time.time(), time.time(), 1)
    return int(found[0]["values"][-1][1]) if found else 0


def _lowest(url: str, score: str) -> str:
    """The rank with the lowest `score` now, or "" while none is scored."""
    found = _query_range(url, f'bottomk(1, {score}{{run="big"}})', time.time(), time.time(), 1)
    return found[0]["metric"]["rank"] if found else ""


def _table_lowest_score() -> str:
    (lowest, *_) = _panel_targets("Per-rank comparison")
    return lowest["expr"]


def _ordered(results: list[dict]) -> list[str]:
    """Ranks by their last value, lowest first."""
    return [series["metric"]["rank"] for series in sorted(results, key=lambda series: float(series["values"][-1][1]))]


# Run "moved": ranks 0 and 1 on node a; rank 0 is killed at MOVED_AT and its requeued pod lands on node b, where it
# pushes from a minute later. Node a's exporter keeps rank 0's group (its allocator memory, a steps rate of 0) until
# its TTL, and its 1m rates read its steps for a minute: both nodes show rank 0 for 10 minutes.
MOVED_AT, REQUEUED_AFTER, KEPT, MOVED_END = 1800, 60, 600, 3600


def _moved_history() -> list[tuple[str, float, float]]:
    """(series, seconds from the start, value): the rules' recordings and the raw families the panels read."""
    lives = {("0", "a"): (0, MOVED_AT), ("0", "b"): (MOVED_AT + REQUEUED_AFTER, MOVED_END), ("1", "a"): (0, MOVED_END)}
    samples = []
    for (rank, node), (begun, ended) in lives.items():
        labels = f'run="moved",rank="{rank}",instance="{node}"'
        kept = KEPT if ended == MOVED_AT else 0
        for t in range(begun, ended + kept + 1, INTERVAL):
            stepping = t <= ended + 60  # the 1m rates still read its last steps
            steps = 10 * (min(t, ended) - begun)
            samples += [(f"{rec.RANK_STEPS_RATE}{{{labels}}}", t, 10.0 if stepping else 0.0),
                        (f"{rec.RANK_SAMPLES_RATE}{{{labels}}}", t, 320.0 if stepping else 0.0),
                        (f"{fam.CUDA_MEMORY_ALLOCATED}{{{labels}}}", t, 2e9),
                        (f'{fam.STEP_SECONDS}_bucket{{{labels},le="0.1"}}', t, steps),
                        (f'{fam.STEP_SECONDS}_bucket{{{labels},le="+Inf"}}', t, steps)]
            if stepping:
                samples += [(f"{rec.RANK_DATALOADER_SHARE}{{{labels}}}", t, 0.1),
                            (f"{rec.RANK_STRAGGLER_SCORE}{{{labels}}}", t, 1.0)]
    return samples


def _legend(pattern: str, labels: dict[str, str]) -> str:
    """A series's name in the legend as Grafana writes it (renderLegendFormat): an absent label as its name."""
    return re.sub(r"\{\{\s*(.+?)\s*\}\}", lambda match: labels.get(match.group(1)) or match.group(1), pattern)


def _moved_legends(url: str, start: int, end: int) -> dict[str, list[str]]:
    """Every per-rank panel's legends over [start, end] for run "moved"."""
    legends: dict[str, list[str]] = {}
    for panel in _rank_panels():
        for target in panel["targets"]:
            found = _query_range(url, _filled(target["expr"], end - start).replace("big", "moved"), start, end,
                                 INTERVAL)
            legends.setdefault(panel["title"], []).extend(
                series["metric"].get("bar") or _legend(target["legendFormat"], series["metric"]) for series in found)
    return legends


def _assert_named_by_node_where_moved(legends: dict[str, list[str]]) -> None:
    for title in ("Throughput", "Data-loading share per rank", "Step time p50 / p95 per rank",
                  "PyTorch allocator memory per rank"):
        assert {"rank 0 on a", "rank 0 on b", "rank 1"} <= {legend.split(" p")[0].removesuffix(" allocated")
                                                          for legend in legends[title]}, (title, legends[title])
    for title, names in legends.items():
        assert len(names) == len(set(names)), (title, names)


def test_a_rank_that_moved_to_another_node_has_a_line_per_node_named_with_its_node(tmp_path: Path) -> None:
    """Rank 0's lines on node a and on node b overlap for 10 minutes (allocator memory, a throughput of 0 on a): both
    read "rank 0" in the throughput, step time, data-loading share and allocator panels. Each is now named with its
    node ("rank 0 on a", "rank 0 on b"), while rank 1, which stayed on one node, reads "rank 1" as before."""
    first = int(time.time()) // 60 * 60 - 3 * 3600
    samples = [(series, first + t, value) for series, t, value in _moved_history()]
    with running_prometheus_holding(tmp_path, samples) as prometheus:
        _assert_named_by_node_where_moved(_moved_legends(prometheus.url, first, first + MOVED_END))


def test_a_rank_that_moved_is_named_with_its_node_on_victoriametrics(tmp_path: Path) -> None:
    first = int(time.time()) // 60 * 60 - 3 * 3600
    values: dict[str, list[str]] = {}
    for series, t, value in _moved_history():
        values.setdefault(series, ["_"] * ((MOVED_END + KEPT) // INTERVAL + 1))[t // INTERVAL] = f"{value:g}"
    history = [{"series": series, "values": " ".join(points)} for series, points in values.items()]
    with running_victoria(tmp_path) as victoria:
        import_series(victoria.url, history, first, INTERVAL)
        _assert_named_by_node_where_moved(_moved_legends(victoria.url, first, first + MOVED_END))


CLOSED_AT, SETUP_SECONDS = 1800, 120  # run "closed": rank 0's pod on node a closes (idle); on node b it sets up, trains


def _closed_history() -> dict[str, list[str]]:
    """{series: a value per INTERVAL, `_` for none}: rank 0 on node a until CLOSED_AT, then idle there (kept until the
    exporter's TTL) while its next pod on node b pushes from a minute later; rank 1 trains on node a throughout, and
    rank 2 on node c pushed through a stock Pushgateway (no last push exported)."""
    points = (CLOSED_AT + KEPT) // INTERVAL + 1
    history: dict[str, list[str]] = {}

    def put(series: str, t: int, value: float) -> None:
        history.setdefault(series, ["_"] * points)[t // INTERVAL] = str(value)

    for t in range(0, CLOSED_AT + KEPT + 1, INTERVAL):
        lives = [("0", "a", "train" if t < CLOSED_AT else "idle", min(t, CLOSED_AT)), ("1", "a", "train", t),
                 ("2", "c", "train", None)]
        if t >= CLOSED_AT + REQUEUED_AFTER:
            lives.append(("0", "b", "setup" if t < CLOSED_AT + REQUEUED_AFTER + SETUP_SECONDS else "train", t))
        for rank, node, state, pushed in lives:
            labels = f'run="closed",rank="{rank}",instance="{node}"'
            for name in ("setup", "train", "idle"):
                put(f'{fam.TRAINING_STATE}{{{labels},state="{name}"}}', t, int(name == state))
            if pushed is not None:
                put(f"{fam.TRAINING_LAST_PUSH}{{{labels}}}", t, 1e9 + pushed)
    return history


def _states(url: str, first: int) -> dict[int, dict[str, str]]:
    """The Training state per rank panel at a few times after the move: {seconds: {its row's name: its state}}."""
    (panel,) = [panel for panel in panels(load_dashboards(DASHBOARDS_DIR)[BOARD])
                if panel["title"] == "Training state per rank"]
    names = {code: mapping["options"][code]["text"] for mapping in panel["fieldConfig"]["defaults"]["mappings"]
             for code in mapping["options"]}
    seen: dict[int, dict[str, str]] = {}
    for after in (CLOSED_AT + REQUEUED_AFTER + 30, CLOSED_AT + KEPT - 30):
        seen[after] = {}
        for target in panel["targets"]:
            expr = _filled(target["expr"], 3600).replace("big", "closed")
            found = _query_range(url, expr, first + after, first + after, INTERVAL)
            seen[after] |= {_legend(target["legendFormat"], series["metric"]): names[series["values"][0][1]]
                            for series in found}
    return seen


# Rank 0 has a row of its own (it was in setup while the others trained); ranks 1 and 2 are in "2 other ranks".
CLOSED_EXPECTED = {CLOSED_AT + REQUEUED_AFTER + 30: {"rank 0": "setup", "2 other ranks": "train"},
                   CLOSED_AT + KEPT - 30: {"rank 0": "train", "2 other ranks": "train"}}


@pytest.mark.parametrize("engine", ["prometheus", "victoriametrics"])
def test_a_rank_that_moved_shows_its_state_on_its_new_node(tmp_path: Path, engine: str) -> None:
    """Rank 0's old pod closed (idle, kept by its exporter for 10 minutes) and its next pod on another node sets up
    and trains: the state timeline took the highest state code of both nodes and read rank 0 `idle` for those 10
    minutes. It now reads the node the rank pushed to last: setup, then train."""
    first = int(time.time()) // 60 * 60 - 3 * 3600
    history = _closed_history()
    if engine == "prometheus":
        samples = [(series, first + index * INTERVAL, float(value)) for series, values in history.items()
                   for index, value in enumerate(values) if value != "_"]
        with running_prometheus_holding(tmp_path, samples) as prometheus:
            assert _states(prometheus.url, first) == CLOSED_EXPECTED
    else:
        with running_victoria(tmp_path) as victoria:
            import_series(victoria.url, [{"series": series, "values": " ".join(values)}
                                         for series, values in history.items()], first, INTERVAL)
            assert _states(victoria.url, first) == CLOSED_EXPECTED

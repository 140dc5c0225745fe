"""Every dashboard query as Grafana sends it, timed against a Prometheus (or VictoriaMetrics) that holds a long,
wide history: which panels are slow, refused or draw too many series at scale.

    PYTHONPATH=. python benchmarks/bench_dashboard_queries.py --url http://127.0.0.1:9090 --at 1795951200 \
        --values run=wide instance=n00 --ranges 6h 24h 7d
    git show HEAD~1:grafana/dashboards_out/stepscope-training.json > /tmp/before/stepscope-training.json
    PYTHONPATH=. python benchmarks/bench_dashboard_queries.py ... --dashboards /tmp/before  # the dashboards before

Each panel target is filled in as Grafana's Prometheus data source fills it (tests/support/dashboard_queries:
`grafana_interpolate`; every multi-value variable at All, `Ranks drawn` at its first choice unless --values sets
it) and sent as Grafana sends it: a table target as an instant query at --at, every other target (time series,
stats, bar gauges, heatmaps: Grafana's default) as a range query over each range, at range / 1000 steps (at least
the 15 s scrape interval), `$__range` the range, `$__interval` the step and `$__rate_interval` max(step + 15 s,
60 s). Prints one row per query and range, slowest first: wall seconds (the client's), Prometheus' own evaluation
seconds (`stats=all`; none from VictoriaMetrics), the series returned, or the error. Run it twice, or against the
dashboards before and after a change in turns: on a shared machine one query's time varies by 2-3x.

benchmarks/results/dashboard-queries.md holds the history it was run on (256 ranks on 32 nodes of 8 GPUs for 3
hours, 26 earlier runs of 256 ranks over the 7 days before) and the slowest queries before and after.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.support.dashboard_queries import DASHBOARDS_DIR, grafana_interpolate, load_dashboards, panels

RANGES = {"6h": 6 * 3600, "24h": 24 * 3600, "7d": 7 * 86400}
SCRAPE_SECONDS = 15
POINTS = 1000  # Grafana's data points per panel
BUILTIN = re.compile(r"\$\{?(__\w+)\}?")


@dataclass(frozen=True)
class Timing:
    dashboard: str
    panel: str
    ref_id: str
    range_name: str
    wall_seconds: float
    eval_seconds: float | None
    series: int | None
    error: str = ""


def with_builtins(expr: str, seconds: int, step: float) -> str:
    """Grafana's built-in interval variables for a panel over `seconds` at `step`."""
    fixed = {"__range": f"{seconds}s", "__range_s": str(seconds), "__interval": f"{step:g}s",
             "__rate_interval": f"{max(step + SCRAPE_SECONDS, 4 * SCRAPE_SECONDS):g}s"}
    return BUILTIN.sub(lambda match: fixed[match.group(1)], expr)


def first_value(variable: dict) -> str:
    """The value a dashboard opens with: its `current` one (a multi-value variable's All is `["$__all"]`)."""
    value = (variable.get("current") or {}).get("value", "$__all")
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def evaluate(url: str, expr: str, instant: bool, at: int, seconds: int, step: float) -> tuple[float, dict]:
    """(wall seconds, the API's reply) of one query."""
    if instant:
        path, params = "query", {"query": expr, "time": at, "stats": "all"}
    else:
        path, params = "query_range", {"query": expr, "start": (at - seconds) // step * step,
                                       "end": at // step * step, "step": step, "stats": "all"}
    started = time.monotonic()
    reply = requests.post(f"{url}/api/v1/{path}", data=params, timeout=300)
    return time.monotonic() - started, reply.json()


def timings(url: str, at: int, directory: Path, values: dict[str, str], ranges: list[str]) -> list[Timing]:
    found = []
    for name, model in load_dashboards(directory).items():
        defaults = {variable["name"]: first_value(variable) for variable in model.get("templating", {}).get("list", [])}
        filled = {**defaults, **{key: value for key, value in values.items() if key in defaults}}
        for panel in panels(model):
            for target in (target for target in panel.get("targets", []) if "expr" in target):
                for range_name in ranges:
                    seconds = RANGES[range_name]
                    step = max(seconds / POINTS, SCRAPE_SECONDS)
                    expr = grafana_interpolate(with_builtins(target["expr"], seconds, step), model, filled)
                    wall, body = evaluate(url, expr, bool(target.get("instant")), at, seconds, step)
                    data = body.get("data") or {}
                    found.append(Timing(name.removesuffix(".json"), panel["title"], target.get("refId", ""),
                                        range_name, wall, data.get("stats", {}).get("timings", {}).get("evalTotalTime"),
                                        len(data["result"]) if body.get("status") == "success" else None,
                                        body.get("error", "")))
    return found


def render(found: list[Timing], rows: int) -> str:
    lines = ["| dashboard | panel | query | range | wall s | eval s | series |", "|---|---|---|---|---|---|---|"]
    for timing in sorted(found, key=lambda timing: -timing.wall_seconds)[:rows]:
        evaluated = "" if timing.eval_seconds is None else f"{timing.eval_seconds:.2f}"
        series = timing.error[:80] if timing.series is None else str(timing.series)
        lines.append(f"| {timing.dashboard} | {timing.panel} | {timing.ref_id} | {timing.range_name} | "
                     f"{timing.wall_seconds:.2f} | {evaluated} | {series} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the Prometheus or VictoriaMetrics base URL")
    parser.add_argument("--at", type=int, default=int(time.time()), help="the time range's end (Unix seconds)")
    parser.add_argument("--values", nargs="*", default=[], help="variable=value, e.g. run=wide instance=n00")
    parser.add_argument("--ranges", nargs="*", default=list(RANGES), choices=list(RANGES))
    parser.add_argument("--dashboards", type=Path, default=DASHBOARDS_DIR, help="a folder of dashboard JSON")
    parser.add_argument("--rows", type=int, default=20, help="how many of the slowest to print")
    args = parser.parse_args()
    malformed = [item for item in args.values if "=" not in item]
    if malformed:
        sys.exit(f"--values takes variable=value, not {' '.join(malformed)}")
    values = dict(item.split("=", 1) for item in args.values)
    print(render(timings(args.url, args.at, args.dashboards, values, args.ranges), args.rows))


if __name__ == "__main__":
    main()

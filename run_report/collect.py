"""Fetches everything the report shows for one run and window, with a few queries in flight at once."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from stepscope.report import queries
from stepscope.report.prometheus import Prometheus, Series
from stepscope.report.window import Window

PARALLEL_QUERIES = 6  # Prometheus answers these concurrently; more only queues on a small server


@dataclass(frozen=True)
class RunData:
    """The answers, keyed like `queries.Queries`: totals over the window and series over time."""

    run: str
    window: Window
    nodes: tuple[str, ...]
    totals: Mapping[str, list[Series]]
    over_time: Mapping[str, list[Series]]


def fetch(prom: Prometheus, run: str, window: Window, nodes: list[str]) -> RunData:
    built = queries.build(run, window, nodes)
    with ThreadPoolExecutor(PARALLEL_QUERIES) as pool:
        totals = {name: pool.submit(prom.query, expr, window.end) for name, expr in built.totals.items()}
        over_time = {
            name: pool.submit(prom.query_range, expr, window.start, window.end, window.step)
            for name, expr in built.over_time.items()
        }
        return RunData(
            run,
            window,
            tuple(nodes),
            {name: future.result() for name, future in totals.items()},
            {name: future.result() for name, future in over_time.items()},
        )

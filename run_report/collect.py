"""Fetches everything the report shows for one run and window, with a few queries in flight at once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from stepscope.report import queries
from stepscope.report.prometheus import Prometheus, Series
from stepscope.report.window import Window

PARALLEL_QUERIES = 6  # Prometheus answers these concurrently; more only queues on a small server
Answer = Future[list[Series]]


@dataclass(frozen=True)
class RunData:
    """The answers, keyed like `queries.Queries`: totals over the window (and the run's quantiles,
    queries.run_quantiles) and series over time."""

    run: str
    window: Window
    nodes: tuple[str, ...]
    totals: Mapping[str, list[Series]]
    over_time: Mapping[str, list[Series]]


def fetch(prom: Prometheus, run: str, window: Window, nodes: list[str]) -> RunData:
    with ThreadPoolExecutor(PARALLEL_QUERIES) as pool:

        def total(expr: str) -> Answer:
            return pool.submit(prom.query, expr, window.end)

        went_down = _sent_once(queries.counter_resets(run, window), total)
        steady = {selector for selector, answer in went_down.items() if not answer.result()}
        built = queries.build(run, window, nodes, steady)
        totals = _sent_once(built.totals, total)
        over_time = _sent_once(
            built.over_time, lambda expr: pool.submit(prom.query_range, expr, window.start, window.end, window.step))
        bounds = shared_bounds(totals["step_buckets"].result())
        totals |= _sent_once(queries.run_quantiles(run, window, bounds), total)
        firsts = totals["first_step_count"].result()
        at_first = queries.first_scrape_values(run, window)
        answers = {at: _sent_once(at_first, lambda expr, at=at: pool.submit(prom.query, expr, at))
                   for at in sorted({at for series in firsts for at, _ in series.points})}
        answered = {name: list(future.result()) for name, future in totals.items()}
        return RunData(
            run,
            window,
            tuple(nodes),
            answered | at_first_points(firsts, answers, at_first),
            {name: list(future.result()) for name, future in over_time.items()},
        )


def at_first_points(firsts: list[Series], answers: Mapping[float, Mapping[str, Answer]],
                    names: Iterable[str]) -> dict[str, list[Series]]:
    """Each name's answers (instant, at each time of `answers`) kept where a rank has a first point (`firsts`,
    queries._first_scrape), as series of those points: what the report asked, for each name, as a subquery over
    the window kept at the first points only."""
    ranks_at: dict[float, set[tuple[str, str]]] = {}
    for series in firsts:
        for at, _ in series.points:
            ranks_at.setdefault(at, set()).add(_rank(series.labels))
    points: dict[str, dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]] = {}
    for at, named in sorted(answers.items()):
        for name, answer in named.items():
            for series in answer.result():
                if _rank(series.labels) in ranks_at.get(at, set()):
                    points.setdefault(name, {}).setdefault(tuple(sorted(series.labels.items())), []).append(
                        (at, series.last))
    return {name: [Series(dict(labels), tuple(found)) for labels, found in points.get(name, {}).items()]
            for name in names}


def _rank(labels: Mapping[str, str]) -> tuple[str, str]:
    return labels.get("rank", ""), labels.get("instance", "")


def shared_bounds(step_buckets: list[Series]) -> list[str]:
    """The bounds (`le`) that every rank of the answer to `step_buckets` has: `count by (le) (buckets) ==
    scalar(count(count by (rank, instance) (buckets)))` of PromQL, read off the answer (queries.run_quantiles)."""
    ranks = {(series.labels.get("rank", ""), series.labels.get("instance", "")) for series in step_buckets}
    ranks_per_bound = Counter(series.labels.get("le", "") for series in step_buckets)
    return sorted(bound for bound, count in ranks_per_bound.items() if count == len(ranks))


def _sent_once(named: Mapping[str, str], send: Callable[[str], Answer]) -> dict[str, Answer]:
    """Each name's answer, sending each distinct expression once: the goodput's counters are the summary's (the same
    PromQL for the run's steps, tokens and state seconds), and on a 3-hour run of 256 ranks asking for the state
    seconds twice cost Prometheus 8.7 s of the report's 97 s."""
    answers = {expr: send(expr) for expr in dict.fromkeys(named.values())}
    return {name: answers[expr] for name, expr in named.items()}

"""A run's report from its fetched data: the numbers, the timelines, the pictures, the files."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from stepscope.contract import TRAIN_STATE
from stepscope.report import csvs, page, plots
from stepscope.report.collect import RunData
from stepscope.report.goodput import CSV_HEADER as GOODPUT_HEADER
from stepscope.report.goodput import Goodput, account
from stepscope.report.mfu import Throughput
from stepscope.report.prometheus import Series
from stepscope.report.resize import Resize, end_at_resizes, resizes, world_sizes
from stepscope.report.summary import (
    NodeSummary,
    RankSummary,
    RunTotals,
    node_summaries,
    rank_summaries,
    run_totals,
)
from stepscope.report.timeline import (
    Bound,
    Interval,
    critical_path,
    labelled_intervals,
    state_intervals,
    times_in_state,
    while_training,
)
from stepscope.report.times import iso
from stepscope.report.verdict import SETTLE_SECONDS, Assessment, assess

SCORES = ("step_score", "local_score")  # the straggler scores: the critical path's

RUN_SUMMARY_HEADER = (
    "run", "start", "end", "resolution_seconds", "ranks", "nodes", "steps", "samples", "first_step_seconds",
    "mean_step_seconds", "p50_step_seconds", "p95_step_seconds", "dataloader_share", "io_samples_per_second",
    "training_samples_per_second", "gpu_effective_utilization_ratio", "gpu_utilization_ratio", "verdict",
    "stragglers", "tokens", "tokens_per_second", "model_flops_per_second", "peak_flops_per_second", "mfu_ratio",
    "world_sizes",
)
PAGE = "index.html"
Table = tuple[Sequence[str], list[list[object]]]  # a CSV's header and rows


@dataclass(frozen=True)
class Report:
    data: RunData
    prometheus_url: str
    generated: float
    ranks: list[RankSummary]
    nodes: list[NodeSummary]
    totals: RunTotals
    assessment: Assessment
    intervals: list[Interval]
    verdicts: list[tuple[str, float, float]]
    path: list[Bound]
    goodput: Goodput  # where the ranks' held time went, and the run's energy
    resizes: list[Resize]  # where the run went on with another world size, in time order
    world_sizes: list[int]  # the world sizes it had, in order


def build(data: RunData, prometheus_url: str) -> Report:
    ranks = rank_summaries(data)
    totals = run_totals(data, ranks)
    over = data.over_time
    # the pushed state, not the verdict: the rules judge a run only once a rank has trained a while, and
    # the straggler scores hold from its first steps
    training = times_in_state(over["state"], TRAIN_STATE)
    resized = resizes(over["world_size"], data.window.step)
    intervals = state_intervals(over["state"], data.window, over.get("last_push", []))
    return Report(
        data=data, prometheus_url=prometheus_url, generated=time.time(), ranks=ranks,
        nodes=node_summaries(ranks), totals=totals, assessment=assess(data, totals, ranks),
        intervals=end_at_resizes(intervals, resized),
        verdicts=labelled_intervals(over["verdict"], "verdict", data.window),
        path=[bound for bound in critical_path(*(while_training(over[score], intervals) for score in SCORES))
              if bound.time in training],
        goodput=account(data.totals, over["stalled"], (over["global_step"], over["global_step_base"]),
                        data.window.step, totals.samples, data.window.start),
        resizes=resized,
        world_sizes=world_sizes(over["world_size"], resized),
    )


def write(report: Report, directory: Path) -> list[str]:
    """Writes the CSVs and index.html into `directory` (which exists and is empty); returns the names."""
    files = _write_csvs(report, directory)
    html = page.render(report, _images(report), files)
    (directory / PAGE).write_text(html, encoding="utf-8")
    return [PAGE, *files]


def _images(report: Report) -> dict[str, tuple[str, bytes | str]]:
    data, window, over = report.data, report.data.window, report.data.over_time
    images: dict[str, tuple[str, bytes | str]] = {
        "Step time": ("Step time per rank, the run's p50 and p95, throughput and data-loading share over time",
                      plots.step_time(window, over) if over["step_mean"] else "No step was timed in this window."),
        "Phase breakdown": ("Seconds per step in each phase, per rank",
                            plots.phase_breakdown(report.ranks, report.totals.phases)
                            if any(rank.steps_timed for rank in report.ranks) else "No step was timed in this window."),
        "States and critical path": ("Gantt chart of each rank's states, the verdict and the slowest rank over time",
                                     plots.gantt(window, report.intervals, report.verdicts, report.path)
                                     if report.intervals else "No training state was recorded in this window."),
        "GPU utilization": ("Effective utilization of each GPU the run used",
                            plots.gpu_utilization(window, over["gpu_effective"], over["gpu_nvml"])
                            if over["gpu_effective"] else _no_gpu_words(over)),
        "Node resources": ("CPU, memory, disk and network of the run's nodes",
                           plots.node_resources(window, over)
                           if any(over.get(name) for name in csvs.NODE_RESOURCE_COLUMNS.values()) else
                           f"No node metrics for {', '.join(data.nodes) or 'the run'}: is the stepscope "
                           "exporter scraped there?"),
    }
    return images


def _no_gpu_words(over: Mapping[str, list[Series]]) -> str:
    """Why the GPU plot is empty: the rules record a GPU's readings for a run only once a rank on it has
    trained a while, so a mapped GPU of a short run has none."""
    if over["gpu_memory"]:
        return (f"The run held memory on {len(over['gpu_memory'])} GPUs, but no rank trained {SETTLE_SECONDS} s "
                "without a break, so no GPU reading was recorded for it.")
    return ("No GPU is mapped to this run: it trains on the CPU, or the exporter on its node cannot see its "
            "processes (hostPID / pid: host).")


def _write_csvs(report: Report, directory: Path) -> list[str]:
    for name, table in CSV_TABLES.items():
        csvs.write(directory / name, *table(report))
    return list(CSV_TABLES)


def _over_time(columns: Mapping[str, str], keys: Mapping[str, str],
               extra: Mapping[str, str] | None = None) -> Callable[[Report], Table]:
    """A table of series over time: a row per time and key (csvs.over_time)."""
    return lambda report: csvs.over_time(report.data.over_time, columns, keys, extra)


CSV_TABLES: dict[str, Callable[[Report], Table]] = {  # file name -> (header, rows) of a report
    "run_summary.csv": lambda report: (RUN_SUMMARY_HEADER, [_run_row(report)]),
    "rank_summary.csv": lambda report: csvs.rank_rows(report.ranks, report.totals.phases),
    "node_summary.csv": lambda report: (csvs.NODE_SUMMARY_HEADER, csvs.node_rows(report.nodes)),
    "state_timeline.csv": lambda report: (csvs.STATE_TIMELINE_HEADER, csvs.state_rows(report.intervals)),
    "critical_path.csv": lambda report: (csvs.CRITICAL_PATH_HEADER, csvs.critical_path_rows(report.path)),
    "goodput.csv": lambda report: (GOODPUT_HEADER, report.goodput.csv_rows()),
    "node_resource_usage.csv": _over_time(csvs.NODE_RESOURCE_COLUMNS, {"node": "instance"}),
    "process_resource_usage.csv": _over_time(csvs.PROCESS_RESOURCE_COLUMNS,
                                             {"node": "instance", "rank": "rank", "pid": "pid"}),
    "gpu_usage.csv": _over_time(csvs.GPU_COLUMNS, {"node": "instance", "gpu": "gpu"}, {"source": "source"}),
}
# Every file write() puts in a report directory: output.py replaces a directory only when it holds no other
FILES = (PAGE, *CSV_TABLES)


def _run_row(report: Report) -> list[object]:
    window, totals, a = report.data.window, report.totals, report.assessment
    return [
        report.data.run, iso(window.start), iso(window.end), window.step, len({r.rank for r in report.ranks}),
        " ".join(report.data.nodes), totals.steps, totals.samples, totals.first_step_seconds, totals.mean,
        totals.p50, totals.p95,
        totals.dataloader_share, totals.io_samples_per_second, totals.training_samples_per_second,
        a.gpus.effective, a.gpus.nvml, a.verdict, " ".join(rank.rank for rank in a.stragglers),
        *_throughput_cells(a.throughput), " ".join(str(size) for size in report.world_sizes),
    ]


def _throughput_cells(throughput: Throughput | None) -> list[float | None]:
    """Tokens, tokens/s, achieved and peak FLOP/s and MFU (docs/mfu.md); empty where the run counts none."""
    if throughput is None:
        return [None] * 5
    return [throughput.tokens, throughput.tokens_per_second, throughput.flops_per_second, throughput.peak_flops,
            throughput.mfu]

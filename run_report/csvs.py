"""The report's CSV files: their columns (documented in docs/report.md) and how rows are made.

Times are RFC 3339 in UTC; quantities are in base units (seconds, bytes, ratios 0..1); an empty cell
means Prometheus had no value there.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from stepscope.contract import STATES
from stepscope.report.prometheus import Series
from stepscope.report.summary import NodeSummary, RankSummary
from stepscope.report.timeline import Bound, Interval, rank_key
from stepscope.report.times import iso

NODE_RESOURCE_COLUMNS = {  # column -> over-time query name (stepscope.report.queries)
    "cpu_utilization_ratio": "node_cpu",
    "memory_used_bytes": "node_memory_used",
    "memory_utilization_ratio": "node_memory_ratio",
    "disk_read_bytes_per_second": "node_disk_read",
    "disk_written_bytes_per_second": "node_disk_write",
    "network_receive_bytes_per_second": "node_net_receive",
    "network_transmit_bytes_per_second": "node_net_transmit",
}
PROCESS_RESOURCE_COLUMNS = {
    "cpu_cores": "process_cpu",
    "resident_memory_bytes": "process_memory",
    "gpu_memory_bytes": "process_gpu_memory",
    "children": "process_children",
    "io_read_bytes_per_second": "process_read",
    "io_write_bytes_per_second": "process_write",
}
GPU_COLUMNS = {
    "effective_utilization_ratio": "gpu_effective",
    "utilization_ratio": "gpu_nvml",
    "memory_used_bytes": "gpu_memory",
}
NODE_SUMMARY_HEADER = ("node", "ranks", "steps", "samples", "mean_step_seconds", "fastest_rank_mean_step_seconds",
                       "slowest_rank_mean_step_seconds", "step_time_skew")
RANK_SUMMARY_HEADER = ("rank", "node", "local_rank", "pid", "steps", "samples", "first_step_seconds",
                       "mean_step_seconds", "p50_step_seconds", "p95_step_seconds")  # then share_<phase>..., the scores
STATE_TIMELINE_HEADER = ("rank", "node", "state", "start", "end", "seconds")
# rank_summary.csv's last columns: seconds per state over the window (counted by the hooks), the train share
STATE_SECONDS_HEADER = (*(f"{state}_seconds" for state in STATES), "train_time_share")
CRITICAL_PATH_HEADER = ("time", "rank", "node", "score", "score_kind", "step_time_score", "local_score")


def cell(value: object) -> str:
    """A CSV cell: integers without a fraction, other numbers with 9 significant digits, None empty."""
    if value is None:
        return ""
    if isinstance(value, float):
        if value != value:  # NaN
            return ""
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.9g}"
    return str(value)


def write(path: Path, header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(header)
        writer.writerows([cell(value) for value in row] for row in rows)


def over_time(over: Mapping[str, list[Series]], columns: Mapping[str, str], keys: Mapping[str, str],
              extra: Mapping[str, str] | None = None) -> tuple[list[str], list[list[object]]]:
    """(header, rows) of time, key columns, one column per query and extra label columns.

    `columns` maps a column to a query's series set; `keys` maps a column to the label that identifies
    a row besides time (node: instance); `extra` maps a column to a label one of the series carries
    (the GPU's `source`).
    """
    extra = extra or {}
    rows: dict[tuple[float, ...], dict[str, object]] = {}
    for column, name in columns.items():
        for series in over.get(name, []):
            key = tuple(series.labels.get(label, "") for label in keys.values())
            for t, value in series.points:
                row = rows.setdefault((t, *key), {})
                row[column] = value
                row.update({column: series.labels[label] for column, label in extra.items() if label in series.labels})
    names = [*columns, *extra]
    order = {key[1:]: tuple(rank_key(part) for part in key[1:]) for key in rows}  # per series, not per row
    ordered = sorted(rows, key=lambda k: (k[0], order[k[1:]]))
    return ["time", *keys, *names], [[iso(k[0]), *k[1:], *(rows[k].get(name) for name in names)] for k in ordered]


CUDA_HEADER = ("cuda_peak_allocated_bytes", "cuda_max_reserved_bytes", "cuda_alloc_retries", "cuda_ooms")


def _cuda_cells(rank: RankSummary) -> list[object]:
    memory = rank.cuda
    if memory is None:
        return [None] * len(CUDA_HEADER)
    return [memory.peak_bytes, memory.reserved_bytes, memory.alloc_retries, memory.ooms]


def rank_rows(ranks: Sequence[RankSummary], phases: Sequence[str]) -> tuple[list[str], list[list[object]]]:
    header = [*RANK_SUMMARY_HEADER, *(f"share_{phase}" for phase in phases), "share_in_no_phase",
              "step_time_score", "local_score", *STATE_SECONDS_HEADER, *CUDA_HEADER]
    rows = [
        [rank.rank, rank.node, rank.local_rank, rank.pids, rank.steps, rank.samples,
         rank.first_step_seconds, rank.mean, rank.p50, rank.p95,
         *(rank.share(phase) for phase in phases), rank.untimed_share, rank.step_time_score, rank.local_score,
         *(rank.state_seconds.get(state) for state in STATES), rank.train_time_share, *_cuda_cells(rank)]
        for rank in ranks
    ]
    return header, rows


def node_rows(nodes: Sequence[NodeSummary]) -> list[list[object]]:
    return [[n.node, n.ranks, n.steps, n.samples, n.mean, n.fastest_rank_mean, n.slowest_rank_mean, n.skew]
            for n in nodes]


def state_rows(intervals: Sequence[Interval]) -> list[list[object]]:
    return [[i.rank, i.node, i.state, iso(i.start), iso(i.end), i.seconds] for i in intervals]


def critical_path_rows(path: Sequence[Bound]) -> list[list[object]]:
    return [[iso(b.time), b.rank, b.node, b.score, b.kind, b.step_time_score, b.local_score] for b in path]

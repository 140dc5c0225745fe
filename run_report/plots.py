"""The report's pictures as PNG bytes, drawn with matplotlib's Agg renderer (no display, no pyplot
state: every figure is a plain `Figure` that is dropped once saved).

Time runs left to right from the window's start, in seconds, minutes or hours by its length.
"""

from __future__ import annotations

import io
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, PercentFormatter

from stepscope.contract import STATES, THRESHOLDS
from stepscope.contract import verdicts as verdict_names
from stepscope.contract.goodput import LOST
from stepscope.report.prometheus import Series
from stepscope.report.summary import STRAGGLER_SCORE, RankSummary
from stepscope.report.timeline import Bound, Interval, rank_key
from stepscope.report.window import Window

WIDTH = 11.0  # inches; at DPI that is the page's content width
DPI = 100
STATE_COLORS = dict(zip(STATES, ("#9e9e9e", "#2e7d32", "#1565c0", "#ef6c00", "#e0e0e0"), strict=True))
STATE_COLORS[LOST] = "#b71c1c"  # the timeline's: a rank that stopped pushing without closing
VERDICT_COLORS = {verdict_names.GPU_BOUND: "#00897b", verdict_names.DATA_BOUND: "#e53935",
                  verdict_names.GPU_BUSY_IDLE: "#8e24aa", verdict_names.HOST_BOUND: "#fdd835",
                  verdict_names.GPU_SHARED: "#a1887f",
                  verdict_names.UNDETERMINED: "#7986cb", verdict_names.IDLE: "#eeeeee"}
OTHER_COLOR = "#6d4c41"
UNTIMED_COLOR = "#cfd8dc"
LEGEND_ENTRIES = 18  # a plot's legend at most: 16 ranks (or nodes) and the run's p50 / p95
# Gantt rows past which the time is labelled above the chart too: 256 ranks drew a chart 8,972 px tall with its
# time axis only at the bottom, 80 screens below its first rows
TIME_ON_TOP_ROWS = 32


class TimeAxis:
    """Elapsed time since the window's start in one unit chosen for its length."""

    def __init__(self, window: Window) -> None:
        self.start = window.start
        self.step = window.step
        seconds = window.seconds
        self.unit, self.scale = ("h", 3600.0) if seconds > 3 * 3600 else ("min", 60.0) if seconds > 600 else ("s", 1.0)
        self.limit = seconds / self.scale

    def __call__(self, t: float) -> float:
        return (t - self.start) / self.scale

    def label(self) -> str:
        return f"time since the window's start ({self.unit})"


def step_time(window: Window, over_time: Mapping[str, list[Series]]) -> bytes:
    """Per-rank mean step time, the run's p50/p95, throughput and each rank's data-loading share."""
    axis = TimeAxis(window)
    fig = Figure(figsize=(WIDTH, 7.5), dpi=DPI, layout="constrained")
    top, middle, bottom = fig.subplots(3, 1, sharex=True, height_ratios=(3, 1.4, 1.4))
    ranks = _by_rank(over_time["step_mean"])
    colors = _rank_colors(ranks)
    for rank, found in ranks.items():
        for index, series in enumerate(found):
            _line(top, axis, series, color=colors[rank], label=f"rank {rank}" if index == 0 else None, linewidth=1.2)
    for name, style in (("run_p50", "--"), ("run_p95", ":")):
        for series in over_time[name]:
            _line(top, axis, series, color="black", linestyle=style, linewidth=1.4,
                  label=f"run {name.removeprefix('run_')}")
    top.set_ylabel("step time (s)")
    top.set_title("Step time per rank (mean over 1m) and the run's p50 / p95")
    _legend(top)
    for series in over_time["run_samples_rate"]:
        _line(middle, axis, series, color="#37474f", linewidth=1.4)
    middle.set_ylabel("samples/s")
    middle.set_title("Run throughput")
    for rank, found in _by_rank(over_time["dataloader_share"]).items():
        for series in found:
            _line(bottom, axis, series, color=colors.get(rank, OTHER_COLOR), linewidth=1.2)
    data_bound = THRESHOLDS["data_loading_share"].value
    bottom.axhline(data_bound, color="#c62828", linestyle="--", linewidth=1)
    bottom.yaxis.set_major_formatter(PercentFormatter(1.0))
    bottom.set_ylim(0, 1.05)
    bottom.set_title(f"Data-loading share of step time per rank (dashed: {data_bound:.0%}, data-bound above)")
    _time_axis(bottom, axis)
    for ax in (top, middle):
        ax.set_ylim(bottom=0)
    return _png(fig)


def phase_breakdown(ranks: Sequence[RankSummary], phases: Sequence[str]) -> bytes:
    """Seconds per step in each phase, stacked per rank, plus the step time in no phase."""
    shown = [rank for rank in ranks if rank.steps_timed > 0]
    fig = Figure(figsize=(WIDTH, 1.4 + 0.32 * max(len(shown), 2)), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    labels = [f"rank {rank.rank} ({rank.node})" for rank in shown]
    left = [0.0] * len(shown)
    colors = _phase_colors(phases)
    for phase in phases:
        widths = [rank.phase_seconds.get(phase, 0.0) / rank.steps_timed for rank in shown]
        ax.barh(labels, widths, left=left, color=colors[phase], label=phase, height=0.7)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    untimed = [max(0.0, (rank.mean or 0.0) - used) for rank, used in zip(shown, left, strict=True)]
    ax.barh(labels, untimed, left=left, color=UNTIMED_COLOR, label="in no phase", height=0.7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.set_title("Phase breakdown per rank over the window (seconds per step)")
    fig.legend(loc="outside lower center", ncols=7, frameon=False, fontsize="small")
    return _png(fig)


def gantt(window: Window, intervals: Sequence[Interval], verdicts: Sequence[tuple[str, float, float]],
          path: Sequence[Bound]) -> bytes:
    """Each rank's states over the window, under the run's verdict and the rank that bounded each window."""
    axis = TimeAxis(window)
    rows = sorted({(i.rank, i.node) for i in intervals}, key=lambda key: (rank_key(key[0]), key[1]))
    fig = Figure(figsize=(WIDTH, 2.0 + 0.34 * (len(rows) + 2)), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    labels = ["verdict", "slowest rank", *(f"rank {rank} ({node})" for rank, node in rows)]
    bars: dict[tuple[int, str, float], list[tuple[float, float]]] = defaultdict(list)  # (row, colour, alpha)
    for value, start, end in verdicts:
        bars[(0, VERDICT_COLORS.get(value, OTHER_COLOR), 1.0)].append((start, end))
    colors = _rank_colors({rank: None for rank, _ in rows})
    for bound, end in _bound_ends(path, window):
        solid = 1.0 if bound.score < STRAGGLER_SCORE else 0.3
        bars[(1, colors.get(bound.rank, OTHER_COLOR), solid)].append((bound.time, end))
    row_of = {key: 2 + index for index, key in enumerate(rows)}
    for interval in intervals:
        color = STATE_COLORS.get(interval.state, OTHER_COLOR)
        bars[(row_of[(interval.rank, interval.node)], color, 1.0)].append((interval.start, interval.end))
    for (row, color, alpha), spans in bars.items():  # one collection per row and colour: fast for 64 ranks
        ax.broken_barh([(axis(start), axis(end) - axis(start)) for start, end in spans], (row - 0.38, 0.76),
                       facecolors=color, alpha=alpha)
    for rank, start, end in _segments(path, window):
        if axis(end) - axis(start) > axis.limit / 25:
            ax.text((axis(start) + axis(end)) / 2, 1, f"rank {rank}", ha="center", va="center", fontsize="small",
                    bbox={"facecolor": "white", "alpha": 0.8, "linewidth": 0, "pad": 1})
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_title("States per rank, the run's verdict, and the slowest rank in each window "
                 f"(solid: straggler score < {STRAGGLER_SCORE})")
    states = [Patch(color=color, label=state) for state, color in STATE_COLORS.items()]
    verdict_patches = [Patch(color=VERDICT_COLORS[v], label=f"verdict {v}")
                       for v in sorted({v for v, _, _ in verdicts}) if v in VERDICT_COLORS and v != verdict_names.IDLE]
    fig.legend(handles=states + verdict_patches, loc="outside lower center", ncols=5, frameon=False,
               fontsize="small")
    _time_axis(ax, axis)
    if len(rows) > TIME_ON_TOP_ROWS:
        ax.tick_params(axis="x", top=True, labeltop=True)
    return _png(fig)


def gpu_utilization(window: Window, effective: Iterable[Series], nvml: Iterable[Series]) -> bytes:
    """Effective utilization (SM active or NVML, label source) of every GPU the run held, NVML dashed."""
    axis = TimeAxis(window)
    gpus = sorted(effective, key=_gpu_key)
    fig = Figure(figsize=(WIDTH, 3.6 + 0.2 * math.ceil(len(gpus) / 4)), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    nvml_by_gpu = {(s.labels.get("instance"), s.labels.get("gpu")): s for s in nvml}
    cycle = _palette(len(gpus))
    for index, series in enumerate(gpus):
        color = cycle[index % len(cycle)]
        gpu = (series.labels.get("instance"), series.labels.get("gpu"))
        _line(ax, axis, series, color=color, linewidth=1.4,
              label=f"{gpu[0]} GPU {gpu[1]} ({series.labels.get('source', '')})")
        if gpu in nvml_by_gpu and series.labels.get("source") != "utilization":
            _line(ax, axis, nvml_by_gpu[gpu], color=color, linewidth=0.9, linestyle="--")
    ax.set_ylim(0, 1.05)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_title("Effective GPU utilization of the run's GPUs (dashed: NVML utilization where SM active is read)")
    if 0 < len(gpus) <= 32:
        fig.legend(loc="outside lower center", ncols=4, frameon=False, fontsize="small")
    _time_axis(ax, axis)
    return _png(fig)


def node_resources(window: Window, over_time: Mapping[str, list[Series]]) -> bytes:
    """CPU, memory, disk and network throughput of the nodes the run's ranks ran on."""
    axis = TimeAxis(window)
    fig = Figure(figsize=(WIDTH, 5.8), dpi=DPI, layout="constrained")
    (cpu, memory), (disk, network) = fig.subplots(2, 2, sharex=True)
    nodes = sorted({s.labels.get("instance", "") for name, found in over_time.items()
                    if name.startswith("node_") for s in found})
    cycle = _palette(len(nodes))
    colors = {node: cycle[i % len(cycle)] for i, node in enumerate(nodes)}
    panels = (
        (cpu, "node_cpu", None, "CPU busy", 1.0),
        (memory, "node_memory_used", None, "memory used (GiB)", 1024**3),
        (disk, "node_disk_read", "node_disk_write", "disk read / written (MB/s)", 1e6),
        (network, "node_net_receive", "node_net_transmit", "network received / sent (MB/s)", 1e6),
    )
    for ax, solid, dashed, title, scale in panels:
        for name, style in ((solid, "-"), (dashed, "--")):
            for series in over_time.get(name or "", []) if name else []:
                node = series.labels.get("instance", "")
                _line(ax, axis, series, scale=scale, color=colors[node], linestyle=style, linewidth=1.3,
                      label=node if style == "-" else None)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
    cpu.yaxis.set_major_formatter(PercentFormatter(1.0))
    cpu.set_ylim(0, 1.05)
    _legend(cpu)
    for ax in (disk, network):
        _time_axis(ax, axis)
    return _png(fig)


def _bound_ends(path: Sequence[Bound], window: Window) -> list[tuple[Bound, float]]:
    """Each window's bound with the time it lasts until: the next point, or one step (at a gap)."""
    ends = []
    for index, bound in enumerate(path):
        following = path[index + 1] if index + 1 < len(path) else None
        contiguous = following is not None and following.time - bound.time <= 1.5 * window.step
        ends.append((bound, following.time if contiguous else min(bound.time + window.step, window.end)))
    return ends


def _segments(path: Sequence[Bound], window: Window) -> list[tuple[str, float, float]]:
    """Consecutive windows bounded by the same rank, merged: (rank, start, end)."""
    segments: list[tuple[str, float, float]] = []
    for bound, end in _bound_ends(path, window):
        if segments and segments[-1][0] == bound.rank and abs(segments[-1][2] - bound.time) < 1e-6:
            segments[-1] = (bound.rank, segments[-1][1], end)
        else:
            segments.append((bound.rank, bound.time, end))
    return segments


def _line(ax, axis: TimeAxis, series: Series, scale: float = 1.0, **style) -> None:
    """One series as a line, broken where it has no points (a gap of more than 1.5 steps)."""
    points = series.points
    xs, ys = [], []
    for index, (t, value) in enumerate(points):
        if index and t - points[index - 1][0] > 1.5 * axis.step:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append(axis(t))
        ys.append(value / scale)
    ax.plot(xs, ys, **style)


def _time_axis(ax, axis: TimeAxis) -> None:
    ax.set_xlim(0, axis.limit)
    ax.set_xlabel(axis.label())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))


def _legend(ax) -> None:
    """A legend while it stays readable; beyond that, colours alone (the CSVs name every line). Before, every line
    got one: a 64-rank run's step-time plot held 66 entries in 4 columns over its whole height, title and lines."""
    handles, _ = ax.get_legend_handles_labels()
    if handles and len(handles) <= LEGEND_ENTRIES:
        ax.legend(fontsize="small", ncols=min(4, len(handles)), loc="best")


def _by_rank(series: Iterable[Series]) -> dict[str, list[Series]]:
    """Each rank's series, ranks in numeric order: one per node it ran on. A job requeued on other nodes has two
    per rank; keyed by rank alone, each rank kept one, and its lines before the requeue were not drawn."""
    found: dict[str, list[Series]] = {}
    for s in sorted(series, key=lambda s: rank_key(s.labels.get("rank", ""))):
        found.setdefault(s.labels.get("rank", ""), []).append(s)
    return found


def _rank_colors(ranks: Mapping[str, object]) -> dict[str, str]:
    cycle = _palette(len(ranks))
    return {rank: cycle[index % len(cycle)] for index, rank in enumerate(sorted(ranks, key=rank_key))}


def _phase_colors(phases: Sequence[str]) -> dict[str, str]:
    cycle = _palette(max(len(phases), 10))
    return {phase: cycle[index % len(cycle)] for index, phase in enumerate(phases)}


def _palette(count: int) -> list[str]:
    """tab10 for up to 10 lines, tab20 up to 20, then evenly spaced viridis."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    if count <= 10:
        return [to_hex(c) for c in colormaps["tab10"].colors]
    if count <= 20:
        return [to_hex(c) for c in colormaps["tab20"].colors]
    return [to_hex(colormaps["viridis"](i / (count - 1))) for i in range(count)]


def _gpu_key(series: Series) -> tuple[str, int]:
    gpu = series.labels.get("gpu", "")
    return series.labels.get("instance", ""), int(gpu) if gpu.isdigit() else -1


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()

"""The PromQL the report sends: totals over the window (instant queries at its end) and series over
time (range queries at its step), over the shipped recording rules and the raw families.

Totals over a window are exact where the counters allow it. The hooks push cumulative counters from
the process start, so a series's increase over [start, end] is its last value up to `end` minus its
last value up to `start`, or its whole last value when it was born inside the window (a run the
window covers whole counts from zero). `increase()` would extrapolate to the window's edges and
miscount a finished run by up to half a scrape interval of steps; it is used only for a rank whose
counters reset inside the window (its process restarted), where no exact answer exists.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from run_report.window import Window, run_matcher

BEFORE = "10m"  # how far before the window a counter's previous value is looked for
RANK = "rank, instance"  # a rank's identity; `instance` is its node
PHASE_LOCAL = "dataloader_next|to_device|forward"  # before the first collective (rules: local score)


@dataclass(frozen=True)
class Queries:
    """The report's queries for one run and window, keyed by what they answer."""

    totals: Mapping[str, str]  # instant, at window.end
    over_time: Mapping[str, str]  # query_range over the window


def window_increase(selector: str, window: Window, steps_selector: str, born_per_rank: bool) -> str:
    """Each series's increase over the window (see the module docstring), labels kept.

    `born_per_rank`: histogram buckets. A rank's bucket bound that appears inside the window starts
    with the counts from before it, so for a rank that existed before the window only bounds it
    exported then are kept; a rank born inside the window counts every bound from zero.
    """
    d = window.range_ms
    just_before = f"{round(window.seconds * 1000) + 1}ms"  # range selectors include both ends: skip `start`
    now = f"last_over_time({selector}[{d}])"
    before = f"last_over_time({selector}[{BEFORE}] offset {just_before})"
    if born_per_rank:
        rank_before = f"last_over_time({steps_selector}[{BEFORE}] offset {just_before})"
        born = f"({now} unless on (run, {RANK}) {rank_before})"
    else:
        born = f"({now} unless {before})"
    restarted = f"(resets({steps_selector}[{d}]) > 0)"
    exact = f"((({now} - {before}) >= 0) or {born})"
    return (
        f"({exact} unless on (run, {RANK}) {restarted})"
        f" or (increase({selector}[{d}]) and on (run, {RANK}) {restarted})"
    )


def build(run: str, window: Window, nodes: list[str]) -> Queries:
    r = run_matcher(run)
    w = window.rate_window
    over_time = _training_over_time(r) | _gpu_over_time(r) | _process_over_time(r, w)
    if nodes:  # the nodes the run's ranks ran on
        over_time |= _node_over_time(f"instance=~{_regex_string(nodes)}", w)
    return Queries(_totals(r, window), over_time)


def _totals(r: str, window: Window) -> dict[str, str]:
    steps = f"stepscope_steps_total{{{r}}}"

    def inc(metric: str, by: str = RANK, per_rank: bool = False) -> str:
        return f"sum by ({by}) ({window_increase(f'{metric}{{{r}}}', window, steps, per_rank)})"

    buckets = inc("stepscope_step_seconds_bucket", f"{RANK}, le", per_rank=True)
    # run quantiles over the bounds every rank exports, as the rules do (run_le:...)
    shared = f"count by (le) ({buckets}) == scalar(count(count by ({RANK}) ({buckets})))"
    return {
        "info": f"max by ({RANK}, local_rank, world_size, pid) "
                f"(last_over_time(stepscope_training_info{{{r}}}[{window.range_ms}]))",
        "steps": inc("stepscope_steps_total"),
        "samples": inc("stepscope_samples_total"),
        "step_seconds": inc("stepscope_step_seconds_sum"),
        "step_count": inc("stepscope_step_seconds_count"),
        "phase_seconds": inc("stepscope_step_phase_seconds_sum", f"{RANK}, phase"),
        "p50": f"histogram_quantile(0.5, {buckets})",
        "p95": f"histogram_quantile(0.95, {buckets})",
        "run_p50": f"histogram_quantile(0.5, sum by (le) ({buckets}) and on (le) ({shared}))",
        "run_p95": f"histogram_quantile(0.95, sum by (le) ({buckets}) and on (le) ({shared}))",
    }


def _training_over_time(r: str) -> dict[str, str]:
    return {
        "state": f"stepscope_training_state{{{r}}} == 1",
        "verdict": f"run:stepscope_bottleneck:verdict{{{r}}}",
        "step_mean": f"run_rank:stepscope_step_seconds:mean_rate1m{{{r}}}",
        "run_p50": f"run:stepscope_step_seconds:p50_rate1m{{{r}}}",
        "run_p95": f"run:stepscope_step_seconds:p95_rate1m{{{r}}}",
        "run_samples_rate": f"run:stepscope_samples:rate1m{{{r}}}",
        "dataloader_share": f"run_rank:stepscope_dataloader_share:ratio_rate1m{{{r}}}",
        "step_score": f"run_rank:stepscope_straggler_score:ratio{{{r}}}",
        "local_score": f"run_rank:stepscope_straggler_local_score:ratio{{{r}}}",
    }


def _gpu_over_time(r: str) -> dict[str, str]:
    run_gpus = f"(instance_gpu_run_rank:stepscope_process_gpu_memory_bytes:sum{{{r}}} > 0)"
    return {
        "run_gpu_effective": f"run:stepscope_gpu_effective_utilization:avg_ratio{{{r}}}",
        "run_gpu_nvml": f"run:stepscope_gpu_utilization:avg_ratio{{{r}}}",
        "gpu_effective": f"instance_gpu_run:stepscope_gpu_effective_utilization:avg_ratio{{{r}}}",
        "gpu_nvml": f"instance_gpu_run:stepscope_gpu_utilization:avg_ratio{{{r}}}",
        "gpu_memory": f"sum by (instance, gpu) (stepscope_gpu_memory_used_bytes) and on (instance, gpu) {run_gpus}",
    }


def _process_over_time(r: str, w: str) -> dict[str, str]:
    by = f"sum by ({RANK}, pid)"
    return {
        "process_cpu": f"{by} (rate(stepscope_process_cpu_seconds_total{{{r}}}[{w}]))",
        "process_memory": f"{by} (stepscope_process_resident_memory_bytes{{{r}}})",
        "process_gpu_memory": f"{by} (stepscope_process_gpu_memory_bytes{{{r}}})",
        "process_children": f"{by} (stepscope_process_children{{{r}}})",
        "process_read": f"{by} (rate(stepscope_process_io_read_bytes_total{{{r}}}[{w}]))",
        "process_write": f"{by} (rate(stepscope_process_io_write_bytes_total{{{r}}}[{w}]))",
    }


def _node_over_time(node: str, w: str) -> dict[str, str]:
    network = f'{node},device!="lo"'  # loopback traffic never leaves the node
    return {
        "node_cpu": f"instance:stepscope_node_cpu_utilization:ratio{{{node}}}",
        "node_memory_ratio": f"instance:stepscope_node_memory_utilization:ratio{{{node}}}",
        "node_memory_used": f"sum by (instance) (stepscope_node_memory_total_bytes{{{node}}}"
                            f" - stepscope_node_memory_available_bytes{{{node}}})",
        "node_disk_read": f"sum by (instance) (rate(stepscope_node_disk_read_bytes_total{{{node}}}[{w}]))",
        "node_disk_write": f"sum by (instance) (rate(stepscope_node_disk_written_bytes_total{{{node}}}[{w}]))",
        "node_net_receive": f"sum by (instance) (rate(stepscope_node_network_receive_bytes_total{{{network}}}[{w}]))",
        "node_net_transmit": f"sum by (instance) (rate(stepscope_node_network_transmit_bytes_total{{{network}}}[{w}]))",
    }


def _regex_string(values: list[str]) -> str:
    """A PromQL string holding an RE2 alternation that matches exactly `values` (Prometheus anchors it)."""
    return json.dumps("|".join(re.escape(value) for value in values))

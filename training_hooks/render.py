"""Renders a tracker snapshot as Prometheus text exposition 0.0.4 (the Pushgateway's push format).

The body carries no run/rank/job labels: the push URL's grouping key supplies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from training_hooks.config import STATES
from training_hooks.limits import Limits
from training_hooks.profiling import TraceOutcome
from training_hooks.timing import HistogramSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Snapshot:
    phases: Sequence[tuple[str, str, HistogramSnapshot]]  # (phase, timing, histogram)
    step: HistogramSnapshot
    steps: int
    samples: int
    state: str
    info: Mapping[str, str]  # local_rank, world_size, pid, framework, start_time where known
    limits: Limits | None = None  # from tracker.measure_limits
    trace: TraceOutcome | None = None  # the latest profiler trace written


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _histogram(
    lines: list[str], name: str, hist: HistogramSnapshot, labels: Sequence[tuple[str, str]]
) -> None:
    les = [floatToGoString(b) for b in hist.bounds] + ["+Inf"]
    for le, value in zip(les, hist.cumulative, strict=True):
        lines.append(f"{name}_bucket{_labels([*labels, ('le', le)])} {value}")
    lines.append(f"{name}_sum{_labels(labels)} {floatToGoString(hist.sum_seconds)}")
    lines.append(f"{name}_count{_labels(labels)} {hist.count}")


def render(snap: Snapshot) -> str:
    lines = [
        "# HELP stepscope_step_phase_seconds Time spent in each phase of a training step (timing: host = wall "
        "time; cuda_event = CUDA event time of sampled steps, each counting for the untimed ones before it; "
        "cuda_sync = wall time between synchronizes).",
        "# TYPE stepscope_step_phase_seconds histogram",
    ]
    for phase, timing, hist in snap.phases:
        _histogram(lines, "stepscope_step_phase_seconds", hist, [("phase", phase), ("timing", timing)])
    lines += [
        "# HELP stepscope_step_seconds Wall time between consecutive step boundaries (the whole step).",
        "# TYPE stepscope_step_seconds histogram",
    ]
    _histogram(lines, "stepscope_step_seconds", snap.step, [])
    lines += [
        "# HELP stepscope_steps_total Training steps completed.",
        "# TYPE stepscope_steps_total counter",
        f"stepscope_steps_total {snap.steps}",
        "# HELP stepscope_samples_total Training samples processed.",
        "# TYPE stepscope_samples_total counter",
        f"stepscope_samples_total {snap.samples}",
        "# HELP stepscope_training_info Identity of the training process (value 1).",
        "# TYPE stepscope_training_info gauge",
        f"stepscope_training_info{_labels(sorted(snap.info.items()))} 1",
        "# HELP stepscope_training_state Current state of the training process (1 for the current state).",
        "# TYPE stepscope_training_state gauge",
    ]
    lines += [f'stepscope_training_state{{state="{s}"}} {int(s == snap.state)}' for s in STATES]
    if snap.limits is not None:
        _limits(lines, snap.limits)
    if snap.trace is not None:
        _trace(lines, snap.trace)
    return "\n".join(lines) + "\n"


def _limits(lines: list[str], limits: Limits) -> None:
    lines += [
        "# HELP stepscope_loader_limit_samples_per_second Samples per second the training loader delivers with "
        "training mocked out (tracker.measure_limits).",
        "# TYPE stepscope_loader_limit_samples_per_second gauge",
        f"stepscope_loader_limit_samples_per_second {floatToGoString(limits.loader_samples_per_second)}",
        "# HELP stepscope_compute_limit_samples_per_second Samples per second of the training step on one cached "
        "batch, the loader mocked out (tracker.measure_limits).",
        "# TYPE stepscope_compute_limit_samples_per_second gauge",
        f"stepscope_compute_limit_samples_per_second {floatToGoString(limits.compute_samples_per_second)}",
    ]


def _trace(lines: list[str], trace: TraceOutcome) -> None:
    path = _labels([("path", trace.path)])
    lines += [
        "# HELP stepscope_profile_trace_bytes Size of the rank's latest PyTorch profiler trace (gzipped Chrome "
        "trace at path).",
        "# TYPE stepscope_profile_trace_bytes gauge",
        f"stepscope_profile_trace_bytes{path} {trace.size}",
        "# HELP stepscope_profile_trace_steps Training steps the rank's latest profiler trace holds.",
        "# TYPE stepscope_profile_trace_steps gauge",
        f"stepscope_profile_trace_steps{path} {trace.steps}",
        "# HELP stepscope_profile_trace_timestamp_seconds Unix time the rank's latest profiler trace was written.",
        "# TYPE stepscope_profile_trace_timestamp_seconds gauge",
        f"stepscope_profile_trace_timestamp_seconds{path} {floatToGoString(trace.time)}",
    ]

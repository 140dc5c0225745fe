"""Renders a tracker snapshot as Prometheus text exposition 0.0.4 (the Pushgateway's push format).

The body carries no run/rank/job labels: the push URL's grouping key supplies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

from stepscope.contract import (
    COMPUTE_LIMIT,
    FAMILIES,
    LOADER_LIMIT,
    MICRO_BATCHES_TOTAL,
    MODEL_FLOPS_TOTAL,
    PEAK_FLOPS,
    SAMPLES_TOTAL,
    STATE_SECONDS,
    STATES,
    STEP_PHASE_SECONDS,
    STEP_SECONDS,
    STEPS_TOTAL,
    TOKENS_TOTAL,
    TRACE_BYTES,
    TRACE_STEPS,
    TRACE_TIMESTAMP,
    TRAINING_INFO,
    TRAINING_LAST_STEP,
    TRAINING_PHASE_ENTERED,
    TRAINING_STATE,
)
from stepscope.contract.exposition import escape_label_value
from stepscope.contract.families import (
    CUDA_ALLOC_RETRIES,
    CUDA_MEMORY_ALLOCATED,
    CUDA_MEMORY_INACTIVE_SPLIT,
    CUDA_MEMORY_PEAK,
    CUDA_MEMORY_RESERVED,
    CUDA_OOMS,
    TRAINING_GLOBAL_STEP,
    TRAINING_GLOBAL_STEP_START,
)
from stepscope.hooks.cuda_memory import AllocatorMemory
from stepscope.hooks.limits import Limits
from stepscope.hooks.profiling import TraceOutcome
from stepscope.hooks.timing import HistogramSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Snapshot:
    phases: Sequence[tuple[str, str, HistogramSnapshot]]  # (phase, timing, histogram)
    step: HistogramSnapshot
    steps: int  # optimizer steps
    samples: int
    state: str
    info: Mapping[str, str]  # local_rank, world_size, pid, framework, start_time, pid_namespace where known
    limits: Limits | None = None  # from tracker.measure_limits
    trace: TraceOutcome | None = None  # the latest profiler trace written
    micro_batches: int = 0  # batches fed to the model: steps x gradient accumulation
    state_seconds: Mapping[str, float] = field(default_factory=dict)  # seconds per state so far (0 if absent)
    last_step_time: float | None = None  # Unix seconds of the last step boundary, None before the first
    open_phase: tuple[str, float] | None = None  # (phase, Unix seconds it was entered) if one is open
    tokens: int | None = None  # None until a step counts tokens: the series appears then
    global_step: int | None = None  # the trainer's, once the loop passes it to step()
    global_step_start: int | None = None  # where the steps since the process started or last restored count from
    flops: float | None = None  # model FLOPs done; None until stated (flops_per_step/sample, measure_flops, step)
    flops_dtype: str = ""  # the dtype the FLOPs run in (label `dtype`)
    peak_flops: float | None = None  # the user's dense peak FLOP/s of the rank's GPU, None: the table's
    allocator: AllocatorMemory | None = None  # PyTorch's CUDA caching allocator, on CUDA only


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{escape_label_value(v)}"' for k, v in pairs) + "}"


def _histogram(
    lines: list[str], name: str, hist: HistogramSnapshot, labels: Sequence[tuple[str, str]]
) -> None:
    if hist.held_back:
        return
    les = [floatToGoString(b) for b in hist.bounds] + ["+Inf"]
    for le, value in zip(les, hist.cumulative, strict=True):
        lines.append(f"{name}_bucket{_labels([*labels, ('le', le)])} {value}")
    lines.append(f"{name}_sum{_labels(labels)} {floatToGoString(hist.sum_seconds)}")
    lines.append(f"{name}_count{_labels(labels)} {hist.count}")


def _header(lines: list[str], name: str) -> str:
    """Appends the family's HELP and TYPE lines from the contract; returns the name for its samples."""
    spec = FAMILIES[name]
    lines += [f"# HELP {name} {spec.help}", f"# TYPE {name} {spec.type}"]
    return name


def render(snap: Snapshot) -> str:
    lines: list[str] = []
    name = _header(lines, STEP_PHASE_SECONDS)
    for phase, timing, hist in snap.phases:
        _histogram(lines, name, hist, [("phase", phase), ("timing", timing)])
    _histogram(lines, _header(lines, STEP_SECONDS), snap.step, [])
    lines.append(f"{_header(lines, STEPS_TOTAL)} {snap.steps}")
    lines.append(f"{_header(lines, SAMPLES_TOTAL)} {snap.samples}")
    lines.append(f"{_header(lines, TRAINING_INFO)}{_labels(sorted(snap.info.items()))} 1")
    name = _header(lines, TRAINING_STATE)
    lines += [f'{name}{{state="{s}"}} {int(s == snap.state)}' for s in STATES]
    lines.append(f"{_header(lines, MICRO_BATCHES_TOTAL)} {snap.micro_batches}")
    name = _header(lines, STATE_SECONDS)
    lines += [f'{name}{{state="{s}"}} {floatToGoString(snap.state_seconds.get(s, 0.0))}' for s in STATES]
    _progress(lines, snap)
    _model_flops(lines, snap)
    if snap.limits is not None:
        _limits(lines, snap.limits)
    if snap.trace is not None:
        _trace(lines, snap.trace)
    if snap.allocator is not None:
        _allocator(lines, snap.allocator)
    return "\n".join(lines) + "\n"


def _progress(lines: list[str], snap: Snapshot) -> None:
    """When the rank last stepped and the phase it is in (the families that name a hung rank), and the
    trainer's global step where the loop passes it (a restore shows as a step back: lost progress) with the one
    the rank's steps count from (where the steps a restore does again begin)."""
    name = _header(lines, TRAINING_LAST_STEP)
    if snap.last_step_time is not None:
        lines.append(f"{name} {floatToGoString(snap.last_step_time)}")
    name = _header(lines, TRAINING_PHASE_ENTERED)
    if snap.open_phase is not None:
        phase, entered = snap.open_phase
        lines.append(f"{name}{_labels([('phase', phase)])} {floatToGoString(entered)}")
    if snap.global_step is not None:
        lines.append(f"{_header(lines, TRAINING_GLOBAL_STEP)} {snap.global_step}")
    if snap.global_step_start is not None:
        lines.append(f"{_header(lines, TRAINING_GLOBAL_STEP_START)} {snap.global_step_start}")


def _model_flops(lines: list[str], snap: Snapshot) -> None:
    """Tokens, model FLOPs and the stated peak: only once stated, so a run without them adds no series."""
    if snap.tokens is not None:
        lines.append(f"{_header(lines, TOKENS_TOTAL)} {snap.tokens}")
    if snap.flops is not None:
        flops = str(snap.flops) if isinstance(snap.flops, int) else floatToGoString(snap.flops)
        lines.append(f"{_header(lines, MODEL_FLOPS_TOTAL)}{_labels([('dtype', snap.flops_dtype)])} {flops}")
    if snap.peak_flops is not None:
        lines.append(f"{_header(lines, PEAK_FLOPS)} {floatToGoString(snap.peak_flops)}")


def _limits(lines: list[str], limits: Limits) -> None:
    loader = _header(lines, LOADER_LIMIT)
    lines.append(f"{loader} {floatToGoString(limits.loader_samples_per_second)}")
    compute = _header(lines, COMPUTE_LIMIT)
    lines.append(f"{compute} {floatToGoString(limits.compute_samples_per_second)}")


def _trace(lines: list[str], trace: TraceOutcome) -> None:
    path = _labels([("path", trace.path)])
    lines.append(f"{_header(lines, TRACE_BYTES)}{path} {trace.size}")
    lines.append(f"{_header(lines, TRACE_STEPS)}{path} {trace.steps}")
    timestamp = _header(lines, TRACE_TIMESTAMP)
    lines.append(f"{timestamp}{path} {floatToGoString(trace.time)}")


ALLOCATOR_FAMILIES = {
    CUDA_MEMORY_ALLOCATED: "allocated_bytes", CUDA_MEMORY_RESERVED: "reserved_bytes",
    CUDA_MEMORY_PEAK: "peak_allocated_bytes", CUDA_MEMORY_INACTIVE_SPLIT: "inactive_split_bytes",
    CUDA_ALLOC_RETRIES: "alloc_retries", CUDA_OOMS: "ooms",
}


def _allocator(lines: list[str], memory: AllocatorMemory) -> None:
    for family, attribute in ALLOCATOR_FAMILIES.items():
        lines.append(f"{_header(lines, family)} {getattr(memory, attribute)}")

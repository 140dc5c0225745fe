"""Renders a tracker snapshot as Prometheus text exposition 0.0.4 (the Pushgateway's push format).

The body carries no run/rank/job labels: the push URL's grouping key supplies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from training_hooks.config import STATES
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
    return "\n".join(lines) + "\n"

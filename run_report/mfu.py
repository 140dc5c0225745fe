"""Tokens per second and model FLOPs utilization (MFU) of a run over the report's window (docs/mfu.md).

Totals count from the pushed counters over the window (exact, as the other totals); the rates and the
MFU are the run's recordings (run:stepscope_tokens:rate1m, run:stepscope_model_flops:rate1m,
run:stepscope_mfu:ratio_rate1m) averaged over the times the rules judged it training, like the GPU
readings, so setup and eval never dilute them. A run that states no FLOPs, or runs on a GPU the peak
table lacks, has no MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepscope.report.collect import RunData
from stepscope.report.prometheus import Series
from stepscope.report.timeline import training_times

_PREFIXES = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


@dataclass(frozen=True)
class Throughput:
    tokens: float | None  # over the window, all ranks; None where no rank counts tokens
    model_flops: float | None  # over the window, all ranks; None where no rank states FLOPs
    tokens_per_second: float | None  # while training
    flops_per_second: float | None  # achieved model FLOP/s while training
    peak_flops: float | None  # the dense peak of the run's GPUs MFU divides by
    mfu: float | None  # while training

    @property
    def headline(self) -> str:
        """"MFU 38%" for the verdict's headline; "" without an MFU."""
        return f"MFU {mfu_percent(self.mfu)}" if self.mfu is not None else ""


def throughput(data: RunData) -> Throughput:
    training = training_times(data.over_time["verdict"])
    over = data.over_time
    return Throughput(
        tokens=_total(data.totals.get("tokens", [])), model_flops=_total(data.totals.get("model_flops", [])),
        tokens_per_second=_mean_while(over["run_tokens_rate"], training),
        flops_per_second=_mean_while(over["run_model_flops_rate"], training),
        peak_flops=_mean_while(over["run_peak_flops"], training),
        mfu=_mean_while(over["run_mfu"], training),
    )


def mfu_percent(value: float | None) -> str:
    """38%; below 1% two significant digits (a CPU loop "on" an H100 is not 0%)."""
    if value is None:
        return "no data"
    return f"{value:.0%}" if value >= 0.01 else f"{value * 100:.2g}%"


def flops_per_second(value: float | None) -> str:
    """505 TFLOP/s."""
    if value is None:
        return "no data"
    scale, prefix = next(((s, p) for s, p in _PREFIXES if abs(value) >= s), (1.0, ""))
    return f"{value / scale:.3g} {prefix}FLOP/s"


def _total(results: list[Series]) -> float | None:
    return sum(series.last for series in results) if results else None


def _mean_while(series: list[Series], times: set[float]) -> float | None:
    values = [value for s in series for t, value in s.points if t in times]
    return sum(values) / len(values) if values else None

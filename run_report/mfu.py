"""Tokens per second and model FLOPs utilization (MFU) of a run over the report's window (docs/mfu.md).

Totals count from the pushed counters over the window (exact, as the other totals). The rates are exact
too: each rank's tokens (FLOPs) over its seconds in state train, summed over the ranks, so setup and eval
never dilute them. The rules' 1-minute rates (run:stepscope_tokens:rate1m) would read a run's first
minute low (rate() of a series younger than its window: a 40 s run at 1,984 tokens/s read 1,125), as the
energy is summed from its recorded watts rather than averaged. The MFU is that FLOP/s over the peak of
the run's GPUs (run:stepscope_peak_flops_per_second:sum, averaged over the times the rules judged it
training). A run that states no FLOPs, or runs on a GPU the peak table lacks, has no MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepscope.contract import TRAIN_STATE
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
    train = _train_seconds(data.totals.get("state_seconds", []))
    flops_per_second = _per_train_second(data.totals.get("model_flops", []), train)
    peak = _mean_while(data.over_time["run_peak_flops"], training)
    return Throughput(
        tokens=_total(data.totals.get("tokens", [])), model_flops=_total(data.totals.get("model_flops", [])),
        tokens_per_second=_per_train_second(data.totals.get("tokens", []), train),
        flops_per_second=flops_per_second, peak_flops=peak,
        mfu=flops_per_second / peak if flops_per_second is not None and peak else None,
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


def _train_seconds(state_seconds: list[Series]) -> dict[tuple[str, str], float]:
    """Each rank's (rank, node) seconds in state train over the window, as its hooks count them."""
    return {_key(s): s.last for s in state_seconds if s.labels.get("state") == TRAIN_STATE}


def _per_train_second(counts: list[Series], train: dict[tuple[str, str], float]) -> float | None:
    """The run's rate: each rank's count over its seconds in train, summed (ranks count side by side)."""
    rates = [s.last / train[_key(s)] for s in counts if train.get(_key(s), 0.0) > 0]
    return sum(rates) if rates else None


def _key(series: Series) -> tuple[str, str]:
    return series.labels.get("rank", ""), series.labels.get("instance", "")


def _total(results: list[Series]) -> float | None:
    return sum(series.last for series in results) if results else None


def _mean_while(series: list[Series], times: set[float]) -> float | None:
    values = [value for s in series for t, value in s.points if t in times]
    return sum(values) / len(values) if values else None

"""The verdict in words: what limited the run over the window, the numbers behind it, and the fix.

The verdict is the recording rule `run:stepscope_bottleneck:verdict` (data_bound, gpu_bound,
gpu_busy_idle, host_bound, idle) counted over the window: the one that held longest while training.
The checks are the seeds' rules of thumb, measured over the whole window: GPU utilization close to
100%, loading time much smaller than training time, I/O sample rate above training sample rate, and
no straggler rank.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from run_report import fmt
from run_report.collect import RunData
from run_report.summary import STRAGGLER_SCORE, RankSummary, RunTotals, stragglers
from run_report.timeline import training_times
from stepscope_contract import DATA_LOADING_PHASE, THRESHOLDS, verdicts

GPU_BOUND = THRESHOLDS["gpu_bound_utilization"].value
DATA_BOUND = THRESHOLDS["data_loading_share"].value

HEADLINES = {
    verdicts.DATA_BOUND: "Data-bound: the ranks wait for the next batch",
    verdicts.GPU_BOUND: "GPU-bound: the GPUs are busy, the healthy state",
    verdicts.GPU_BUSY_IDLE: "GPUs busy but idle: kernels run all the time yet the SMs do little",
    verdicts.HOST_BOUND: "Host-bound: the time goes to work on the host",
    verdicts.IDLE: "Idle: no rank trained in this range",
}

FIXES = {
    verdicts.DATA_BOUND: [
        "Raise the DataLoader's num_workers (watch node CPU below), set pin_memory=True, "
        "persistent_workers=True and a higher prefetch_factor.",
        "Store data pre-decoded and pre-augmented, read it sequentially in large shards (WebDataset, "
        "TFRecord) from NVMe or a local cache, or keep the data set in memory when it fits.",
    ],
    verdicts.GPU_BOUND: [
        "Make each step cheaper: BF16/FP16 autocast for the tensor cores (or TF32 for FP32 matmuls), "
        "torch.compile to fuse kernels, a larger batch where memory allows.",
    ],
    verdicts.GPU_BUSY_IDLE: [
        "Give each kernel more work: a larger batch or fewer gradient-accumulation steps.",
        "Remove launch overhead: CUDA graphs (torch.compile(mode=\"reduce-overhead\")), torch.compile to fuse "
        "small kernels, fewer host syncs per step (.item(), .cpu(), printing tensors).",
    ],
    verdicts.HOST_BOUND: [
        "Overlap host-to-device copies with compute (pinned memory and .to(device, non_blocking=True)), "
        "move augmentation to the GPU, cut Python work and host syncs per step.",
        "Under DDP or FSDP compare the phase breakdown per rank: a long backward on the fast ranks is "
        "time spent waiting for a slow one in the all-reduce.",
    ],
    verdicts.IDLE: [
        "Read the state timeline: setup, eval or checkpointing filled the range, or a rank stalled "
        "(py-spy dump, NCCL_DEBUG=INFO).",
    ],
}


@dataclass(frozen=True)
class Check:
    rule: str
    measured: str
    target: str
    ok: bool | None  # None: cannot be measured for this run


@dataclass(frozen=True)
class Assessment:
    verdict: str
    fractions: dict[str, float]  # share of the window's points with each verdict
    headline: str
    because: str
    fixes: list[str]
    checks: list[Check]
    stragglers: list[RankSummary]
    gpu_effective: float | None
    gpu_nvml: float | None
    gpu_source: str


def assess(data: RunData, totals: RunTotals, ranks: list[RankSummary]) -> Assessment:
    fractions = _verdict_fractions(data)
    busy = {verdict: share for verdict, share in fractions.items() if verdict != verdicts.IDLE}
    verdict = max(busy, key=busy.__getitem__) if busy else verdicts.IDLE
    training = training_times(data.over_time["verdict"])
    gpu_effective = _mean_while(data.over_time["run_gpu_effective"], training)
    gpu_nvml = _mean_while(data.over_time["run_gpu_nvml"], training)
    source = ", ".join(sorted({s.labels.get("source", "") for s in data.over_time["gpu_effective"]} - {""}))
    slow = stragglers(ranks)
    fixes = list(FIXES[verdict])
    fixes += [f"Open rank {rank.rank}'s node {rank.node}: GPU throttling, XID/ECC errors, CPU saturation, "
              "network; compare its phase breakdown with the other ranks'." for rank in slow]
    headline = HEADLINES[verdict]
    if busy and verdict != verdicts.IDLE:
        headline += f" ({busy[verdict] / sum(busy.values()):.0%} of the training time)"
    return Assessment(
        verdict=verdict, fractions=fractions, headline=headline,
        because=_because(verdict, totals, gpu_effective, gpu_nvml, source) + _straggler_words(slow),
        fixes=fixes, checks=_checks(totals, ranks, gpu_effective, source), stragglers=slow,
        gpu_effective=gpu_effective, gpu_nvml=gpu_nvml, gpu_source=source,
    )


def _verdict_fractions(data: RunData) -> dict[str, float]:
    counts = Counter({s.labels.get("verdict", ""): len(s.points) for s in data.over_time["verdict"]})
    total = sum(counts.values())
    return {verdict: count / total for verdict, count in counts.most_common()} if total else {}


def _mean_while(series: list, times: set[float]) -> float | None:
    values = [value for s in series for t, value in s.points if t in times]
    return sum(values) / len(values) if values else None


def _because(verdict: str, totals: RunTotals, gpu: float | None, nvml: float | None, source: str) -> str:
    share = totals.dataloader_share
    loading = f"data loading took {share:.0%} of step time" if share is not None else "data loading is not timed"
    gpus = (f"the run's GPUs averaged {gpu:.0%} effective utilization ({source}) while training"
            if gpu is not None else "no GPU is mapped to the run (CPU-only, or the exporter cannot see its processes)")
    if verdict == verdicts.DATA_BOUND:
        rates = ""
        if totals.io_samples_per_second and totals.training_samples_per_second:
            rates = (f"; loading delivers {totals.io_samples_per_second:,.0f} samples per second of waiting, "
                     f"training consumes {totals.training_samples_per_second:,.0f} per second of the rest")
        return f"Over the whole window {loading} (threshold {DATA_BOUND:.0%}){rates}; {gpus}."
    if verdict == verdicts.GPU_BOUND:
        return f"Over the window {gpus} (threshold {GPU_BOUND:.0%}) and {loading}."
    if verdict == verdicts.GPU_BUSY_IDLE:
        busy = f"{nvml:.0%}" if nvml is not None else "most"
        return (f"The GPUs ran kernels {busy} of the time (NVML) but {gpus}: kernels too small to fill "
                "the GPU, or a loop bound by kernel launches.")
    if verdict == verdicts.HOST_BOUND:
        return f"Over the window {loading} and {gpus}: neither limits the run, its steps wait on the host."
    return "No step was made in state train in this range."


def _straggler_words(slow: list[RankSummary]) -> str:
    if not slow:
        return ""
    named = ", ".join(f"rank {rank.rank} on {rank.node} (score {rank.lowest_score:.2f})" for rank in slow)
    return f" Straggler: {named}; every synchronised step waits for it."


def _checks(totals: RunTotals, ranks: list[RankSummary], gpu: float | None, source: str) -> list[Check]:
    checks = [
        Check("GPU utilization close to 100%",
              f"{gpu:.0%} effective ({source}) while training" if gpu is not None else "no GPU mapped to the run",
              f">= {GPU_BOUND:.0%}", None if gpu is None else gpu >= GPU_BOUND),
    ]
    share, mean = totals.dataloader_share, totals.mean
    if share is None or mean is None:
        checks.append(Check("Loading time much smaller than training time",
                            f"{DATA_LOADING_PHASE} not timed (iterate through tracker.loader())", "", None))
    else:
        checks.append(Check("Loading time much smaller than training time",
                            f"{fmt.seconds(share * mean)} of a {fmt.seconds(mean)} step ({share:.0%})",
                            f"<= {DATA_BOUND:.0%} of the step", share <= DATA_BOUND))
    io, train = totals.io_samples_per_second, totals.training_samples_per_second
    checks.append(Check("I/O sample rate above training sample rate",
                        f"{io:,.0f} vs {train:,.0f} samples/s" if io and train else "not measurable",
                        "I/O > training", io > train if io and train else None))
    scored = [rank for rank in ranks if rank.lowest_score is not None]
    if len(scored) >= 2:
        worst = min(scored, key=lambda rank: rank.lowest_score)  # type: ignore[arg-type, return-value]
        kind = "local phases" if worst.lowest_score == worst.local_score else "step time"
        checks.append(Check("No straggler rank", f"lowest score {worst.lowest_score:.2f} (rank {worst.rank}, {kind})",
                            f">= {STRAGGLER_SCORE}", (worst.lowest_score or 0) >= STRAGGLER_SCORE))
    return checks

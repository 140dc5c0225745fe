"""The numbers signals are judged by: the rules' verdicts and alerts, the dashboards' colours and the
report's verdict all use these values, so a threshold changes in one place.

Each threshold names the recording rule or alert whose expression holds it (`used_by`), so the
consistency test can check the rules say the same number until they are generated from here; one that
no rule uses (`used_by` empty) only colours the dashboards and the report.
"""

from collections.abc import Mapping
from dataclasses import dataclass

from stepscope.contract.recordings import (
    GPU_HELD_IDLE,
    RANK_LOST_LAST_PUSH,
    RANK_STALLED_SECONDS,
    RANK_STRAGGLER_ALERT_SCORES,
    RANK_TRAINING_SETTLED,
    RUN_GPU_SM_ACTIVE_TRAINED,
    RUN_GPU_TENSOR_ACTIVE_TRAINED,
    RUN_GPU_TRAINING_READINGS,
    RUN_GPU_UTILIZATION_TRAINED,
    RUN_LIMITS_VERDICT,
    RUN_MFU_HELD,
    RUN_TRAINING_SAMPLES_HELD,
    RUN_TRAINING_TOKENS_HELD,
    RUN_VERDICT,
    SHARD_RUN_FIRST_STEP_STALLED,
    SHARD_RUN_STALLED,
)


@dataclass(frozen=True)
class Threshold:
    value: float
    meaning: str
    used_by: tuple[str, ...]  # recording rules and alerts whose expression compares with `value`

    @property
    def percent(self) -> str:
        """The value as the dashboards and the report write a share: 0.3 -> "30%"."""
        return f"{self.value:.0%}"

    @property
    def number(self) -> str:
        """The value as written in a query or a sentence: 0.75 -> "0.75", 120 -> "120"."""
        return f"{self.value:g}"

    @property
    def duration(self) -> str:
        """Seconds as an alert's sentence says them: 21600 -> "6 hours", 1200 -> "20 minutes", 45 -> "45 s" (a
        description read "or 21600 s after this push")."""
        for unit, seconds in (("hour", 3600), ("minute", 60)):
            count = self.value / seconds
            if count >= 1 and count.is_integer():
                return f"{count:g} {unit}{'' if count == 1 else 's'}"
        return f"{self.value:g} s"


THRESHOLDS: Mapping[str, Threshold] = {
    "data_loading_share": Threshold(
        0.3, "share of step time spent in dataloader_next above which a run is data bound",
        (RUN_VERDICT, "StepscopeDataLoadingBottleneck")),
    # Set from the H100 recordings in ../shared/corpus (h100-2026-11-24, medians of steady training):
    # GPU-bound bf16 work read NVML utilization 0.98-1.00 with SM active 0.73-0.90 (0.73 at the 700 W
    # power cap); a data-bound loop 0.00; a launch-bound loop 0.14 (SM active 0.0009); one single-SM
    # kernel per step 1.00 with SM active 0.008. Held to the H200's (benchmarks/corpus/h200-2026-11-26,
    # every steady reading): the nearest busy GPU is one time-sharing two DDP ranks, 0.86-0.91 (SM active
    # 0.67), the nearest waiting one a loop copying pageable memory, 0.18-0.21. tests/test_corpus_verdicts.py
    # holds the thresholds to those readings and replays them through the rules.
    "gpu_bound_utilization": Threshold(
        0.8, "NVML utilization of a run's GPUs, averaged while it trains, at or above which they are busy "
        "(gpu_bound, or gpu_busy_idle when their SMs are idle) and below which they wait "
        "(H100 and H200: busy 0.98-1.00 alone, 0.86-0.91 time-shared by two DDP ranks; data-bound 0.00, "
        "launch-bound 0.14, host-bound copies 0.21 at most)",
        (RUN_VERDICT, "StepscopeGpuUnderutilized", "StepscopeGpuBusyButIdle")),
    "busy_idle_sm_active": Threshold(
        0.2, "SM active (GPM) below which a busy GPU does little: kernels too small for it "
        "(H100: one-SM kernel 0.008; GPU-bound bf16 on the H100 and H200 0.67-0.90, the 0.67 two DDP ranks "
        "time-sharing one)",
        (RUN_VERDICT, "StepscopeGpuBusyButIdle")),
    "verdict_settle_seconds": Threshold(
        30, "seconds since a rank started training (in state train now, and already that long ago) before the "
        "verdict reads it: longer than the GPU readings lag behind the state (6-8 s on the H100); an eval or "
        "checkpoint break later does not start it again",
        (RANK_TRAINING_SETTLED,)),
    "gpu_reading_lag_seconds": Threshold(
        10, "seconds a rank must have trained without a break before its GPUs' readings count as its "
        "training's: they lag the state by a collector cycle or two (6-8 s on the H100)",
        (RUN_GPU_TRAINING_READINGS,)),
    "stall_seconds": Threshold(
        60, "seconds without a step after which a run whose ranks are all in state train has stalled (or "
        "stall_step_multiple x its recent step time, if longer)", (SHARD_RUN_STALLED,)),
    "stall_step_multiple": Threshold(
        5, "a run stalls after this many times the slowest recent minute's mean step time without a step, or "
        "this many times its process's mean step time so far (a warm-up: a long first step), if longer than "
        "stall_seconds", (SHARD_RUN_STALLED,)),
    # A first step holds a warm-up no later step has: torch.compile (83 s here for a small model on the CPU;
    # minutes for a large one), cuDNN benchmarking, the DataLoader's workers starting. A first collective that
    # hangs under NCCL is ended by PyTorch's watchdog after the process group's timeout (default_pg_nccl_timeout,
    # 10 min in torch 2.11.0+cu130; gloo's default_pg_timeout is 30 min) and the rank is then lost, which
    # StepscopeRankLost pages 45 s later. Longer than that, so one hang pages once and a compilation of up to
    # about 9 minutes before the first collective pages neither; the alert is for the hangs no watchdog ends.
    "first_step_stall_seconds": Threshold(
        1200, "seconds in state train without a first step after which a run hangs in its first step: longer "
        "than a first step's warm-up (torch.compile took 83 s for a small model on the CPU, minutes for a large "
        "one; cuDNN benchmarking; DataLoader workers starting) and than NCCL's default collective timeout "
        "(10 min in torch 2.11.0+cu130), after which PyTorch's watchdog ends a hung first collective and "
        "StepscopeRankLost pages the rank instead",
        (SHARD_RUN_FIRST_STEP_STALLED, RANK_STALLED_SECONDS)),
    "rank_lost_seconds": Threshold(
        45, "seconds without a push (the hooks push every 5 s) after which a rank that did not close is lost",
        (RANK_LOST_LAST_PUSH, SHARD_RUN_STALLED, SHARD_RUN_FIRST_STEP_STALLED, "StepscopeDataLoadingBottleneck",
         "StepscopeLoaderBelowCompute", "StepscopeStragglerRank")),
    "rank_lost_kept_seconds": Threshold(
        600, "seconds after its last push that a lost rank stays lost once its exporter's scrape failed or the "
        "exporter restarted and forgot it: the exporter's default --ingest-ttl, as long as it keeps a group",
        (RANK_LOST_LAST_PUSH,)),
    # A lost rank whose run goes on without it (its other ranks push, waiting in a collective with no timeout, or
    # training on without it) stays paged; this bounds how long, so a run left waiting for a week is not paged for
    # a week: a work shift after the kill, the person has had the page.
    "rank_lost_max_seconds": Threshold(
        21600, "seconds after its last push that StepscopeRankLost stops paging a lost rank whose run is still "
        "there but that never came back (a restart of its run, or its own push, ends it sooner)",
        (RANK_LOST_LAST_PUSH,)),
    # 10 minutes, not more: each evaluation reads this much of every rank's and GPU's recorded reading, and at
    # 250 nodes (2,000 ranks, bench_scale side by side) the holds already took StepscopeGpuBusyButIdle from 0.30
    # to 1.89 s an evaluation with under 5 minutes of history to read.
    "pause_hold_seconds": Threshold(
        600, "seconds of an eval or checkpoint break through which the training alerts keep the reading of the "
        "rank's last minute of training: a run that validates or saves more often than an alert's `for` is "
        "still alerted, and a firing alert is not resolved by the break; the verdict holds as long",
        ("StepscopeDataLoadingBottleneck", "StepscopeStragglerRank", RUN_VERDICT)),
    # From tests/test_pauses_victoriametrics.py: at 30 s evaluations vmalert's recordings gave a verdict again 2
    # minutes after a break (each level read an evaluation late); Prometheus took 30-60 s (promtool, pauses.yml).
    "verdict_resume_seconds": Threshold(
        180, "seconds after an eval or checkpoint break that the verdict holds the one from before it while the "
        "evidence comes in again (GPU readings count as training after gpu_reading_lag_seconds, the 1m step "
        "rate may be empty, VictoriaMetrics reads each level of recordings an evaluation late); the samples per "
        "second of training StepscopeRunSlowerThanItself compares skip as long after one (a minute over a break's "
        "edge reads its samples and its time in train apart)",
        (RUN_VERDICT, RUN_TRAINING_SAMPLES_HELD, RUN_TRAINING_TOKENS_HELD, RUN_MFU_HELD)),
    # A 1m rate window of 15 s scrapes spans 45 s of samples: an optimizer step longer than that (gradient
    # accumulation: 8 micro-batches of 10 s make an 80 s step) ends in some windows and not in others, and the
    # verdict read idle in every window without one (data_bound, undetermined, idle, data_bound every 4 minutes).
    "slow_step_seconds": Threshold(
        30, "mean step time above which a run steps too rarely for every 1m window to hold a step: a run that made "
        "fewer than 60 / this many steps in each minute of the last pause_hold_seconds keeps its verdict through a "
        "window without a step, until it stalls",
        (RUN_VERDICT,)),
    "pause_carry_seconds": Threshold(
        300, "seconds back the GPU readings the training alerts read are carried from while a rank of the run is "
        "in an eval or checkpoint break: longer than an evaluation interval and VictoriaMetrics' lag in "
        "showing a recorded sample",
        (RUN_GPU_UTILIZATION_TRAINED, RUN_GPU_SM_ACTIVE_TRAINED, RUN_GPU_TENSOR_ACTIVE_TRAINED)),
    "tensor_active_idle": Threshold(
        0.01, "tensor-core activity below which a training GPU's tensor cores are idle",
        ("StepscopeTensorCoresIdle",)),
    "straggler_score": Threshold(
        0.75, "straggler score (the run's typical over the rank's: the median rank's, of two ranks the faster's) "
        "below which a rank is a straggler",
        ("StepscopeStragglerRank",)),
    "straggler_local_share": Threshold(
        0.05, "extra local time, as a share of the step, a local-score straggler must add",
        (RANK_STRAGGLER_ALERT_SCORES,)),
    "gpu_memory_full": Threshold(
        0.95, "GPU memory used / total above which the GPU is near full", ("StepscopeGpuMemoryNearFull",)),
    "host_memory_pressure": Threshold(
        0.9, "host memory used / total above which the node is under pressure", ("StepscopeHostMemoryPressure",)),
    "cpu_saturated": Threshold(
        0.9, "node CPU utilization above which the node is saturated", ("StepscopeCpuSaturated",)),
    "throttled_share": Threshold(
        0.2, "share of time a thermal or hardware clock event (or a power cap that costs too much clock) is "
        "active above which a GPU is throttled", ("StepscopeGpuThrottling",)),
    "power_cap_clock_ratio": Threshold(
        0.7, "SM clock over the GPU's maximum below which power capping costs more than a GPU at its power "
        "limit does (at their 700 W cap on bf16 matmuls an H100 ran 1.695-1.815 of 1.98 GHz, 0.86-0.92, and an "
        "H200 1.53-1.725 GHz, 0.77-0.87, 0.82 on average)",
        ("StepscopeGpuThrottling",)),
    "collector_stale_seconds": Threshold(
        120, "age of a collector's last success above which its readings are stale",
        ("StepscopeExporterCollectionStale",)),
    # The rules' rate windows are 1m: they need two scrapes inside every minute. Prometheus 2.42 scraping a real
    # exporter every 60 s (evaluating every 1m, its default) recorded no step rate, share, straggler score nor verdict
    # for any run in 7 minutes, and paged StepscopeRankLost for every live rank (a push read up to 60 s old).
    "scrape_interval_max_seconds": Threshold(
        30, "longest scrape interval of a stepscope exporter the rules serve (their 1m windows need two scrapes)",
        ("StepscopeScrapeIntervalTooLong",)),
    "compute_limit_share": Threshold(
        0.8, "share of the compute limit below which a run whose loader keeps up is below its limits",
        (RUN_LIMITS_VERDICT,)),
    # From the H100 recordings in ../shared/corpus (h100-2026-11-24): the FLOP counter's count of each
    # workload's step (torch.utils.flop_counter) over its measured step time, over the H100 SXM's dense
    # bf16 peak, against the tensor-core activity GPM read: mlp_bf16 MFU 0.51 at tensor 0.58 (0.88 of it),
    # transformer_bf16 0.26 at 0.27 (0.97). Below half, the tensor cores do work the model does not need.
    # Held to the H200's (benchmarks/corpus/h200-2026-11-26): mlp_bf16 0.56 at 0.70 (0.81), conv_bf16 0.16 at
    # 0.20 (0.78), the nearest healthy run (tests/test_mfu_corpus.py).
    "mfu_tensor_share": Threshold(
        0.5, "MFU over the tensor-core activity of a GPU-bound run's GPUs below which the tensor cores do work "
        "the model's FLOPs do not account for (H100 bf16: 0.88 and 0.97 of it; H200: 0.81, a conv net 0.78)",
        ("StepscopeMfuBelowTensorActivity",)),
    # Only the dashboards and the report colour or judge by these.
    "data_loading_share_notice": Threshold(
        0.1, "data-loading share above which the dashboards colour it yellow, on the way to data bound", ()),
    "utilization_low": Threshold(
        0.5, "effective GPU utilization below which the dashboards colour it red (yellow up to GPU bound)", ()),
    "straggler_score_typical": Threshold(
        0.9, "straggler score at or above which the dashboards colour a rank green (yellow down to a straggler)", ()),
    "idle_gpu_utilization": Threshold(
        0.05, "NVML utilization (1m average) below which a GPU is idle: capacity where no run holds memory on "
        "it, held but idle where a process does (StepscopeGpuHeldIdle after 30 minutes)",
        (GPU_HELD_IDLE, "StepscopeGpuHeldIdle")),
    "slower_than_itself": Threshold(
        0.7, "samples per second of training over the run's own median of the past hour below which the run "
        "is slower than itself (StepscopeRunSlowerThanItself after 10 minutes)", ("StepscopeRunSlowerThanItself",)),
    "rank_skew": Threshold(
        1.3, "slowest over fastest rank's mean step time above which a rank or its node holds the run back", ()),
    "filesystem_filling": Threshold(0.8, "used share of a filesystem the dashboards colour yellow", ()),
    "filesystem_full": Threshold(0.95, "used share of a filesystem the dashboards colour red", ()),
    "gpu_temperature_hot_celsius": Threshold(
        85, "GPU die temperature around which thermal slowdown usually starts (dashboard line)", ()),
}

"""The verdict in words: what limited the run over the window, the numbers behind it, and the fix.

The verdict is the recording rule `run:stepscope_bottleneck:verdict` counted over the window: the one
that held longest while training. Its rule is stepscope.contract.verdicts.MEANINGS, so the page says
what the dashboards say. NVML utilization decides whether the GPUs are busy or wait; SM active and
tensor-core activity (GPM, Hopper and newer) only grade how well busy GPUs are used, because a
saturated H100 training in bf16 reads NVML 0.98 with SM active 0.73. The rules judge a rank only once
it has trained `verdict_settle_seconds` without a break, so a window can hold training and no verdict.
The checks are the seeds' rules of thumb, measured over the whole window: GPU utilization close to
100%, loading time much smaller than training time, I/O sample rate above training sample rate, and
no straggler rank.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from stepscope.contract import DATA_LOADING_PHASE, THRESHOLDS, TRAIN_STATE, families, verdicts
from stepscope.report import fmt
from stepscope.report.collect import RunData
from stepscope.report.mfu import Throughput, throughput
from stepscope.report.prometheus import Series
from stepscope.report.summary import STRAGGLER_SCORE, RankSummary, RunTotals, stragglers
from stepscope.report.timeline import (
    StragglerSpell,
    labelled_intervals,
    state_intervals,
    straggler_spells,
    times_in_state,
    training_times,
    while_training,
)
from stepscope.report.times import clock
from stepscope.report.window import SCRAPE_INTERVAL_MAX_SECONDS, Window

GPU_BOUND = THRESHOLDS["gpu_bound_utilization"].value
BUSY_IDLE_SM_ACTIVE = THRESHOLDS["busy_idle_sm_active"].value
DATA_BOUND = THRESHOLDS["data_loading_share"].value
SETTLE_SECONDS = THRESHOLDS["verdict_settle_seconds"].number
NO_VERDICT = ""  # ranks trained in the window, but none long enough for the rules to judge the run
# A verdict held for less than the rules' rate window is the window catching up with a change, not a period
# of the run's own: the periods leave it out (a run fixed live read `undetermined` or `idle` for seconds).
PERIOD_MIN_SECONDS = 60
SPELLS_NAMED = 5  # straggler spells the verdict names, the earliest first; critical_path.csv has every one

HEADLINES = {
    verdicts.DATA_BOUND: "Data-bound: the ranks wait for the next batch",
    verdicts.GPU_BOUND: "GPU-bound: the GPUs are busy",
    verdicts.GPU_BUSY_IDLE: "GPUs busy but idle: kernels run all the time yet the SMs do little",
    verdicts.HOST_BOUND: "Host-bound: the time goes to work on the host",
    verdicts.GPU_SHARED: "GPUs shared with another run or process: their readings count its kernels too",
    verdicts.UNDETERMINED: "Undetermined: the run steps, but nothing measured says what limits it",
    verdicts.IDLE: "Idle: no rank trained in this range",
}
STALLED_HEADLINE = "Idle: a rank in state train stopped stepping (stalled)"

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
    verdicts.GPU_SHARED: [
        "Judge the run on GPUs of its own: ask the scheduler for whole GPUs (no time-slicing replicas or MPS), "
        "or give each run its own CUDA_VISIBLE_DEVICES, or stop the process that shares it "
        f"({families.PROCESS_GPU_MEMORY}{{holder=\"foreign\"}} names its pid); while it shares, its step and "
        "phase times still show what it waits on.",
    ],
    verdicts.UNDETERMINED: [
        f"Iterate the training data through tracker.loader(): it times {DATA_LOADING_PHASE}, so a slow loader "
        "can be told apart from GPUs that wait on the host.",
        "Time the step's phases: tracker.phase(name, cuda=True) around forward, backward and the optimizer "
        "step puts the GPU's clock (CUDA events) beside the host's.",
        "Let the exporter map the run's pids to their GPUs: it needs the host's pid namespace (hostPID=true "
        "in the chart, pid: host in compose) to count a GPU's readings for the run.",
    ],
    verdicts.IDLE: [
        "Read the state timeline: setup, eval or checkpointing filled the range, or a rank stalled "
        "(py-spy dump, NCCL_DEBUG=INFO).",
    ],
}
NO_VERDICT_FIXES = [
    f"Report a range with a longer stretch of training: the rules judge a run once a rank has trained "
    f"{SETTLE_SECONDS} s without eval or checkpoints between, when the GPU readings and the 1m rates are in.",
]
SPARSE_SCRAPES_FIXES = [
    f"Scrape the stepscope job every 15 s (at most {SCRAPE_INTERVAL_MAX_SECONDS:g} s): its scrape_interval, the "
    "chart's serviceMonitor.interval, or -promscrape.config's scrape_interval for VictoriaMetrics and vmagent, "
    "whose default is 1m (docs/deployment.md).",
]


@dataclass(frozen=True)
class Check:
    rule: str
    measured: str
    target: str
    ok: bool | None  # None: cannot be measured for this run


@dataclass(frozen=True)
class GpuReadings:
    """What the run's GPUs read, averaged over the window's training times (None: never read)."""

    nvml: float | None  # share of time a kernel ran (NVML utilization): busy or waiting, decides the verdict
    sm_active: float | None  # GPM: how much of the GPU the kernels use, grades a busy GPU
    tensor_active: float | None  # GPM: tensor-core activity, near 0 for FP32 matmuls
    effective: float | None  # SM active where GPM reads it, NVML elsewhere: what the dashboards colour
    source: str  # which reading `effective` is, per GPU (sm_active, utilization)

    @property
    def grade(self) -> str:
        """How well busy GPUs are used, e.g. "SM active 0.73, tensor cores 0.58"; "" without GPM."""
        named = (("SM active", self.sm_active), ("tensor cores", self.tensor_active))
        return ", ".join(f"{name} {fmt.activity(value)}" for name, value in named if value is not None)


@dataclass(frozen=True)
class Evidence:
    """What the verdict's words measure: the whole window, or where another verdict held part of it, the times this
    one held. A run data-bound for its first hour and GPU-bound for two read "GPU-bound ... ran kernels 71% of the
    time while training (NVML utilization: waiting): the step's time is GPU work", the data-bound hour's 30% in it."""

    over: str  # "Over the window", "While gpu_bound (1h 55m, 66% of the judged time)"
    gpus: GpuReadings
    loading_share: float | None  # None: dataloader_next is not timed
    io_samples_per_second: float | None = None  # the whole window's only
    training_samples_per_second: float | None = None
    phases_timed: bool = True
    too_long_scrape_interval: float = 0.0  # the exporter's, where longer than the rules serve (else 0)
    stalled: bool = False  # judged idle while a rank was in state train


@dataclass(frozen=True)
class Assessment:
    verdict: str  # a verdicts.BOTTLENECK_VERDICTS value, or NO_VERDICT
    fractions: dict[str, float]  # share of the window's points with each verdict
    headline: str
    because: str  # what this run measured
    rule: str  # the verdict's rule (verdicts.MEANINGS), "" without a verdict
    fixes: list[str]
    checks: list[Check]
    stragglers: list[RankSummary]
    gpus: GpuReadings
    throughput: Throughput | None = None  # tokens/s and MFU (docs/mfu.md)
    periods: tuple[tuple[str, float, float], ...] = ()  # (verdict, start, end): what limited the run, in order
    spells: tuple[StragglerSpell, ...] = ()  # stragglers for part of the window, not over the whole of it


def judged_periods(data: RunData) -> tuple[tuple[str, float, float], ...]:
    """The verdicts the run had, in order, as (verdict, start, end): idle stretches and verdicts held for less
    than PERIOD_MIN_SECONDS left out, and a verdict on both sides of them one period. A run whose verdict
    changed (fixed live, or storage that slowed) has two; the fractions alone did not say which came last."""
    periods: list[tuple[str, float, float]] = []
    for verdict, start, end in labelled_intervals(data.over_time["verdict"], "verdict", data.window):
        if verdict == verdicts.IDLE or end - start < PERIOD_MIN_SECONDS:
            continue
        if periods and periods[-1][0] == verdict:
            periods[-1] = (verdict, periods[-1][1], end)
        else:
            periods.append((verdict, start, end))
    return tuple(periods)


def assess(data: RunData, totals: RunTotals, ranks: list[RankSummary]) -> Assessment:
    fractions = _verdict_fractions(data)
    verdict = _verdict(fractions, data)
    gpus = _gpu_readings(data)
    achieved = throughput(data)
    slow = stragglers(ranks)
    spells = _partial_stragglers(data, slow)
    periods = judged_periods(data)
    last = periods[-1] if periods and periods[-1][0] != verdict and verdict != NO_VERDICT else None
    fixes = list(FIXES.get(verdict, SPARSE_SCRAPES_FIXES if data.window.scraped_too_rarely else NO_VERDICT_FIXES))
    fixes += [fix for fix in FIXES[last[0]] if fix not in fixes] if last else []
    fixes += [f"Open rank {rank.rank}'s node {rank.node}: GPU throttling, XID/ECC errors, CPU saturation, "
              "network; compare its phase breakdown with the other ranks'." for rank in slow]
    fixes += [f"Open rank {spell.rank}'s node {spell.node} from {_clock(data.window, spell.start)} to "
              f"{_clock(data.window, spell.end)} UTC: "
              "GPU throttling, XID/ECC errors, CPU saturation, another job on the node, network." for spell in spells]
    return Assessment(
        verdict=verdict, fractions=fractions,
        headline=_sparse_headline(data.window) if verdict == NO_VERDICT and data.window.scraped_too_rarely
        else STALLED_HEADLINE if verdict == verdicts.IDLE and _stalled(data)
        else _headline(verdict, fractions, gpus, achieved, last),
        because=_because(data, verdict, totals, gpus, periods) + _straggler_words(slow)
        + _spell_words(spells, data.window),
        rule=verdicts.MEANINGS.get(verdict, ""), fixes=fixes, checks=_checks(totals, ranks, gpus, spells),
        stragglers=slow, gpus=gpus, throughput=achieved, periods=periods, spells=spells,
    )


def _partial_stragglers(data: RunData, whole: list[RankSummary]) -> tuple[StragglerSpell, ...]:
    """The straggler spells (timeline.straggler_spells) of ranks that are not stragglers over the whole window: a
    rank slow for an hour of three scored 0.85 over the window, named nowhere but critical_path.csv."""
    named = {(rank.rank, rank.node) for rank in whole}
    over = data.over_time
    training = times_in_state(over["state"], TRAIN_STATE)
    intervals = state_intervals(over["state"], data.window, over.get("last_push", []))
    return tuple(spell for spell in straggler_spells(while_training(over["step_score"], intervals),
                                                     while_training(over["local_score"], intervals), training,
                                                     data.window.step)
                 if (spell.rank, spell.node) not in named)


def _because(data: RunData, verdict: str, totals: RunTotals, gpus: GpuReadings,
             periods: tuple[tuple[str, float, float], ...]) -> str:
    """The verdict's reasons and GPM grade, measured over the times it held where another verdict held too."""
    evidence = _evidence(data, verdict, totals, gpus, periods)
    return BECAUSE[verdict](evidence) + _grade_words(evidence.gpus)


def _evidence(data: RunData, verdict: str, totals: RunTotals, gpus: GpuReadings,
              periods: tuple[tuple[str, float, float], ...]) -> Evidence:
    """The whole window's numbers, or where another verdict had a period of its own (a blip shorter than the rules'
    rate window is none), the ones measured while this verdict held."""
    judged = {t for s in data.over_time["verdict"] for t, _ in s.points
              if s.labels.get("verdict") not in (verdicts.IDLE, verdict)}
    whole = Evidence("Over the window", gpus, totals.dataloader_share, totals.io_samples_per_second,
                     totals.training_samples_per_second, bool(totals.phase_seconds),
                     data.window.scrape_interval if data.window.scraped_too_rarely else 0.0,
                     _stalled(data))
    if verdict not in verdicts.BOTTLENECK_VERDICTS or all(period[0] == verdict for period in periods):
        return whole
    held = {t for s in data.over_time["verdict"] if s.labels.get("verdict") == verdict for t, _ in s.points}
    share = len(held) / len(held | judged)
    shares = _mean_of_ranks_while(data.over_time["dataloader_share"], held)
    return dataclasses.replace(
        whole, over=f"While {verdict} ({fmt.duration(len(held) * data.window.step)}, {share:.0%} of the judged time)",
        gpus=_gpu_readings(data, held), io_samples_per_second=None, training_samples_per_second=None,
        loading_share=shares if shares is not None else totals.dataloader_share)


def _mean_of_ranks_while(series: list[Series], times: set[float]) -> float | None:
    """The ranks' mean at each of `times`, averaged over those times (each time counts once, whatever its ranks)."""
    at: dict[float, list[float]] = {}
    for s in series:
        for t, value in s.points:
            if t in times:
                at.setdefault(t, []).append(value)
    return statistics.fmean(statistics.fmean(values) for values in at.values()) if at else None


def _gpu_readings(data: RunData, times: set[float] | None = None) -> GpuReadings:
    """The run's GPU recordings averaged over the times the rules judged it training (or `times`): the rules record
    them only for settled training ranks, so setup and warm-up never dilute them."""
    training = training_times(data.over_time["verdict"]) if times is None else times
    over = data.over_time
    return GpuReadings(
        nvml=_mean_while(over["run_gpu_nvml"], training),
        sm_active=_mean_while(over["run_gpu_sm_active"], training),
        tensor_active=_mean_while(over["run_gpu_tensor_active"], training),
        effective=_mean_while(over["run_gpu_effective"], training),
        source=", ".join(sorted({s.labels.get("source", "") for s in over["gpu_effective"]} - {""})),
    )


def _verdict_fractions(data: RunData) -> dict[str, float]:
    counts = Counter({s.labels.get("verdict", ""): len(s.points) for s in data.over_time["verdict"]})
    total = sum(counts.values())
    return {verdict: count / total for verdict, count in counts.most_common()} if total else {}


def _verdict(fractions: dict[str, float], data: RunData) -> str:
    """The verdict that held longest while training. Without one, a window in which ranks trained while
    the run had no verdict has NO_VERDICT (they never trained long enough to be judged), not idle; ranks
    in state train under the idle verdict stalled."""
    judged = {verdict: share for verdict, share in fractions.items() if verdict in verdicts.BOTTLENECK_VERDICTS
              and verdict != verdicts.IDLE}
    if judged:
        return max(judged, key=judged.__getitem__)
    training = times_in_state(data.over_time["state"], TRAIN_STATE)
    judged_at = {t for s in data.over_time["verdict"] for t, _ in s.points}
    # A stalled run trains unjudged until the rules see it stall (the settle time and the stall threshold),
    # then is judged idle while in train: that is the rules' verdict, not "none yet".
    return NO_VERDICT if training - judged_at and not _stalled(data) else verdicts.IDLE


def _stalled(data: RunData) -> bool:
    """Whether the rules judged the run idle at a time a rank was in state train: it stopped stepping there (a
    hung loader, collective or I/O), which "no rank trained" would hide (range queries share times)."""
    idle_at = {t for s in data.over_time["verdict"] if s.labels.get("verdict") == verdicts.IDLE for t, _ in s.points}
    return bool(times_in_state(data.over_time["state"], TRAIN_STATE) & idle_at)


def _headline(verdict: str, fractions: dict[str, float], gpus: GpuReadings, achieved: Throughput,
              last: tuple[str, float, float] | None = None) -> str:
    """The verdict, the grade of busy GPUs (GPM), the MFU where the run has one, how much of the judged
    training time the verdict held, and the verdict the window ended on where that is another (`last`): a run
    whose storage slowed for its last two minutes read only "Host-bound (55% of the training time)"."""
    if verdict == NO_VERDICT:
        return verdicts.NO_VERDICT_YET[:1].upper() + verdicts.NO_VERDICT_YET[1:]
    details = [gpus.grade] if verdict in (verdicts.GPU_BOUND, verdicts.GPU_BUSY_IDLE) and gpus.grade else []
    details += [achieved.headline] if achieved.headline and verdict != verdicts.IDLE else []
    judged = sum(share for name, share in fractions.items() if name != verdicts.IDLE)
    if verdict != verdicts.IDLE and judged:
        details.append(f"{fractions[verdict] / judged:.0%} of the training time")
    if last is not None:
        name, start, end = last
        details.append(f"then {HEADLINES[name].split(':')[0].lower()} for its last {fmt.duration(end - start)}")
    return HEADLINES[verdict] + (f" ({'; '.join(details)})" if details else "")


def _mean_while(series: list[Series], times: set[float]) -> float | None:
    values = [value for s in series for t, value in s.points if t in times]
    return sum(values) / len(values) if values else None


def _loading_words(evidence: Evidence) -> str:
    share = evidence.loading_share
    return f"data loading took {share:.0%} of step time" if share is not None else "data loading is not timed"


def _gpu_words(gpus: GpuReadings) -> str:
    """NVML utilization says whether the GPUs are busy or wait; SM active and tensor activity grade them."""
    if gpus.nvml is None:
        return "no GPU is mapped to the run (CPU-only, or the exporter cannot see its processes)"
    state = "busy" if gpus.nvml >= GPU_BOUND else "waiting"
    return f"the run's GPUs ran kernels {gpus.nvml:.0%} of the time while training (NVML utilization: {state})"


def _grade_words(gpus: GpuReadings) -> str:
    """SM active and tensor activity after the verdict's reasons: they grade the GPUs, they decide nothing."""
    return f" GPM grades how well the kernels use the GPUs: {gpus.grade}." if gpus.grade else ""


def _data_bound(e: Evidence) -> str:
    rates = ""
    if e.io_samples_per_second and e.training_samples_per_second:
        rates = (f"; loading delivers {e.io_samples_per_second:,.0f} samples per second of waiting, "
                 f"training consumes {e.training_samples_per_second:,.0f} per second of the rest")
    return f"{e.over} {_loading_words(e)}{rates}; {_gpu_words(e.gpus)}."


def _gpu_bound(e: Evidence) -> str:
    return f"{e.over} {_loading_words(e)} and {_gpu_words(e.gpus)}: the step's time is GPU work, the healthy state."


def _busy_idle(e: Evidence) -> str:
    return f"{e.over} {_gpu_words(e.gpus)}: kernels too small to fill the GPU, or a loop bound by kernel launches."


def _host_bound(e: Evidence) -> str:
    if e.gpus.nvml is None:
        return f"{e.over} {_loading_words(e)} and {_gpu_words(e.gpus)}; its phases are host time: it trains on the CPU."
    return (f"{e.over} {_gpu_words(e.gpus)} and {_loading_words(e)}: the loader is not why they wait, "
            "the steps wait on the host (launches, syncs, copies, Python).")


def _gpu_shared(e: Evidence) -> str:
    """The shared GPUs' reading is given, but as both runs' kernels: it decides nothing about this run."""
    busy = f" ran kernels {e.gpus.nvml:.0%} of the time while training, but" if e.gpus.nvml is not None else ""
    return (f"{e.over} every GPU of the run was another run's too, or held a process the hooks do not know "
            f"(time-sliced or under MPS): they{busy} NVML counts the other tenant's kernels as well, so that says "
            f"nothing about this one; {_loading_words(e)}.")


def _undetermined(e: Evidence) -> str:
    """Names the evidence this run lacks, which the fixes then add."""
    missing = []
    if e.loading_share is None:
        missing.append(f"{DATA_LOADING_PHASE} is not timed")
    if e.gpus.nvml is None:
        missing.append("no GPU is mapped to the run")
    elif e.gpus.nvml < GPU_BOUND:
        missing.append(f"its GPUs ran kernels only {e.gpus.nvml:.0%} of the time (NVML utilization: waiting)")
    if not e.phases_timed:
        missing.append("no phase is timed")
    found = "; ".join(missing) or "the 1m readings the rules judged by decided nothing"
    return f"{e.over} the run stepped, but {found}: nothing tells the GPU, the loader and the host apart."


def _idle(e: Evidence) -> str:
    if e.stalled:
        return ("A rank was in state train but made no step while the rules judged the run idle: it hangs in a "
                "phase (the state timeline and StepscopeTrainingStalled say which), or waits on another rank.")
    return "No step was made in state train in this range."


def _sparse_headline(window: Window) -> str:
    return (f"No verdict: the run's exporter was scraped every {window.scrape_interval:.0f} s, and the rules need a "
            f"scrape at least every {SCRAPE_INTERVAL_MAX_SECONDS:g} s")


def _no_verdict(e: Evidence) -> str:
    if e.too_long_scrape_interval:
        return (f"The ranks trained in this range, but their exporter was scraped every "
                f"{e.too_long_scrape_interval:.0f} s: the rules' 1m windows held one sample or none, so they gave no "
                "verdict; the numbers below hold.")
    return (f"The ranks trained in this range, but none for {SETTLE_SECONDS} s without a break (setup, eval, "
            "checkpoints or the run's end came first), so the rules gave no verdict; the numbers below hold.")


BECAUSE: dict[str, Callable[[Evidence], str]] = {
    verdicts.DATA_BOUND: _data_bound, verdicts.GPU_BOUND: _gpu_bound, verdicts.GPU_BUSY_IDLE: _busy_idle,
    verdicts.HOST_BOUND: _host_bound, verdicts.GPU_SHARED: _gpu_shared, verdicts.UNDETERMINED: _undetermined,
    verdicts.IDLE: _idle,
    NO_VERDICT: _no_verdict,
}


def _straggler_words(slow: list[RankSummary]) -> str:
    if not slow:
        return ""
    named = ", ".join(f"rank {rank.rank} on {rank.node} (score {rank.lowest_score:.2f})" for rank in slow)
    it = "it" if len(slow) == 1 else "them"
    if all(rank.step_time_score is not None and rank.step_time_score >= STRAGGLER_SCORE for rank in slow):
        # Synchronised ranks (DDP, FSDP) share one step time, the wait hidden in a collective: a straggler
        # with a typical step time was found by its local phases, and every rank's step waits for it.
        return f" Straggler: {named}; every synchronised step waits for {it}."
    # A slow step time of its own: the rank steps at its pace, not in step with the others (independent
    # processes), so no other rank waits for it.
    steps = "it steps" if len(slow) == 1 else "they step"
    return f" Straggler: {named}; {steps} slower than the other ranks, which do not wait for {it}."


def _spell_words(spells: tuple[StragglerSpell, ...], window: Window) -> str:
    """" Straggler for part of the run: rank 2 on n2 for 58m 00s between 06:30:00 and 07:30:00 UTC (local phases
    score 0.60 at its median: 1.67x the typical rank's time), typical again after it."""
    if not spells:
        return ""
    named = "; ".join(_spell_text(spell, window) for spell in spells[:SPELLS_NAMED])
    more = f"; and {len(spells) - SPELLS_NAMED} more (critical_path.csv)" if len(spells) > SPELLS_NAMED else ""
    return f" Straggler for part of the run: {named}{more}."


def _spell_text(spell: StragglerSpell, window: Window) -> str:
    kind = "local phases" if spell.kind == "local_phases" else "step time"
    after = "typical again after it" if spell.recovered else "to the end of the window"
    return (f"rank {spell.rank} on {spell.node} for {fmt.duration(spell.slow_seconds)} between "
            f"{_clock(window, spell.start)} and {_clock(window, spell.end)} UTC ({kind} score {spell.score:.2f} at "
            f"its median: {1 / spell.score:.2f}x the typical rank's time), {after}")


def _clock(window: Window, seconds: float) -> str:
    return clock(seconds, window.start, window.end)


def _gpu_check(gpus: GpuReadings) -> Check:
    """NVML utilization while training against the verdict's threshold: a saturated GPU reads 0.98 whatever
    its SM activity (0.73 on an H100 at full bf16 load), which only grades it. SMs active below the
    busy-but-idle threshold fail it, as the rules' gpu_busy_idle does."""
    rule, target = "GPU utilization close to 100%", (f">= {GPU_BOUND:.0%} (NVML); SM active >= "
                                                     f"{BUSY_IDLE_SM_ACTIVE:g} where GPM reads it")
    if gpus.nvml is None:
        return Check(rule, "no GPU reading while training", target, None)
    measured = f"kernels ran {gpus.nvml:.0%} of the time (NVML) while training"
    measured += f"; grade: {gpus.grade}" if gpus.grade else "; no GPM grade (SM active not read)"
    idle_sms = gpus.sm_active is not None and gpus.sm_active < BUSY_IDLE_SM_ACTIVE
    return Check(rule, measured, target, gpus.nvml >= GPU_BOUND and not idle_sms)


def _checks(totals: RunTotals, ranks: list[RankSummary], gpus: GpuReadings,
            spells: tuple[StragglerSpell, ...] = ()) -> list[Check]:
    checks = [_gpu_check(gpus)]
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
        measured = f"lowest score {worst.lowest_score:.2f} (rank {worst.rank}, {kind})"
        if spells:
            measured += "; below it for part of the run: " + ", ".join(
                f"rank {spell.rank} for {fmt.duration(spell.slow_seconds)} ({spell.score:.2f})" for spell in spells)
        checks.append(Check("No straggler rank", measured, f">= {STRAGGLER_SCORE}",
                            (worst.lowest_score or 0) >= STRAGGLER_SCORE and not spells))
    return checks

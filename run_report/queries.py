"""The PromQL the report sends: totals over the window (instant queries at its end) and series over
time (range queries at its step), over the shipped recording rules and the raw families.

Totals over a window are exact where the counters allow it. The hooks push cumulative counters from
the process start, so a series's increase over [start, end] is its last value up to `end` minus its
last value up to `start`, or its whole last value when it was born inside the window (a run the
window covers whole counts from zero). `increase()` would extrapolate to the window's edges and
miscount a finished run by up to half a scrape interval of steps, and takes a series's first value for its
base (a histogram born in the window loses its first step); it is used only for the step-time buckets of a rank
whose counters reset inside the window (its process restarted). Other counters that reset count through the
resets at the window's resolution (`_series_increase`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from stepscope.contract import DATA_LOADING_PHASE, LOCAL_PHASES
from stepscope.contract import families as fam
from stepscope.contract import recordings as rec
from stepscope.contract import selector as sel
from stepscope.report.window import Window, promql_string, run_matcher

BEFORE_MS = 600_000  # how far before the window a counter's previous value is looked for
BEFORE = f"{BEFORE_MS}ms"
RANK = "rank, instance"  # a rank's identity; `instance` is its node
PHASE_LOCAL = "|".join(LOCAL_PHASES)  # before the first collective (rules: local score)
RUN_QUANTILES = {"run_p50": 0.5, "run_p95": 0.95}  # totals asked once `step_buckets` is answered (run_quantiles)


@dataclass(frozen=True)
class Queries:
    """The report's queries for one run and window, keyed by what they answer."""

    totals: Mapping[str, str]  # instant, at window.end
    over_time: Mapping[str, str]  # query_range over the window


def window_increase(selector: str, window: Window, steps_selector: str, born_per_rank: bool,
                    steady: Collection[str] = ()) -> str:
    """Each series's increase over the window (see the module docstring), labels kept.

    `born_per_rank`: histogram buckets. A rank's bucket bound that appears inside the window starts
    with the counts from before it, so for a rank that existed before the window only bounds it
    exported then are kept; a rank born inside the window counts every bound from zero; a rank whose process
    restarted in the window counts them with `increase()`. Any other series counts through its resets
    (`_series_increase`): `increase()` took a series's first value in the window for its base, so a restarted
    rank's step histogram born in the window lost its first step (a 60 s warm-up), which the report's warm-up
    cut then took out once more. `steady`: see `_series_increase`.
    """
    if not born_per_rank:
        return _series_increase(selector, window, steady)
    d = window.range_ms
    just_before = f"{round(window.seconds * 1000) + 1}ms"  # range selectors include both ends: skip `start`
    now = f"last_over_time({selector}[{d}])"
    before = f"last_over_time({selector}[{BEFORE}] offset {just_before})"
    rank_before = f"last_over_time({steps_selector}[{BEFORE}] offset {just_before})"
    born = f"({now} unless on (run, {RANK}) {rank_before})"
    restarted = f"(resets({steps_selector}[{d}]) > 0)"
    exact = f"((({now} - {before}) >= 0) or {born})"
    counted = (f"({exact} unless on (run, {RANK}) {restarted})"
               f" or (increase({selector}[{d}]) and on (run, {RANK}) {restarted})")
    return f"({counted}) and on (run, {RANK}, le) {_exported_at_rank_end(selector, steps_selector, window)}"


def _exported_at_rank_end(selector: str, steps_selector: str, window: Window) -> str:
    """The bucket series its rank still exported at its last sample in the window.

    The hooks drop a block of bounds left unused for a while when they need the room
    (stepscope.hooks.timing.FollowingLayout): a run's compile-time blocks, once its pace is steady. A dropped
    bound's last value is its count then, below the counts of the bounds under it at the rank's end, so its
    rank's totals per bound were not cumulative; Prometheus' histogram_quantile repairs that upward, but
    VictoriaMetrics' read the dropped bound for the quantiles (p50 0.5 s for 45 ms steps,
    tests/test_report_evicted_bounds.py). A series scraped with its rank's steps counter is present at the same
    points of the window; one last present at an earlier point was dropped (a bound dropped within a step of its
    rank's end is kept: at the resolution of a long window, five minutes).

    Each series's last point is the last time() it was present at, not timestamp() of its last sample: inside a
    subquery Prometheus (2.42) reads timestamp() of a selector by seeking through the series's whole range again
    at every point, and a 3-day run of 16 ranks with restarts took 90 s per quantile query and hit Prometheus'
    2-minute query timeout for the run's p50 and p95: no report at all."""
    d, step = window.range_ms, window.step_duration

    def last_seen(series: str) -> str:
        return f"last_over_time((time() + 0 * {series})[{d}:{step}])"

    return f"({last_seen(selector)} >= on (run, {RANK}) group_left () {last_seen(steps_selector)})"


def restart_aware_increase(selector: str, window: Window, by: str, steady: Collection[str] = ()) -> str:
    """What a counter counted over the window, summed `by`, through restarts and gaps of any length
    (`_series_increase`). Used by the goodput, whose restart gaps make every rank of a restarted run a reset
    rank."""
    return f"sum by ({by}) ({_series_increase(selector, window, steady)})"


def _series_increase(selector: str, window: Window, steady: Collection[str] = ()) -> str:
    """What each series counted over the window, labels kept, through restarts and gaps of any length.

    A series that never went down in the window (resets() compares its samples however far apart) counts its
    last value less its last before the window (all of it when born in the window), so a gap in it (an exporter or
    Prometheus down, a closed tracker's group dropped at the exporter's TTL until the next fit reopens it)
    adds only what it grew by across it. Summing each step's increase instead found no previous sample after
    a gap over BEFORE and counted the whole value again: 1,350 s of train for 1,200.

    A series that went down (a new process counting from 0 under the same rank and node) counts, at each step,
    the increase since the series's last sample up to BEFORE before that step, or the whole value where the
    counter reset or was born; not the value one step back, which after a short gap (a failed scrape) is stale
    and would add the whole count once more. Where it went down, the step's peak above the value at its end is
    the process before's last count: what it grew by since the step before counts too. Before, a process lost and
    replaced within one step lost its steps since the point before: a week-long run of 8 ranks at 600 s points,
    requeued 2 minutes after a kill 7 minutes past a point, read 1,204,200 steps per rank for 1,205,040. Exact
    where no process grew past its predecessor's count within one step or gap, and where no gap over BEFORE comes
    with a restart in the same series.

    A step of several scrapes (a run longer than RESOLUTION_POINTS scrapes: 5 h at 15 s) may hold a restart whose
    new process is already back at its predecessor's count (a setup of 300 s again, at a 300 s step): the counter
    went down inside the step (resets, or a sample in it below the step's previous value) and counts whole. Before,
    the new count less the old was 0: a 3-day run restarted twice read 900 s of setup per rank for 1,200.

    The steps are the window's points after its start, each counting from the point before; a sample at the start
    itself counts from the last sample before the window, as without a reset. Prometheus' subquery over the window
    took its start's point too (ranges include both ends there; VictoriaMetrics' leave the start out), which
    counted a whole step before the window: --from 14 h to 56 h of a 3-day run restarted twice, at 300 s points,
    read 297,720 steps per rank for 297,120, and 300 s more of train.

    A selector in `steady` (none of its series went down in the window: `counter_resets`) is counted without the
    resets' part, whose answer would be empty: Prometheus evaluates both sides of `or` whatever they hold, and the
    resets' part, a subquery at every point of the window, was most of the time (on a 3 h run of 256 ranks, 3.9 s
    of Prometheus' time for the steps, 0.3 s without it)."""
    d, step = window.range_ms, window.step_duration
    just_before = f"{round(window.seconds * 1000) + 1}ms"  # range selectors include both ends: skip `start`
    now = f"last_over_time({selector}[{d}])"
    before = f"last_over_time({selector}[{BEFORE}] offset {just_before})"
    steadily = f"(({now} - {before}) >= 0 or {now})"
    if selector in steady:
        return steadily
    reset = f"(resets({selector}[{d}]) > 0)"
    previous = f"last_over_time({selector}[{BEFORE}] offset {step})"
    went_down = f"(resets({selector}[{step}]) > 0 or min_over_time({selector}[{step}]) < {previous})"
    peak = f"max_over_time({selector}[{step}])"
    # where it went down, the process before's last growth: the step's peak above a later, lower sample
    predecessor_rest = f"(({peak} - {previous}) > 0 and {peak} > {selector})"
    counted = (f"((({selector} - {previous}) >= 0 unless {went_down})"
               f" or ({selector} + ({predecessor_rest} or 0 * {selector})))")
    at_start = f"last_over_time({selector}[1ms] offset {d})"  # a sample at the window's start
    from_start = f"((({at_start} - {before}) >= 0 or {at_start}) or 0 * {now})"
    through_resets = f"(sum_over_time({counted}[{window.after_start_ms}:{step}]) + {from_start})"
    return f"({steadily} unless {reset}) or ({through_resets} and {reset})"


def build(run: str, window: Window, nodes: list[str], steady: Collection[str] = ()) -> Queries:
    """`steady`: the counters' selectors whose series did not go down in the window (`counter_resets`)."""
    r = run_matcher(run)
    w = window.rate_window
    over_time = _training_over_time(r, window) | _gpu_over_time(r) | _process_over_time(r, w)
    if nodes:  # the nodes the run's ranks ran on
        over_time |= _node_over_time(f"instance=~{_regex_string(nodes)}", w)
    return Queries(_totals(r, window, steady), over_time)


def counter_resets(run: str, window: Window) -> dict[str, str]:
    """For each counter's selector the totals count through resets (`_series_increase`), a query answering a
    sample where any of its series went down in the window, nothing where none did: the selectors answered
    nothing are `steady` for `build`."""
    r = run_matcher(run)
    selectors = [sel(name, r) for name in _COUNTED_THROUGH_RESETS]
    selectors.append(sel(f"{fam.STEP_PHASE_SECONDS}_sum", _loading(r)))
    return {selector: f"count(resets({selector}[{window.range_ms}]) > 0)" for selector in selectors}


_COUNTED_THROUGH_RESETS = (
    fam.STEPS_TOTAL, fam.SAMPLES_TOTAL, fam.TOKENS_TOTAL, fam.MODEL_FLOPS_TOTAL, fam.CUDA_ALLOC_RETRIES,
    fam.CUDA_OOMS, f"{fam.STEP_SECONDS}_sum", f"{fam.STEP_SECONDS}_count", f"{fam.STEP_PHASE_SECONDS}_sum",
    fam.STATE_SECONDS)


def _loading(r: str) -> str:
    """The matchers of the run's data loading phase (the goodput's)."""
    return f'{r},phase="{DATA_LOADING_PHASE}"'


def _totals(r: str, window: Window, steady: Collection[str]) -> dict[str, str]:
    steps = sel(fam.STEPS_TOTAL, r)

    def inc(metric: str, by: str = RANK, per_rank: bool = False) -> str:
        return f"sum by ({by}) ({window_increase(f'{metric}{{{r}}}', window, steps, per_rank, steady)})"

    buckets = _step_buckets(r, window)
    return {
        "step_buckets": buckets,  # first: the run's quantiles wait for it (run_quantiles)
        "info": f"max by ({RANK}, local_rank, world_size, pid) "
                f"(last_over_time({sel(fam.TRAINING_INFO, r)}[{window.range_ms}]))",
        "steps": inc(fam.STEPS_TOTAL),
        "samples": inc(fam.SAMPLES_TOTAL),
        "tokens": inc(fam.TOKENS_TOTAL),  # docs/mfu.md: only ranks that count them
        "model_flops": inc(fam.MODEL_FLOPS_TOTAL),
        # PyTorch's allocator per rank (on CUDA only; docs/hooks.md): the window's highest peak and reserve
        "cuda_peak": f"max by ({RANK}) (max_over_time({sel(fam.CUDA_MEMORY_PEAK, r)}[{window.range_ms}]))",
        "cuda_reserved": f"max by ({RANK}) (max_over_time({sel(fam.CUDA_MEMORY_RESERVED, r)}[{window.range_ms}]))",
        "cuda_retries": inc(fam.CUDA_ALLOC_RETRIES),
        "cuda_ooms": inc(fam.CUDA_OOMS),
        "step_seconds": inc(f"{fam.STEP_SECONDS}_sum"),
        "step_count": inc(f"{fam.STEP_SECONDS}_count"),
        "phase_seconds": inc(f"{fam.STEP_PHASE_SECONDS}_sum", f"{RANK}, phase"),
        "state_seconds": inc(fam.STATE_SECONDS, f"{RANK}, state"),
        # the goodput's held span per rank and node (stepscope.report.goodput): from the Tracker's start (a
        # push's time less the seconds its states add up to, the same in every push of a process) to the
        # last push; and the run's GPU energy: its watts (recorded each evaluation) summed at the resolution, each
        # point's over the step before it (the start's lies before the window: on Prometheus it added a step of watts)
        "first_push": f"min by ({RANK}) (min_over_time(({sel(fam.TRAINING_LAST_PUSH, r)} - on (run, {RANK})"
                      f" sum by (run, {RANK}) ({sel(fam.STATE_SECONDS, r)}))"
                      f"[{window.range_ms}:{window.step_duration}]))",
        "last_push": f"max by ({RANK}) (max_over_time({sel(fam.TRAINING_LAST_PUSH, r)}[{window.range_ms}]))",
        "energy_joules": f"sum(sum_over_time({sel(rec.RUN_ENERGY_RATE, r)}"
                         f"[{window.after_start_ms}:{window.step_duration}])) * {window.step:g}",
        "goodput_states": restart_aware_increase(sel(fam.STATE_SECONDS, r), window, f"{RANK}, state", steady),
        "goodput_loading": restart_aware_increase(
            sel(f"{fam.STEP_PHASE_SECONDS}_sum", _loading(r)), window, RANK, steady),
        "goodput_tokens": restart_aware_increase(sel(fam.TOKENS_TOTAL, r), window, RANK, steady),
        "goodput_steps": restart_aware_increase(sel(fam.STEPS_TOTAL, r), window, RANK, steady),
        **_first_scrape(r, window),
        "p50": f"histogram_quantile(0.5, {buckets})",
        "p95": f"histogram_quantile(0.95, {buckets})",
    }


def _step_buckets(r: str, window: Window, bounds: str = "") -> str:
    """Each rank's step-time histogram over the window: its count per bound (`window_increase`), of the bounds
    `bounds` matches (a matcher of `le`) or all."""
    selector = f"{fam.STEP_SECONDS}_bucket{{{r}{bounds}}}"
    return f"sum by ({RANK}, le) ({window_increase(selector, window, sel(fam.STEPS_TOTAL, r), born_per_rank=True)})"


def run_quantiles(run: str, window: Window, shared_bounds: list[str]) -> dict[str, str]:
    """The run's step-time quantiles (RUN_QUANTILES) over the bounds every rank exports, as the rules do
    (run_le:...): the bounds the answer to `step_buckets` holds for every rank (collect.shared_bounds), none
    without any. Asking the server which bounds those are inside each quantile query evaluated the ranks' bucket
    totals three times over: on a 3 h run of 256 ranks, 9.3 s of Prometheus' time per quantile for the 3.8 s of
    `p50`; now once, over the shared bounds only, whose totals are the same."""
    if not shared_bounds:
        return {}
    buckets = _step_buckets(run_matcher(run), window, f",le=~{_regex_string(shared_bounds)}")
    return {name: f"histogram_quantile({quantile:g}, sum by (le) ({buckets}))"
            for name, quantile in RUN_QUANTILES.items()}


def _first_scrape(r: str, window: Window) -> dict[str, str]:
    """Each process's first point of a rank in the window, at the window's resolution, with the rank's step count
    there; the report leaves a warm-up first step out of its means, shares and rates (summary.warm_up), the first
    process's and each restarted one's (a requeue, a restore from a checkpoint compiles again). What the process
    had counted there is asked at those points only (`first_scrape_values`).

    A process's first point is one where the rank's step histogram counts steps and had counted none, or more, at
    its last sample before it in the window (or up to BEFORE before the window): born (a held-back histogram appears
    with the first step) or gone down (a new process counts from 0). Looking only BEFORE back took a
    node's 20 minutes of failed scrapes for a new process: on a 64-rank run, the 8 ranks of that node had their
    5 hours of steps up to the gap left out as an 851 s "warm-up", their mean step time 4.4% low. The ranks whose
    step histogram was born in the window come too, without which a first point that follows no restart is a
    window's start, not a process's.

    Finding the points costs Prometheus an aggregation and two vector matchings at every point of the window.
    Before, each of the five counts asked at them found them again, the restarts twice: on a 3 h run of 256 ranks,
    9.1 s of Prometheus' time for the five, 1.0 s for the points alone."""
    d, step = window.range_ms, window.step_duration
    just_before = f"{round(window.seconds * 1000) + 1}ms"
    step_count = sel(f"{fam.STEP_SECONDS}_count", r)
    counted = f"(sum by (run, {RANK}) ({step_count}) > 0)"
    firsts = f"({counted} unless on (run, {RANK}) ({_counted_earlier(r, window)} <= on (run, {RANK}) {counted}))"
    return {
        "first_step_count": f"{firsts}[{d}:{step}]",
        "step_histogram_born": f"last_over_time({step_count}[{d}]) unless on (run, {RANK})"
                               f" last_over_time({step_count}[{BEFORE}] offset {just_before})",
    }


def _counted_earlier(r: str, window: Window) -> str:
    """Each rank's step count at its last sample a step or more before the point it is evaluated at, back to
    BEFORE before the window."""
    since_before = f"{round(window.seconds * 1000) + BEFORE_MS}ms"
    step_count = sel(f"{fam.STEP_SECONDS}_count", r)
    return (f"(sum by (run, {RANK}) (last_over_time({step_count}[{since_before}] offset {window.step_duration}))"
            f" > 0)")


def first_scrape_values(run: str, window: Window) -> dict[str, str]:
    """What each rank had counted at a point, asked as instant queries at the times of the processes' first points
    (`_first_scrape`), which keep the ranks that start a process there. `first_restarts`: the ranks whose process
    there follows a restart: its step histogram had counted more before (a first point with an earlier count), or
    its steps counter went down in the BEFORE up to it."""
    r = run_matcher(run)
    steps_reset = f"(sum by (run, {RANK}) (resets({sel(fam.STEPS_TOTAL, r)}[{BEFORE}])) > 0)"
    return {
        "first_step_seconds": f"sum by (run, {RANK}) ({sel(f'{fam.STEP_SECONDS}_sum', r)})",
        "first_samples": f"sum by (run, {RANK}) ({sel(fam.SAMPLES_TOTAL, r)})",
        "first_phase_seconds": f"sum by (run, {RANK}, phase) ({sel(f'{fam.STEP_PHASE_SECONDS}_sum', r)})",
        "first_restarts": f"{_counted_earlier(r, window)} or on (run, {RANK}) {steps_reset}",
    }


def pushed_at(r: str) -> str:
    """Each rank's last push time on Prometheus' clock, which the timeline compares it with: the push's time less
    its node's clock offset (the rules' recording; docs/alerts.md, "Clock skew"), or as pushed where none is
    recorded. Before, a node a minute behind had every rank read lost from its first point."""
    push = sel(fam.TRAINING_LAST_PUSH, r)
    return f"({push} - on (job, instance) group_left () {rec.NODE_CLOCK_OFFSET}) or {push}"


def fresh(expr: str, selector: str, window: Window) -> str:
    """`expr` at the points where `selector` (whose series `expr`'s keep their labels) has a sample at most
    Window.fresh_duration old. A series that ended without a staleness marker (history backfilled with promtool,
    imported into VictoriaMetrics) went on at every point of Prometheus' 5-minute lookback: a rank whose
    exporter group expired after it was lost read lost for 915 s on Prometheus, 630 s on VictoriaMetrics, for
    615 s up to the scrape that no longer had it. A staleness marker ends the series as before."""
    return f"({expr}) and last_over_time({selector}[{window.fresh_duration}])"


def latest_verdict(r: str, window: Window) -> str:
    """The run's verdict at each point: the verdict series written in the last step (or scrape interval, if longer),
    and where none was (an evaluation that came late) any fresh one. A verdict is one series per value, and a series
    that ended without a staleness marker (history backfilled with promtool, imported) went on for Prometheus'
    5-minute lookback beside the next one: a run data-bound for 10 minutes, then GPU-bound for 6, read "While
    data_bound (15m 00s, 88% of the judged time)". timestamp() would pick the newest, at a cost over long windows
    (test_no_query_takes_the_timestamp_of_a_selector_point_by_point)."""
    verdict = sel(rec.RUN_VERDICT, r)
    last_step = f"{max(1, round(max(window.step, window.scrape_interval) * 1000) - 1)}ms"
    written_last = f"{verdict} and last_over_time({verdict}[{last_step}])"
    return f"({written_last}) or on (run) ({fresh(verdict, verdict, window)})"


def _training_over_time(r: str, window: Window) -> dict[str, str]:
    state = sel(fam.TRAINING_STATE, r)
    return {
        "state": fresh(f"{state} == 1", state, window),
        # a rank that stopped pushing unclosed is lost (timeline)
        "last_push": fresh(pushed_at(r), sel(fam.TRAINING_LAST_PUSH, r), window),
        "world_size": f"count by (world_size) ({sel(fam.TRAINING_INFO, r)})",  # a resized run (resize.py)
        "verdict": latest_verdict(r, window),
        "step_mean": sel(rec.RANK_STEP_SECONDS_MEAN, r),
        "run_p50": sel(rec.RUN_STEP_SECONDS_P50, r),
        "run_p95": sel(rec.RUN_STEP_SECONDS_P95, r),
        "run_samples_rate": sel(rec.RUN_SAMPLES_RATE, r),
        "run_peak_flops": sel(rec.RUN_PEAK_FLOPS, r),
        "dataloader_share": sel(rec.RANK_DATALOADER_SHARE, r),
        "step_score": sel(rec.RANK_STRAGGLER_SCORE, r),
        "local_score": sel(rec.RANK_STRAGGLER_LOCAL_SCORE, r),
        "stalled": sel(rec.RANK_STALLED_SECONDS, r),
        "global_step": sel(fam.TRAINING_GLOBAL_STEP, r),
        # the global step a process's steps count from, lower after a restore: as the hooks push it (a restore in
        # the same process moves it too), from older hooks its global step less its own steps
        "global_step_base": f"{sel(fam.TRAINING_GLOBAL_STEP_START, r)} or "
                            f"{sel(fam.TRAINING_GLOBAL_STEP, r)} - {sel(fam.STEPS_TOTAL, r)}",
    }


def _gpu_over_time(r: str) -> dict[str, str]:
    """The run's GPUs, recorded by the rules only while its ranks train: NVML utilization says busy or
    waiting, SM active and tensor activity (GPM) grade a busy GPU; per GPU for the plot and the CSV."""
    run_gpus = f"({sel(rec.RANK_GPU_MEMORY, r)} > 0)"
    return {
        "run_gpu_effective": sel(rec.RUN_GPU_EFFECTIVE_UTILIZATION, r),
        "run_gpu_nvml": sel(rec.RUN_GPU_UTILIZATION, r),
        "run_gpu_sm_active": sel(rec.RUN_GPU_SM_ACTIVE, r),  # GPM only: grades a busy GPU
        "run_gpu_tensor_active": sel(rec.RUN_GPU_TENSOR_ACTIVE, r),
        "gpu_effective": sel(rec.RUN_GPU_EFFECTIVE_UTILIZATION_BY_GPU, r),
        "gpu_nvml": sel(rec.RUN_GPU_UTILIZATION_BY_GPU, r),
        # from the GPU source layer: stepscope's reading, or dcgm-exporter's (one series per pod holding the GPU)
        "gpu_memory": f"max by (instance, gpu) ({rec.GPU_SOURCE_MEMORY_USED}) and on (instance, gpu) {run_gpus}",
    }


def _process_over_time(r: str, w: str) -> dict[str, str]:
    by = f"sum by ({RANK}, pid)"
    return {
        "process_cpu": f"{by} (rate({sel(fam.PROCESS_CPU_SECONDS, r)}[{w}]))",
        "process_memory": f"{by} ({sel(fam.PROCESS_RESIDENT_MEMORY, r)})",
        "process_gpu_memory": f"{by} ({sel(fam.PROCESS_GPU_MEMORY, r)})",
        "process_children": f"{by} ({sel(fam.PROCESS_CHILDREN, r)})",
        "process_read": f"{by} (rate({sel(fam.PROCESS_IO_READ, r)}[{w}]))",
        "process_write": f"{by} (rate({sel(fam.PROCESS_IO_WRITE, r)}[{w}]))",
    }


def _node_over_time(node: str, w: str) -> dict[str, str]:
    network = f'{node},device!="lo"'  # loopback traffic never leaves the node
    return {
        "node_cpu": sel(rec.NODE_CPU_UTILIZATION, node),
        "node_memory_ratio": sel(rec.NODE_MEMORY_UTILIZATION, node),
        "node_memory_used": f"sum by (instance) ({sel(fam.NODE_MEMORY_TOTAL, node)}"
                            f" - {sel(fam.NODE_MEMORY_AVAILABLE, node)})",
        "node_disk_read": f"sum by (instance) (rate({sel(fam.NODE_DISK_READ_BYTES, node)}[{w}]))",
        "node_disk_write": f"sum by (instance) (rate({sel(fam.NODE_DISK_WRITTEN_BYTES, node)}[{w}]))",
        "node_net_receive": f"sum by (instance) (rate({sel(fam.NODE_NETWORK_RECEIVE, network)}[{w}]))",
        "node_net_transmit": f"sum by (instance) (rate({sel(fam.NODE_NETWORK_TRANSMIT, network)}[{w}]))",
    }


def _regex_string(values: list[str]) -> str:
    """A PromQL string holding an RE2 alternation that matches exactly `values` (Prometheus anchors it)."""
    return promql_string("|".join(re.escape(value) for value in values))

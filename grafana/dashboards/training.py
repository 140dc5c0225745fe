"""Training run dashboard: is this run fast, what is each step made of, and which rank holds it up."""

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models import dashboard as dm

import stepscope.contract as contract
from grafana.dashboards import node
from grafana.dashboards.panels import (
    SAMPLES_PER_SECOND,
    Q,
    age,
    alert_list_panel,
    bargauge_panel,
    base_dashboard,
    custom_variable,
    data_link,
    heatmap_panel,
    query_variable,
    range_text,
    row,
    stat_panel,
    state_timeline_panel,
    table_panel,
    thresholds,
    timeseries_panel,
    value_text,
)
from stepscope.contract import families as fam
from stepscope.contract import goodput
from stepscope.contract import recordings as rec
from stepscope.contract import selector as sel
from stepscope.contract import verdicts as verdict

UID = "stepscope-training"
# The run is matched exactly: Grafana regex-escapes a variable's value only where several may be picked, so with
# `=~` a run named "bert+lora" matched no series (an empty dashboard) and "exp.1" matched "expx1" too.
RUN = 'run="$run"'
RANKS = 'run="$run",rank=~"$rank"'

# State set -> one code per rank, so the state timeline shows one row per rank; state -> (code, colour).
STATE_COLOURS = ("blue", "green", "purple", "orange", "text")  # in the contract's order of STATES
STATES = {state: (code, colour)
          for code, (state, colour) in enumerate(zip(contract.STATES, STATE_COLOURS, strict=True), start=1)}
DATA_BOUND = contract.THRESHOLDS["data_loading_share"]
DATA_NOTICE = contract.THRESHOLDS["data_loading_share_notice"]
GPU_BOUND = contract.THRESHOLDS["gpu_bound_utilization"]
GPU_LOW = contract.THRESHOLDS["utilization_low"]
BUSY_IDLE = contract.THRESHOLDS["busy_idle_sm_active"]
STRAGGLER = contract.THRESHOLDS["straggler_score"]
TYPICAL = contract.THRESHOLDS["straggler_score_typical"]
TENSOR_IDLE = contract.THRESHOLDS["tensor_active_idle"]
MEMORY_FULL = contract.THRESHOLDS["gpu_memory_full"]
COMPUTE_SHARE = contract.THRESHOLDS["compute_limit_share"]
LOADING = contract.DATA_LOADING_PHASE
LOCAL = " + ".join(contract.LOCAL_PHASES)
TRAIN = contract.TRAIN_STATE
BUCKET_STEP = 2 ** (1 / contract.STEPS_PER_OCTAVE) - 1  # neighbouring fine bounds, apart
# Where the run and rank dropdowns come from: a recording per run and rank of the pushed step counter, so they
# list the same ranks as the counter on a plain Prometheus and on a sharded layout's global layer, where the
# shards send recordings but not the raw counter (the run dropdown was empty there).
VARIABLE_SOURCE = rec.RANK_STEPS_RATE
# The ranks a per-rank time series draws: one line per rank is unreadable at 64 ranks (and 512), so the
# `$ranks_drawn` ranks with the lowest straggler score (step time or local phases, whichever is lower) among the
# picked ones, beside the run's typical line; the Per-rank comparison table lists every rank, lowest score over
# the range first.
# Averaged over the time range and taken once at its end (`@ end()`), so one set of ranks is drawn across the
# panel: a plain bottomk picks anew at each step, and with two ranks slow in turn over an hour drew 6 ranks for 5
# asked, some for part of the panel, a different sixth on Prometheus and on VictoriaMetrics
# (tests/test_dashboards_ranks.py holds that hour). A rank that pushed but has no score over the range (it never
# stepped: hung, or the run is still in setup) scores 0, so it is drawn first where it has a line (throughput,
# memory, CPU); the panels of what only a stepping rank has draw the lowest scored ranks (DRAWN_SCORED).
# A figure of the dashboard's whole time range, in a stat or bars: read over the range at its end (`@ end()`), so a
# range query (Grafana's default) gives the range's figure at every step, not each step's over the range before it:
# its sparkline read into the hours before the range (a goodput of 0.90 at its start for the range's 0.50), and each
# step re-read the whole range.
THE_RANGE = "[$__range] @ end()"
DRAWN_CHOICES = {"5 slowest": 5, "10 slowest": 10, "20 slowest": 20, "all": 1_000_000}


def over_the_range(selector: str) -> str:
    """`selector`'s series averaged over the dashboard's time range, taken at its end (one figure at every step)."""
    return f"avg_over_time({selector}[$__range] @ end())"


def lowest_score(by: str, over_range: bool = False) -> str:
    """Each picked rank's lower straggler score (step time or local phases) by the labels `by`, now or averaged
    over the time range at its end."""
    def score(recorded: str) -> str:
        selector = sel(recorded, RANKS)
        return over_the_range(selector) if over_range else selector
    return (
        f"min by ({by}) (\n"
        f'  label_replace({score(rec.RANK_STRAGGLER_SCORE)}, "score", "step", "", "")\n'
        f'  or label_replace({score(rec.RANK_STRAGGLER_LOCAL_SCORE)}, "score", "local", "", "")\n'
        ")"
    )


# The Per-rank comparison's sort column: the lower score over the range, the figure the ranks drawn are chosen by.
# Sorted on the score now, a rank slow for the first half of an hour (0.5, 1 since: 0.75 over the hour) was drawn on
# every panel but sat 14th of 64, tied at 1 with 59 ranks, in a table said to begin with the drawn ranks.
RANGE_SCORE_COLUMN = "lowest score over the range"
# Where each rank is: sorted on it, longest first. In a run stalled by one rank (a hung loader), every rank stopped
# stepping at once (360.0 s against up to 360.1 s, 64 ranks): seconds in its phase set the hung rank apart (360.0 s,
# the others entered backward's all-reduce after it: 359.7 s), where the label order put it 51st of 64.
IN_ITS_PHASE_COLUMN = "in its phase"
# A training rank outside every host-timed phase (hung in the loop's own code, a collective the hooks do not time)
# has no phase entered: its row had no "in its phase", and the sort put it last of 64 (rank 50 hung there 360.1 s,
# the others 359.7 s in backward's all-reduce). Its seconds since its last step stand in, as the phase it is in.
BETWEEN_PHASES = "(between phases)"


PUSHED_UNSCORED = f"group by (run, rank) (max_over_time({sel(VARIABLE_SOURCE, RANKS)}[$__range] @ end())) * 0"
SCORED = lowest_score("run, rank", over_range=True)
CANDIDATES = f"{SCORED} or {PUSHED_UNSCORED}"  # every rank that may be drawn
DRAWN = f"bottomk by (run) ($ranks_drawn, {CANDIDATES})"
# The ranks a panel of what only a stepping rank has draws (scores, step time, data-loading share): the lowest scored
# ones only. From DRAWN, 5 ranks still in setup (or hung) took every place at score 0, and such a panel, with no line
# or bar for them, drew none.
DRAWN_SCORED = f"bottomk by (run) ($ranks_drawn, {SCORED})"


def _in_its_phase() -> str:
    """Per rank, seconds in the host-timed phase it is in; for a rank in train between phases, seconds since its
    last step, under the phase BETWEEN_PHASES. Ranks in setup, eval, checkpoint or idle stay without a figure: they
    are not stepping on purpose, and a closed rank's old last step would top the table."""
    training = sel(contract.TRAINING_STATE, f'{RANKS},state="{TRAIN}"')
    between = f"{age(sel(fam.TRAINING_LAST_STEP, RANKS))}\n  and ignoring (state) {training} == 1"
    return (f"{age(sel(fam.TRAINING_PHASE_ENTERED, RANKS))}\nor ignoring (phase)\n"
            f'label_replace(\n  {between},\n  "phase", "{BETWEEN_PHASES}", "", ""\n)')


def _score_bars() -> str:
    """The Straggler scores bars: a row per drawn rank and score (step, local), averaged over the range, whose one
    label `bar` ("rank 3 step (n0)") names its bar, for a sort on the value to put the lowest on top. A query per
    score drew the bars in label order, query by query: step scores 0.5, 0.8, 0.6, 0.7, 0.9 of ranks 3, 9, 17, 40, 60
    put rank 17's 0.6 third, and every local bar under the step bars."""
    scores = " or ".join(
        f'label_replace({over_the_range(sel(recorded, RANKS))}, "score", "{kind}", "", "")'
        for kind, recorded in (("step", rec.RANK_STRAGGLER_SCORE), ("local", rec.RANK_STRAGGLER_LOCAL_SCORE)))
    joined = f'label_join({drawn(f"({scores})", DRAWN_SCORED)}, "bar", ";", "rank", "score", "instance")'
    return f'max by (bar) (label_replace({joined}, "bar", "rank $1 $2 ($3)", "bar", "(.*);(.*);(.*)"))'


# The run's GPUs a per-GPU time series draws: as many as ranks are drawn, the least used (effective utilization
# averaged over the time range, taken at its end as DRAWN is) for the utilization panel, the fullest for the memory
# one. A line per GPU was 512 lines for a run of 256 ranks on 256 GPUs (effective and NVML), one colour per line.
LEAST_USED_GPUS = (f"bottomk by (run) ($ranks_drawn, avg_over_time("
                   f"{sel(rec.RUN_GPU_EFFECTIVE_UTILIZATION_BY_GPU, RUN)}[$__range] @ end()))")
RUN_GPUS = f"group by (instance, gpu) ({sel(rec.RANK_GPU_MEMORY, RUN)} > 0)"
FULLEST_GPUS = (f"topk($ranks_drawn, max_over_time({rec.GPU_MEMORY_USED_RATIO}[$__range] @ end())"
                f" and on (instance, gpu) group by (instance, gpu) (max_over_time({sel(rec.RANK_GPU_MEMORY, RUN)}"
                f"[$__range] @ end()) > 0))")


def on_gpus(per_gpu: str, gpus: str) -> str:
    """`per_gpu` (a vector with `instance` and `gpu` labels) for the GPUs of `gpus` only."""
    return f"{per_gpu} and on (instance, gpu) {gpus}"


# A rank's node (the `instance` column of the per-rank tables) opens the Node dashboard on it: where a straggler's
# cause is (its GPU, its host), with the same time range.
NODE_LINK = data_link("Node dashboard of ${__value.raw}", node.UID, "instance")


def drawn(per_rank: str, among: str = DRAWN) -> str:
    """`per_rank` (a vector with `run` and `rank` labels) for the drawn ranks only (`among`: DRAWN or
    DRAWN_SCORED)."""
    return f"{per_rank} and on (run, rank) {among}"


# A rank that ran on more than one node over the time range: a requeued pod that landed on another node. Its old
# node's series outlive the move (the 1m rates for a minute, a killed rank's kept group until the exporter's TTL),
# so its lines name their node; every other rank's line stays "rank N". Taken over the range at its end, as DRAWN
# is, so a line keeps one name across the panel.
MOVED = (f"count by (run, rank) (group by (run, rank, instance) "
         f"(max_over_time({sel(VARIABLE_SOURCE, RANKS)}[$__range] @ end()))) > 1")
RANK_LEGEND = "rank {{rank_shown}}"  # "rank 3", or "rank 3 on n2" for a rank that moved (named_by_node_where_moved)
# Each rank that may be drawn with a label `node_separator`, " on " where it MOVED and none elsewhere (value 1). The
# others are added `unless` MOVED: with `or on (run, rank)` VictoriaMetrics 1.79 gave every rank the separator. Not
# DRAWN itself: evaluated twice, VictoriaMetrics' bottomk broke ties between equal scores differently, and 1 of 5
# drawn ranks kept its line.
NODE_SEPARATOR = (f'group by (run, rank, node_separator) (label_replace({MOVED}, "node_separator", " on ", "", "")\n'
                  f"  or (group by (run, rank) ({CANDIDATES}) unless on (run, rank) ({MOVED})))")
# rank;node_separator;instance -> the name: "3;;n2" (stayed) -> "3", "3; on ;n2" (moved) -> "3 on n2".
RANK_SHOWN = '"([^;]*);(?:;.*|( on );(.*))"'


def named_by_node_where_moved(per_rank: str) -> str:
    """`per_rank` (with `run`, `rank` and `instance` labels, of ranks that may be drawn) with a label `rank_shown` for
    RANK_LEGEND: the rank, and for a rank that moved to another node over the range its node too (`3 on n2`).
    Before, both of a moved rank's lines read "rank 3": Grafana writes an absent label's name in a legend, so the
    node can only be left out by a label that every series has. `per_rank` is evaluated once, named by a join
    (times 1): as two branches (the moved ranks' lines `and` MOVED, the others' `unless`) it was evaluated twice,
    half of the 5.7-6.4 s the step-time p50 of 256 ranks took over 6 hours."""
    joined = (f"({per_rank}) * on (run, rank) group_left (node_separator) ({NODE_SEPARATOR})")
    shown = f'label_join({joined}, "rank_shown", ";", "rank", "node_separator", "instance")'
    return f'label_replace(label_replace({shown}, "rank_shown", "$1$2$3", "rank_shown", {RANK_SHOWN}), ' \
           '"node_separator", "", "", "")'


def drawn_lines(per_rank: str, among: str = DRAWN) -> str:
    """`per_rank` (a vector with `run`, `rank` and `instance` labels) for the drawn ranks only (`among`: DRAWN or
    DRAWN_SCORED), named for RANK_LEGEND."""
    return named_by_node_where_moved(drawn(per_rank, among))


def median_rank(per_rank: str) -> Q:
    """The run's typical rank: the median over all its ranks of `per_rank`, the selector of a per-rank series
    (the line a drawn rank is compared with)."""
    return Q(f"quantile by (run) (0.5, {per_rank})", "median rank")


def _latest_node() -> str:
    """Per rank, the node it pushed to last (any node where no last push is exported: a stock Pushgateway). A rank
    whose requeued pod landed on another node is on two until the old node's exporter drops its group (its TTL);
    the highest state code of both read a rank that trains on its new node as `idle` (its old process closed) for
    those 10 minutes."""
    push = sel(fam.TRAINING_LAST_PUSH, RANKS)
    state = sel(contract.TRAINING_STATE, RANKS)
    return (f"(({push} == on (run, rank) group_left () max by (run, rank) ({push}))"
            f" or (group by (run, rank, instance) ({state}) unless on (run, rank) {push}))")


def _state_expr() -> str:
    """One code per rank: its state on the node it pushed to last (`_latest_node`)."""
    selector = f"{contract.TRAINING_STATE}{{{RANKS}"
    known = "|".join(STATES)
    parts = [f'(({selector},state="{state}"}} == 1) * {code})' for state, (code, _) in STATES.items()]
    parts.append(f'(({selector},state!~"{known}"}} == 1) * 0)')
    states = "\n  or ".join(parts)
    return f"max by (rank) (\n  (\n  {states}\n  )\n  and on (run, rank, instance) {_latest_node()}\n)"


# The Training state per rank panel at 64-512 ranks: a row per rank was 64 rows (512) in a panel 8 units high, and
# the rank that matters (hung in a checkpoint, stuck in eval, idle while the others train) was one unreadable line
# among them. It draws the `Ranks drawn` ranks that spent the most of the time range in a state other than the
# run's most common one, the ranks drawn (DRAWN: the slowest, a rank that pushed but never stepped first), and one
# row for all other ranks, named with their count, that shows the run's most common state.
STATE_NOW = f"({sel(contract.TRAINING_STATE, RANKS)} == 1) and on (run, rank, instance) {_latest_node()}"
RANKS_PER_STATE = f"count by (run, state) ({STATE_NOW})"
# topk, not `== max`: the states are counted once, not twice (a tie picks one of the most common states).
MOST_COMMON_STATE = f"topk by (run) (1, {RANKS_PER_STATE})"
# Each rank's count of the panel's steps over the range (`$__interval` apart, taken at its end as DRAWN is) at which
# it was in a state other than the run's most common one.
STEPS_APART = (f"count_over_time((group by (run, rank) (({STATE_NOW}) unless on (run, state) ({MOST_COMMON_STATE})))"
               f"[$__range:$__interval] @ end())")
STATE_RANKS_SHOWN = f"group by (run, rank) (topk by (run) ($ranks_drawn, {STEPS_APART}) or {DRAWN})"
STATE_CODES = " or ".join(f'label_replace(vector({code}), "state", "{state}", "", "")'
                          for state, (code, _) in STATES.items())
RANKS_HIDDEN = (f"count by (run) (group by (run, rank) (max_over_time({sel(contract.TRAINING_STATE, RANKS)}"
                f"[$__range] @ end())) unless on (run, rank) {STATE_RANKS_SHOWN})")


def _other_ranks_state() -> str:
    """The row of the ranks the panel hides: the code of the run's most common state at each step (none where it is
    a state the contract does not name), with a label `hidden`, their count, for the legend."""
    code = f"max by (run) (({MOST_COMMON_STATE}) * 0 + on (state) group_left () ({STATE_CODES}))"
    return f'count_values by (run) ("hidden", {RANKS_HIDDEN}) * 0 + on (run) group_left () {code}'


def _overview_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "Overview" row."""
    board = board.with_row(row("Overview"))
    board = (
        board.with_panel(
            stat_panel(
                "Bottleneck verdict",
                "What limits the run now, from evidence (first that holds). "
                + " ".join(f"{name}: {meaning}." for name, meaning in verdict.MEANINGS.items())
                + f" Empty: {verdict.NO_VERDICT_YET}.",
                [Q(sel(rec.RUN_VERDICT, RUN), "{{verdict}}")],
                "none",
                show_name=True,
            )
        )
        .with_panel(
            stat_panel(
                "Throughput",
                "Samples per second over all ranks of the run (1m rate).",
                [Q(sel(rec.RUN_SAMPLES_RATE, RUN), "samples/s")],
                SAMPLES_PER_SECOND,
            )
        )
        .with_panel(
            stat_panel(
                "Step time p50",
                "Median step time over all ranks (1m window, from the step histogram).",
                [Q(sel(rec.RUN_STEP_SECONDS_P50, RUN), "p50")],
                "s",
            )
        )
        .with_panel(
            stat_panel(
                "Step time p95",
                "95th percentile step time over all ranks: far above p50 means hiccups "
                "(data stalls, checkpoints, garbage collection).",
                [Q(sel(rec.RUN_STEP_SECONDS_P95, RUN), "p95")],
                "s",
            )
        )
        .with_panel(
            stat_panel(
                "Data-loading share",
                f"Share of step time spent in {LOADING} (waiting for the next batch). Loading should be "
                f"much smaller than training time: above {DATA_BOUND.percent} the run is data bound.",
                [Q(sel(rec.RUN_DATALOADER_SHARE, RUN), "data loading")],
                "percentunit",
                steps=thresholds((None, "green"), (DATA_NOTICE.value, "yellow"), (DATA_BOUND.value, "red")),
            )
        )
        .with_panel(
            stat_panel(
                "GPU utilization (run's GPUs)",
                "The GPUs the run's ranks hold memory on, averaged over the last minute of training. NVML: the "
                f"share of time a kernel was resident; at or above {GPU_BOUND.percent} the GPUs are busy (the "
                "healthy state), below it they wait for the data or the host. SM active (GPM, Hopper and newer) "
                "and tensor cores grade how well busy GPUs are used: saturated bf16 training on an H100 or H200 read "
                f"SM active 0.67-0.90; below {BUSY_IDLE.percent} the busy GPUs do little. Empty for CPU-only runs.",
                [
                    Q(sel(rec.RUN_GPU_UTILIZATION, RUN), "NVML"),
                    Q(sel(rec.RUN_GPU_SM_ACTIVE, RUN), "SM active"),
                    Q(sel(rec.RUN_GPU_TENSOR_ACTIVE, RUN), "tensor cores"),
                ],
                "percentunit",
                steps=thresholds((None, "red"), (GPU_LOW.value, "yellow"), (GPU_BOUND.value, "green")),
            )
        )
    )
    return board


def _step_time_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "Step time" row."""
    board = board.with_row(row("Step time"))
    board = (
        board.with_panel(
            timeseries_panel(
                "Step time p50 / p95 per rank",
                "Step time quantiles of the drawn ranks (the slowest by straggler score, `Ranks drawn`) from "
                "the step histogram (1m window), and the run's over all its ranks. Ranks far above the run's "
                "are stragglers; p95 spikes are stalls.",
                [
                    Q(named_by_node_where_moved(rec.rank_step_seconds_quantile(0.5, RANKS, DRAWN_SCORED)),
                      f"{RANK_LEGEND} p50"),
                    Q(named_by_node_where_moved(rec.rank_step_seconds_quantile(0.95, RANKS, DRAWN_SCORED)),
                      f"{RANK_LEGEND} p95"),
                    Q(sel(rec.RUN_STEP_SECONDS_P50, RUN), "run p50"),
                    Q(sel(rec.RUN_STEP_SECONDS_P95, RUN), "run p95"),
                ],
                "s",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Throughput",
                "Samples per second of the run, of the drawn ranks and of its median rank (1m rate). Drops line "
                "up with stalls in the step time panel.",
                [
                    Q(sel(rec.RUN_SAMPLES_RATE, RUN), "run"),
                    Q(drawn_lines(sel(rec.RANK_SAMPLES_RATE, RANKS)), RANK_LEGEND),
                    median_rank(sel(rec.RANK_SAMPLES_RATE, RUN)),
                ],
                SAMPLES_PER_SECOND,
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Phase breakdown (seconds per step)",
                "Average seconds per step in each phase over the selected ranks, stacked: what a step is "
                f"made of. A tall {LOADING} band means data loading; {contract.TO_DEVICE_PHASE} means "
                "host-to-device copies (use pinned memory and non_blocking); "
                f"{contract.FORWARD_PHASE}/{contract.BACKWARD_PHASE}/{contract.OPTIMIZER_PHASE} is compute.",
                [
                    Q(
                        "avg by (phase) "
                        f"({sel(rec.RANK_PHASE_SECONDS_PER_STEP, RANKS)})",
                        "{{phase}}",
                    )
                ],
                "s",
                stack=True,
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Data-loading share per rank",
                f"{LOADING} seconds / step seconds of the drawn ranks and the median rank (1m). The dashed line is "
                f"the {DATA_BOUND.percent} alert threshold; the I/O-vs-compute rule of thumb wants it near 0.",
                [Q(drawn_lines(sel(rec.RANK_DATALOADER_SHARE, RANKS), DRAWN_SCORED), RANK_LEGEND),
                 median_rank(sel(rec.RANK_DATALOADER_SHARE, RUN))],
                "percentunit",
                limits=(0, 1),
                threshold_line=thresholds((None, "green"), (DATA_BOUND.value, "red")),
            )
        )
        .with_panel(
            heatmap_panel(
                "Step time distribution",
                "Histogram of the run's step times over all its ranks, per minute: one band is steady, "
                "several bands or a long tail mean periodic stalls. "
                f"Buckets are fine ({BUCKET_STEP:.0%} apart) where the run's steps fall and coarse elsewhere; "
                "only bounds every rank exports are shown.",
                [
                    Q(
                        sel(rec.RUN_STEP_SECONDS_BUCKETS, RUN),
                        "{{le}}",
                        buckets=True,
                    )
                ],
                "short",
                y_unit="s",
                width=24,
            )
        )
    )
    return board


def _ranks_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "Ranks" row."""
    board = board.with_row(row("Ranks"))
    board = (
        board.with_panel(
            table_panel(
                "Per-rank comparison",
                "One line per picked rank, sorted by the lower of its two straggler scores averaged over the time "
                "range (the figure that picks the ranks the time series and the Straggler scores bars draw: they "
                "are its first `Ranks drawn` rows, a rank not yet scored aside). Then, now (the last minute), the "
                "lower score and each (run median / the rank's; 1 typical, below "
                f"{STRAGGLER.number} a straggler) of step time and of the local phases ({LOCAL}, before the first "
                "collective), mean and p95 step time, local seconds per step, data-loading share, steps and samples "
                "per second. Under DDP/FSDP step times are equal on every rank; under DDP the local score and local "
                "seconds still show the straggler.",
                [
                    Q(lowest_score("run, rank, instance", over_range=True), table=True),
                    Q(lowest_score("run, rank, instance"), table=True),
                    Q(sel(rec.RANK_STRAGGLER_SCORE, RANKS), table=True),
                    Q(sel(rec.RANK_STRAGGLER_LOCAL_SCORE, RANKS), table=True),
                    Q(sel(rec.RANK_STEP_SECONDS_MEAN, RANKS), table=True),
                    Q(rec.rank_step_seconds_quantile(0.95, RANKS), table=True),
                    Q(sel(rec.RANK_LOCAL_SECONDS_PER_STEP, RANKS), table=True),
                    Q(sel(rec.RANK_DATALOADER_SHARE, RANKS), table=True),
                    Q(sel(rec.RANK_STEPS_RATE, RANKS), table=True),
                    Q(sel(rec.RANK_SAMPLES_RATE, RANKS), table=True),
                ],
                {
                    "Value #A": (RANGE_SCORE_COLUMN, "none"),
                    "Value #B": ("lowest score now", "none"),
                    "Value #C": ("step-time score", "none"),
                    "Value #D": ("local score", "none"),
                    "Value #E": ("mean step", "s"),
                    "Value #F": ("p95 step", "s"),
                    "Value #G": ("local per step", "s"),
                    "Value #H": ("data-loading share", "percentunit"),
                    "Value #I": ("steps/s", "none"),
                    "Value #J": ("samples/s", "none"),
                },
                sort_by=RANGE_SCORE_COLUMN,
                width=14,
            ).override_by_name("instance", NODE_LINK)
        )
        .with_panel(
            bargauge_panel(
                "Straggler scores",
                "The `Ranks drawn` scored ranks with the lowest scores, each score averaged over the time range (the "
                "figure that picks them, and the Per-rank comparison's first column; its other columns read now): a "
                "bar per rank and score, the lowest on top; a rank not yet scored has no bar. Run median / the rank's "
                "value, of mean step time (step) and of the "
                f"local phases before the first collective (local: {LOCAL}). 1 = typical; below {STRAGGLER.number} "
                "(red) the rank is a straggler and every synchronised step waits for it: check its node on "
                "the Node dashboard (a rank's node in the tables links there). Under DDP/FSDP all ranks wait for "
                "the slowest in the all-reduce, so their step scores stay at 1; under DDP the local score is the one "
                "that drops (FSDP "
                f"all-gathers parameters inside {contract.FORWARD_PHASE}, so the wait lands there and both stay "
                "near 1).",
                [Q(_score_bars(), table=True)],
                "none",
                limits=(0, 1.5),
                steps=thresholds((None, "red"), (STRAGGLER.value, "yellow"), (TYPICAL.value, "green")),
                lowest_first=True,
                width=10,
            )
        )
        .with_panel(
            state_timeline_panel(
                "Training state per rank",
                "What ranks report doing (setup, train, eval, checkpoint, idle): long checkpoint or eval bands "
                "explain throughput dips; a rank stuck in a state while others train is hung. Not a row per rank "
                "(64 to 512 rows): the `Ranks drawn` ranks that spent the most of the time range in a state other "
                "than the run's most common one at the same time (hung in a checkpoint, stuck in eval, idle), the "
                "ranks the other panels draw, and one row, \"N other ranks\", for the ranks it hides, showing the "
                "run's most common state. Where more ranks stray than `Ranks drawn`, raise it. "
                "Sampled at each push: a state shorter than the push interval may not show here; the time per "
                "state beside counts it. A rank whose requeued pod landed on another node shows its state there "
                "(the node it pushed to last), not its old pod's, which the old node keeps for 10 minutes.",
                [Q(f"{_state_expr()}\nand on (rank) {STATE_RANKS_SHOWN}", "rank {{rank}}"),
                 Q(_other_ranks_state(), "{{hidden}} other ranks")],
                value_text(
                    {str(code): (state, color) for state, (code, color) in STATES.items()}
                    | {"0": ("other", "text")}
                ),
                width=16,
            )
        )
        .with_panel(
            stat_panel(
                "Time per state",
                "Seconds the selected ranks spent in each state over the dashboard's time range, all ranks "
                "added up (rank-seconds), from the seconds per state the hooks count: every eval and checkpoint "
                f"is in, however short. The {TRAIN} share of the whole is the time the ranks trained.",
                [Q(f"sum by (state) (increase({sel(fam.STATE_SECONDS, RANKS)}{THE_RANGE}))", "{{state}}")],
                "s",
                sparkline=False,
                width=8,
                height=8,
            )
        )
        .with_panel(
            table_panel(
                "Where each rank is",
                "Per rank, the longest in its phase first: seconds since its last step, the host-timed phase it "
                "is in and for how long, and seconds since its last push. When a run stops stepping "
                "(StepscopeTrainingStalled), the rank in its phase the longest, on top, or in a different phase "
                f"from the others holds them up (a loader in {contract.DATA_LOADING_PHASE}, a hung GPU); the ranks "
                f"in {contract.BACKWARD_PHASE} wait for it in the all-reduce, and all stopped stepping together. "
                "A rank training outside every timed phase (hung in the loop's own code) reads its seconds since "
                f"its last step, in phase {BETWEEN_PHASES}. "
                "A rank whose last push is old and that did not close is lost (StepscopeRankLost).",
                [
                    Q(age(sel(fam.TRAINING_LAST_STEP, RANKS)), table=True),
                    Q(_in_its_phase(), table=True),
                    Q(age(sel(fam.TRAINING_LAST_PUSH, RANKS)), table=True),
                ],
                {
                    "Value #A": ("since last step", "s"),
                    "Value #B": (IN_ITS_PHASE_COLUMN, "s"),
                    "Value #C": ("since last push", "s"),
                },
                sort_by=IN_ITS_PHASE_COLUMN,
                descending=True,
                width=24,
            ).override_by_name("instance", NODE_LINK)
        )
    )
    return board


def _gpus_and_processes_of_this_run_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "GPUs and processes of this run" row."""
    board = board.with_row(row("GPUs and processes of this run"))
    board = (
        board.with_panel(
            timeseries_panel(
                "GPU utilization of the run's GPUs",
                "The least used of the GPUs the run's ranks hold memory on (as many as `Ranks drawn`, by effective "
                "utilization averaged over the time range; average over the last minute of training). NVML "
                f"utilization (the share of time a kernel was resident) below {GPU_BOUND.percent} for 15 minutes "
                "pages StepscopeGpuUnderutilized: the GPU waits. Effective utilization (SM active where GPM reads "
                f"it, else NVML, named in the legend) grades a busy GPU; below {BUSY_IDLE.percent} SM active on a "
                "busy GPU pages StepscopeGpuBusyButIdle (larger batch, CUDA graphs, torch.compile, fewer host syncs).",
                [
                    Q(
                        on_gpus(sel(rec.RUN_GPU_EFFECTIVE_UTILIZATION_BY_GPU, RUN), LEAST_USED_GPUS),
                        "{{instance}} GPU {{gpu}} effective ({{source}})",
                    ),
                    Q(
                        on_gpus(sel(rec.RUN_GPU_UTILIZATION_BY_GPU, RUN), LEAST_USED_GPUS),
                        "{{instance}} GPU {{gpu}} NVML",
                    ),
                ],
                "percentunit",
                limits=(0, 1),
                threshold_line=thresholds((None, "red"), (GPU_BOUND.value, "green")),
            )
        )
        .with_panel(
            stat_panel(
                "Tensor cores (run's GPUs)",
                "Hint: the least tensor-core activity among the run's GPUs (GPM, Hopper and newer; empty "
                "elsewhere). Near 0 while training means matrix multiplications run in FP32 on the CUDA "
                "cores: BF16/FP16 autocast (torch.autocast, Lightning precision=\"bf16-mixed\", transformers "
                "bf16=True) or TF32 (torch.set_float32_matmul_precision(\"high\")) puts them on the tensor "
                "cores. StepscopeTensorCoresIdle (info) fires after an hour of it.",
                [Q(f"min({sel(rec.RUN_GPU_TENSOR_ACTIVE_BY_GPU, RUN)})", "tensor cores")],
                "percentunit",
                steps=thresholds((None, "orange"), (TENSOR_IDLE.value, "green")),
                mappings=[range_text(0, TENSOR_IDLE.value, "unused: FP32 matmuls? try BF16 or TF32", "orange")],
                width=12,
                height=8,
            )
        )
        .with_panel(
            timeseries_panel(
                "PyTorch allocator memory per rank",
                "What PyTorch's caching allocator of each drawn rank does with the GPU memory it holds (pushed by the "
                "hooks on CUDA from torch.cuda.memory_stats(), summed over the rank's devices): allocated to "
                "tensors, reserved (allocated plus cached for reuse), the peak allocated since the previous push, "
                "and inactive split bytes (cached blocks too small to reuse: fragmentation). Reserved far above "
                "allocated is a full cache, not pressure; allocated near the GPU's memory is real pressure. Empty for "
                "ranks on the CPU.",
                [
                    Q(drawn_lines(sel(fam.CUDA_MEMORY_ALLOCATED, RANKS)), f"{RANK_LEGEND} allocated"),
                    Q(drawn_lines(sel(fam.CUDA_MEMORY_RESERVED, RANKS)), f"{RANK_LEGEND} reserved"),
                    Q(drawn_lines(sel(fam.CUDA_MEMORY_PEAK, RANKS)), f"{RANK_LEGEND} peak allocated"),
                    Q(drawn_lines(sel(fam.CUDA_MEMORY_INACTIVE_SPLIT, RANKS)), f"{RANK_LEGEND} inactive split"),
                ],
                "bytes",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Allocation retries and OOMs per rank",
                "PyTorch's caching allocator of each drawn rank: allocations that failed, flushed the cache and "
                "retried, and out-of-memory errors, per second over 5 minutes. Retries that keep coming page "
                "StepscopeCudaAllocRetries; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, a smaller "
                "micro-batch or activation checkpointing make room.",
                [
                    Q(drawn_lines(f"rate({sel(fam.CUDA_ALLOC_RETRIES, RANKS)}[5m])"), f"{RANK_LEGEND} retries"),
                    Q(drawn_lines(f"rate({sel(fam.CUDA_OOMS, RANKS)}[5m])"), f"{RANK_LEGEND} OOMs"),
                ],
                "ops",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "GPU memory held by each rank",
                "GPU memory each drawn rank's process holds, per GPU (from NVML's process list).",
                [
                    Q(
                        drawn(sel(rec.RANK_GPU_MEMORY, RANKS)),
                        "rank {{rank}} on {{instance}} GPU {{gpu}}",
                    )
                ],
                "bytes",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "GPU memory used of the run's GPUs",
                "Used / total memory of the GPUs the run uses (all processes on them): the fullest over the time "
                "range, as many as `Ranks drawn`. "
                f"Above {MEMORY_FULL.percent} the next allocation may fail with CUDA OOM.",
                [
                    Q(
                        on_gpus(f"{rec.GPU_MEMORY_USED_RATIO} * on (instance, gpu) group_left () {RUN_GPUS}",
                                FULLEST_GPUS),
                        "{{instance}} GPU {{gpu}}",
                    )
                ],
                "percentunit",
                limits=(0, 1),
            )
        )
        .with_panel(
            timeseries_panel(
                "Host CPU of the run's processes (cores)",
                "CPU cores used by each drawn rank's process and its data-loader workers, and the median rank's. "
                "Data-bound runs whose workers use all their cores need more cores or cheaper decoding.",
                [
                    Q(drawn(f"sum by (run, rank) (rate({sel(fam.PROCESS_CPU_SECONDS, RANKS)}[1m]))"), "rank {{rank}}"),
                    median_rank(f"sum by (run, rank) (rate({sel(fam.PROCESS_CPU_SECONDS, RUN)}[1m]))"),
                ],
                "none",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Host memory of the run's processes",
                "Resident memory of each drawn rank's process plus its data-loader workers, and the median rank's.",
                [Q(drawn(f"sum by (run, rank) ({sel(fam.PROCESS_RESIDENT_MEMORY, RANKS)})"), "rank {{rank}}"),
                 median_rank(f"sum by (run, rank) ({sel(fam.PROCESS_RESIDENT_MEMORY, RUN)})")],
                "bytes",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Data-loader workers and read throughput",
                "Live child processes (DataLoader workers) per drawn rank, and bytes they read from storage per "
                "second. Few workers with a high data-loading share: raise num_workers.",
                [
                    Q(drawn(f"sum by (run, rank) ({sel(fam.PROCESS_CHILDREN, RANKS)})"), "rank {{rank}} workers"),
                    Q(
                        drawn(f"sum by (run, rank) (rate({sel(fam.PROCESS_IO_READ, RANKS)}[1m]))"),
                        "rank {{rank}} read",
                    ),
                ],
                "none",
                limits=(0, None),
            ).override_by_regexp(".* read", [dm.DynamicConfigValue(id_val="unit", value="Bps")])
        )
    )

    board = _limits_and_traces(board)
    return board


def _where_the_time_went_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "Where the time went" row (docs/goodput.md): goodput and badput by cause, energy, the run's pace
    against its own."""
    causes = sel(rec.RUN_TIME_BY_CAUSE, RUN)
    over_range = f"sum_over_time({causes}{THE_RANGE})"
    productive = sel(rec.RUN_TIME_BY_CAUSE, f'{RUN},cause="{goodput.PRODUCTIVE}"')
    step = goodput.ACCOUNTING_STEP
    slower = contract.THRESHOLDS["slower_than_itself"]
    redone = sel(rec.RUN_STEPS_REDONE, RUN)
    board = board.with_row(row("Where the time went"))
    return (
        board.with_panel(
            stat_panel(
                "Goodput",
                "The share of the rank-seconds the run's ranks held their GPUs that went into productive training "
                f"(state {TRAIN}, less the wait for data and stalls), over the time range picked and in the last "
                "minute; the bars beside name the rest.",
                [Q(f"sum(sum_over_time({productive}{THE_RANGE})) / sum({over_range})", "over the range"),
                 Q(sel(rec.RUN_GOODPUT, RUN), "last minute")],
                "percentunit",
                width=4,
            )
        )
        .with_panel(
            bargauge_panel(
                "Where the time went (range)",
                "Each cause's share of the run's held rank-seconds over the time range: productive, data_wait "
                f"({LOADING} in {TRAIN}), stalled (no step for longer than the pace explains), setup, eval, "
                "checkpoint, idle (the hooks' state seconds) and lost (a rank that stopped pushing without closing). "
                "The report adds the restart gaps.",
                [Q(f"sum by (cause) ({over_range}) / scalar(sum({over_range}))", "{{cause}}")],
                "percentunit",
                width=8,
            )
        )
        .with_panel(
            timeseries_panel(
                "Where the time went (over time)",
                "Each cause's share of the run's rank-seconds per minute, stacked to 1.",
                [Q(sel(rec.RUN_TIME_SHARE_BY_CAUSE, RUN), "{{cause}}")],
                "percentunit",
                stack=True,
                limits=(0, 1),
            )
        )
        .with_panel(
            stat_panel(
                "Energy over the range",
                "Energy of the GPUs the run's processes held memory on (each GPU's energy counter, split equally "
                "between the runs holding it and any process the hooks do not know), summed at "
                f"{step} resolution over the time range.",
                # The range's points once each: 1 ms earlier, the point on the range's end is left out and the one
                # on its start (which Prometheus' ranges include, VictoriaMetrics' not) taken on both engines.
                [Q(f"sum(sum_over_time({sel(rec.RUN_ENERGY_RATE, RUN)}[$__range:{step}] @ end() offset 1ms))"
                   f" * {goodput.ACCOUNTING_STEP_SECONDS} / {goodput.JOULES_PER_KWH:g}", "kWh")],
                "kwatth",
                sparkline=False,
                width=3,
            )
        )
        .with_panel(
            stat_panel(
                "Energy per sample",
                "Joules per training sample now: the run's GPU watts over its samples per second (1m).",
                [Q(sel(rec.RUN_ENERGY_PER_SAMPLE, RUN), "J/sample")],
                "joule",
                width=3,
            )
        )
        .with_panel(
            stat_panel(
                "Energy per token",
                "Joules per token now, where the run counts tokens (docs/mfu.md): the run's GPU watts over its "
                "tokens per second (1m).",
                [Q(sel(rec.RUN_ENERGY_PER_TOKEN, RUN), "J/token")],
                "joule",
                width=3,
            )
        )
        .with_panel(
            stat_panel(
                "GPU power charged to the run",
                "Watts of the run's GPUs now (1m rate of their energy counters, shared GPUs split).",
                [Q(sel(rec.RUN_ENERGY_RATE, RUN), "W")],
                "watt",
                width=3,
            )
        )
        .with_panel(
            timeseries_panel(
                "Pace against its own",
                "Samples per second of training (eval and checkpoints do not lower it), tokens for a run that "
                f"counts them, its median over the past hour, and {slower.percent} of that median: below it for "
                "10 minutes, after 15 minutes of training, StepscopeRunSlowerThanItself fires.",
                [
                    Q(f"{sel(rec.RUN_TRAINING_TOKENS_RATE, RUN)} or {sel(rec.RUN_TRAINING_SAMPLES_RATE, RUN)}",
                      "per second of training"),
                    Q(f"{sel(rec.RUN_TRAINING_TOKENS_BASELINE, RUN)} or {sel(rec.RUN_TRAINING_SAMPLES_BASELINE, RUN)}",
                      "median, past hour"),
                    Q(f"{slower.number} * ({sel(rec.RUN_TRAINING_TOKENS_BASELINE, RUN)} or "
                      f"{sel(rec.RUN_TRAINING_SAMPLES_BASELINE, RUN)})", "alert below"),
                ],
                "suffix: /s",
                limits=(0, None),
            )
        )
        .with_panel(
            stat_panel(
                "Steps redone after a restore (range)",
                "Lost progress: the most global steps the run had to do again after restoring a checkpoint in the "
                "time range (where the loop passes its global step): where it was less where it restarted from. "
                "Their time counts as productive here; the report moves it to lost_progress.",
                [Q(f"max(max_over_time({redone}{THE_RANGE}))", "steps")],
                "none",
                sparkline=False,
                width=6,
            )
        )
        .with_panel(
            timeseries_panel(
                "Steps being redone",
                "The global steps lost at the restore the run is catching up from, held until it is back where it "
                "was (0 otherwise): each restore shows as a plateau of its size.",
                [Q(redone, "{{run}}")],
                "none",
                width=18,
                limits=(0, None),
            )
        )
    )

def _alerts_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "Alerts" row."""
    board = board.with_row(row("Alerts"))
    board = board.with_panel(
        alert_list_panel(
            "Firing alerts",
            "stepscope alerts that are firing or pending now (Grafana-managed rules "
            "provisioned from the Prometheus rules file).",
        )
    )
    return board


def build() -> dashboard.Dashboard:
    board = (
        base_dashboard(
            "stepscope / Training run", UID, ["stepscope", "training"],
            "Why is this training run slow: step time, phases, data loading, ranks, GPUs.",
        )
        .with_variable(
            query_variable(
                "run",
                "Run",
                VARIABLE_SOURCE,
                "run",
                description="training run (the `run` label set by the hooks)",
            )
        )
        .with_variable(
            query_variable(
                "rank",
                "Rank",
                sel(VARIABLE_SOURCE, RUN),
                "rank",
                multi=True,
                description="global ranks of the run",
            )
        )
        .with_variable(
            custom_variable(
                "ranks_drawn",
                "Ranks drawn",
                DRAWN_CHOICES,
                description="how many of the picked ranks the per-rank time series draw: those with the lowest "
                "straggler score over the time range, beside the run's median rank; and how many of the run's GPUs "
                "the per-GPU ones draw (the least used, the fullest)",
            )
        )
    )
    for add_row in (_overview_row, _throughput_row, _where_the_time_went_row, _step_time_row, _ranks_row,
                    _gpus_and_processes_of_this_run_row, _alerts_row):
        board = add_row(board)
    return board
def _limits_and_traces(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The loader and compute limits (tracker.measure_limits) next to the real throughput, and the
    ranks' latest profiler traces (stepscope-profile)."""
    limits = [
        Q(sel(rec.RUN_LOADER_LIMIT, RUN), "loader can deliver"),
        Q(sel(rec.RUN_COMPUTE_LIMIT, RUN), "training consumes"),
        Q(sel(rec.RUN_SAMPLES_OF_MEASURED_RANKS, RUN), "run gets"),
    ]
    board = board.with_row(row("Limits and profiler traces"))
    return (
        board.with_panel(
            stat_panel(
                "Limits verdict",
                "From tracker.measure_limits (the loader alone, the training step alone on one cached batch) "
                f"against the samples/s the measured ranks really get. {verdict.LOADER_BOUND}: the loader delivers "
                "fewer samples/s than the step consumes, so the run can go no faster than its loader (more workers, "
                f"pinned memory, pre-decoded or cached data, sequential reads). {verdict.COMPUTE_BOUND}: the loader "
                f"keeps up and the run gets at least {COMPUTE_SHARE.percent} of the compute limit. "
                f"{verdict.BELOW_LIMITS}: the loader "
                f"keeps up, yet the run gets less than {COMPUTE_SHARE.percent} of the compute limit: "
                "loading not overlapped with compute (num_workers=0), host syncs, logging, eval or communication. "
                "Empty until a rank measures.",
                [Q(sel(rec.RUN_LIMITS_VERDICT, RUN), "{{verdict}}")],
                "none",
                show_name=True,
                width=6,
            )
        )
        .with_panel(
            stat_panel(
                "Loader can deliver / training consumes / run gets",
                "The loader limit and the compute limit summed over the ranks that measured them, and the "
                "samples/s those ranks really get (1m rate). The loader must deliver more than training "
                "consumes; the run gets at most the smaller of the two.",
                limits,
                SAMPLES_PER_SECOND,
                show_name=True,
                width=18,
            )
        )
        .with_panel(
            timeseries_panel(
                "Limits next to the real throughput",
                "Loader limit and compute limit (summed over the ranks that measured them, stepping when a rank "
                "measures again), the samples/s those ranks get, and the whole run's. A run line far below "
                "both limits loses its time outside loading and the training step.",
                [*limits, Q(sel(rec.RUN_SAMPLES_RATE, RUN), "whole run")],
                SAMPLES_PER_SECOND,
                limits=(0, None),
            )
        )
        .with_panel(
            table_panel(
                "Limits per rank",
                "Each rank's loader and compute limits, their ratio (below 1 the loader cannot feed the step: "
                "StepscopeLoaderBelowCompute) and the samples/s it gets.",
                [
                    Q(f"sum by (run, rank, instance) ({sel(fam.LOADER_LIMIT, RANKS)})",
                      table=True),
                    Q(f"sum by (run, rank, instance) ({sel(fam.COMPUTE_LIMIT, RANKS)})",
                      table=True),
                    Q(sel(rec.RANK_LOADER_COMPUTE_RATIO, RANKS), table=True),
                    Q(sel(rec.RANK_SAMPLES_RATE, RANKS), table=True),
                ],
                {
                    "Value #A": ("loader limit", SAMPLES_PER_SECOND),
                    "Value #B": ("compute limit", SAMPLES_PER_SECOND),
                    "Value #C": ("loader / compute", "none"),
                    "Value #D": ("gets", SAMPLES_PER_SECOND),
                },
                width=12,
            )
        )
        .with_panel(
            table_panel(
                "Profiler traces (stepscope-profile)",
                "Each rank's latest PyTorch profiler trace, taken on request with `stepscope-profile --run RUN "
                "--rank K` (or --all-ranks): a gzipped Chrome trace on the rank's node at path (open it in "
                "ui.perfetto.dev, chrome://tracing or TensorBoard), its size, the steps it holds and when it "
                "was written.",
                [
                    Q(sel(fam.TRACE_BYTES, RANKS), table=True),
                    Q(sel(fam.TRACE_STEPS, RANKS), table=True),
                    Q(f"{sel(fam.TRACE_TIMESTAMP, RANKS)} * 1000", table=True),
                ],
                {
                    "Value #A": ("size", "bytes"),
                    "Value #B": ("steps", "none"),
                    "Value #C": ("written", "dateTimeAsIso"),
                },
                width=24,
            )
        )
    )


def _throughput_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """Tokens/s and model FLOPs utilization (docs/mfu.md), beside the verdict: how much of the hardware the
    run gets. Empty until the run states its FLOPs or tokens."""
    flops_words = ("the FLOPs the model needs per step (stated with flops_per_step=, counted once with "
                   "tracker.measure_flops, or from the framework) times steps per second")
    board = board.with_row(row("Throughput and MFU"))
    return (
        board.with_panel(
            stat_panel(
                "MFU",
                f"Model FLOPs utilization: {flops_words}, over the dense peak FLOP/s of the run's GPUs for the "
                "dtype stated (flops_dtype, bf16 by default), from the table in stepscope.contract.peak_flops by "
                "the GPU's NVML name or the peak a rank states (peak_flops=). Empty for a GPU not in the table "
                "rather than a guess.",
                [Q(sel(rec.RUN_MFU, RUN), "MFU")],
                "percentunit",
                width=6,
            )
        )
        .with_panel(
            stat_panel(
                "Tokens/s",
                "Tokens per second over all ranks (1m rate), as the loop counts them (step(tokens=)) or the "
                "framework does.",
                [Q(sel(rec.RUN_TOKENS_RATE, RUN), "tokens/s")],
                "suffix: tokens/s",
                width=6,
            )
        )
        .with_panel(
            stat_panel(
                "Model FLOP/s",
                f"Achieved model FLOP/s over all ranks: {flops_words}.",
                [Q(sel(rec.RUN_MODEL_FLOPS_RATE, RUN), "achieved")],
                "flops",
                width=6,
            )
        )
        .with_panel(
            stat_panel(
                "Peak FLOP/s of the run's GPUs",
                "The dense peak FLOP/s MFU divides by: the GPU of each rank that counts FLOPs (the one it holds "
                "the most memory on), for the stated dtype, summed.",
                [Q(sel(rec.RUN_PEAK_FLOPS, RUN), "peak")],
                "flops",
                width=6,
            )
        )
        .with_panel(
            timeseries_panel(
                "MFU per rank, and tensor-core activity",
                "The drawn ranks' model FLOP/s over their GPU's peak, the run's, and the tensor-core activity of the "
                "run's GPUs (GPM, Hopper and newer). On an H100, bf16 training read an MFU of 0.88-0.97 of its "
                "tensor activity; a GPU-bound run far below it for an hour is StepscopeMfuBelowTensorActivity.",
                [
                    Q(drawn_lines(sel(rec.RANK_MFU, RANKS)), RANK_LEGEND),
                    Q(sel(rec.RUN_MFU, RUN), "run"),
                    Q(sel(rec.RUN_GPU_TENSOR_ACTIVE, RUN), "tensor cores active"),
                ],
                "percentunit",
                limits=(0, 1),
                width=12,
            )
        )
        .with_panel(
            timeseries_panel(
                "Tokens/s and samples/s per rank",
                "The drawn ranks' tokens and samples per second (1m rate).",
                [
                    Q(drawn_lines(sel(rec.RANK_TOKENS_RATE, RANKS)), f"{RANK_LEGEND} tokens/s"),
                    Q(drawn_lines(sel(rec.RANK_SAMPLES_RATE, RANKS)), f"{RANK_LEGEND} samples/s"),
                ],
                "short",
                limits=(0, None),
                width=12,
            )
        )
    )

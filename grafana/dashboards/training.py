"""Training run dashboard: is this run fast, what is each step made of, and which rank holds it up."""

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models import dashboard as dm

from grafana.dashboards.panels import (
    SAMPLES_PER_SECOND,
    Q,
    alert_list_panel,
    bargauge_panel,
    base_dashboard,
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

UID = "stepscope-training"
RUN = 'run=~"$run"'
RANKS = 'run=~"$run",rank=~"$rank"'


def rank_step_quantile(quantile: float) -> str:
    """A step-time quantile per rank of the chosen runs, at query time: recorded for every rank of a
    cluster it would re-read every step-time bucket each evaluation (benchmarks/results/scale.md), while
    a dashboard reads one run's. No value for a rank without steps in the window (NaN, dropped)."""
    buckets = f"rate(stepscope_step_seconds_bucket{{{RANKS}}}[1m])"
    return f"histogram_quantile({quantile}, sum by (run, rank, instance, le) ({buckets})) >= 0"

# State set -> one code per rank, so the state timeline shows one row per rank; state -> (code, colour).
STATES = {"setup": (1, "blue"), "train": (2, "green"), "eval": (3, "purple"), "checkpoint": (4, "orange"),
          "idle": (5, "text")}


def _state_expr() -> str:
    selector = f"stepscope_training_state{{{RANKS}"
    known = "|".join(STATES)
    parts = [f'(({selector},state="{state}"}} == 1) * {code})' for state, (code, _) in STATES.items()]
    parts.append(f'(({selector},state!~"{known}"}} == 1) * 0)')
    return "max by (rank) (\n  " + "\n  or ".join(parts) + "\n)"


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
                "stepscope_steps_total",
                "run",
                description="training run (the `run` label set by the hooks)",
            )
        )
        .with_variable(
            query_variable(
                "rank",
                "Rank",
                f"stepscope_steps_total{{{RUN}}}",
                "rank",
                multi=True,
                description="global ranks of the run",
            )
        )
    )

    board = board.with_row(row("Overview"))
    board = (
        board.with_panel(
            stat_panel(
                "Bottleneck verdict",
                "What limits the run now. data_bound: waiting for batches takes > 30% of step time. "
                "gpu_bound: its GPUs' effective utilization (SM active on Hopper and newer, NVML utilization "
                "elsewhere) is >= 80% (good: buy faster GPUs or optimise kernels). gpu_busy_idle: its GPUs run "
                "kernels >= 80% of the time but their SMs are active < 50%: kernels too small or a "
                "launch-bound loop (larger batch, CUDA graphs, torch.compile, fewer host syncs). host_bound: "
                "none of these, the time goes to host work (Python, copies, communication, CPU-only compute). "
                "idle: no step in the last minute, or no rank in state train.",
                [Q(f"run:stepscope_bottleneck:verdict{{{RUN}}}", "{{verdict}}")],
                "none",
                show_name=True,
            )
        )
        .with_panel(
            stat_panel(
                "Throughput",
                "Samples per second over all ranks of the run (1m rate).",
                [Q(f"run:stepscope_samples:rate1m{{{RUN}}}", "samples/s")],
                SAMPLES_PER_SECOND,
            )
        )
        .with_panel(
            stat_panel(
                "Step time p50",
                "Median step time over all ranks (1m window, from the step histogram).",
                [Q(f"run:stepscope_step_seconds:p50_rate1m{{{RUN}}}", "p50")],
                "s",
            )
        )
        .with_panel(
            stat_panel(
                "Step time p95",
                "95th percentile step time over all ranks: far above p50 means hiccups "
                "(data stalls, checkpoints, garbage collection).",
                [Q(f"run:stepscope_step_seconds:p95_rate1m{{{RUN}}}", "p95")],
                "s",
            )
        )
        .with_panel(
            stat_panel(
                "Data-loading share",
                "Share of step time spent in dataloader_next (waiting for the next batch). Loading should be "
                "much smaller than training time: above 30% the run is data bound.",
                [Q(f"run:stepscope_dataloader_share:ratio_rate1m{{{RUN}}}", "data loading")],
                "percentunit",
                steps=thresholds((None, "green"), (0.1, "yellow"), (0.3, "red")),
            )
        )
        .with_panel(
            stat_panel(
                "GPU utilization (run's GPUs)",
                "Average utilization of the GPUs the run's ranks hold memory on. effective: SM active where "
                "GPM reads it (Hopper and newer), NVML utilization elsewhere; below 80% the GPUs wait for "
                "the host or the data, or do little. NVML: the share of time a kernel was resident, however "
                "few SMs it used; high NVML with low effective is a GPU that looks busy but does little. "
                "Empty for CPU-only runs.",
                [
                    Q(f"run:stepscope_gpu_effective_utilization:avg_ratio{{{RUN}}}", "effective"),
                    Q(f"run:stepscope_gpu_utilization:avg_ratio{{{RUN}}}", "NVML"),
                ],
                "percentunit",
                steps=thresholds((None, "red"), (0.5, "yellow"), (0.8, "green")),
            )
        )
    )

    board = board.with_row(row("Step time"))
    board = (
        board.with_panel(
            timeseries_panel(
                "Step time p50 / p95 per rank",
                "Step time quantiles per rank from the step histogram (1m window). Ranks far above the "
                "others are stragglers; p95 spikes are stalls.",
                [
                    Q(rank_step_quantile(0.5), "rank {{rank}} p50"),
                    Q(rank_step_quantile(0.95), "rank {{rank}} p95"),
                ],
                "s",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Throughput",
                "Samples per second of the run and of each rank (1m rate). Drops line up with "
                "stalls in the step time panel.",
                [
                    Q(f"run:stepscope_samples:rate1m{{{RUN}}}", "run"),
                    Q(f"run_rank:stepscope_samples:rate1m{{{RANKS}}}", "rank {{rank}}"),
                ],
                SAMPLES_PER_SECOND,
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Phase breakdown (seconds per step)",
                "Average seconds per step in each phase over the selected ranks, stacked: what a step is "
                "made of. A tall dataloader_next band means data loading; to_device means host-to-device "
                "copies (use pinned memory and non_blocking); forward/backward/optimizer_step is compute.",
                [
                    Q(
                        "avg by (phase) "
                        f"(run_rank_phase:stepscope_step_phase_seconds:per_step_rate1m{{{RANKS}}})",
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
                "dataloader_next seconds / step seconds per rank (1m). The dashed line is the 30% alert "
                "threshold; the I/O-vs-compute rule of thumb wants it near 0.",
                [Q(f"run_rank:stepscope_dataloader_share:ratio_rate1m{{{RANKS}}}", "rank {{rank}}")],
                "percentunit",
                limits=(0, 1),
                threshold_line=thresholds((None, "green"), (0.3, "red")),
            )
        )
        .with_panel(
            heatmap_panel(
                "Step time distribution",
                "Histogram of the run's step times over all its ranks, per minute: one band is steady, "
                "several bands or a long tail mean periodic stalls. Buckets are fine (9% apart) where the "
                "run's steps fall and coarse elsewhere; only bounds every rank exports are shown.",
                [
                    Q(
                        f"run_le:stepscope_step_seconds_bucket:rate1m{{{RUN}}}",
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

    board = board.with_row(row("Ranks"))
    board = (
        board.with_panel(
            table_panel(
                "Per-rank comparison",
                "One line per rank: the two straggler scores (run median / the rank's; 1 typical, below "
                "0.75 a straggler) of step time and of the local phases (dataloader_next + to_device + "
                "forward, before the first collective), mean and p95 step time, local seconds per step, "
                "data-loading share, steps and samples per second. Under DDP/FSDP step times are equal on "
                "every rank; under DDP the local score and local seconds still show the straggler.",
                [
                    Q(f"run_rank:stepscope_straggler_score:ratio{{{RANKS}}}", table=True),
                    Q(f"run_rank:stepscope_straggler_local_score:ratio{{{RANKS}}}", table=True),
                    Q(f"run_rank:stepscope_step_seconds:mean_rate1m{{{RANKS}}}", table=True),
                    Q(rank_step_quantile(0.95), table=True),
                    Q(f"run_rank:stepscope_step_local_seconds:per_step_rate1m{{{RANKS}}}", table=True),
                    Q(f"run_rank:stepscope_dataloader_share:ratio_rate1m{{{RANKS}}}", table=True),
                    Q(f"run_rank:stepscope_steps:rate1m{{{RANKS}}}", table=True),
                    Q(f"run_rank:stepscope_samples:rate1m{{{RANKS}}}", table=True),
                ],
                {
                    "Value #A": ("step-time score", "none"),
                    "Value #B": ("local score", "none"),
                    "Value #C": ("mean step", "s"),
                    "Value #D": ("p95 step", "s"),
                    "Value #E": ("local per step", "s"),
                    "Value #F": ("data-loading share", "percentunit"),
                    "Value #G": ("steps/s", "none"),
                    "Value #H": ("samples/s", "none"),
                },
                width=14,
            )
        )
        .with_panel(
            bargauge_panel(
                "Straggler scores",
                "Run median / the rank's value, of mean step time (step) and of the local phases before the "
                "first collective (local: dataloader_next + to_device + forward). 1 = typical; below 0.75 "
                "(red) the rank is a straggler and every synchronised step waits for it: check its node on "
                "the Node dashboard. Under DDP/FSDP all ranks wait for the slowest in the all-reduce, so "
                "their step scores stay at 1; under DDP the local score is the one that drops (FSDP "
                "all-gathers parameters inside forward, so the wait lands there and both stay near 1).",
                [
                    Q(f"run_rank:stepscope_straggler_score:ratio{{{RANKS}}}", "rank {{rank}} step ({{instance}})"),
                    Q(
                        f"run_rank:stepscope_straggler_local_score:ratio{{{RANKS}}}",
                        "rank {{rank}} local ({{instance}})",
                    ),
                ],
                "none",
                limits=(0, 1.5),
                steps=thresholds((None, "red"), (0.75, "yellow"), (0.9, "green")),
                width=10,
            )
        )
        .with_panel(
            state_timeline_panel(
                "Training state per rank",
                "What each rank reports doing (setup, train, eval, checkpoint, idle): long checkpoint or "
                "eval bands explain throughput dips; a rank stuck in a state while others train is hung.",
                [Q(_state_expr(), "rank {{rank}}")],
                value_text(
                    {str(code): (state, color) for state, (code, color) in STATES.items()}
                    | {"0": ("other", "text")}
                ),
            )
        )
    )

    board = board.with_row(row("GPUs and processes of this run"))
    board = (
        board.with_panel(
            timeseries_panel(
                "GPU utilization of the run's GPUs",
                "Every GPU the run's ranks hold memory on (1m average). Effective utilization (SM active "
                "where GPM reads it, else NVML utilization, named in the legend) below 80% SM active or 90% "
                "NVML for 15 minutes pages StepscopeGpuUnderutilized. The NVML line is the share of time a "
                "kernel was resident: far above the effective line, the GPU looks busy but does little "
                "(StepscopeGpuBusyButIdle: larger batch, CUDA graphs, torch.compile, fewer host syncs).",
                [
                    Q(
                        f"instance_gpu_run:stepscope_gpu_effective_utilization:avg_ratio{{{RUN}}}",
                        "{{instance}} GPU {{gpu}} effective ({{source}})",
                    ),
                    Q(
                        f"instance_gpu_run:stepscope_gpu_utilization:avg_ratio{{{RUN}}}",
                        "{{instance}} GPU {{gpu}} NVML",
                    ),
                ],
                "percentunit",
                limits=(0, 1),
                threshold_line=thresholds((None, "red"), (0.8, "green")),
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
                [Q(f"min(instance_gpu_run:stepscope_gpu_tensor_active:avg_ratio{{{RUN}}})", "tensor cores")],
                "percentunit",
                steps=thresholds((None, "orange"), (0.01, "green")),
                mappings=[range_text(0, 0.01, "unused: FP32 matmuls? try BF16 or TF32", "orange")],
                width=12,
                height=8,
            )
        )
        .with_panel(
            timeseries_panel(
                "GPU memory held by each rank",
                "GPU memory each rank's process holds, per GPU (from NVML's process list).",
                [
                    Q(
                        f"instance_gpu_run_rank:stepscope_process_gpu_memory_bytes:sum{{{RANKS}}}",
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
                "Used / total memory of the GPUs the run uses (all processes on them). Above 95% the next "
                "allocation may fail with CUDA OOM.",
                [
                    Q(
                        "instance_gpu:stepscope_gpu_memory_used:ratio * on (instance, gpu) group_left ()"
                        " group by (instance, gpu)"
                        f" (instance_gpu_run_rank:stepscope_process_gpu_memory_bytes:sum{{{RUN}}} > 0)",
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
                "CPU cores used by each rank's process and its data-loader workers. Data-bound runs whose "
                "workers use all their cores need more cores or cheaper decoding.",
                [
                    Q(
                        f"sum by (rank) (rate(stepscope_process_cpu_seconds_total{{{RANKS}}}[1m]))",
                        "rank {{rank}}",
                    )
                ],
                "none",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Host memory of the run's processes",
                "Resident memory of each rank's process plus its data-loader workers.",
                [Q(f"sum by (rank) (stepscope_process_resident_memory_bytes{{{RANKS}}})", "rank {{rank}}")],
                "bytes",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Data-loader workers and read throughput",
                "Live child processes (DataLoader workers) per rank, and bytes they read from storage per "
                "second. Few workers with a high data-loading share: raise num_workers.",
                [
                    Q(f"sum by (rank) (stepscope_process_children{{{RANKS}}})", "rank {{rank}} workers"),
                    Q(
                        f"sum by (rank) (rate(stepscope_process_io_read_bytes_total{{{RANKS}}}[1m]))",
                        "rank {{rank}} read",
                    ),
                ],
                "none",
                limits=(0, None),
            ).override_by_regexp(".* read", [dm.DynamicConfigValue(id_val="unit", value="Bps")])
        )
    )

    board = _limits_and_traces(board)

    board = board.with_row(row("Alerts"))
    return board.with_panel(
        alert_list_panel(
            "Firing alerts",
            "stepscope alerts that are firing or pending now (Grafana-managed rules "
            "provisioned from the Prometheus rules file).",
        )
    )


def _limits_and_traces(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The loader and compute limits (tracker.measure_limits) next to the real throughput, and the
    ranks' latest profiler traces (stepscope-profile)."""
    limits = [
        Q(f"run:stepscope_loader_limit_samples_per_second:sum{{{RUN}}}", "loader can deliver"),
        Q(f"run:stepscope_compute_limit_samples_per_second:sum{{{RUN}}}", "training consumes"),
        Q(f"run:stepscope_samples_of_measured_ranks:rate1m{{{RUN}}}", "run gets"),
    ]
    board = board.with_row(row("Limits and profiler traces"))
    return (
        board.with_panel(
            stat_panel(
                "Limits verdict",
                "From tracker.measure_limits (the loader alone, the training step alone on one cached batch) "
                "against the samples/s the measured ranks really get. loader_bound: the loader delivers fewer "
                "samples/s than the step consumes, so the run can go no faster than its loader (more workers, "
                "pinned memory, pre-decoded or cached data, sequential reads). compute_bound: the loader keeps up "
                "and the run gets at least 80% of the compute limit. below_limits: the loader keeps up, yet the "
                "run gets less than 80% of the compute limit: loading not overlapped with compute "
                "(num_workers=0), host syncs, logging, eval or communication. Empty until a rank measures.",
                [Q(f"run:stepscope_limits:verdict{{{RUN}}}", "{{verdict}}")],
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
                [*limits, Q(f"run:stepscope_samples:rate1m{{{RUN}}}", "whole run")],
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
                    Q(f"sum by (run, rank, instance) (stepscope_loader_limit_samples_per_second{{{RANKS}}})",
                      table=True),
                    Q(f"sum by (run, rank, instance) (stepscope_compute_limit_samples_per_second{{{RANKS}}})",
                      table=True),
                    Q(f"run_rank:stepscope_loader_compute_limit:ratio{{{RANKS}}}", table=True),
                    Q(f"run_rank:stepscope_samples:rate1m{{{RANKS}}}", table=True),
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
                    Q(f"stepscope_profile_trace_bytes{{{RANKS}}}", table=True),
                    Q(f"stepscope_profile_trace_steps{{{RANKS}}}", table=True),
                    Q(f"stepscope_profile_trace_timestamp_seconds{{{RANKS}}} * 1000", table=True),
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

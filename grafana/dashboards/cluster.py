"""Cluster dashboard: all agents side by side, to spot idle GPUs and uneven work across nodes and ranks."""

from grafana_foundation_sdk.builders import dashboard

import stepscope.contract as contract
from grafana.dashboards import node, training
from grafana.dashboards.panels import (
    SAMPLES_PER_SECOND,
    Q,
    alert_list_panel,
    bargauge_panel,
    base_dashboard,
    custom_variable,
    data_link,
    heatmap_panel,
    row,
    stat_panel,
    table_panel,
    thresholds,
    timeseries_panel,
)
from stepscope.contract import families as fam
from stepscope.contract import goodput
from stepscope.contract import recordings as rec

UID = "stepscope-cluster"
IDLE = contract.THRESHOLDS["idle_gpu_utilization"]
SKEW = contract.THRESHOLDS["rank_skew"]
IDLE_GPU = f"({rec.GPU_UTILIZATION} < {IDLE.number}) unless on (instance, gpu) {rec.GPU_EFFECTIVE_UTILIZATION_IN_RUN}"
STEP = goodput.ACCOUNTING_STEP
HELD_IDLE_HOURS = (f"sum by (instance, run) (count_over_time({rec.GPU_HELD_IDLE}[$__range:{STEP}]))"
                   f" * {goodput.ACCOUNTING_STEP_SECONDS} / 3600")
# Each GPU's up (1) or down (0) from its node's GPU source: stepscope's family, else dcgm-exporter's fill-in
# (recorded from dcgm-exporter's fields alone), as the Node dashboard's "GPUs up" reads it.
GPUS_UP = f"{fam.GPU_UP} or on (instance, gpu) {rec.GPU_DCGM_UP}"
# The namespace of the pod the kubelet gave each GPU to, by node and GPU index. Read through the GPU source layer,
# not stepscope_gpu_info, which a node whose GPUs come from dcgm-exporter lacks (its GPU collector is off): the
# exporter's pod attribution joined to the GPU's UUID, else the pod labels dcgm-exporter puts on its readings.
GPU_NAMESPACE = (
    f"max by (instance, gpu, namespace) ({fam.GPU_POD_INFO} * on (instance, uuid) group_left (gpu) "
    f"group by (instance, gpu, uuid) ({rec.GPU_SOURCE_MEMORY_USED}))"
    f' or on (instance, gpu) max by (instance, gpu, namespace) ({rec.GPU_SOURCE_MEMORY_USED}{{namespace!=""}})')
# Each node's GPUs, from either GPU source (stepscope's collector or dcgm-exporter).
GPUS_PER_NODE = f"count by (instance) ({rec.GPU_SOURCE_NAME})"
HELD_IDLE_HOURS_BY_NAMESPACE = (
    f"sum by (namespace) (count_over_time(({rec.GPU_HELD_IDLE} * on (instance, gpu) group_left (namespace) "
    f"{GPU_NAMESPACE})[$__range:{STEP}])) * {goodput.ACCOUNTING_STEP_SECONDS} / 3600")
# The nodes a per-node time series or bar draws: a line per node was 32 lines at 32 nodes (a legend of 32 names, one
# colour each) and the node that holds a run back one of them. `$nodes_drawn` of them, the least used or the busiest
# (averaged over the time range and taken at its end, so one set of nodes is drawn across the panel), beside the
# cluster's median node.
NODES_DRAWN_CHOICES = {"5": 5, "10": 10, "20": 20, "all": 1_000_000}


def over_the_range(per_node: str) -> str:
    """`per_node` averaged over the dashboard's time range, taken at its end (one figure at every step)."""
    return f"avg_over_time({per_node}[$__range] @ end())"


def lowest_nodes(per_node: str, ranked_by: str = "") -> str:
    """`per_node` (a vector with an `instance` label) of the `$nodes_drawn` nodes lowest over the time range:
    `per_node` averaged over it, or `ranked_by` where `per_node` is not a selector."""
    return f"{per_node} and on (instance) bottomk($nodes_drawn, {ranked_by or over_the_range(per_node)})"


def gpus_of_nodes_with_the_least_used_gpu(per_gpu: str) -> str:
    """`per_gpu` (a selector with `instance` and `gpu`) of the `$nodes_drawn` nodes whose least used GPU, averaged
    over the time range, is lowest: a node with one sick GPU among busy ones is drawn, every GPU of it beside it."""
    return f"{per_gpu} and on (instance) bottomk($nodes_drawn, min by (instance) ({over_the_range(per_gpu)}))"


def highest_nodes(per_node: str) -> str:
    """`per_node` (a selector with an `instance` label) of the `$nodes_drawn` nodes highest over the time range."""
    return f"{per_node} and on (instance) topk($nodes_drawn, {over_the_range(per_node)})"


def median_node(per_node: str) -> Q:
    """The cluster's typical node: the median over all nodes of `per_node` (the line a drawn node is compared with)."""
    return Q(f"quantile(0.5, {per_node})", "median node")


NODE_SAMPLES_RATE = f"sum by (instance) ({rec.RANK_SAMPLES_RATE})"
NODE_SAMPLES_RATE_OVER_THE_RANGE = f"sum by (instance) ({over_the_range(rec.RANK_SAMPLES_RATE)})"
UTILIZATION = thresholds(
    (None, "red"),
    (contract.THRESHOLDS["utilization_low"].value, "yellow"),
    (contract.THRESHOLDS["gpu_bound_utilization"].value, "green"),
)


def _fleet_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "Fleet" row."""
    board = board.with_row(row("Fleet"))
    board = (
        board.with_panel(
            stat_panel(
                "Nodes",
                "stepscope exporters Prometheus scrapes.",
                [Q(f"count({fam.BUILD_INFO})", "nodes")],
                "none",
            )
        )
        .with_panel(
            stat_panel(
                "GPUs",
                "GPUs answering across all nodes: stepscope's GPU collector (NVML), or dcgm-exporter where a "
                "node's GPUs come from it (docs/cluster.md).",
                [Q(f"sum({GPUS_UP})", "GPUs")],
                "none",
            )
        )
        .with_panel(
            stat_panel(
                "Idle GPUs",
                f"GPUs below {IDLE.percent} utilization that no run holds memory on: capacity nobody uses.",
                [Q(f"count({IDLE_GPU}) or vector(0)", "idle GPUs")],
                "none",
                steps=thresholds((None, "green"), (1, "yellow")),
            )
        )
        .with_panel(
            stat_panel(
                "Active runs",
                "Runs that completed a step in the last minute.",
                [Q(f"count({rec.RUN_STEPS_RATE} > 0) or vector(0)", "runs")],
                "none",
            )
        )
        .with_panel(
            stat_panel(
                "GPU utilization in runs",
                "Average effective utilization of the GPUs that runs hold memory on, over the whole cluster: "
                "SM active where GPM reads it (Hopper and newer), NVML utilization elsewhere.",
                [Q(f"avg({rec.GPU_EFFECTIVE_UTILIZATION_IN_RUN})", "in runs")],
                "percentunit",
                steps=UTILIZATION,
            )
        )
        .with_panel(
            stat_panel(
                "Cluster throughput",
                "Samples per second over all runs.",
                [Q(f"sum({rec.RUN_SAMPLES_RATE})", "samples/s")],
                SAMPLES_PER_SECOND,
            )
        )
    )
    return board


def _gpus_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "GPUs" row."""
    board = board.with_row(row("GPUs"))
    board = (
        board.with_panel(
            heatmap_panel(
                "GPU utilization, node x GPU",
                "One row per GPU (node and index) of the `Nodes drawn` nodes whose least used GPU is lowest over "
                "the time range, colour = effective utilization (1m average: SM active where GPM reads it, NVML "
                "utilization elsewhere): dark rows are idle, starved or busy-but-idle GPUs, a single dark row in "
                "a busy run is a sick GPU or a straggler. Idle GPUs lists every idle GPU of the fleet.",
                [
                    Q(
                        gpus_of_nodes_with_the_least_used_gpu(rec.GPU_EFFECTIVE_UTILIZATION),
                        "{{instance}} GPU {{gpu}} ({{source}})",
                    )
                ],
                "percentunit",
                width=24,
                height=12,
            )
        )
        .with_panel(
            table_panel(
                "Idle GPUs",
                f"GPUs below {IDLE.percent} NVML utilization (no kernel ran) with no run on them (empty when "
                "every GPU is in use).",
                [Q(IDLE_GPU, table=True)],
                {"Value": ("utilization", "percentunit")},
                width=12,
            )
        )
        .with_panel(
            table_panel(
                "GPU-hours held but idle",
                f"GPU-hours over the time range during which a process held memory on a GPU below {IDLE.percent} NVML "
                f"utilization (1m average), per node and holding run (empty: a process the hooks did not register), "
                f"counted at {STEP} resolution. A GPU held idle for 30 minutes pages StepscopeGpuHeldIdle.",
                [Q(HELD_IDLE_HOURS, table=True)],
                {"Value": ("GPU-hours", "h")},
                width=12,
            )
        )
        .with_panel(
            table_panel(
                "GPU-hours held but idle per namespace",
                "The same GPU-hours per Kubernetes namespace: the namespace of the pod the kubelet gave the GPU to "
                "(pod attribution: the exporter's --kubelet-pod-resources-socket). Empty without it.",
                [Q(HELD_IDLE_HOURS_BY_NAMESPACE, table=True)],
                {"Value": ("GPU-hours", "h")},
                width=12,
            )
        )
        .with_panel(
            bargauge_panel(
                "GPU utilization per node",
                "Average effective utilization of all GPUs of a node, averaged over the time range: the "
                "`Nodes drawn` least used nodes, the least used on top.",
                [Q(f"bottomk($nodes_drawn, {over_the_range(rec.NODE_GPU_EFFECTIVE_UTILIZATION)})", table=True)],
                "percentunit",
                steps=UTILIZATION,
                lowest_first=True,
            )
        )
    )
    return board


def _skew_across_nodes_and_ranks_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "Skew across nodes and ranks" row."""
    board = board.with_row(row("Skew across nodes and ranks"))
    board = (
        board.with_panel(
            timeseries_panel(
                "GPU utilization in runs per node",
                "Average effective utilization of the GPUs runs use, per node: the `Nodes drawn` least used over "
                "the time range, beside the median node. Nodes of the same run should sit together; a lower line "
                "is where the run loses time.",
                [Q(lowest_nodes(rec.NODE_GPU_EFFECTIVE_UTILIZATION_IN_RUN), "{{instance}}"),
                 median_node(rec.NODE_GPU_EFFECTIVE_UTILIZATION_IN_RUN)],
                "percentunit",
                limits=(0, 1),
            )
        )
        .with_panel(
            timeseries_panel(
                "CPU utilization per node",
                "Host CPU utilization per node (all but idle and iowait, 1m): the `Nodes drawn` busiest over the "
                "time range, beside the median node. A saturated node starves its data loaders.",
                [Q(highest_nodes(rec.NODE_CPU_UTILIZATION), "{{instance}}"), median_node(rec.NODE_CPU_UTILIZATION)],
                "percentunit",
                limits=(0, 1),
            )
        )
        .with_panel(
            timeseries_panel(
                "Samples per second per node",
                "Throughput each node contributes over all runs: the `Nodes drawn` slowest over the time range, "
                "beside the median node. A node far below the median for equal hardware means uneven work or a "
                "slow node.",
                [Q(lowest_nodes(NODE_SAMPLES_RATE, NODE_SAMPLES_RATE_OVER_THE_RANGE), "{{instance}}"),
                 median_node(NODE_SAMPLES_RATE)],
                SAMPLES_PER_SECOND,
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Rank skew per run (slowest / fastest mean step)",
                f"Per run, the slowest rank's mean step time over the fastest's. 1 = balanced; above {SKEW.number} a "
                "rank or its node holds the run back (see the straggler table on the Training dashboard).",
                [
                    Q(
                        f"max by (run) ({rec.RANK_STEP_SECONDS_MEAN}) / min by (run) ({rec.RANK_STEP_SECONDS_MEAN})",
                        "{{run}}",
                    )
                ],
                "none",
                limits=(1, None),
            )
        )
        .with_panel(
            table_panel(
                "Runs",
                "Every run with its verdict, throughput, median step time, data-loading share, effective "
                f"utilization of its GPUs, ranks in state {contract.TRAIN_STATE} and lowest straggler score "
                "(step time or local phases, whichever is lower).",
                [
                    Q(rec.RUN_VERDICT, table=True),
                    Q(rec.RUN_SAMPLES_RATE, table=True),
                    Q(rec.RUN_STEP_SECONDS_P50, table=True),
                    Q(rec.RUN_DATALOADER_SHARE, table=True),
                    Q(rec.RUN_GPU_EFFECTIVE_UTILIZATION, table=True),
                    Q(rec.RUN_TRAINING_RANKS, table=True),
                    Q(
                        "min by (run) (\n"
                        f'  label_replace({rec.RANK_STRAGGLER_SCORE}, "score", "step", "", "")\n'
                        f'  or label_replace({rec.RANK_STRAGGLER_LOCAL_SCORE}, "score", "local", "", "")\n'
                        ")",
                        table=True,
                    ),
                ],
                {
                    "Value #B": ("samples/s", "none"),
                    "Value #C": ("p50 step", "s"),
                    "Value #D": ("data-loading share", "percentunit"),
                    "Value #E": ("GPU utilization", "percentunit"),
                    "Value #F": ("ranks training", "none"),
                    "Value #G": ("lowest straggler score", "none"),
                },
                hide=("Time", "__name__", "job", "Value #A"),
            ).override_by_name("run", data_link("Training dashboard of ${__value.raw}", training.UID, "run"))
        )
        .with_panel(
            table_panel(
                "Nodes",
                "Every node with its CPU, memory and effective GPU utilization and GPU count.",
                [
                    Q(rec.NODE_CPU_UTILIZATION, table=True),
                    Q(rec.NODE_MEMORY_UTILIZATION, table=True),
                    Q(rec.NODE_GPU_EFFECTIVE_UTILIZATION, table=True),
                    Q(GPUS_PER_NODE, table=True),
                ],
                {
                    "Value #A": ("CPU", "percentunit"),
                    "Value #B": ("memory", "percentunit"),
                    "Value #C": ("GPU utilization", "percentunit"),
                    "Value #D": ("GPUs", "none"),
                },
            ).override_by_name("instance", data_link("Node dashboard of ${__value.raw}", node.UID, "instance"))
        )
    )
    return board


def _alerts_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "Alerts" row."""
    board = board.with_row(row("Alerts"))
    board = board.with_panel(
        alert_list_panel(
            "Firing alerts",
            "Every stepscope alert firing or pending in the cluster.",
        )
    )
    return board


def build() -> dashboard.Dashboard:
    board = (
        base_dashboard(
            "stepscope / Cluster", UID, ["stepscope", "cluster"],
            "All stepscope agents side by side: GPU use per node and GPU, idle GPUs, skew.",
            since="now-3h", refresh="1m",
        )
        .with_variable(
            custom_variable(
                "nodes_drawn",
                "Nodes drawn",
                NODES_DRAWN_CHOICES,
                description="how many nodes the per-node time series and bars draw: the least used (GPU, "
                "throughput) or the busiest (CPU) over the time range, beside the median node",
            )
        )
    )
    for add_row in (_fleet_row, _gpus_row, _skew_across_nodes_and_ranks_row, _alerts_row):
        board = add_row(board)
    return board

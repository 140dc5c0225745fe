"""Node and GPU dashboard: one agent's host, disks, network, every GPU reading, and its processes."""

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models import dashboard as dm

from grafana.dashboards.panels import (
    Q,
    bargauge_panel,
    base_dashboard,
    query_variable,
    row,
    stat_panel,
    state_timeline_panel,
    table_panel,
    thresholds,
    timeseries_panel,
    value_text,
)

UID = "stepscope-node"
NODE = 'instance=~"$instance"'
GPUS = 'instance=~"$instance",gpu=~"$gpu"'


def _per_process(series: str) -> Q:
    """A column of the process table: one row per process, whose columns merge on (pid, run, rank);
    GPU memory adds up the process's GPUs."""
    return Q(f"sum by (pid, run, rank) ({series})", table=True)


def _link_throughput(link: str, legend: str) -> list[Q]:
    """Receive and transmit bytes/s of one GPU link family (pcie, nvlink, c2c)."""
    return [
        Q(f"stepscope_gpu_{link}_{direction}_bytes_per_second{{{GPUS}}}", f"{legend} {direction}")
        for direction in ("receive", "transmit")
    ]


def _interconnect_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """One row per selected GPU: its NVLink traffic, the step phases of the ranks holding memory on it,
    and its host link (PCIe, C2C) side by side, so a slow backward shows next to the all-reduce's
    NVLink traffic and a slow to_device next to the host-to-device copy."""
    gpu_ranks = (
        f"group by (instance, run, rank) "
        f"(instance_gpu_run_rank:stepscope_process_gpu_memory_bytes:sum{{{GPUS}}} > 0)"
    )
    board = board.with_row(row("GPU $gpu: NVLink, step phases, host link").repeat("gpu"))
    return (
        board.with_panel(
            timeseries_panel(
                "NVLink (GPU ↔ GPU), GPU $gpu",
                "Bytes per second over all NVLink links of this GPU (GPM average since the last cycle): "
                "the gradient all-reduce of DDP and FSDP's all-gathers and reduce-scatters between GPUs "
                "of the node. Traffic in bursts with the backward phase alongside is the all-reduce; a "
                "backward that grows while NVLink stays flat is a rank waiting for a slower one. Absent, "
                "not zero, where the GPU has no GPM (before Hopper) or no NVLink.",
                _link_throughput("nvlink", "GPU {{gpu}}"),
                "Bps",
                limits=(0, None),
                no_data="No NVLink reading: no GPM (before Hopper) or no NVLink on this GPU",
                width=8,
            )
        )
        .with_panel(
            timeseries_panel(
                "Step phases of the ranks on GPU $gpu",
                "Seconds per step in each phase (1m) of every registered rank holding memory on this GPU. "
                "backward holds DDP's gradient all-reduce (compare with NVLink on the left); to_device is "
                "the host-to-device copy (compare with the host link on the right).",
                [
                    Q(
                        f"run_rank_phase:stepscope_step_phase_seconds:per_step_rate1m{{{NODE}}}"
                        f" and on (instance, run, rank) {gpu_ranks}",
                        "{{run}} rank {{rank}} {{phase}}",
                    )
                ],
                "s",
                limits=(0, None),
                no_data="No registered rank holds memory on this GPU",
                width=8,
            )
        )
        .with_panel(
            timeseries_panel(
                "Host link (PCIe, C2C), GPU $gpu",
                "Bytes per second between host and GPU: PCIe (GPM on Hopper and newer, a 20 ms window "
                "every 10 s before), and NVLink-C2C on Grace Hopper, where host copies travel over C2C "
                "instead of PCIe. Receive is host to device (input batches, to_device). C2C is absent, "
                "not zero, on GPUs without it.",
                [*_link_throughput("pcie", "GPU {{gpu}} PCIe"), *_link_throughput("c2c", "GPU {{gpu}} C2C")],
                "Bps",
                limits=(0, None),
                no_data="No PCIe or C2C reading for this GPU (--no-gpu-pcie-poll on a GPU without GPM?)",
                width=8,
            )
        )
    )


def build() -> dashboard.Dashboard:
    board = (
        base_dashboard(
            "stepscope / Node and GPU", UID, ["stepscope", "node", "gpu"],
            "One agent: host CPU, memory, disks, network, every GPU metric, and its processes.",
        )
        .with_variable(
            query_variable(
                "instance",
                "Node",
                "stepscope_exporter_build_info",
                "instance",
                description="the exporter's scrape target (node name)",
            )
        )
        .with_variable(
            query_variable(
                "gpu",
                "GPU",
                f"stepscope_gpu_info{{{NODE}}}",
                "gpu",
                multi=True,
                description="GPU indices on the node",
            )
        )
    )

    board = board.with_row(row("Host"))
    board = (
        board.with_panel(
            timeseries_panel(
                "CPU utilization by mode",
                "Share of all logical CPUs per mode (1m rate); the dashed line marks 90%, where "
                "StepscopeCpuSaturated starts counting. High user time with a data-bound run: decoding and "
                "augmentation in data-loader workers; high iowait: storage.",
                [
                    Q(
                        f'sum by (mode) (rate(stepscope_node_cpu_seconds_total{{{NODE},mode!="idle"}}[1m])) '
                        f"/ scalar(sum(stepscope_node_cpus{{{NODE}}}))",
                        "{{mode}}",
                    ),
                    Q(
                        f"instance:stepscope_node_cpu_utilization:ratio{{{NODE}}}",
                        "busy (all but idle+iowait)",
                    ),
                ],
                "percentunit",
                limits=(0, 1),
                threshold_line=thresholds((None, "green"), (0.9, "red")),
            )
        )
        .with_panel(
            timeseries_panel(
                "Host memory",
                "Total and available host memory; StepscopeHostMemoryPressure fires above 90% used. "
                "Data-loader workers each holding a copy of the data set is the usual culprit.",
                [
                    Q(f"stepscope_node_memory_total_bytes{{{NODE}}}", "total"),
                    Q(f"stepscope_node_memory_available_bytes{{{NODE}}}", "available"),
                    Q(
                        f"stepscope_node_memory_total_bytes{{{NODE}}}"
                        f" - stepscope_node_memory_available_bytes{{{NODE}}}",
                        "used",
                    ),
                ],
                "bytes",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Disk IOPS",
                "Completed reads and writes per second per device (1m rate). Many small reads at a "
                "data-bound run: store data in large sequential shards.",
                [
                    Q(f"rate(stepscope_node_disk_reads_completed_total{{{NODE}}}[1m])", "{{device}} reads"),
                    Q(f"rate(stepscope_node_disk_writes_completed_total{{{NODE}}}[1m])", "{{device}} writes"),
                ],
                "iops",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Disk throughput and busy time",
                "Bytes read and written per second per device, and the share of time each device was busy "
                "(near 100% = the disk is the limit: local NVMe cache or data in memory).",
                [
                    Q(f"rate(stepscope_node_disk_read_bytes_total{{{NODE}}}[1m])", "{{device}} read"),
                    Q(f"rate(stepscope_node_disk_written_bytes_total{{{NODE}}}[1m])", "{{device}} written"),
                    Q(f"rate(stepscope_node_disk_io_time_seconds_total{{{NODE}}}[1m])", "{{device}} busy"),
                ],
                "Bps",
                limits=(0, None),
            ).override_by_regexp(
                ".* busy",
                [
                    dm.DynamicConfigValue(id_val="unit", value="percentunit"),
                    dm.DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
                ],
            )
        )
        .with_panel(
            timeseries_panel(
                "Network throughput",
                "Bytes received and transmitted per second per interface: data streamed from remote storage "
                "and gradient all-reduce traffic.",
                [
                    Q(
                        f"rate(stepscope_node_network_receive_bytes_total{{{NODE}}}[1m])",
                        "{{device}} receive",
                    ),
                    Q(
                        f"rate(stepscope_node_network_transmit_bytes_total{{{NODE}}}[1m])",
                        "{{device}} transmit",
                    ),
                ],
                "Bps",
                limits=(0, None),
            )
        )
        .with_panel(
            bargauge_panel(
                "Filesystem space used",
                "Used share of each filesystem given with --filesystem-paths (data set, cache, checkpoints).",
                [
                    Q(
                        f"1 - stepscope_node_filesystem_avail_bytes{{{NODE}}}"
                        f" / stepscope_node_filesystem_size_bytes{{{NODE}}}",
                        "{{mountpoint}}",
                    )
                ],
                "percentunit",
                steps=thresholds((None, "green"), (0.8, "yellow"), (0.95, "red")),
            )
        )
    )

    board = board.with_row(row("GPU"))
    board = (
        board.with_panel(
            timeseries_panel(
                "GPU utilization",
                "Share of time a kernel was running on each GPU. It says nothing about how much of the GPU a "
                "kernel uses: see SM active and occupancy below on Hopper and newer.",
                [Q(f"stepscope_gpu_utilization_ratio{{{GPUS}}}", "GPU {{gpu}}")],
                "percentunit",
                limits=(0, 1),
            )
        )
        .with_panel(
            timeseries_panel(
                "Effective GPU utilization",
                "What the verdicts and alerts read (1m average): SM active where GPM reads it (Hopper and "
                "newer), NVML utilization elsewhere; the legend says which. NVML utilization high while SM "
                "active is low is a GPU that looks busy but does little: kernels too small to fill it, or a "
                "launch-bound loop (StepscopeGpuBusyButIdle).",
                [
                    Q(
                        f"instance_gpu:stepscope_gpu_effective_utilization:avg_ratio{{{GPUS}}}",
                        "GPU {{gpu}} ({{source}})",
                    )
                ],
                "percentunit",
                limits=(0, 1),
                threshold_line=thresholds((None, "red"), (0.8, "green")),
            )
        )
        .with_panel(
            timeseries_panel(
                "GPM: SM active, SM occupancy, tensor cores, DRAM",
                "NVML GPU performance metrics (Hopper and newer; empty elsewhere): SM active = share of SMs "
                "busy; occupancy = warps resident; tensor = tensor-core pipes busy (low with FP32: use "
                "BF16/FP16 autocast); DRAM = memory bandwidth in use.",
                [
                    Q(f"stepscope_gpu_sm_active_ratio{{{GPUS}}}", "GPU {{gpu}} SM active"),
                    Q(f"stepscope_gpu_sm_occupancy_ratio{{{GPUS}}}", "GPU {{gpu}} SM occupancy"),
                    Q(f"stepscope_gpu_tensor_active_ratio{{{GPUS}}}", "GPU {{gpu}} tensor active"),
                    Q(f"stepscope_gpu_dram_active_ratio{{{GPUS}}}", "GPU {{gpu}} DRAM active"),
                ],
                "percentunit",
                limits=(0, 1),
            )
        )
        .with_panel(
            timeseries_panel(
                "GPU memory",
                "Framebuffer memory used, free and total per GPU. PyTorch's caching allocator keeps freed "
                "memory reserved, so used stays high after peaks.",
                [
                    Q(f"stepscope_gpu_memory_used_bytes{{{GPUS}}}", "GPU {{gpu}} used"),
                    Q(f"stepscope_gpu_memory_free_bytes{{{GPUS}}}", "GPU {{gpu}} free"),
                    Q(f"stepscope_gpu_memory_total_bytes{{{GPUS}}}", "GPU {{gpu}} total"),
                ],
                "bytes",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "GPU memory-controller utilization",
                "Share of time the memory controller was reading or writing device memory: high with low SM "
                "activity means memory-bound kernels.",
                [Q(f"stepscope_gpu_memory_utilization_ratio{{{GPUS}}}", "GPU {{gpu}}")],
                "percentunit",
                limits=(0, 1),
            )
        )
        .with_panel(
            timeseries_panel(
                "Clocks",
                "SM and memory clocks. SM clocks dropping under load together with throttle reasons below "
                "mean power or thermal limits.",
                [
                    Q(f"stepscope_gpu_sm_clock_hertz{{{GPUS}}}", "GPU {{gpu}} SM"),
                    Q(f"stepscope_gpu_memory_clock_hertz{{{GPUS}}}", "GPU {{gpu}} memory"),
                ],
                "hertz",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Power",
                "Power draw against the enforced limit, and the average draw from the energy counter (1m). "
                "Draw pinned at the limit means power capping.",
                [
                    Q(f"stepscope_gpu_power_watts{{{GPUS}}}", "GPU {{gpu}} draw"),
                    Q(f"stepscope_gpu_power_limit_watts{{{GPUS}}}", "GPU {{gpu}} limit"),
                    Q(
                        f"rate(stepscope_gpu_energy_joules_total{{{GPUS}}}[1m])",
                        "GPU {{gpu}} average (energy)",
                    ),
                ],
                "watt",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Temperature",
                "GPU die temperature; thermal slowdown usually starts in the high 80s celsius.",
                [Q(f"stepscope_gpu_temperature_celsius{{{GPUS}}}", "GPU {{gpu}}")],
                "celsius",
                threshold_line=thresholds((None, "green"), (85, "red")),
            )
        )
        .with_panel(
            timeseries_panel(
                "PCIe throughput",
                "Host-device PCIe traffic per GPU: input batches in (receive) and results out (transmit). "
                "Large steady receive with a host-bound run: copy less or overlap copies with compute.",
                _link_throughput("pcie", "GPU {{gpu}}"),
                "Bps",
                limits=(0, None),
            )
        )
        .with_panel(
            state_timeline_panel(
                "Throttle reasons",
                "Active clock-event reasons per GPU over time (red = active). Power and thermal reasons "
                "slow the GPU down (StepscopeGpuThrottling); gpu_idle and applications_clocks_setting are "
                "harmless.",
                [Q(f"stepscope_gpu_clock_event_active{{{GPUS}}}", "GPU {{gpu}} {{reason}}")],
                value_text({"0": ("inactive", "transparent"), "1": ("active", "red")}),
                width=12,
            )
        )
        .with_panel(
            timeseries_panel(
                "Time throttled per reason",
                "Share of time clocks were held down, per reason (1m rate of the cumulative counter).",
                [Q(f"rate(stepscope_gpu_clock_event_seconds_total{{{GPUS}}}[1m])", "GPU {{gpu}} {{reason}}")],
                "percentunit",
                limits=(0, 1),
            )
        )
        .with_panel(
            timeseries_panel(
                "ECC errors",
                "Corrected and uncorrected ECC errors since driver load. Uncorrected ones crash the job; a "
                "growing corrected count announces a failing memory.",
                [Q(f"stepscope_gpu_ecc_errors_total{{{GPUS}}}", "GPU {{gpu}} {{type}}")],
                "short",
                limits=(0, None),
            )
        )
        .with_panel(
            table_panel(
                "XID errors",
                "XID events per GPU since the exporter started and how long ago each last fired. Empty is "
                "good. Look the code up in NVIDIA's XID catalogue (79 = fallen off the bus, 48/94/95 = ECC).",
                [
                    Q(f"stepscope_gpu_xid_errors_total{{{GPUS}}}", table=True),
                    Q(f"time() - stepscope_gpu_xid_last_seen_timestamp_seconds{{{GPUS}}}", table=True),
                ],
                {"Value #A": ("events", "short"), "Value #B": ("last seen ago", "s")},
                hide=("Time", "__name__", "job", "instance", "uuid"),
                width=12,
            )
        )
        .with_panel(
            table_panel(
                "GPUs",
                "Inventory: model, driver, PCI bus id, and whether NVML still answers (1) for each GPU.",
                [
                    Q(f"stepscope_gpu_info{{{GPUS}}}", table=True),
                    Q(f"stepscope_gpu_up{{{GPUS}}}", table=True),
                ],
                {"Value #A": ("info", "none"), "Value #B": ("up", "none")},
                hide=("Time", "__name__", "job", "instance", "Value #A"),
                width=12,
            )
        )
        .with_panel(
            stat_panel(
                "NVML",
                "1 when the exporter initialised NVML on this node; 0 without a GPU or driver (GPU panels "
                "then stay empty).",
                [Q(f"stepscope_gpu_collector_up{{{NODE}}}", "NVML")],
                "none",
                steps=thresholds((None, "red"), (1, "green")),
                width=12,
                height=4,
            )
        )
        .with_panel(
            stat_panel(
                "GPUs answering",
                "GPUs on the node that still answer NVML queries.",
                [Q(f"sum(stepscope_gpu_up{{{NODE}}})", "GPUs up")],
                "none",
                width=12,
                height=4,
            )
        )
    )

    board = _interconnect_row(board)

    board = board.with_row(row("Processes"))
    board = board.with_panel(
        table_panel(
            "Processes",
            "Processes registered by the training hooks or holding GPU memory: CPU cores (process plus "
            "data-loader workers), resident memory, worker count, storage reads and writes, GPU memory. "
            "Unregistered GPU processes have an empty run.",
            [
                _per_process(f"rate(stepscope_process_cpu_seconds_total{{{NODE}}}[1m])"),
                _per_process(f"stepscope_process_resident_memory_bytes{{{NODE}}}"),
                _per_process(f"stepscope_process_children{{{NODE}}}"),
                _per_process(f"rate(stepscope_process_io_read_bytes_total{{{NODE}}}[1m])"),
                _per_process(f"rate(stepscope_process_io_write_bytes_total{{{NODE}}}[1m])"),
                _per_process(f"stepscope_process_gpu_memory_bytes{{{NODE}}}"),
            ],
            {
                "Value #A": ("CPU cores", "none"),
                "Value #B": ("resident memory", "bytes"),
                "Value #C": ("workers", "none"),
                "Value #D": ("read", "Bps"),
                "Value #E": ("written", "Bps"),
                "Value #F": ("GPU memory", "bytes"),
            },
            height=9,
        )
    )

    board = board.with_row(row("Exporter"))
    return (
        board.with_panel(
            timeseries_panel(
                "Collector cycle duration",
                "Wall time of each collector's last cycle; near or above --collect-interval means readings "
                "lag (a slow NVML call or filesystem).",
                [Q(f"stepscope_exporter_collector_duration_seconds{{{NODE}}}", "{{collector}}")],
                "s",
                limits=(0, None),
                width=8,
            )
        )
        .with_panel(
            timeseries_panel(
                "Collector errors and staleness",
                "Failed cycles per second per collector, and seconds since each collector last succeeded "
                "(StepscopeExporterCollectionStale fires above 2 minutes).",
                [
                    Q(
                        f"rate(stepscope_exporter_collector_errors_total{{{NODE}}}[1m])",
                        "{{collector}} errors/s",
                    ),
                    Q(
                        f"time() - stepscope_exporter_collector_last_success_timestamp_seconds{{{NODE}}}",
                        "{{collector}} since success",
                    ),
                ],
                "s",
                limits=(0, None),
                width=8,
            ).override_by_regexp(".* errors/s", [dm.DynamicConfigValue(id_val="unit", value="short")])
        )
        .with_panel(
            timeseries_panel(
                "Training pushes",
                "Pushes from training hooks accepted and rejected per second (by reason), and the push "
                "groups (one per run and rank) the exporter holds.",
                [
                    Q(f"rate(stepscope_exporter_ingest_accepted_total{{{NODE}}}[1m])", "accepted/s"),
                    Q(
                        f"sum by (reason) (rate(stepscope_exporter_ingest_rejected_total{{{NODE}}}[1m]))",
                        "rejected/s {{reason}}",
                    ),
                    Q(f"stepscope_exporter_ingest_groups{{{NODE}}}", "groups"),
                ],
                "short",
                limits=(0, None),
                width=8,
            )
        )
        .with_panel(
            table_panel(
                "Exporter build",
                "Exporter version and Python version on this node.",
                [Q(f"stepscope_exporter_build_info{{{NODE}}}", table=True)],
                {},
                hide=("Time", "__name__", "job", "Value"),
                height=4,
            )
        )
    )

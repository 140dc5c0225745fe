"""Node and GPU dashboard: one agent's host, disks, network, every GPU reading, and its processes."""

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models import dashboard as dm

import stepscope.contract as contract
from grafana.dashboards.panels import (
    NODE_CLOCK_JOIN,
    Q,
    age,
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
from stepscope.contract import families as fam
from stepscope.contract import recordings as rec
from stepscope.contract import selector as sel

UID = "stepscope-node"
NODE = 'instance="$instance"'  # one node, matched exactly (Grafana regex-escapes only a multi-value variable)
GPUS = 'instance="$instance",gpu=~"$gpu"'
NOT_IDLE = NODE + ',mode!="idle"'  # CPU modes
BACKWARD = contract.BACKWARD_PHASE
TO_DEVICE = contract.TO_DEVICE_PHASE
CPU_SATURATED = contract.THRESHOLDS["cpu_saturated"]
HOST_MEMORY = contract.THRESHOLDS["host_memory_pressure"]
BUSY_IDLE = contract.THRESHOLDS["busy_idle_sm_active"]
POWER_CAP_CLOCK = contract.THRESHOLDS["power_cap_clock_ratio"]
FILLING = contract.THRESHOLDS["filesystem_filling"]
FULL = contract.THRESHOLDS["filesystem_full"]
HOT = contract.THRESHOLDS["gpu_temperature_hot_celsius"]
STALE = contract.THRESHOLDS["collector_stale_seconds"]


def _per_process(series: str, also_by: str = "") -> Q:
    """A column of the process table: one row per process, whose columns merge on (pid, run, rank), the labels
    every column has (Grafana's merge); `also_by` keeps a label of this column's only, which the merge adds to the
    row. GPU memory adds up the process's GPUs. A process the hooks registered less than a rate window ago still
    has its row from before (no run, 0 CPU): left out where the pid has another (a pid's only row stays)."""
    per_process = f"sum by (pid, run, rank{', ' + also_by if also_by else ''}) ({series})"
    return Q(f"{per_process} unless on (pid, run) (count by (pid) ({per_process}) > 1)", table=True)


def _filled(family: str, dcgm: str, matchers: str = GPUS, on: str = "instance, gpu", only: str = "") -> str:
    """stepscope's family, else dcgm-exporter's fill-in (rec.GPU_DCGM_*, narrowed by `only`): the fill-in is
    recorded only from dcgm-exporter's fields, so a node with stepscope's GPU collector alone costs no recording
    for the panel, and stepscope's readings win on a node that has both."""
    return f"{sel(family, matchers)} or on ({on}) {sel(dcgm, matchers + only)}"


def _link_throughput(link: tuple[str, str], legend: str, dcgm: str | None = None) -> list[Q]:
    """Receive and transmit bytes/s of one GPU link (fam.GPU_PCIE, GPU_NVLINK, GPU_C2C); with `dcgm` (its
    dcgm-exporter fill-in, label `direction`) also of the GPUs whose node has no stepscope GPU collector."""
    queries = []
    for name, direction in zip(link, ("receive", "transmit"), strict=True):
        expr = _filled(name, dcgm, only=f',direction="{direction}"') if dcgm else sel(name, GPUS)
        queries.append(Q(expr, f"{legend} {direction}"))
    return queries


def _interconnect_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """One row per selected GPU: its NVLink traffic, the step phases of the ranks holding memory on it,
    and its host link (PCIe, C2C) side by side, so a slow backward shows next to the all-reduce's
    NVLink traffic and a slow to_device next to the host-to-device copy."""
    gpu_ranks = (
        f"group by (instance, run, rank) "
        f"({sel(rec.RANK_GPU_MEMORY, GPUS)} > 0)"
    )
    board = board.with_row(row("GPU $gpu: NVLink, step phases, host link").repeat("gpu"))
    return (
        board.with_panel(
            timeseries_panel(
                "NVLink (GPU ↔ GPU), GPU $gpu",
                "Bytes per second over all NVLink links of this GPU (GPM average since the last cycle): "
                "the gradient all-reduce of DDP and FSDP's all-gathers and reduce-scatters between GPUs "
                f"of the node. Traffic in bursts with the {BACKWARD} phase alongside is the all-reduce; a "
                f"{BACKWARD} that grows while NVLink stays flat is a rank waiting for a slower one. Absent, "
                "not zero, where the GPU has no GPM (before Hopper) or no NVLink.",
                _link_throughput(fam.GPU_NVLINK, "GPU {{gpu}}", rec.GPU_DCGM_NVLINK),
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
                f"{BACKWARD} holds DDP's gradient all-reduce (compare with NVLink on the left); {TO_DEVICE} is "
                "the host-to-device copy (compare with the host link on the right).",
                [
                    Q(
                        f"{sel(rec.RANK_PHASE_SECONDS_PER_STEP, NODE)} and on (instance, run, rank) {gpu_ranks}",
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
                f"instead of PCIe. Receive is host to device (input batches, {TO_DEVICE}). C2C is absent, "
                "not zero, on GPUs without it.",
                [
                    *_link_throughput(fam.GPU_PCIE, "GPU {{gpu}} PCIe", rec.GPU_DCGM_PCIE),
                    *_link_throughput(fam.GPU_C2C, "GPU {{gpu}} C2C"),
                ],
                "Bps",
                limits=(0, None),
                no_data="No PCIe or C2C reading for this GPU (--no-gpu-pcie-poll on a GPU without GPM?)",
                width=8,
            )
        )
    )


def _host_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "Host" row."""
    board = board.with_row(row("Host"))
    board = (
        board.with_panel(
            timeseries_panel(
                "CPU utilization by mode",
                f"Share of all logical CPUs per mode (1m rate); the dashed line marks {CPU_SATURATED.percent}, where "
                "StepscopeCpuSaturated starts counting. High user time with a data-bound run: decoding and "
                "augmentation in data-loader workers; high iowait: storage.",
                [
                    Q(
                        f"sum by (mode) (rate({sel(fam.NODE_CPU_SECONDS, NOT_IDLE)}[1m])) "
                        f"/ scalar(sum({sel(fam.NODE_CPUS, NODE)}))",
                        "{{mode}}",
                    ),
                    Q(
                        sel(rec.NODE_CPU_UTILIZATION, NODE),
                        "busy (all but idle+iowait)",
                    ),
                ],
                "percentunit",
                limits=(0, 1),
                threshold_line=thresholds((None, "green"), (CPU_SATURATED.value, "red")),
            )
        )
        .with_panel(
            timeseries_panel(
                "Host memory",
                f"Total and available host memory; StepscopeHostMemoryPressure fires above {HOST_MEMORY.percent} used. "
                "Data-loader workers each holding a copy of the data set is the usual culprit.",
                [
                    Q(sel(fam.NODE_MEMORY_TOTAL, NODE), "total"),
                    Q(sel(fam.NODE_MEMORY_AVAILABLE, NODE), "available"),
                    Q(
                        f"{sel(fam.NODE_MEMORY_TOTAL, NODE)} - {sel(fam.NODE_MEMORY_AVAILABLE, NODE)}",
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
                    Q(f"rate({sel(fam.NODE_DISK_READS, NODE)}[1m])", "{{device}} reads"),
                    Q(f"rate({sel(fam.NODE_DISK_WRITES, NODE)}[1m])", "{{device}} writes"),
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
                    Q(f"rate({sel(fam.NODE_DISK_READ_BYTES, NODE)}[1m])", "{{device}} read"),
                    Q(f"rate({sel(fam.NODE_DISK_WRITTEN_BYTES, NODE)}[1m])", "{{device}} written"),
                    Q(f"rate({sel(fam.NODE_DISK_IO_TIME, NODE)}[1m])", "{{device}} busy"),
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
                        f"rate({sel(fam.NODE_NETWORK_RECEIVE, NODE)}[1m])",
                        "{{device}} receive",
                    ),
                    Q(
                        f"rate({sel(fam.NODE_NETWORK_TRANSMIT, NODE)}[1m])",
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
                        f"1 - {sel(fam.NODE_FILESYSTEM_AVAIL, NODE)}"
                        f" / {sel(fam.NODE_FILESYSTEM_SIZE, NODE)}",
                        "{{mountpoint}}",
                    )
                ],
                "percentunit",
                steps=thresholds((None, "green"), (FILLING.value, "yellow"), (FULL.value, "red")),
            )
        )
    )
    return board


def _gpu_activity(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """How busy each GPU is: NVML utilization, the effective utilization the verdicts read, GPM."""
    return (
        board.with_panel(
            timeseries_panel(
                "GPU utilization",
                "Share of time a kernel was running on each GPU. It says nothing about how much of the GPU a "
                "kernel uses: see SM active and occupancy below on Hopper and newer.",
                [Q(sel(rec.GPU_SOURCE_UTILIZATION, GPUS), "GPU {{gpu}}")],
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
                        sel(rec.GPU_EFFECTIVE_UTILIZATION, GPUS),
                        "GPU {{gpu}} ({{source}})",
                    )
                ],
                "percentunit",
                limits=(0, 1),
                threshold_line=thresholds((None, "red"), (BUSY_IDLE.value, "green")),
            )
        )
        .with_panel(
            timeseries_panel(
                "GPM: SM active, SM occupancy, tensor cores, DRAM",
                "NVML GPU performance metrics (Hopper and newer; empty elsewhere): SM active = share of SMs "
                "busy; occupancy = warps resident; tensor = tensor-core pipes busy (low with FP32: use "
                "BF16/FP16 autocast); DRAM = memory bandwidth in use.",
                [
                    Q(sel(rec.GPU_SOURCE_SM_ACTIVE, GPUS), "GPU {{gpu}} SM active"),
                    Q(_filled(fam.GPU_SM_OCCUPANCY, rec.GPU_DCGM_SM_OCCUPANCY), "GPU {{gpu}} SM occupancy"),
                    Q(sel(rec.GPU_SOURCE_TENSOR_ACTIVE, GPUS), "GPU {{gpu}} tensor active"),
                    Q(_filled(fam.GPU_DRAM_ACTIVE, rec.GPU_DCGM_DRAM_ACTIVE), "GPU {{gpu}} DRAM active"),
                ],
                "percentunit",
                limits=(0, 1),
            )
        )
    )


def _gpu_memory_clocks_power(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """Memory, clocks, power and temperature of each GPU."""
    return (
        board.with_panel(
            timeseries_panel(
                "GPU memory",
                "Framebuffer memory used, free and total per GPU. PyTorch's caching allocator keeps freed "
                "memory reserved, so used stays high after peaks (the next panel splits it).",
                [
                    Q(f"max by (instance, gpu) ({sel(rec.GPU_SOURCE_MEMORY_USED, GPUS)})", "GPU {{gpu}} used"),
                    Q(_filled(fam.GPU_MEMORY_FREE, rec.GPU_DCGM_MEMORY_FREE), "GPU {{gpu}} free"),
                    Q(sel(rec.GPU_SOURCE_MEMORY_TOTAL, GPUS), "GPU {{gpu}} total"),
                ],
                "bytes",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "GPU memory in PyTorch's allocators",
                "Where training ranks on the GPU push their caching allocator's memory (on CUDA; empty for ranks "
                "on the CPU): bytes given to tensors and bytes the allocators keep cached but free. A GPU nearly "
                "full with a large cached share has a full cache the ranks reuse, not memory pressure.",
                [
                    Q(sel(rec.GPU_TORCH_ALLOCATED, GPUS), "GPU {{gpu}} PyTorch tensors"),
                    Q(sel(rec.GPU_TORCH_CACHED, GPUS), "GPU {{gpu}} PyTorch cached, free"),
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
                [Q(_filled(fam.GPU_MEMORY_UTILIZATION, rec.GPU_DCGM_MEMORY_UTILIZATION), "GPU {{gpu}}")],
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
                    Q(sel(rec.GPU_SOURCE_SM_CLOCK, GPUS), "GPU {{gpu}} SM"),
                    Q(_filled(fam.GPU_MEMORY_CLOCK, rec.GPU_DCGM_MEMORY_CLOCK), "GPU {{gpu}} memory"),
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
                    Q(_filled(fam.GPU_POWER, rec.GPU_DCGM_POWER), "GPU {{gpu}} draw"),
                    Q(_filled(fam.GPU_POWER_LIMIT, rec.GPU_DCGM_POWER_LIMIT), "GPU {{gpu}} limit"),
                    Q(sel(rec.GPU_SOURCE_ENERGY_RATE, GPUS), "GPU {{gpu}} average (energy)"),
                ],
                "watt",
                limits=(0, None),
            )
        )
        .with_panel(
            timeseries_panel(
                "Temperature",
                "GPU die temperature; thermal slowdown usually starts in the high 80s celsius.",
                [Q(_filled(fam.GPU_TEMPERATURE, rec.GPU_DCGM_TEMPERATURE), "GPU {{gpu}}")],
                "celsius",
                threshold_line=thresholds((None, "green"), (HOT.value, "red")),
            )
        )
    )


def _gpu_throttling(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """PCIe traffic, and which clock events hold the clocks down and for how long."""
    return (
        board.with_panel(
            timeseries_panel(
                "PCIe throughput",
                "Host-device PCIe traffic per GPU: input batches in (receive) and results out (transmit). "
                "Large steady receive with a host-bound run: copy less or overlap copies with compute.",
                _link_throughput(fam.GPU_PCIE, "GPU {{gpu}}", rec.GPU_DCGM_PCIE),
                "Bps",
                limits=(0, None),
            )
        )
        .with_panel(
            state_timeline_panel(
                "Throttle reasons",
                "Active clock-event reasons per GPU over time (red = active). Thermal and hardware reasons "
                "slow the GPU down (StepscopeGpuThrottling); sw_power_cap is how a GPU at full load runs (an H100 "
                "on bf16 matmuls sits at its 700 W cap), and warns only when the clock it costs is large (panel "
                "beside); gpu_idle and applications_clocks_setting are harmless.",
                [Q(sel(rec.GPU_SOURCE_CLOCK_EVENT_ACTIVE, GPUS), "GPU {{gpu}} {{reason}}")],
                value_text({"0": ("inactive", "transparent"), "1": ("active", "red")}),
                width=12,
            )
        )
        .with_panel(
            timeseries_panel(
                "SM clock lost below its maximum",
                "1 - SM clock / maximum SM clock, per GPU: what power capping (or throttling) costs. At its "
                "700 W cap on bf16 matmuls an H100 ran at 0.86-0.92 of its 1.98 GHz (a loss of 8-14%), an H200 at "
                "0.77-0.87 (13-23%); "
                f"StepscopeGpuThrottling warns for sw_power_cap only past a loss of {1 - POWER_CAP_CLOCK.value:.0%}.",
                [Q(f"1 - {sel(rec.GPU_SOURCE_SM_CLOCK, GPUS)} "
                   f"/ on (instance, gpu) ({sel(rec.GPU_SOURCE_SM_CLOCK_MAX, GPUS)} > 0)", "GPU {{gpu}}")],
                "percentunit",
                limits=(0, 1),
                threshold_line=thresholds((None, "green"), (1 - POWER_CAP_CLOCK.value, "red")),
            )
        )
        .with_panel(
            timeseries_panel(
                "Time throttled per reason",
                "Share of time clocks were held down, per reason (1m rate of the cumulative counter); from "
                "dcgm-exporter, which has no such counter among its defaults, the share of its readings (1m) that "
                "had the reason active.",
                [Q(f"rate({sel(fam.GPU_CLOCK_EVENT_SECONDS, GPUS)}[1m]) or on (instance, gpu) "
                   f"avg_over_time({sel(rec.GPU_SOURCE_CLOCK_EVENT_ACTIVE, GPUS)}[1m])", "GPU {{gpu}} {{reason}}")],
                "percentunit",
                limits=(0, 1),
            )
        )
    )


def _gpu_health(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """ECC and XID errors, the inventory, and whether NVML answers."""
    return (
        board.with_panel(
            timeseries_panel(
                "ECC errors",
                "Corrected and uncorrected ECC errors since driver load. Uncorrected ones crash the job; a "
                "growing corrected count announces a failing memory.",
                [Q(_filled(fam.GPU_ECC_ERRORS, rec.GPU_DCGM_ECC_ERRORS), "GPU {{gpu}} {{type}}")],
                "short",
                limits=(0, None),
            )
        )
        .with_panel(
            table_panel(
                "XID errors",
                "XID events per GPU since the exporter started and how long ago each last fired. Empty is "
                "good. Look the code up in NVIDIA's XID catalogue (79 = fallen off the bus, 48/94/95 = ECC). "
                "From dcgm-exporter (its last XID's number) only when each new XID came, within the time range.",
                [
                    Q(f"max by (instance, gpu, xid) ({sel(fam.GPU_XID_ERRORS, GPUS)})", table=True),
                    Q(f"time() - max by (instance, gpu, xid) ({sel(fam.GPU_XID_LAST_SEEN, GPUS)} - "
                      f"{NODE_CLOCK_JOIN}) or time() - max by (instance, gpu, xid) "
                      f"(max_over_time({sel(rec.GPU_DCGM_XID_LAST_SEEN, GPUS)}[$__range]))",
                      table=True),
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
                    Q(f"{sel(fam.GPU_INFO, GPUS)} or on (instance, gpu) {sel(rec.GPU_SOURCE_NAME, GPUS)}", table=True),
                    Q(_filled(fam.GPU_UP, rec.GPU_DCGM_UP), table=True),
                ],
                {"Value #A": ("info", "none"), "Value #B": ("up", "none")},
                hide=("Time", "__name__", "job", "instance", "Value #A"),
                width=12,
            )
        )
        .with_panel(
            stat_panel(
                "NVML",
                "1 when the exporter initialised NVML on this node (or, with dcgm-exporter as the GPU source, "
                "when its target answers); 0 without a GPU or driver (GPU panels then stay empty).",
                [Q(_filled(fam.GPU_COLLECTOR_UP, rec.GPU_DCGM_COLLECTOR_UP, NODE, "instance"), "NVML")],
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
                [Q(f"sum({_filled(fam.GPU_UP, rec.GPU_DCGM_UP, NODE)})", "GPUs up")],
                "none",
                width=12,
                height=4,
            )
        )
    )


def _gpu_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "GPU" row, then one row per selected GPU for its interconnect."""
    board = board.with_row(row("GPU"))
    for add_panels in (_gpu_activity, _gpu_memory_clocks_power, _gpu_throttling, _gpu_health):
        board = add_panels(board)
    return _interconnect_row(board)


def _processes_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "Processes" row."""
    board = board.with_row(row("Processes"))
    board = board.with_panel(
        table_panel(
            "Processes",
            "Processes registered by the training hooks or holding GPU memory: CPU cores (process plus "
            "data-loader workers), resident memory, worker count, storage reads and writes, GPU memory and who "
            "holds it (holder): rank (a registered rank, its workers' memory on its GPUs included), worker (a "
            "rank's worker on a GPU its rank does not hold), mps_server, foreign (any other process: a notebook "
            "or another team's job sharing the GPU) or unknown (a process the exporter cannot read). "
            "Unregistered GPU processes have an empty run.",
            [
                _per_process(f"rate({sel(fam.PROCESS_CPU_SECONDS, NODE)}[1m])"),
                _per_process(sel(fam.PROCESS_RESIDENT_MEMORY, NODE)),
                _per_process(sel(fam.PROCESS_CHILDREN, NODE)),
                _per_process(f"rate({sel(fam.PROCESS_IO_READ, NODE)}[1m])"),
                _per_process(f"rate({sel(fam.PROCESS_IO_WRITE, NODE)}[1m])"),
                _per_process(sel(fam.PROCESS_GPU_MEMORY, NODE), also_by="holder"),
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
    return board


def exporter_restarts(start_time: str) -> str:
    """Times the start time went up in the last 24 hours, a minute at a time. Not `changes()`: VictoriaMetrics
    counts a series' first sample as a change (MetricsQL), so every node in its first day read one restart more
    there than on Prometheus (1 for an exporter never restarted). `last_over_time` carries the start time over
    the restart's scrape gap, where a failed scrape marks the series stale."""
    return (f"sum_over_time((last_over_time({start_time}[2m]) > bool last_over_time({start_time}[2m] offset 1m))"
            "[24h:1m])")


def _exporter_row(board: dashboard.Dashboard) -> dashboard.Dashboard:
    """The "Exporter" row."""
    board = board.with_row(row("Exporter"))
    board = (
        board.with_panel(
            timeseries_panel(
                "Collector cycle duration",
                "Wall time of each collector's last cycle; near or above --collect-interval means readings "
                "lag (a slow NVML call or filesystem).",
                [Q(sel(fam.COLLECTOR_DURATION, NODE), "{{collector}}")],
                "s",
                limits=(0, None),
                width=8,
            )
        )
        .with_panel(
            timeseries_panel(
                "Collector errors and staleness",
                "Failed cycles per second per collector, and seconds since each collector last succeeded "
                f"(StepscopeExporterCollectionStale fires above {STALE.value / 60:g} minutes).",
                [
                    Q(
                        f"rate({sel(fam.COLLECTOR_ERRORS, NODE)}[1m])",
                        "{{collector}} errors/s",
                    ),
                    Q(
                        age(sel(fam.COLLECTOR_LAST_SUCCESS, NODE)),
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
                    Q(f"rate({sel(fam.INGEST_ACCEPTED, NODE)}[1m])", "accepted/s"),
                    Q(
                        f"sum by (reason) (rate({sel(fam.INGEST_REJECTED, NODE)}[1m]))",
                        "rejected/s {{reason}}",
                    ),
                    Q(sel(fam.INGEST_GROUPS, NODE), "groups"),
                ],
                "short",
                limits=(0, None),
                width=8,
            )
        )
        .with_panel(
            timeseries_panel(
                "Exporter CPU by part",
                "What the exporter costs this node, by part: each collector (its cycles and helper threads; "
                "--collectors turns one off, --collect-interval spaces them) and the server (scrapes, pushes, "
                "password checks). 0.01 is 1% of one core.",
                [Q(f"rate({sel(fam.EXPORTER_CPU, NODE)}[1m])", "{{part}}")],
                "percentunit",
                limits=(0, None),
                width=16,
                stack=True,
            )
        )
        .with_panel(
            table_panel(
                "Exporter build",
                "Exporter version and Python version on this node.",
                [Q(sel(fam.BUILD_INFO, NODE), table=True)],
                {},
                hide=("Time", "__name__", "job", "Value"),
                width=8,
            )
        )
        .with_panel(
            stat_panel(
                "Exporter restarts (24h)",
                "Times the exporter started again in the last 24 hours (restarts less than a minute apart count "
                "once). The rules hold its readings through each restart (docs/alerts.md, Scrape gaps), but it "
                "forgets a rank that died before one.",
                [Q(exporter_restarts(sel(fam.EXPORTER_START_TIME, NODE)), "restarts")],
                "short",
            )
        )
        .with_panel(
            stat_panel(
                "Exporter up for",
                "Time since the exporter on this node started.",
                [Q(age(sel(fam.EXPORTER_START_TIME, NODE)), "up for")],
                "s",
            )
        )
        .with_panel(
            stat_panel(
                "Clock offset",
                "How far this node's clock is off Prometheus' (+ ahead), measured at every scrape. The rules and "
                "these panels take it out of every time the node stamps (a rank's last push and step, an XID, a "
                "collector's success); the node's own logs and anything else comparing clocks across nodes do not: "
                "check its time sync (chronyc tracking, timedatectl).",
                [Q(sel(rec.NODE_CLOCK_OFFSET, NODE), "offset")],
                "s",
            )
        )
    )
    return board


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
                fam.BUILD_INFO,
                "instance",
                description="the exporter's scrape target (node name)",
            )
        )
        .with_variable(
            query_variable(
                "gpu",
                "GPU",
                sel(rec.GPU_SOURCE_NAME, NODE),
                "gpu",
                multi=True,
                description="GPU indices on the node",
            )
        )
    )
    for add_row in (_host_row, _gpu_row, _processes_row, _exporter_row):
        board = add_row(board)
    return board

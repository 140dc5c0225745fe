"""Every metric family stepscope publishes: name, type, labels, meaning, and for the pushed families the
help text and value rules both the hooks and the exporter's ingest use.

The order is the metric table's of docs/exporter.md ("What it publishes"): `python -m grafana generate` writes
that table from FAMILIES, merging neighbours that share type, labels and meaning into one row.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

from stepscope.contract.scrape_gaps import SETTLE_SECONDS

GPU = ("gpu", "uuid")
PROCESS = ("pid", "run", "rank")
# Who holds memory on a GPU (stepscope_process_gpu_memory_bytes' `holder`). A foreign holder is a process this
# exporter sees that is neither a registered rank, nor one of its descendants (a data-loader worker that opened a
# CUDA context), nor the MPS server: another tenant whose kernels the GPU's readings count with the run's. A holder
# this exporter cannot see (another pid namespace without hostPID, hidepid) is unknown: it may be a rank.
HOLDER_RANK = "rank"
HOLDER_WORKER = "worker"
HOLDER_MPS_SERVER = "mps_server"
HOLDER_FOREIGN = "foreign"
HOLDER_UNKNOWN = "unknown"
GPU_HOLDERS = (HOLDER_RANK, HOLDER_WORKER, HOLDER_MPS_SERVER, HOLDER_FOREIGN, HOLDER_UNKNOWN)
RUN_RANK = ("run", "rank")
# Every family by role: the exporter, the hooks' renderer, the ingest, the dashboards and the report name
# them through these, so a rename is an edit here.
NODE_INFO = "stepscope_node_info"
NODE_CPU_SECONDS = "stepscope_node_cpu_seconds_total"
NODE_CPUS = "stepscope_node_cpus"
NODE_MEMORY_TOTAL = "stepscope_node_memory_total_bytes"
NODE_MEMORY_AVAILABLE = "stepscope_node_memory_available_bytes"
NODE_DISK_READ_BYTES = "stepscope_node_disk_read_bytes_total"
NODE_DISK_WRITTEN_BYTES = "stepscope_node_disk_written_bytes_total"
NODE_DISK_READS = "stepscope_node_disk_reads_completed_total"
NODE_DISK_WRITES = "stepscope_node_disk_writes_completed_total"
NODE_DISK_IO_TIME = "stepscope_node_disk_io_time_seconds_total"
NODE_NETWORK_RECEIVE = "stepscope_node_network_receive_bytes_total"
NODE_NETWORK_TRANSMIT = "stepscope_node_network_transmit_bytes_total"
NODE_FILESYSTEM_SIZE = "stepscope_node_filesystem_size_bytes"
NODE_FILESYSTEM_AVAIL = "stepscope_node_filesystem_avail_bytes"

GPU_COLLECTOR_UP = "stepscope_gpu_collector_up"
GPU_UP = "stepscope_gpu_up"
GPU_INFO = "stepscope_gpu_info"
GPU_UTILIZATION = "stepscope_gpu_utilization_ratio"
GPU_MEMORY_UTILIZATION = "stepscope_gpu_memory_utilization_ratio"
GPU_MEMORY_USED = "stepscope_gpu_memory_used_bytes"
GPU_MEMORY_FREE = "stepscope_gpu_memory_free_bytes"
GPU_MEMORY_TOTAL = "stepscope_gpu_memory_total_bytes"
GPU_TEMPERATURE = "stepscope_gpu_temperature_celsius"
GPU_POWER = "stepscope_gpu_power_watts"
GPU_POWER_LIMIT = "stepscope_gpu_power_limit_watts"
GPU_ENERGY = "stepscope_gpu_energy_joules_total"
GPU_ENERGY_READ_TIME = "stepscope_gpu_energy_read_timestamp_seconds"
GPU_SM_CLOCK = "stepscope_gpu_sm_clock_hertz"
GPU_SM_CLOCK_MAX = "stepscope_gpu_sm_clock_max_hertz"
GPU_MEMORY_CLOCK = "stepscope_gpu_memory_clock_hertz"
GPU_CLOCK_EVENT_ACTIVE = "stepscope_gpu_clock_event_active"
GPU_CLOCK_EVENT_SECONDS = "stepscope_gpu_clock_event_seconds_total"
GPU_PCIE_RECEIVE = "stepscope_gpu_pcie_receive_bytes_per_second"
GPU_PCIE_TRANSMIT = "stepscope_gpu_pcie_transmit_bytes_per_second"
GPU_PCIE = (GPU_PCIE_RECEIVE, GPU_PCIE_TRANSMIT)
GPU_ECC_ERRORS = "stepscope_gpu_ecc_errors_total"
GPU_XID_ERRORS = "stepscope_gpu_xid_errors_total"
GPU_XID_LAST_SEEN = "stepscope_gpu_xid_last_seen_timestamp_seconds"
GPU_SM_ACTIVE = "stepscope_gpu_sm_active_ratio"
GPU_SM_OCCUPANCY = "stepscope_gpu_sm_occupancy_ratio"
GPU_TENSOR_ACTIVE = "stepscope_gpu_tensor_active_ratio"
GPU_DRAM_ACTIVE = "stepscope_gpu_dram_active_ratio"
GPU_NVLINK_RECEIVE = "stepscope_gpu_nvlink_receive_bytes_per_second"
GPU_NVLINK_TRANSMIT = "stepscope_gpu_nvlink_transmit_bytes_per_second"
GPU_NVLINK = (GPU_NVLINK_RECEIVE, GPU_NVLINK_TRANSMIT)
GPU_C2C_RECEIVE = "stepscope_gpu_c2c_receive_bytes_per_second"
GPU_C2C_TRANSMIT = "stepscope_gpu_c2c_transmit_bytes_per_second"
GPU_C2C = (GPU_C2C_RECEIVE, GPU_C2C_TRANSMIT)

PROCESS_CPU_SECONDS = "stepscope_process_cpu_seconds_total"
PROCESS_RESIDENT_MEMORY = "stepscope_process_resident_memory_bytes"
PROCESS_IO_READ = "stepscope_process_io_read_bytes_total"
PROCESS_IO_WRITE = "stepscope_process_io_write_bytes_total"
PROCESS_CHILDREN = "stepscope_process_children"
PROCESS_GPU_MEMORY = "stepscope_process_gpu_memory_bytes"
# Pod attribution on Kubernetes (--kubelet-pod-resources-socket, docs/cluster.md): the pod container a GPU is
# given to, and the pod container of a registered training process with each GPU that container holds.
GPU_POD_INFO = "stepscope_gpu_pod_info"
PROCESS_POD_INFO = "stepscope_process_pod_info"
POD = ("namespace", "pod", "container")

COLLECTOR_DURATION = "stepscope_exporter_collector_duration_seconds"
COLLECTOR_ERRORS = "stepscope_exporter_collector_errors_total"
COLLECTOR_LAST_SUCCESS = "stepscope_exporter_collector_last_success_timestamp_seconds"
BUILD_INFO = "stepscope_exporter_build_info"
EXPORTER_START_TIME = "stepscope_exporter_start_time_seconds"
NODE_TIME = "stepscope_exporter_time_seconds"
INGEST_ACCEPTED = "stepscope_exporter_ingest_accepted_total"
INGEST_REJECTED = "stepscope_exporter_ingest_rejected_total"
INGEST_GROUPS = "stepscope_exporter_ingest_groups"
TLS_CERTIFICATE_EXPIRY = "stepscope_exporter_tls_certificate_expiry_timestamp_seconds"
EXPORTER_CPU = "stepscope_exporter_cpu_seconds_total"

STEP_PHASE_SECONDS = "stepscope_step_phase_seconds"
STEP_SECONDS = "stepscope_step_seconds"
STEPS_TOTAL = "stepscope_steps_total"
SAMPLES_TOTAL = "stepscope_samples_total"
MICRO_BATCHES_TOTAL = "stepscope_micro_batches_total"
STATE_SECONDS = "stepscope_state_seconds_total"
TRAINING_INFO = "stepscope_training_info"
TRAINING_STATE = "stepscope_training_state"
TRAINING_LAST_PUSH = "stepscope_training_last_push_timestamp_seconds"
TRAINING_LAST_STEP = "stepscope_training_last_step_timestamp_seconds"
TRAINING_PHASE_ENTERED = "stepscope_training_phase_entered_timestamp_seconds"
TRAINING_GLOBAL_STEP = "stepscope_training_global_step"
TRAINING_GLOBAL_STEP_START = "stepscope_training_global_step_start"
CUDA_MEMORY_ALLOCATED = "stepscope_torch_cuda_memory_allocated_bytes"
CUDA_MEMORY_RESERVED = "stepscope_torch_cuda_memory_reserved_bytes"
CUDA_MEMORY_PEAK = "stepscope_torch_cuda_memory_peak_allocated_bytes"
CUDA_MEMORY_INACTIVE_SPLIT = "stepscope_torch_cuda_memory_inactive_split_bytes"
CUDA_ALLOC_RETRIES = "stepscope_torch_cuda_alloc_retries_total"
CUDA_OOMS = "stepscope_torch_cuda_ooms_total"
LOADER_LIMIT = "stepscope_loader_limit_samples_per_second"
COMPUTE_LIMIT = "stepscope_compute_limit_samples_per_second"
TRACE_BYTES = "stepscope_profile_trace_bytes"
TRACE_STEPS = "stepscope_profile_trace_steps"
TRACE_TIMESTAMP = "stepscope_profile_trace_timestamp_seconds"
TOKENS_TOTAL = "stepscope_tokens_total"
MODEL_FLOPS_TOTAL = "stepscope_model_flops_total"
PEAK_FLOPS = "stepscope_peak_flops_per_second"
# The labels a push's URL carries (/metrics/job/stepscope/run/<run>/rank/<rank>), never its body.
PATH_LABELS = RUN_RANK
# The header of an accepted push's answer naming the exporter process that stored it, new at each start. Hooks that
# left out what an older exporter refused push it all again once the answer comes from another process (an upgrade
# that restarted the exporter between two pushes, which no failed push revealed); a release without it never sends it.
EXPORTER_INSTANCE_HEADER = "Stepscope-Exporter-Instance"


@dataclass(frozen=True)
class Family:
    """One family as a scrape shows it: counters named with `_total`, histograms by their base name.

    `labels` are on every series (without `le`, `job` and `instance`); `optional` ones may be left out
    (older clients do). `kind` "info" means value 1 with identity labels, "state set" one series per
    state, 1 for the current one. `doc` is the meaning in that table; `help` is the exposed HELP where this
    table is the renderer's source (the pushed families and what the exporter adds to them).
    """

    name: str
    type: str
    labels: tuple[str, ...]
    doc: str
    kind: str = ""
    optional: tuple[str, ...] = ()
    label_notes: Mapping[str, str] = field(default_factory=dict)  # label -> its values, for that table
    help: str = ""
    pushed: bool = False  # sent by the training hooks through the push API


def _gpu(name: str, type_: str, doc: str, *extra: str, **kwargs: object) -> Family:
    return Family(name, type_, (*GPU, *extra), doc, **kwargs)  # type: ignore[arg-type]


_CLOCK_EVENT_REASONS = (
    "1 for each active clock-event (throttle) reason: `gpu_idle`, `applications_clocks_setting`, `sw_power_cap`, "
    "`hw_slowdown`, `sync_boost`, `sw_thermal_slowdown`, `hw_thermal_slowdown`, `hw_power_brake_slowdown`, "
    "`display_clock_setting`")
_THROTTLE_POLICIES = (
    "cumulative time clocks were held down, per NVML policy: `power`, `thermal`, `sync_boost`, `board_limit`, "
    "`low_utilization`, `reliability`, `app_clocks`, `base_clocks` (read every 10 s)")
_PCIE = ("PCIe throughput: GPM average since the last cycle on Hopper+; older GPUs a 20 ms window every 10 s "
         "(none with `--no-gpu-pcie-poll`)")
_NVLINK = ("NVLink throughput, all links together (GPM average since the last cycle; absent without GPM or where "
           "GPM refuses it)")
_C2C = "NVLink-C2C throughput between a Grace Hopper GPU and its CPU (GPM; absent on GPUs without C2C)"
_GPM = "NVML GPM (Hopper and newer only; absent elsewhere)"
_PHASE_DOC = (
    "pushed by the hooks: time per step phase (only `le=\"+Inf\"` unless phase buckets are on); `timing` says "
    "what it holds: `host` (wall time), `cuda_event` (CUDA event time of sampled steps, each counting for the "
    "untimed ones), `cuda_sync` (`sync=True`); older clients omit it")
_ALLOCATOR_DOC = "pushed on CUDA: torch.cuda.memory_stats() summed over the rank's devices, read at each push; "
_LIMITS_DOC = (
    "pushed after `tracker.measure_limits`: samples/s of the loader alone and of the training step alone "
    "([limits](hooks.md#loader-and-compute-limits))")
_TRACE_DOC = (
    "pushed: the rank's latest profiler trace (gzipped, on the rank's node at `path`), its steps, when written; "
    "one series each per rank ([traces](hooks.md#profiler-traces-on-demand))")

_MFU_DOC = "pushed once stated: tokens and model FLOPs done ([MFU](mfu.md))"

_NODE = (
    Family(NODE_INFO, "gauge", ("hostname", "kernel", "os"), "node identity (the hostname in the node's "
           "`/etc/hostname` under `--path.rootfs`, where a pod's own would be the pod's name)", kind="info"),
    Family(NODE_CPU_SECONDS, "counter", ("mode",), "CPU time summed over all CPUs"),
    Family(NODE_CPUS, "gauge", (),
           'logical CPUs: `rate(cpu_seconds_total{mode!~"idle\\|iowait"})/cpus` is utilization'),
    *(Family(n, "gauge", (), "host memory") for n in (NODE_MEMORY_TOTAL, NODE_MEMORY_AVAILABLE)),
    *(Family(n, "counter", ("device",), "disk throughput") for n in (NODE_DISK_READ_BYTES, NODE_DISK_WRITTEN_BYTES)),
    *(Family(n, "counter", ("device",), "disk IOPS") for n in (NODE_DISK_READS, NODE_DISK_WRITES)),
    Family(NODE_DISK_IO_TIME, "counter", ("device",), "time the disk was busy"),
    *(Family(n, "counter", ("device",), "network throughput (tc's ifb devices left out: their bytes are another "
             "interface's; so are containers' veth pairs, CNI bridges and tunnels, whose traffic the physical "
             "interfaces carry too: `--collector.node.netdev-exclude`); the node's interfaces from a container of "
             "its own network namespace with `--collector.node.host-network`")
      for n in (NODE_NETWORK_RECEIVE, NODE_NETWORK_TRANSMIT)),
    *(Family(n, "gauge", ("path", "mountpoint"), "space for `--filesystem-paths`, read every 5 s at most; a path that "
             "does not answer within 1 s (a hung mount) is left out, and logged, until it does. Both labels are the "
             "node's: in a container, the paths are read under `--path.rootfs` (the node's root mounted there)")
      for n in (NODE_FILESYSTEM_SIZE, NODE_FILESYSTEM_AVAIL)),
)
_GPUS = (
    Family(GPU_COLLECTOR_UP, "gauge", (), "1 when NVML initialised, 0 otherwise (no GPU, no driver)"),
    _gpu(GPU_UP, "gauge", "1 while the GPU answers, 0 once lost (its readings are then absent; `_info` and XID "
                          "counts stay)"),
    _gpu(GPU_INFO, "gauge", "GPU identity", "name", "driver_version", "pci_bus_id", kind="info"),
    _gpu(GPU_UTILIZATION, "gauge", "kernel-active time fraction"),
    _gpu(GPU_MEMORY_UTILIZATION, "gauge", "memory-controller busy fraction"),
    *(_gpu(n, "gauge", "framebuffer memory") for n in (GPU_MEMORY_USED, GPU_MEMORY_FREE, GPU_MEMORY_TOTAL)),
    _gpu(GPU_TEMPERATURE, "gauge", "die temperature"),
    *(_gpu(n, "gauge", "draw and enforced limit") for n in (GPU_POWER, GPU_POWER_LIMIT)),
    _gpu(GPU_ENERGY, "counter", "energy since driver load (read every `--collector.gpu.slow-interval`, 10 s)"),
    Family(GPU_ENERGY_READ_TIME, "gauge", (), "when the node's published energy counters were read (one round): "
                                              "the rules divide a counter's increase by this one's"),
    *(_gpu(n, "gauge", "clocks") for n in (GPU_SM_CLOCK, GPU_MEMORY_CLOCK)),
    _gpu(GPU_SM_CLOCK_MAX, "gauge", "the SM clock's maximum: capping or throttling costs the clock below it "
         "(read once, when the GPU is found: on an H100 the call costs 1.46 ms of CPU)"),
    _gpu(GPU_CLOCK_EVENT_ACTIVE, "gauge", _CLOCK_EVENT_REASONS, "reason", kind="state set"),
    _gpu(GPU_CLOCK_EVENT_SECONDS, "counter", _THROTTLE_POLICIES, "reason"),
    *(_gpu(n, "gauge", _PCIE) for n in GPU_PCIE),
    _gpu(GPU_ECC_ERRORS, "counter", "ECC errors", "type", label_notes={"type": "corrected, uncorrected"}),
    _gpu(GPU_XID_ERRORS, "counter", "XID events seen since exporter start", "xid"),
    _gpu(GPU_XID_LAST_SEEN, "gauge", "when that XID last fired", "xid"),
    *(_gpu(n, "gauge", _GPM) for n in (GPU_SM_ACTIVE, GPU_SM_OCCUPANCY, GPU_TENSOR_ACTIVE, GPU_DRAM_ACTIVE)),
    *(_gpu(n, "gauge", _NVLINK) for n in GPU_NVLINK),
    *(_gpu(n, "gauge", _C2C) for n in GPU_C2C),
)
_PROCESSES = (
    Family(PROCESS_CPU_SECONDS, "counter", PROCESS, "CPU of the process plus its children (data-loader workers)"),
    Family(PROCESS_RESIDENT_MEMORY, "gauge", PROCESS, "RSS of the process plus its children"),
    *(Family(n, "counter", PROCESS, "storage I/O of the process plus its children")
      for n in (PROCESS_IO_READ, PROCESS_IO_WRITE)),
    Family(PROCESS_CHILDREN, "gauge", PROCESS, "live descendant processes (data-loader workers)"),
    Family(PROCESS_GPU_MEMORY, "gauge", (*PROCESS, "gpu", "holder"),
           "GPU memory the process holds; a registered rank's includes its descendants' (data-loader workers) on "
           "the GPUs it holds",
           label_notes={"holder": ", ".join(GPU_HOLDERS)}),
    Family(GPU_POD_INFO, "gauge", ("uuid", *POD), "the pod container the kubelet gave the GPU to (Kubernetes only)",
           kind="info"),
    Family(PROCESS_POD_INFO, "gauge", (*PROCESS, *POD, "uuid"),
           "a registered process's pod container, once per GPU that container holds (Kubernetes only)", kind="info"),
)
_SELF = (
    Family(COLLECTOR_DURATION, "gauge", ("collector",),
           "last cycle's wall time, or the cycle under way once it has run for three intervals, 10 s at least (a "
           "hung call: the collector's families are then left out of `/metrics` until it returns)"),
    Family(COLLECTOR_ERRORS, "counter", ("collector",),
           "failed cycles, a cycle left out for running three intervals (10 s at least), and cycles that left a "
           "reading out (`node`: the network counters of `--collector.node.host-network` where PID 1's "
           "`/proc/1/net/dev` cannot be read, a `--filesystem-paths` path that is missing or whose read hangs; "
           "`gpu`: an NVML query (energy and clock-event time too) failing with an error other than "
           "NotSupported/FunctionNotFound, e.g. Timeout, "
           "Unknown, Uninitialized, while a lost GPU is `stepscope_gpu_up 0`, not counted here; `pods`: a "
           "kubelet List that failed while its last answer is kept); the log says which, once at WARNING until "
           "the reading is back"),
    Family(COLLECTOR_LAST_SUCCESS, "gauge", ("collector",), "last good cycle"),
    Family(EXPORTER_CPU, "counter", ("part",),
           "the exporter's CPU time by part (Linux), read once a collect interval: `node`, `gpu`, `process` "
           "(a collector's cycles and its helper threads: the GPU's slow readings and XID events), `server` "
           "(HTTP: scrapes, pushes, password checks)", label_notes={"part": "node, gpu, process, server"}),
    Family(BUILD_INFO, "gauge", ("version", "python_version"), "build", kind="info"),
    Family(EXPORTER_START_TIME, "gauge", (),
           f"when the exporter started (Unix seconds): for {SETTLE_SECONDS} s after it the rules hold the readings "
           "it does not serve yet, until every rank has pushed again ([alerts](alerts.md#scrape-gaps))"),
    Family(NODE_TIME, "gauge", (),
           "the node's clock (Unix seconds) when the scrape was answered; less `timestamp()` of it, how far the node's "
           "clock is off, which the rules take out of every time the node stamps ([clock skew](alerts.md#clock-skew))"),
    Family(INGEST_ACCEPTED, "counter", (), "pushes stored"),
    Family(INGEST_REJECTED, "counter", ("reason",), "pushes refused, by reason (every reason present from start)"),
    Family(INGEST_GROUPS, "gauge", (), "(run, rank) groups stored"),
    Family(TLS_CERTIFICATE_EXPIRY, "gauge", (),
           "when the served TLS certificate expires (notAfter; only with TLS): alert well before it"),
)
_TRAINING = (
    Family(STEP_PHASE_SECONDS, "histogram", (*RUN_RANK, "phase"), _PHASE_DOC, optional=("timing",),
           help="Time spent in each phase of a training step (timing: host = wall time; cuda_event = CUDA event "
                "time of sampled steps, each counting for the untimed ones before it; cuda_sync = wall time "
                "between synchronizes).", pushed=True),
    Family(STEP_SECONDS, "histogram", RUN_RANK,
           "pushed: whole step time (buckets follow the run: fine blocks where the rank's steps fall, a block "
           "unused 30 s may leave for one in use; the histogram appears with the first step)",
           help="Wall time between consecutive step boundaries (the whole step).", pushed=True),
    Family(STEPS_TOTAL, "counter", RUN_RANK, "pushed: steps (optimizer steps) and samples done",
           help="Training steps completed: optimizer steps, whatever the gradient accumulation.", pushed=True),
    Family(SAMPLES_TOTAL, "counter", RUN_RANK, "pushed: steps (optimizer steps) and samples done",
           help="Training samples processed.", pushed=True),
    Family(MICRO_BATCHES_TOTAL, "counter", RUN_RANK,
           "pushed: batches fed to the model; more than steps where gradients accumulate over several",
           help="Training batches fed to the model (micro-batches: several per step under gradient "
                "accumulation).", pushed=True),
    Family(TRAINING_INFO, "gauge", (*RUN_RANK, "local_rank", "world_size", "pid", "framework"),
           "pushed: rank identity; `pid` as the process sees it, `start_time` its creation time (Unix seconds), "
           "`pid_namespace` the inode of its pid namespace (/proc/self/ns/pid)",
           kind="info", optional=("start_time", "pid_namespace"), help="Identity of the training process (value 1).",
           pushed=True),
    Family(TRAINING_STATE, "gauge", (*RUN_RANK, "state"), "pushed: 1 for the rank's current state",
           kind="state set", help="Current state of the training process (1 for the current state).",
           pushed=True),
    Family(STATE_SECONDS, "counter", (*RUN_RANK, "state"),
           "pushed: seconds spent in each state, so a state shorter than a push interval still counts",
           help="Seconds the training process spent in each state (every state from the start).", pushed=True),
    Family(TRAINING_LAST_STEP, "gauge", RUN_RANK,
           "pushed: when the rank's last step ended, or the last micro-batch of the step under way was counted "
           "(absent before the rank's first step): a run stalls when it stops moving",
           help="Unix time the last step or micro-batch ended (absent before the first step).", pushed=True),
    Family(TRAINING_PHASE_ENTERED, "gauge", (*RUN_RANK, "phase"),
           "pushed: the host-timed phase the rank entered last and has not left, with when it entered it; "
           "absent between phases",
           help="Unix time the rank entered the phase it is in (host-timed phases).", pushed=True),
    Family(CUDA_MEMORY_ALLOCATED, "gauge", RUN_RANK, _ALLOCATOR_DOC + "bytes held by tensors",
           help="Bytes PyTorch's caching allocator has given to tensors (all CUDA devices of the rank).",
           pushed=True),
    Family(CUDA_MEMORY_RESERVED, "gauge", RUN_RANK, _ALLOCATOR_DOC + "bytes held from the GPU: allocated + cached",
           help="Bytes PyTorch's caching allocator holds on the GPU, allocated or cached for reuse.", pushed=True),
    Family(CUDA_MEMORY_PEAK, "gauge", RUN_RANK, _ALLOCATOR_DOC + "the most allocated at once since the last push",
           help="Peak bytes allocated to tensors since the previous push (peak statistics reset at each push).",
           pushed=True),
    Family(CUDA_MEMORY_INACTIVE_SPLIT, "gauge", RUN_RANK,
           _ALLOCATOR_DOC + "cached blocks split below reuse (fragmentation)",
           help="Bytes in cached blocks split too small to reuse (allocator fragmentation).", pushed=True),
    Family(CUDA_ALLOC_RETRIES, "counter", RUN_RANK,
           _ALLOCATOR_DOC + "allocations that flushed the cache and retried: steps slow down before an OOM",
           help="Allocations that failed, freed the allocator's cache and retried.", pushed=True),
    Family(CUDA_OOMS, "counter", RUN_RANK, _ALLOCATOR_DOC + "out-of-memory errors the allocator raised",
           help="Out-of-memory errors raised by PyTorch's caching allocator.", pushed=True),
    Family(TRAINING_GLOBAL_STEP, "gauge", RUN_RANK,
           "pushed once the loop passes it (`step(global_step=...)`, the framework callbacks): the trainer's "
           "global step, which goes back when a restarted run restores a checkpoint ([goodput](goodput.md))",
           help="The trainer's global step after the last step (lower after a restore from a checkpoint).",
           pushed=True),
    Family(TRAINING_GLOBAL_STEP_START, "gauge", RUN_RANK,
           "pushed with the global step: the global step the rank's steps count from since its process started "
           "or last restored a checkpoint (its global step stepped back): where the steps a restore does again "
           "begin, also for a restore in the same process, whose steps counter goes on ([goodput](goodput.md))",
           help="The global step this process's steps count from (the checkpoint's after a restore).",
           pushed=True),
    Family(TRAINING_LAST_PUSH, "gauge", RUN_RANK,
           "when the rank last pushed (groups expire `--ingest-ttl` after it)",
           help="Unix time of the last accepted push of this run and rank (pushes without steps = stalled)."),
    Family(LOADER_LIMIT, "gauge", RUN_RANK, _LIMITS_DOC, pushed=True,
           help="Samples per second the training loader delivers with training mocked out "
                "(tracker.measure_limits)."),
    Family(COMPUTE_LIMIT, "gauge", RUN_RANK, _LIMITS_DOC, pushed=True,
           help="Samples per second of the training step on one cached batch, the loader mocked out "
                "(tracker.measure_limits)."),
    Family(TRACE_BYTES, "gauge", (*RUN_RANK, "path"), _TRACE_DOC, pushed=True,
           help="Size of the rank's latest PyTorch profiler trace (gzipped Chrome trace at path)."),
    Family(TRACE_STEPS, "gauge", (*RUN_RANK, "path"), _TRACE_DOC, pushed=True,
           help="Training steps the rank's latest profiler trace holds."),
    Family(TRACE_TIMESTAMP, "gauge", (*RUN_RANK, "path"), _TRACE_DOC, pushed=True,
           help="Unix time the rank's latest profiler trace was written."),
    Family(TOKENS_TOTAL, "counter", RUN_RANK, _MFU_DOC,
           help="Training tokens processed (as the training loop or its framework counts them).", pushed=True),
    Family(MODEL_FLOPS_TOTAL, "counter", (*RUN_RANK, "dtype"), _MFU_DOC,
           label_notes={"dtype": "the math the model's FLOPs run in: fp8, bf16, fp16, tf32, fp32"},
           help="Floating-point operations the model needs for the steps done (stated or counted once), by the "
                "dtype they run in.", pushed=True),
    Family(PEAK_FLOPS, "gauge", RUN_RANK,
           "pushed when the user states it (`peak_flops=`): the dense peak FLOP/s of the GPU the rank uses, "
           "instead of the table's",
           help="Dense peak FLOP/s of the GPU this rank uses, as the user stated it (overrides the table).",
           pushed=True),
)

FAMILIES: Mapping[str, Family] = {f.name: f for f in (*_NODE, *_GPUS, *_PROCESSES, *_SELF, *_TRAINING)}


def family(name: str) -> Family:
    """The family of that name; a KeyError names it, so a consumer of a renamed family fails at import."""
    return FAMILIES[name]


def selector(name: str, matchers: str) -> str:
    """The PromQL selector of a family or recorded series with `matchers` (`run="$run"`)."""
    return f"{name}{{{matchers}}}"


def sample_names(families: Mapping[str, Family] = FAMILIES) -> frozenset[str]:
    """The names PromQL can select: a histogram's `_bucket`, `_sum` and `_count`, every other family's own."""
    names: set[str] = set()
    for spec in families.values():
        if spec.type == "histogram":
            names |= {f"{spec.name}{suffix}" for suffix in ("_bucket", "_sum", "_count")}
        else:
            names.add(spec.name)
    return frozenset(names)


SAMPLE_NAMES = sample_names()

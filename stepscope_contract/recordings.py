"""The recorded series the dashboards, the report and the alerts read, one constant each.

The rules files (grafana/rules/*.rules.yml) must produce every name here with a `record:` rule;
tests/test_contract.py fails while one is missing, and tests/test_dashboards.py while a recorded series
goes unread. A rename is an edit here plus the same edit to the `record:` line.
"""

from stepscope.contract import families
from stepscope.contract.families import selector

# The exporters and GPU collectors Prometheus knows as such, for as long as they stay down: StepscopeExporterDown
# and StepscopeGpuCollectorDown fire on a target that served stepscope (an NVML that answered), and a lookback of
# an hour resolved them after an hour of a node still down.
EXPORTER_KNOWN = "instance:stepscope_exporter_known:info"
GPU_COLLECTOR_KNOWN = "instance:stepscope_gpu_collector_known:info"
NODE_CPU_UTILIZATION = "instance:stepscope_node_cpu_utilization:ratio"
NODE_MEMORY_UTILIZATION = "instance:stepscope_node_memory_utilization:ratio"
# How far each node's clock is off the rules' (seconds, + ahead): every rule that compares a time the node stamped
# with time(), or with another node's, takes it out.
NODE_CLOCK_OFFSET = "instance:stepscope_node_clock_offset:seconds"

# The GPU source layer: each GPU's readings from stepscope's GPU collector, or from dcgm-exporter's series where
# the collector is off (docs/cluster.md); every GPU recording below reads these, never a source itself.
GPU_SOURCE_UTILIZATION = "instance_gpu:stepscope_gpu_utilization_ratio:source"
GPU_SOURCE_SM_ACTIVE = "instance_gpu:stepscope_gpu_sm_active_ratio:source"
GPU_SOURCE_TENSOR_ACTIVE = "instance_gpu:stepscope_gpu_tensor_active_ratio:source"
GPU_SOURCE_MEMORY_USED = "instance_gpu:stepscope_gpu_memory_used_bytes:source"  # dcgm: with its pod labels
GPU_SOURCE_MEMORY_TOTAL = "instance_gpu:stepscope_gpu_memory_total_bytes:source"
# StepscopeGpuThrottling's readings from either source, recorded in the alert's group just before it
GPU_SOURCE_CLOCK_EVENT_ACTIVE = "instance_gpu_reason:stepscope_gpu_clock_event_active:source"  # label `reason`
GPU_SOURCE_SM_CLOCK = "instance_gpu:stepscope_gpu_sm_clock_hertz:source"
GPU_SOURCE_SM_CLOCK_MAX = "instance_gpu:stepscope_gpu_sm_clock_max_hertz:source"
# The SM clock of each GPU at the evaluations its power cap is active (absent otherwise): StepscopeGpuThrottling
# averages it over 5m instead of a [5m:] subquery re-evaluating the join at every step
GPU_SM_CLOCK_POWER_CAPPED = "instance_gpu:stepscope_gpu_sm_clock_hertz:power_capped"
# Each GPU's power from its energy counter (watts: joules per second over 1m), from either source
GPU_SOURCE_ENERGY_RATE = "instance_gpu:stepscope_gpu_energy_joules:rate1m"
# dcgm-exporter's fill-ins for the Node dashboard's other GPU readings: its field alone, in stepscope's units
# (a panel reads stepscope's family `or on (instance, gpu)` the fill-in), so a node with stepscope's GPU
# collector and no dcgm-exporter records none of them; `direction` receive/transmit for the links, `type`
# corrected/uncorrected for ECC.
GPU_DCGM_MEMORY_FREE = "instance_gpu:stepscope_gpu_memory_free_bytes:dcgm"
GPU_DCGM_MEMORY_UTILIZATION = "instance_gpu:stepscope_gpu_memory_utilization_ratio:dcgm"
GPU_DCGM_TEMPERATURE = "instance_gpu:stepscope_gpu_temperature_celsius:dcgm"
GPU_DCGM_POWER = "instance_gpu:stepscope_gpu_power_watts:dcgm"
GPU_DCGM_POWER_LIMIT = "instance_gpu:stepscope_gpu_power_limit_watts:dcgm"
GPU_DCGM_MEMORY_CLOCK = "instance_gpu:stepscope_gpu_memory_clock_hertz:dcgm"
GPU_DCGM_SM_OCCUPANCY = "instance_gpu:stepscope_gpu_sm_occupancy_ratio:dcgm"
GPU_DCGM_DRAM_ACTIVE = "instance_gpu:stepscope_gpu_dram_active_ratio:dcgm"
GPU_DCGM_PCIE = "instance_gpu_direction:stepscope_gpu_pcie_bytes_per_second:dcgm"
GPU_DCGM_NVLINK = "instance_gpu_direction:stepscope_gpu_nvlink_bytes_per_second:dcgm"
GPU_DCGM_ECC_ERRORS = "instance_gpu_type:stepscope_gpu_ecc_errors:dcgm"
# StepscopeGpuXidErrors', StepscopeGpuDown's and StepscopeGpuCollectorDown's readings from dcgm-exporter (on a
# node with stepscope's GPU collector they read its families): when each XID (label `xid`) was seen (when the
# last-XID gauge turned to a new number), whether each GPU answers (its series go on while the node's
# dcgm-exporter is scraped) and whether the node's dcgm-exporter target is up.
GPU_DCGM_XID_LAST_SEEN = "instance_gpu_xid:stepscope_gpu_xid_last_seen_timestamp_seconds:dcgm"
GPU_DCGM_UP = "instance_gpu:stepscope_gpu_up:dcgm"
GPU_DCGM_COLLECTOR_UP = "instance:stepscope_gpu_collector_up:dcgm"
# StepscopeGpuDown's GPUs that stepscope's collector read (by uuid) and the node's exporter publishes no more: a
# restarted exporter asks NVML afresh, which lists a GPU fallen off the bus no more, or unidentified.
GPU_GONE = "instance_gpu:stepscope_gpu_up:gone"
GPU_UTILIZATION = "instance_gpu:stepscope_gpu_utilization:avg_ratio"  # NVML, 1m average
GPU_EFFECTIVE_UTILIZATION = "instance_gpu:stepscope_gpu_effective_utilization:avg_ratio"  # label `source`
NODE_GPU_EFFECTIVE_UTILIZATION = "instance:stepscope_gpu_effective_utilization:avg_ratio"
GPU_MEMORY_USED_RATIO = "instance_gpu:stepscope_gpu_memory_used:ratio"
RANK_GPU_MEMORY = "instance_gpu_run_rank:stepscope_process_gpu_memory_bytes:sum"  # the GPU <-> rank mapping
# PyTorch's allocators of the ranks on each GPU (pushed, docs/alerts): tensors' bytes and cached-but-free bytes,
# which tell a full cache from real pressure when the GPU's memory is nearly full.
GPU_TORCH_ALLOCATED = "instance_gpu:stepscope_torch_cuda_memory_allocated_bytes:sum"
GPU_TORCH_CACHED = "instance_gpu:stepscope_torch_cuda_memory_cached_bytes:sum"
RUN_GPU_EFFECTIVE_UTILIZATION_BY_GPU = "instance_gpu_run:stepscope_gpu_effective_utilization:avg_ratio"
RUN_GPU_UTILIZATION_BY_GPU = "instance_gpu_run:stepscope_gpu_utilization:avg_ratio"
RUN_GPU_TENSOR_ACTIVE_BY_GPU = "instance_gpu_run:stepscope_gpu_tensor_active:avg_ratio"
RUN_GPU_SM_ACTIVE_BY_GPU = "instance_gpu_run:stepscope_gpu_sm_active:avg_ratio"
# The alerts' GPU readings, the 1m training ones carried through eval and checkpoint breaks
RUN_GPU_UTILIZATION_TRAINED = "instance_gpu_run:stepscope_gpu_utilization_trained:avg_ratio"
RUN_GPU_SM_ACTIVE_TRAINED = "instance_gpu_run:stepscope_gpu_sm_active_trained:avg_ratio"
RUN_GPU_TENSOR_ACTIVE_TRAINED = "instance_gpu_run:stepscope_gpu_tensor_active_trained:avg_ratio"
# The readings of each GPU a settled training rank holds memory on, sampled at every evaluation: the
# 1m averages above (NVML, SM active, tensor) read only these, so setup and warm-up never dilute them.
RUN_GPU_UTILIZATION_TRAINING = "instance_gpu_run:stepscope_gpu_utilization:training_ratio"
RUN_GPU_SM_ACTIVE_TRAINING = "instance_gpu_run:stepscope_gpu_sm_active:training_ratio"
RUN_GPU_TENSOR_ACTIVE_TRAINING = "instance_gpu_run:stepscope_gpu_tensor_active:training_ratio"
GPU_EFFECTIVE_UTILIZATION_IN_RUN = "instance_gpu:stepscope_gpu_effective_utilization_in_run:avg_ratio"
NODE_GPU_EFFECTIVE_UTILIZATION_IN_RUN = "instance:stepscope_gpu_effective_utilization_in_run:avg_ratio"
RUN_GPU_EFFECTIVE_UTILIZATION = "run:stepscope_gpu_effective_utilization:avg_ratio"
RUN_GPU_UTILIZATION = "run:stepscope_gpu_utilization:avg_ratio"
RUN_GPU_SM_ACTIVE = "run:stepscope_gpu_sm_active:avg_ratio"
RUN_GPU_TENSOR_ACTIVE = "run:stepscope_gpu_tensor_active:avg_ratio"

RANK_STEPS_RATE = "run_rank:stepscope_steps:rate1m"
RUN_STEPS_RATE = "run:stepscope_steps:rate1m"
RANK_SAMPLES_RATE = "run_rank:stepscope_samples:rate1m"
RUN_SAMPLES_RATE = "run:stepscope_samples:rate1m"
RUN_STEP_SECONDS_BUCKETS = "run_le:stepscope_step_seconds_bucket:rate1m"  # bounds every rank exports
RUN_STEP_SECONDS_P50 = "run:stepscope_step_seconds:p50_rate1m"
RUN_STEP_SECONDS_P95 = "run:stepscope_step_seconds:p95_rate1m"
RANK_STEP_SECONDS_MEAN = "run_rank:stepscope_step_seconds:mean_rate1m"
RANK_PHASE_SECONDS_PER_STEP = "run_rank_phase:stepscope_step_phase_seconds:per_step_rate1m"  # and `timing`
RANK_PHASE_SHARE_BY_TIMING = "run_rank_timing:stepscope_step_phase_seconds:share_rate1m"  # loader left out
RUN_PHASE_SHARE_BY_TIMING = "run_timing:stepscope_step_phase_seconds:share_rate1m"
RANK_DATALOADER_SHARE = "run_rank:stepscope_dataloader_share:ratio_rate1m"
RUN_DATALOADER_SHARE = "run:stepscope_dataloader_share:ratio_rate1m"
RANK_STRAGGLER_SCORE = "run_rank:stepscope_straggler_score:ratio"
RANK_LOCAL_SECONDS_PER_STEP = "run_rank:stepscope_step_local_seconds:per_step_rate1m"
RANK_STRAGGLER_LOCAL_SCORE = "run_rank:stepscope_straggler_local_score:ratio"
# The scores StepscopeStragglerRank reads (label `score`: step_time, local_phases), kept through eval breaks
RANK_STRAGGLER_ALERT_SCORES = "run_rank:stepscope_straggler_alert_scores:ratio"
RUN_TRAINING_RANKS = "run:stepscope_training_ranks:count"
RUN_BREAK_RANKS = "run:stepscope_break_ranks:count"  # ranks in an eval or checkpoint break: the verdict holds
# When the run's latest attempt started, as far as one shard sees its ranks: their latest start (last push less
# their state seconds); a rank lost before it is the killed attempt's
SHARD_RUN_ATTEMPT_START = "shard_run:stepscope_attempt_start:timestamp_seconds"
RANK_TRAINING_SETTLED = "run_rank:stepscope_training_settled:bool"  # in train now and 30 s-5.5 min ago
RUN_SETTLED_RANKS = "run:stepscope_training_settled_ranks:count"
RUN_GPUS = "run:stepscope_gpus:count"  # GPUs the run's ranks hold memory on
# Runs whose ranks hold memory on each GPU, plus 1 where processes the hooks do not know do (holder "foreign"): above
# 1, a GPU time-sliced (or under MPS) between runs, or with a stranger
GPU_RUNS = "instance_gpu:stepscope_gpu_runs:count"
# The GPUs whose readings are a run's training now: a rank of the run on it has trained 10 s without a break
RUN_GPU_TRAINING_READINGS = "instance_gpu_run:stepscope_gpu_training_readings:bool"
RUN_VERDICT = "run:stepscope_bottleneck:verdict"  # value 1, label `verdict`

RUN_LOADER_LIMIT = "run:stepscope_loader_limit_samples_per_second:sum"
RUN_COMPUTE_LIMIT = "run:stepscope_compute_limit_samples_per_second:sum"
RUN_SAMPLES_OF_MEASURED_RANKS = "run:stepscope_samples_of_measured_ranks:rate1m"
RANK_LOADER_COMPUTE_RATIO = "run_rank:stepscope_loader_compute_limit:ratio"
RUN_LIMITS_VERDICT = "run:stepscope_limits:verdict"  # value 1, label `verdict`

# Tokens/s and model FLOPs utilization (docs/mfu.md): the table's dense peak of each GPU by its NVML name
# (label `dtype`, stepscope.contract.peak_flops), each rank's rates, its peak (its GPUs' for its dtype, or
# the peak it states) and MFU = achieved model FLOP/s over that peak; per run over its ranks.
GPU_SOURCE_NAME = "instance_gpu:stepscope_gpu_info:source"  # label `name`: NVML's, or dcgm-exporter's modelName
GPU_PEAK_FLOPS = "instance_gpu:stepscope_gpu_peak_flops_per_second:table"
RANK_TOKENS_RATE = "run_rank:stepscope_tokens:rate1m"
RANK_MODEL_FLOPS_RATE = "run_rank:stepscope_model_flops:rate1m"
RANK_PEAK_FLOPS = "run_rank:stepscope_peak_flops_per_second:sum"
RANK_MFU = "run_rank:stepscope_mfu:ratio_rate1m"
RUN_TOKENS_RATE = "run:stepscope_tokens:rate1m"
RUN_MODEL_FLOPS_RATE = "run:stepscope_model_flops:rate1m"
RUN_PEAK_FLOPS = "run:stepscope_peak_flops_per_second:sum"
RUN_MFU = "run:stepscope_mfu:ratio_rate1m"
# What StepscopeMfuBelowTensorActivity compares: the MFU of minutes clear of eval and checkpoint breaks, carried
# through the breaks
RUN_MFU_HELD = "run:stepscope_mfu:held_ratio_rate1m"

# Seconds since each rank's last push while it has not closed (StepscopeRankLost's test): its last value tells
# the alert whether a rank that left the scrape (a failed scrape, an exporter restart) was lost when last seen
RANK_SINCE_LAST_PUSH = "run_rank:stepscope_training_since_last_push:seconds"
# The last push (on the rules' clock) of each rank StepscopeRankLost pages, carried from one evaluation to the next
# once its exporter drops it (--ingest-ttl), while the rest of its run is still there and nothing brought it back
RANK_LOST_LAST_PUSH = "run_rank:stepscope_lost_last_push:timestamp_seconds"
# The runs StepscopeTrainingStalled and StepscopeFirstStepStalled page (their value: the seconds), as one shard
# sees them: the run's warnings and hints stop while its stall pages, in the rules rather than through an
# Alertmanager inhibition, whose muted alerts' `resolved` is never sent (prometheus/alertmanager#2754)
SHARD_RUN_STALLED = "shard_run:stepscope_training_stalled:seconds"
# How many nodes push each run and rank while it is not idle nor lost: more than one is two jobs under one run
# name (the default is the script's name: `train` on every node that runs `python train.py`), whose steps,
# verdict and straggler scores the run rules mix into one run (StepscopeRunNameClash)
RANK_PUSHING_NODES = "run_rank:stepscope_pushing_nodes:count"
SHARD_RUN_FIRST_STEP_STALLED = "shard_run:stepscope_first_step_stalled:seconds"

# Where the GPU-hours go (docs/goodput.md). Seconds per second by cause (label `cause`: stepscope.contract.goodput)
# per rank and per run, each cause's share of the run's and the goodput (the productive share); a rank's stall
# now; the watts each run is charged on each GPU and per run, joules per sample; samples per second of training
# and its median over the past hour (StepscopeRunSlowerThanItself); GPUs held by a process but idle.
RANK_STALLED_SECONDS = "run_rank:stepscope_training_stalled:seconds"  # last push - last step while stalled
RANK_TIME_BY_CAUSE = "run_rank_cause:stepscope_time_seconds:rate1m"
RUN_TIME_BY_CAUSE = "run_cause:stepscope_time_seconds:rate1m"
RUN_TIME_SHARE_BY_CAUSE = "run_cause:stepscope_time_seconds:share_rate1m"
RUN_GOODPUT = "run:stepscope_goodput:ratio_rate1m"
GPU_RUN_ENERGY_RATE = "instance_gpu_run:stepscope_gpu_energy_joules:rate1m"  # watts charged to the run
RUN_ENERGY_RATE = "run:stepscope_gpu_energy_joules:rate1m"
RUN_ENERGY_PER_SAMPLE = "run:stepscope_gpu_energy_per_sample_joules:rate1m"
RUN_ENERGY_PER_TOKEN = "run:stepscope_gpu_energy_per_token_joules:rate1m"  # runs that count tokens (docs/mfu.md)
RUN_TRAINING_SAMPLES_RATE = "run:stepscope_samples_per_train_second:rate1m"
RUN_TRAINING_SAMPLES_BASELINE = "run:stepscope_samples_per_train_second:median1h"
# The same in tokens, for runs that count tokens: StepscopeRunSlowerThanItself compares these there (a longer sequence
# is fewer samples per second at the same tokens per second: a new stage of a curriculum, not a slower run)
RUN_TRAINING_TOKENS_RATE = "run:stepscope_tokens_per_train_second:rate1m"
RUN_TRAINING_TOKENS_BASELINE = "run:stepscope_tokens_per_train_second:median1h"
# What StepscopeRunSlowerThanItself compares with those: the readings of minutes clear of eval and checkpoint breaks,
# carried through the breaks
RUN_TRAINING_SAMPLES_HELD = "run:stepscope_samples_per_train_second:held_rate1m"
RUN_TRAINING_TOKENS_HELD = "run:stepscope_tokens_per_train_second:held_rate1m"
GPU_HELD_IDLE = "instance_gpu_run:stepscope_gpu_held_idle:bool"  # 1 per GPU and holding run (run "" unregistered)
# Lost progress: each rank's global step and the one its process started from, the run's (the least of its
# ranks'), and the global steps lost at the restore a rank is catching up from (0 for a rank that passes its
# global step and is not behind; the run's: the most of its ranks').
RANK_GLOBAL_STEP = "run_rank:stepscope_training_global_step:sum"
RANK_GLOBAL_STEP_START = "run_rank:stepscope_training_global_step_start:sum"  # where its steps count from (pushed)
RUN_GLOBAL_STEP_MIN = "run:stepscope_training_global_step:min"
RANK_STEPS_REDONE = "run_rank:stepscope_steps_redone:last_restore"
RUN_STEPS_REDONE = "run:stepscope_steps_redone:last_restore"


def rank_step_seconds_quantile(quantile: float, matchers: str, ranks: str = "") -> str:
    """Each selected rank's step-time quantile (1m window), at query time: recorded for every rank of a
    cluster it would re-read every step-time bucket each evaluation (benchmarks/results/scale.md), while a
    dashboard reads one run's. `>= 0` drops a rank without steps in the window (NaN) rather than plot it.
    `ranks`, a vector with `run` and `rank` labels, keeps only its ranks' buckets, before the sum: a panel that
    draws a few of 512 ranks interpolates their quantiles only. It filters the rates first: matching every rank's
    rates to every rank's buckets (`still_exported_step_buckets`) and only then to `ranks` took 8-38 s per line
    of the Training dashboard's "Step time p50 / p95 per rank" for 256 ranks over 6 hours (Prometheus 2.42, 1,000
    steps, benchmarks/bench_dashboard_queries.py), 3-6 s the other way round, with the same lines. Only the bounds
    the rank still exports count."""
    rates = still_exported_step_buckets(selector(families.STEP_SECONDS + '_bucket', matchers), ranks)
    return f"histogram_quantile({quantile}, sum by (run, rank, instance, le) ({rates})) >= 0"


def still_exported_step_buckets(buckets: str, ranks: str = "") -> str:
    """`rate(buckets[1m])` of the bucket series scraped now: not of a bound its rank dropped in the window; of the
    ranks of `ranks` only, where given (filtered first, the cheaper join).

    The hooks drop a block of fine bounds left unused for a while when they need room
    (stepscope.hooks.timing.FollowingLayout): the blocks of a run's slow first steps once it is fast. For a
    minute the dropped series is still in the rate window, its rate over its part of the window only, below the
    rates of the bounds under it once the run steps faster. Prometheus' histogram_quantile raises that dip;
    VictoriaMetrics 1.79's lowers every bucket below it to it and read the run's p50 1.8-2.7 s and p95 3.9 s
    for 45 ms steps for that minute (tests/test_dropped_bounds_e2e.py). Both engines mark a dropped series stale
    at the next scrape, so the plain selector no longer holds it."""
    rates = f"rate({buckets}[1m])"
    if ranks:
        rates = f"({rates} and on (run, rank) {ranks})"
    return f"({rates} and {buckets})"

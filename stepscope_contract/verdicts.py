"""The values of the `verdict` label: what the run rules conclude about a run, and what the dashboards
colour and the report explains. The rules source spells them `<<verdict:NAME>>`."""

# run:stepscope_bottleneck:verdict (recordings.RUN_VERDICT), first match wins
IDLE = "idle"  # no step in the last minute, or no rank in state train
DATA_BOUND = "data_bound"  # the data-loading share is over its threshold
GPU_BOUND = "gpu_bound"  # the run's GPUs are busy: the healthy state
GPU_BUSY_IDLE = "gpu_busy_idle"  # kernels run most of the time but the SMs do little
HOST_BOUND = "host_bound"  # anything else that steps: host work, copies, communication, CPU training
BOTTLENECK_VERDICTS = (IDLE, DATA_BOUND, GPU_BOUND, GPU_BUSY_IDLE, HOST_BOUND)

# run:stepscope_limits:verdict (recordings.RUN_LIMITS_VERDICT), after tracker.measure_limits
LOADER_BOUND = "loader_bound"  # the loader delivers fewer samples/s than the step consumes
COMPUTE_BOUND = "compute_bound"  # the run gets most of its compute limit
BELOW_LIMITS = "below_limits"  # the loader keeps up, yet the run gets less than its compute limit
LIMITS_VERDICTS = (LOADER_BOUND, COMPUTE_BOUND, BELOW_LIMITS)

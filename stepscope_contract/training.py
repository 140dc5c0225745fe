"""What a training step is made of: phase names, the state set, the `timing` values and the bucket grid.

The hooks time and push these; the ingest validator, the rules, the dashboards and the report read
them back, so they live here once.
"""

# The standard phases by role: the dashboards and the report explain a step through these.
DATA_LOADING_PHASE = "dataloader_next"  # waiting for the next batch: the numerator of the data-loading share
TO_DEVICE_PHASE = "to_device"  # the host-to-device copy of the batch
FORWARD_PHASE = "forward"
BACKWARD_PHASE = "backward"  # holds DDP's gradient all-reduce
OPTIMIZER_PHASE = "optimizer_step"
TRAIN_BATCH_PHASE = "train_batch"  # forward, backward and optimizer together, where a trainer does not split them
LR_SCHEDULER_PHASE = "step_lr_schedulers"
# Standard phase names (the seeds' vocabulary); users may add their own, bounded in count.
STANDARD_PHASES = (
    DATA_LOADING_PHASE, TO_DEVICE_PHASE, FORWARD_PHASE, BACKWARD_PHASE, OPTIMIZER_PHASE, TRAIN_BATCH_PHASE,
    LR_SCHEDULER_PHASE, "from_device", "reduce_metrics",
)
# The phases before a step's first collective: the local straggler score compares their sum across ranks,
# because synchronous data parallelism equalises whole step times and hides the slow rank.
LOCAL_PHASES = (DATA_LOADING_PHASE, TO_DEVICE_PHASE, FORWARD_PHASE)

# The fixed state set of stepscope_training_state: exactly one is 1 at any time.
SETUP_STATE = "setup"  # from the Tracker's start until its first step
TRAIN_STATE = "train"  # the state the verdict, the alerts and the report count as training
EVAL_STATE = "eval"
CHECKPOINT_STATE = "checkpoint"
IDLE_STATE = "idle"  # what close() and SIGTERM push
STATES = (SETUP_STATE, TRAIN_STATE, EVAL_STATE, CHECKPOINT_STATE, IDLE_STATE)

# What a run name (the `run` label) must be: the exporter refuses a push for any other, so the hooks refuse
# it at init rather than push into 400s for the whole run.
RUN_NAME_RULE = "non-empty printable text without quotes (' or \")"
# Grafana puts a single-valued variable into a query's `run="$run"` with its Prometheus escaping, which leaves
# a `"` as it is (the query no longer parses: every panel of the run is an error) and turns a `'` into `\\'`
# (a run that does not exist: every panel empty; grafana/grafana#48138). A run named so could be stored and
# alerted on, and never shown.
_QUOTES = frozenset("'\"")


def is_run_name(run: str) -> bool:
    """Whether the exporter takes `run` as a run label value: no tab, newline or other control character
    (str.isprintable: Unicode's printable characters and the ASCII space), and no quote (`_QUOTES`)."""
    return bool(run) and run.isprintable() and _QUOTES.isdisjoint(run)

# Values of stepscope_step_phase_seconds{timing}: what a phase histogram holds.
HOST_TIMING = "host"  # wall time on the host (perf_counter): CPU work, or launches of async GPU work
CUDA_EVENT_TIMING = "cuda_event"  # CUDA events on the stream: the GPU's own clock, idle gaps included
CUDA_SYNC_TIMING = "cuda_sync"  # wall time with a synchronize at each boundary (the hooks' debug mode)
TIMINGS = (HOST_TIMING, CUDA_EVENT_TIMING, CUDA_SYNC_TIMING)
GPU_TIMINGS = (CUDA_EVENT_TIMING, CUDA_SYNC_TIMING)  # a run that times these runs on a GPU

# The hooks' bucket grid: every observation is counted on a fine log grid, 2^(1/8) apart (1 ms * 2^(k/8),
# from 2^-10 ms to 2^17 ms), and a histogram exports a skeleton (every second octave) plus windows around
# its quantiles, at most MAX_EXPORTED_BOUNDS bounds (+Inf, _sum and _count on top).
STEPS_PER_OCTAVE = 8
GRID_OCTAVES = (-10, 17)
SKELETON_EVERY_OCTAVES = 2
MAX_EXPORTED_BOUNDS = 40

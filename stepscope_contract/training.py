"""What a training step is made of: phase names, the state set, the `timing` values and the bucket grid.

The hooks time and push these; the ingest validator, the rules, the dashboards and the report read
them back, so they live here once.
"""

# Standard phase names (the seeds' vocabulary); users may add their own, bounded in count.
STANDARD_PHASES = (
    "dataloader_next", "to_device", "forward", "backward", "optimizer_step", "train_batch",
    "step_lr_schedulers", "from_device", "reduce_metrics",
)
# Waiting for the next batch: the numerator of the data-loading share.
DATA_LOADING_PHASE = "dataloader_next"
# The phases before a step's first collective: the local straggler score compares their sum across ranks,
# because synchronous data parallelism equalises whole step times and hides the slow rank.
LOCAL_PHASES = ("dataloader_next", "to_device", "forward")

# The fixed state set of stepscope_training_state: exactly one is 1 at any time.
STATES = ("setup", "train", "eval", "checkpoint", "idle")

# Values of stepscope_step_phase_seconds{timing}: what a phase histogram holds.
TIMINGS = ("host", "cuda_event", "cuda_sync")

# The hooks' bucket grid: every observation is counted on a fine log grid, 2^(1/8) apart (1 ms * 2^(k/8),
# from 2^-10 ms to 2^17 ms), and a histogram exports a skeleton (every second octave) plus windows around
# its quantiles, at most MAX_EXPORTED_BOUNDS bounds (+Inf, _sum and _count on top).
STEPS_PER_OCTAVE = 8
GRID_OCTAVES = (-10, 17)
SKELETON_EVERY_OCTAVES = 2
MAX_EXPORTED_BOUNDS = 40

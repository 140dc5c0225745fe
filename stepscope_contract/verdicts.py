"""The values of the `verdict` label: what the run rules conclude about a run, and what the dashboards
colour and the report explains. The rules source spells them `<<verdict:NAME>>`."""

from stepscope.contract.thresholds import THRESHOLDS

# run:stepscope_bottleneck:verdict (recordings.RUN_VERDICT), first match wins; none while a run has
# trained less than THRESHOLDS["verdict_settle_seconds"] (the evidence is not in yet); through an eval or
# checkpoint break, and after it until the evidence is in again (THRESHOLDS["verdict_resume_seconds"] at most),
# the verdict from before it, for up to THRESHOLDS["pause_hold_seconds"]
IDLE = "idle"  # no step in the last minute, or no rank in state train
DATA_BOUND = "data_bound"  # the data-loading share is over its threshold
GPU_BUSY_IDLE = "gpu_busy_idle"  # the GPUs run kernels most of the time but their SMs do little
GPU_BOUND = "gpu_bound"  # the run's GPUs are busy (NVML utilization): the healthy state
HOST_BOUND = "host_bound"  # evidence of host time: the GPUs wait and the timed loader is not why, or
# a run without GPUs whose phases are host time (CPU training)
GPU_SHARED = "gpu_shared"  # every GPU of the run is another run's too (time-slicing, MPS), or a foreign process's:
# its readings count both tenants' kernels, so they say nothing about this one
UNDETERMINED = "undetermined"  # steps, but the evidence says none of these (untimed loader, no GPU reading)
BOTTLENECK_VERDICTS = (IDLE, DATA_BOUND, GPU_BUSY_IDLE, GPU_BOUND, HOST_BOUND, GPU_SHARED, UNDETERMINED)

# run:stepscope_limits:verdict (recordings.RUN_LIMITS_VERDICT), after tracker.measure_limits
LOADER_BOUND = "loader_bound"  # the loader delivers fewer samples/s than the step consumes
COMPUTE_BOUND = "compute_bound"  # the run gets most of its compute limit
BELOW_LIMITS = "below_limits"  # the loader keeps up, yet the run gets less than its compute limit
LIMITS_VERDICTS = (LOADER_BOUND, COMPUTE_BOUND, BELOW_LIMITS)


def _meanings() -> dict[str, str]:
    """Each verdict's rule in one sentence, with the thresholds the rules use: the Training dashboard's
    verdict panel, the report and docs/dashboards.md say the same."""
    busy = THRESHOLDS["gpu_bound_utilization"].percent
    idle_sms = THRESHOLDS["busy_idle_sm_active"].percent
    loading = THRESHOLDS["data_loading_share"].percent
    hold = f"{THRESHOLDS['pause_hold_seconds'].value / 60:g}"
    return {
        IDLE: "no step in the last minute, or no rank in state train (an eval or checkpoint break keeps the "
              f"verdict from before it for up to {hold} min)",
        DATA_BOUND: f"waiting for the next batch takes more than {loading} of the step time",
        GPU_BUSY_IDLE: f"the GPUs run kernels at least {busy} of the time (NVML) but their SMs are active less "
                       f"than {idle_sms} of it (GPM): kernels too small for the GPU",
        GPU_BOUND: f"the GPUs run kernels at least {busy} of the time while the run trains (NVML): the step is "
                   "GPU work; SM and tensor-core activity say how well it uses the GPU",
        HOST_BOUND: f"the GPUs wait (kernels less than {busy} of the time) and the timed loader is not why, so "
                    "the step waits on the host: launches, syncs, copies, Python; or a run without GPUs "
                    "whose phases are host time (CPU training)",
        GPU_SHARED: "every GPU of the run is another run's too, or holds a process the hooks do not know "
                    "(time-slicing, MPS, overlapping CUDA_VISIBLE_DEVICES, a notebook): its utilization counts the "
                    "other tenant's kernels as well, so it tells nothing about this run "
                    "(a run with GPUs of its own as well is judged by those)",
        UNDETERMINED: "the run steps, but the evidence decides nothing: time the loader (tracker.loader()) "
                      "so a waiting GPU can be told apart from a slow loader, or map the run's processes "
                      "to their GPUs",
    }


MEANINGS: dict[str, str] = _meanings()
NO_VERDICT_YET = (f"no verdict yet: a rank must have started training "
                  f"{THRESHOLDS['verdict_settle_seconds'].number} s ago")

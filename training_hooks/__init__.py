"""stepscope training hooks: time each training step's phases in-process and push them to the exporter.

Imports neither torch nor the exporter; the framework integrations live in `stepscope.hooks.lightning`
and `stepscope.hooks.huggingface`.

    import stepscope.hooks as th
    tracker = th.init(run="resnet-a")
    for batch in tracker.loader(train_loader):
        with tracker.phase("forward", cuda=True):
            ...
        tracker.step(samples=len(batch))
    tracker.close()
"""

from __future__ import annotations

from collections.abc import Sequence

from stepscope.contract import STANDARD_PHASES, STATES
from stepscope.hooks.config import Config, log_buckets
from stepscope.hooks.tracker import Tracker, check_unclaimed

__all__ = ["STANDARD_PHASES", "STATES", "Config", "Tracker", "init", "log_buckets"]


def init(
    run: str | None = None, *, push_url: str | None = None, push_token: str | None = None,
    push_interval: float | None = None, rank: int | None = None, local_rank: int | None = None,
    world_size: int | None = None, buckets: Sequence[float] | None = None, phase_buckets: bool | None = None,
    max_phases: int | None = None, framework: str | None = None, sync: bool | None = None,
    max_backoff: float | None = None, handle_sigterm: bool | None = None, trace_dir: str | None = None,
    trace_max_bytes: int | None = None, trace_keep: int | None = None, flops_per_step: float | None = None,
    flops_per_sample: float | None = None, flops_dtype: str | None = None, peak_flops: float | None = None,
    share_bounds: bool | None = None, store: object | None = None,
) -> Tracker:
    """A started Tracker; every argument left as None comes from the environment or its default.

    Environment: STEPSCOPE_RUN, RANK, LOCAL_RANK, WORLD_SIZE (else srun's or mpirun's own: docs/hooks.md,
    Launchers), STEPSCOPE_PUSH_URL (default
    http://127.0.0.1:9847; empty disables pushing), STEPSCOPE_PUSH_TOKEN, STEPSCOPE_PUSH_INTERVAL (5 s),
    STEPSCOPE_BUCKETS (fixed bounds instead of buckets that follow the run), STEPSCOPE_PHASE_BUCKETS
    (per-phase buckets, off by default), STEPSCOPE_TRACE_DIR, STEPSCOPE_TRACE_MAX_BYTES and
    STEPSCOPE_TRACE_KEEP (profiler traces taken on request: where, the cap per trace gzipped, and how
    many per rank are kept), STEPSCOPE_FLOPS_DTYPE and STEPSCOPE_PEAK_FLOPS. Model FLOPs for MFU (docs/mfu.md):
    flops_per_step and flops_per_sample count into stepscope_model_flops_total at each step (or
    `tracker.measure_flops` counts them once); flops_dtype (fp8, bf16 (default), fp16, tf32, fp32) picks the
    GPU's peak they are compared with; peak_flops (FLOP/s of one GPU) replaces the table's.
    handle_sigterm=False leaves SIGTERM alone (by default a handler pushes the final state, then chains to
    the previous one). share_bounds (STEPSCOPE_SHARE_BOUNDS, on by default): the ranks of a run agree on
    their step-time bounds through torch.distributed's store (the default process group's once it is
    initialized, or `store`), else through the exporter they push to (the ranks of one node), so that a run's
    quantile sums the same bounds on every rank (stepscope.hooks.run_bounds). Raises ValueError with a clear
    message on bad settings, and when a tracker of this process still open pushes the same run and rank: both
    would replace the exporter's group at each push, its steps read as 40, 0, 40 (counter resets) and the last
    to close would win.
    """
    config = Config.resolve(
        run=run, push_url=push_url, push_token=push_token, push_interval=push_interval, rank=rank,
        local_rank=local_rank, world_size=world_size, buckets=tuple(buckets) if buckets is not None else None,
        phase_buckets=phase_buckets, max_phases=max_phases, framework=framework, sync=sync,
        max_backoff=max_backoff, handle_sigterm=handle_sigterm, trace_dir=trace_dir,
        trace_max_bytes=trace_max_bytes, trace_keep=trace_keep, flops_per_step=flops_per_step,
        flops_per_sample=flops_per_sample, flops_dtype=flops_dtype, peak_flops=peak_flops,
        share_bounds=share_bounds,
    )
    check_unclaimed(config)
    return Tracker(config, store)

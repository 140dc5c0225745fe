"""The families the push API accepts: one table the parser, the store and the renderer all read.

Adding an optional label or a family is a change to `FAMILIES` only: the parser derives the label
sets, the canonical label order and the value rules from it.
"""

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FamilySpec:
    """One accepted family: its exposed name (counters with `_total`), type and body labels.

    `values` names the rule every sample value must meet ("non_negative", "one", "zero_or_one");
    histograms have their own rules (finite non-negative cumulative counts, finite sum).
    """

    name: str
    type: str
    labels: tuple[str, ...]
    help: str
    optional: tuple[str, ...] = ()  # body labels a client may leave out (older clients do)
    values: str = "non_negative"
    body_labels: tuple[str, ...] = field(init=False)  # required then optional: the series key order

    def __post_init__(self) -> None:
        object.__setattr__(self, "body_labels", (*self.labels, *self.optional))


FAMILIES: Mapping[str, FamilySpec] = {
    spec.name: spec
    for spec in (
        FamilySpec("stepscope_step_phase_seconds", "histogram", ("phase",),
                   "Time of one phase of a training step (CUDA event time for GPU phases).",
                   optional=("timing",)),
        FamilySpec("stepscope_step_seconds", "histogram", (), "Time of one whole training step."),
        FamilySpec("stepscope_steps_total", "counter", (), "Training steps completed."),
        FamilySpec("stepscope_samples_total", "counter", (), "Training samples processed."),
        FamilySpec("stepscope_training_info", "gauge", ("local_rank", "world_size", "pid", "framework"),
                   "Identity of a training process; always 1.", optional=("start_time",), values="one"),
        FamilySpec("stepscope_training_state", "gauge", ("state",),
                   "State set: 1 for the process's current training state, 0 for the others.",
                   values="zero_or_one"),
        # tracker.measure_limits: what the loader alone and the training step alone can do
        FamilySpec("stepscope_loader_limit_samples_per_second", "gauge", (),
                   "Samples per second the training loader delivers with training mocked out (measure_limits)."),
        FamilySpec("stepscope_compute_limit_samples_per_second", "gauge", (),
                   "Samples per second of the training step on one cached batch, the loader mocked out "
                   "(measure_limits)."),
        # the rank's latest profiler trace (stepscope-profile): one series each per rank, never a growing set
        FamilySpec("stepscope_profile_trace_bytes", "gauge", ("path",),
                   "Size of the rank's latest PyTorch profiler trace, a gzipped Chrome trace at path."),
        FamilySpec("stepscope_profile_trace_steps", "gauge", ("path",),
                   "Training steps the rank's latest profiler trace holds."),
        FamilySpec("stepscope_profile_trace_timestamp_seconds", "gauge", ("path",),
                   "Unix time the rank's latest profiler trace was written."),
    )
}
PATH_LABELS = ("run", "rank")  # from the URL path; a body may repeat them only with the same values
RESERVED_LABELS = ("job", "instance")  # set by the scraping Prometheus, never by a pusher
NON_EMPTY_LABELS = frozenset({"phase", "state", "pid", "path"})
# Labels whose values may be longer than --ingest-max-label-value-length: file paths (PATH_MAX).
LONG_LABEL_LENGTHS: Mapping[str, int] = {"path": 4096}
PHASE_FAMILY = "stepscope_step_phase_seconds"
INFO_FAMILY = "stepscope_training_info"
LAST_PUSH_FAMILY = "stepscope_training_last_push_timestamp_seconds"

_PID = re.compile(r"[1-9][0-9]{0,9}")
_START_TIME = re.compile(r"[0-9]{1,12}(\.[0-9]{1,9})?")  # Unix seconds, as psutil's create_time()

# Per label name: (check of a non-empty value, what the refusal says the value must be).
LABEL_RULES: Mapping[str, tuple[Callable[[str], object], str]] = {
    "pid": (_PID.fullmatch, "a positive process id"),
    "start_time": (_START_TIME.fullmatch, "the process start time in Unix seconds (a non-negative decimal "
                                          "number like 1712345678.25)"),
}

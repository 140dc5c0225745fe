"""The metric contract of stepscope, in one place: what the exporter publishes, what the training hooks
push, and the numbers the rules, dashboards and report judge them by.

Pure standard library, so the exporter, the hooks (which must import without the exporter), the
dashboard and rules generators and the tests all read the same table instead of typing it again.
A rename is an edit here plus `python -m grafana generate`; tests/test_contract.py fails while any
consumer still disagrees. Every family has a constant in `families`, every recorded series the dashboards
and the report read one in `recordings`.
"""

from stepscope.contract.families import (
    COMPUTE_LIMIT,
    FAMILIES,
    LOADER_LIMIT,
    MICRO_BATCHES_TOTAL,
    PATH_LABELS,
    SAMPLE_NAMES,
    SAMPLES_TOTAL,
    STATE_SECONDS,
    STEP_PHASE_SECONDS,
    STEP_SECONDS,
    STEPS_TOTAL,
    TRACE_BYTES,
    TRACE_STEPS,
    TRACE_TIMESTAMP,
    TRAINING_INFO,
    TRAINING_LAST_PUSH,
    TRAINING_LAST_STEP,
    TRAINING_PHASE_ENTERED,
    TRAINING_STATE,
    Family,
    family,
    sample_names,
    selector,
)
from stepscope.contract.thresholds import THRESHOLDS, Threshold
from stepscope.contract.training import (
    BACKWARD_PHASE,
    DATA_LOADING_PHASE,
    FORWARD_PHASE,
    GRID_OCTAVES,
    IDLE_STATE,
    LOCAL_PHASES,
    MAX_EXPORTED_BOUNDS,
    OPTIMIZER_PHASE,
    SKELETON_EVERY_OCTAVES,
    STANDARD_PHASES,
    STATES,
    STEPS_PER_OCTAVE,
    TIMINGS,
    TO_DEVICE_PHASE,
    TRAIN_STATE,
)

VERSION = "0.1.0"  # the one place: pyproject reads it, and so do build_info, the hooks' User-Agent, the chart test

__all__ = [
    "BACKWARD_PHASE",
    "COMPUTE_LIMIT",
    "DATA_LOADING_PHASE",
    "FAMILIES",
    "FORWARD_PHASE",
    "GRID_OCTAVES",
    "IDLE_STATE",
    "LOADER_LIMIT",
    "LOCAL_PHASES",
    "MAX_EXPORTED_BOUNDS",
    "MICRO_BATCHES_TOTAL",
    "OPTIMIZER_PHASE",
    "PATH_LABELS",
    "SAMPLES_TOTAL",
    "SAMPLE_NAMES",
    "SKELETON_EVERY_OCTAVES",
    "STANDARD_PHASES",
    "STATES",
    "STATE_SECONDS",
    "STEPS_PER_OCTAVE",
    "STEPS_TOTAL",
    "STEP_PHASE_SECONDS",
    "STEP_SECONDS",
    "THRESHOLDS",
    "TIMINGS",
    "TO_DEVICE_PHASE",
    "TRACE_BYTES",
    "TRACE_STEPS",
    "TRACE_TIMESTAMP",
    "TRAINING_INFO",
    "TRAINING_LAST_PUSH",
    "TRAINING_LAST_STEP",
    "TRAINING_PHASE_ENTERED",
    "TRAINING_STATE",
    "TRAIN_STATE",
    "VERSION",
    "Family",
    "Threshold",
    "family",
    "sample_names",
    "selector",
]

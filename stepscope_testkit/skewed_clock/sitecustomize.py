"""A node whose wall clock is off, for one process: this directory first on PYTHONPATH makes Python's start-up
(`site` imports `sitecustomize`) move `time.time()` and `time.time_ns()` by STEPSCOPE_TEST_CLOCK_SKEW_SECONDS
(negative: the node is behind). The system clock cannot be set in a test, and every wall-clock time stepscope
stamps (the exporter's push and collector times, the hooks' last step and phase entry) reads these two, bound
when their modules import, after this ran. Monotonic clocks stay as they are, as on a node whose NTP is off.
"""

import os
import time

_SKEW_SECONDS = float(os.environ.get("STEPSCOPE_TEST_CLOCK_SKEW_SECONDS", "0"))
_true_time, _true_time_ns = time.time, time.time_ns


def _skewed_time() -> float:
    return _true_time() + _SKEW_SECONDS


def _skewed_time_ns() -> int:
    return _true_time_ns() + round(_SKEW_SECONDS * 1e9)


if _SKEW_SECONDS:
    time.time, time.time_ns = _skewed_time, _skewed_time_ns

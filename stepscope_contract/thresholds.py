"""The numbers signals are judged by: the rules' verdicts and alerts, the dashboards' colours and the
report's verdict all use these values, so a threshold changes in one place.

Each threshold names the recording rule or alert whose expression holds it (`used_by`), so the
consistency test can check the rules say the same number until they are generated from here.
"""

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Threshold:
    value: float
    meaning: str
    used_by: tuple[str, ...]  # recording rules and alerts whose expression compares with `value`


THRESHOLDS: Mapping[str, Threshold] = {
    "data_loading_share": Threshold(
        0.3, "share of step time spent in dataloader_next above which a run is data bound",
        ("run:stepscope_bottleneck:verdict", "StepscopeDataLoadingBottleneck")),
    "gpu_bound_utilization": Threshold(
        0.8, "run effective GPU utilization at or above which a run is GPU bound",
        ("run:stepscope_bottleneck:verdict",)),
    "sm_active_underutilized": Threshold(
        0.8, "SM active below which a GPU a run uses is underutilized (GPM)", ("StepscopeGpuUnderutilized",)),
    "nvml_utilization_underutilized": Threshold(
        0.9, "NVML utilization below which a GPU a run uses is underutilized (no GPM)",
        ("StepscopeGpuUnderutilized",)),
    "busy_nvml_utilization": Threshold(
        0.8, "NVML utilization at or above which a GPU looks busy", ("StepscopeGpuBusyButIdle",)),
    "busy_idle_sm_active": Threshold(
        0.5, "SM active below which a busy-looking GPU does little", ("StepscopeGpuBusyButIdle",)),
    "tensor_active_idle": Threshold(
        0.01, "tensor-core activity below which a training GPU's tensor cores are idle",
        ("StepscopeTensorCoresIdle",)),
    "straggler_score": Threshold(
        0.75, "straggler score (run median over the rank's) below which a rank is a straggler",
        ("StepscopeStragglerRank",)),
    "straggler_local_share": Threshold(
        0.05, "extra local time, as a share of the step, a local-score straggler must add",
        ("StepscopeStragglerRank",)),
    "gpu_memory_full": Threshold(
        0.95, "GPU memory used / total above which the GPU is near full", ("StepscopeGpuMemoryNearFull",)),
    "host_memory_pressure": Threshold(
        0.9, "host memory used / total above which the node is under pressure", ("StepscopeHostMemoryPressure",)),
    "cpu_saturated": Threshold(
        0.9, "node CPU utilization above which the node is saturated", ("StepscopeCpuSaturated",)),
    "throttled_share": Threshold(
        0.2, "share of time a power or thermal clock event is active above which a GPU is throttled",
        ("StepscopeGpuThrottling",)),
    "collector_stale_seconds": Threshold(
        120, "age of a collector's last success above which its readings are stale",
        ("StepscopeExporterCollectionStale",)),
    "compute_limit_share": Threshold(
        0.8, "share of the compute limit below which a run whose loader keeps up is below its limits",
        ("run:stepscope_limits:verdict",)),
}

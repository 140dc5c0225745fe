"""The numbers signals are judged by: the rules' verdicts and alerts, the dashboards' colours and the
report's verdict all use these values, so a threshold changes in one place.

Each threshold names the recording rule or alert whose expression holds it (`used_by`), so the
consistency test can check the rules say the same number until they are generated from here; one that
no rule uses (`used_by` empty) only colours the dashboards and the report.
"""

from collections.abc import Mapping
from dataclasses import dataclass

from stepscope_contract.recordings import RUN_LIMITS_VERDICT, RUN_VERDICT


@dataclass(frozen=True)
class Threshold:
    value: float
    meaning: str
    used_by: tuple[str, ...]  # recording rules and alerts whose expression compares with `value`

    @property
    def percent(self) -> str:
        """The value as the dashboards and the report write a share: 0.3 -> "30%"."""
        return f"{self.value:.0%}"

    @property
    def number(self) -> str:
        """The value as written in a query or a sentence: 0.75 -> "0.75", 120 -> "120"."""
        return f"{self.value:g}"


THRESHOLDS: Mapping[str, Threshold] = {
    "data_loading_share": Threshold(
        0.3, "share of step time spent in dataloader_next above which a run is data bound",
        (RUN_VERDICT, "StepscopeDataLoadingBottleneck")),
    "gpu_bound_utilization": Threshold(
        0.8, "run effective GPU utilization at or above which a run is GPU bound",
        (RUN_VERDICT,)),
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
        (RUN_LIMITS_VERDICT,)),
    # Only the dashboards and the report colour or judge by these.
    "data_loading_share_notice": Threshold(
        0.1, "data-loading share above which the dashboards colour it yellow, on the way to data bound", ()),
    "utilization_low": Threshold(
        0.5, "effective GPU utilization below which the dashboards colour it red (yellow up to GPU bound)", ()),
    "straggler_score_typical": Threshold(
        0.9, "straggler score at or above which the dashboards colour a rank green (yellow down to a straggler)", ()),
    "idle_gpu_utilization": Threshold(
        0.05, "NVML utilization below which a GPU no run holds memory on counts as idle capacity", ()),
    "rank_skew": Threshold(
        1.3, "slowest over fastest rank's mean step time above which a rank or its node holds the run back", ()),
    "filesystem_filling": Threshold(0.8, "used share of a filesystem the dashboards colour yellow", ()),
    "filesystem_full": Threshold(0.95, "used share of a filesystem the dashboards colour red", ()),
    "gpu_temperature_hot_celsius": Threshold(
        85, "GPU die temperature around which thermal slowdown usually starts (dashboard line)", ()),
}

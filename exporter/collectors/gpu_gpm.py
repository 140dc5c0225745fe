"""NVML GPM (GPU Performance Monitoring, Hopper and newer): SM, tensor-core and DRAM activity.

GPM metrics are computed from two device samples taken some time apart, so each GPU keeps two
allocated samples and alternates between them: the newest sample of one cycle is the baseline of
the next.
"""

import contextlib
from types import ModuleType
from typing import Any

# (metric suffix published as stepscope_gpu_<suffix>, NVML GPM metric id constant); values are percent
GPM_METRICS = (
    ("sm_active_ratio", "NVML_GPM_METRIC_SM_UTIL"),
    ("sm_occupancy_ratio", "NVML_GPM_METRIC_SM_OCCUPANCY"),
    ("tensor_active_ratio", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
    ("dram_active_ratio", "NVML_GPM_METRIC_DRAM_BW_UTIL"),
)
MIN_SAMPLE_GAP_SECONDS = 0.1  # NVML needs the two samples at least 100 ms apart


class GpmSampler:
    """Per-GPU GPM state: the baseline sample, its time, and a spare sample to fill next."""

    def __init__(self, nvml: ModuleType, handle: Any, samples: tuple[Any, Any]) -> None:
        self._nvml = nvml
        self._handle = handle
        self._baseline, self._spare = samples
        self._baseline_at: float | None = None

    @classmethod
    def open(cls, nvml: ModuleType, handle: Any) -> "GpmSampler | None":
        """A sampler for a GPU that supports GPM; None for older GPUs, drivers or bindings."""
        try:
            if not nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                return None
            first = nvml.nvmlGpmSampleAlloc()
        except (AttributeError, nvml.NVMLError):
            return None
        try:
            second = nvml.nvmlGpmSampleAlloc()
        except nvml.NVMLError:
            nvml.nvmlGpmSampleFree(first)
            return None
        return cls(nvml, handle, (first, second))

    def read(self, now: float) -> dict[str, float]:
        """Ratios since the baseline sample; empty on the first call or when called too soon.

        NVML errors propagate (the caller treats them like any field error) after dropping the
        baseline, so the next cycle starts a fresh pair instead of spanning the failure.
        """
        if self._baseline_at is not None and now - self._baseline_at < MIN_SAMPLE_GAP_SECONDS:
            return {}
        nvml = self._nvml
        try:
            nvml.nvmlGpmSampleGet(self._handle, self._spare)
            ratios = self._metrics() if self._baseline_at is not None else {}
        except nvml.NVMLError:
            self._baseline_at = None
            raise
        self._baseline, self._spare = self._spare, self._baseline
        self._baseline_at = now
        return ratios

    def reset(self) -> None:
        """Forget the baseline (the GPU stopped answering)."""
        self._baseline_at = None

    def close(self) -> None:
        for sample in (self._baseline, self._spare):
            with contextlib.suppress(self._nvml.NVMLError):  # best effort at exit (GPU may be gone)
                self._nvml.nvmlGpmSampleFree(sample)

    def _metrics(self) -> dict[str, float]:
        nvml = self._nvml
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1 = self._baseline
        request.sample2 = self._spare
        for slot, (_, metric_id) in enumerate(GPM_METRICS):
            request.metrics[slot].metricId = getattr(nvml, metric_id)
        nvml.nvmlGpmMetricsGet(request)
        return {
            suffix: min(max(request.metrics[slot].value / 100.0, 0.0), 1.0)
            for slot, (suffix, _) in enumerate(GPM_METRICS)
            if request.metrics[slot].nvmlReturn == nvml.NVML_SUCCESS
        }

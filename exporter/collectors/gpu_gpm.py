"""NVML GPM (GPU Performance Monitoring, Hopper and newer): SM, tensor-core, DRAM, PCIe, NVLink and C2C.

GPM metrics are computed from two device samples taken some time apart, so each GPU keeps two
allocated samples and alternates between them: the newest sample of one cycle is the baseline of
the next. PCIe throughput comes from the same sample pair, so a GPU with GPM never needs
`nvmlDeviceGetPcieThroughput`, which blocks for 20 ms per direction. NVLink (all links together: the
gradient all-reduce between GPUs) and C2C (Grace Hopper's chip-to-chip link to its CPU) come from the
same nvmlGpmMetricsGet call; a GPU whose GPM refuses them (no NVLink, no C2C) publishes none.

A cycle that comes before the next pair is due (a --collect-interval under 100 ms, a caller that
collects twice in a row) publishes the last pair's values again rather than nothing, so a GPM family
never blinks out between cycles; only a failed read drops them until a new pair.
"""

import contextlib
from types import ModuleType
from typing import Any

from stepscope.contract import families as fam

# (family name, NVML GPM metric id constant, factor to base units)
GPM_METRICS = (
    (fam.GPU_SM_ACTIVE, "NVML_GPM_METRIC_SM_UTIL", 0.01),  # percent
    (fam.GPU_SM_OCCUPANCY, "NVML_GPM_METRIC_SM_OCCUPANCY", 0.01),
    (fam.GPU_TENSOR_ACTIVE, "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 0.01),
    (fam.GPU_DRAM_ACTIVE, "NVML_GPM_METRIC_DRAM_BW_UTIL", 0.01),
    (fam.GPU_PCIE_TRANSMIT, "NVML_GPM_METRIC_PCIE_TX_PER_SEC", 2.0**20),  # MiB/s
    (fam.GPU_PCIE_RECEIVE, "NVML_GPM_METRIC_PCIE_RX_PER_SEC", 2.0**20),
    (fam.GPU_NVLINK_TRANSMIT, "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", 2.0**20),
    (fam.GPU_NVLINK_RECEIVE, "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", 2.0**20),
    (fam.GPU_C2C_TRANSMIT, "NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC", 2.0**20),
    (fam.GPU_C2C_RECEIVE, "NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC", 2.0**20),
)
PCIE_KEYS = frozenset({fam.GPU_PCIE_TRANSMIT, fam.GPU_PCIE_RECEIVE})
MIN_SAMPLE_GAP_SECONDS = 0.1  # NVML needs the two samples at least 100 ms apart


class GpmSampler:
    """Per-GPU GPM state: the baseline sample, its time, and a spare sample to fill next."""

    def __init__(self, nvml: ModuleType, handle: Any, samples: tuple[Any, Any]) -> None:
        self._nvml = nvml
        self._handle = handle
        self._baseline, self._spare = samples
        self._baseline_at: float | None = None
        self._last: dict[str, float] = {}  # the latest pair's values, published until the next pair
        # metrics these bindings name; older nvidia-ml-py lacks the PCIe, NVLink or C2C ids
        self._metrics = [(key, getattr(nvml, name), factor) for key, name, factor in GPM_METRICS
                         if hasattr(nvml, name)]
        self.gives_pcie: bool | None = None  # None until the first metrics read tells

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
        """Values since the baseline sample; empty on the first call.

        Called before a new pair is due (MIN_SAMPLE_GAP_SECONDS after the baseline), it takes no
        sample and returns the last pair's values, which are still the newest there are. NVML errors
        propagate (the caller treats them like any field error) after dropping the baseline and those
        values, so the next cycle starts a fresh pair instead of spanning the failure.
        """
        if self._baseline_at is not None and now - self._baseline_at < MIN_SAMPLE_GAP_SECONDS:
            return dict(self._last)
        nvml = self._nvml
        try:
            nvml.nvmlGpmSampleGet(self._handle, self._spare)
            values = self._values() if self._baseline_at is not None else {}
        except nvml.NVMLError:
            self.reset()
            raise
        self._baseline, self._spare = self._spare, self._baseline
        self._baseline_at = now
        self._last = values
        return dict(values)

    def reset(self) -> None:
        """Forget the baseline and the values it gave (a failed read, or the GPU stopped answering)."""
        self._baseline_at = None
        self._last = {}

    def close(self) -> None:
        for sample in (self._baseline, self._spare):
            with contextlib.suppress(self._nvml.NVMLError):  # best effort at exit (GPU may be gone)
                self._nvml.nvmlGpmSampleFree(sample)

    def _values(self) -> dict[str, float]:
        """One nvmlGpmMetricsGet for every metric; a metric NVML refuses is left out."""
        nvml = self._nvml
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(self._metrics)
        request.sample1 = self._baseline
        request.sample2 = self._spare
        for slot, (_, metric_id, _) in enumerate(self._metrics):
            request.metrics[slot].metricId = metric_id
        nvml.nvmlGpmMetricsGet(request)
        values = {}
        for slot, (key, _, factor) in enumerate(self._metrics):
            metric = request.metrics[slot]
            if metric.nvmlReturn == nvml.NVML_SUCCESS:
                value = max(metric.value * factor, 0.0)
                values[key] = min(value, 1.0) if key.endswith("_ratio") else value
        self.gives_pcie = values.keys() >= PCIE_KEYS
        if not self.gives_pcie:  # half a pair: the slow thread polls both directions instead
            for key in PCIE_KEYS:
                values.pop(key, None)
        return values

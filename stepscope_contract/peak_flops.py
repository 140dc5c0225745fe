"""Dense peak FLOP/s per GPU model and dtype: the denominator of model FLOPs utilization (MFU).

MFU = the model's FLOPs per step x steps per second / the peak FLOP/s of the GPUs it runs on, for the
dtype its matmuls use. The numbers are NVIDIA's datasheet figures for dense math (the datasheets print
tensor-core figures "with sparsity", twice the dense rate: those are halved here), at the boost clock
of the part's default power limit. A GPU is recognised by the name NVML reports (`stepscope_gpu_info{name}`,
or dcgm-exporter's `modelName`); a name not listed gets no MFU rather than a guess, and a user whose
clocks or part differ states the peak instead (`stepscope.hooks.init(peak_flops=...)`).

`rules_table` turns the table into the PromQL the node rules record from (`<<peak_flops:DTYPE>>`).
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass

BF16 = "bf16"
FP16 = "fp16"
FP8 = "fp8"
TF32 = "tf32"
FP32 = "fp32"
DTYPES = (FP8, BF16, FP16, TF32, FP32)  # what `flops_dtype=` accepts
DEFAULT_DTYPE = BF16
TERA = 1e12

_H100_SXM = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446"
_GH200 = "https://resources.nvidia.com/en-us-grace-cpu/grace-hopper-superchip"
_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_L40S = "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"
_L40 = "https://images.nvidia.com/content/Solutions/data-center/vgpu-L40-datasheet.pdf"
_L4 = "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet"
_A10 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"
_T4 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"
_V100 = "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"


@dataclass(frozen=True)
class GpuPeak:
    """One GPU part: the NVML names it reports, its dense peak FLOP/s per dtype, and where they are from."""

    part: str
    nvml_names: tuple[str, ...]
    tflops: Mapping[str, float]  # dtype -> dense peak in TFLOP/s; a dtype the part lacks is absent
    source: str

    def peak(self, dtype: str) -> float | None:
        """FLOP/s for `dtype`, None where the part has no such math."""
        value = self.tflops.get(dtype)
        return value * TERA if value is not None else None


def _hopper(fp32: float, tf32: float, bf16: float, fp8: float) -> dict[str, float]:
    return {FP32: fp32, TF32: tf32, BF16: bf16, FP16: bf16, FP8: fp8}


def _ampere(fp32: float, tf32: float, bf16: float) -> dict[str, float]:
    return {FP32: fp32, TF32: tf32, BF16: bf16, FP16: bf16}


GPUS: tuple[GpuPeak, ...] = (
    GpuPeak("H100 SXM", ("NVIDIA H100 80GB HBM3",), _hopper(66.9, 494.7, 989.4, 1978.9), _H100_SXM),
    GpuPeak("H100 PCIe", ("NVIDIA H100 PCIe",), _hopper(51.2, 378.0, 756.0, 1513.0), _H100_SXM),
    GpuPeak("H100 NVL", ("NVIDIA H100 NVL",), _hopper(60.0, 417.5, 835.5, 1670.5), _H100_SXM),
    GpuPeak("H200 SXM", ("NVIDIA H200",), _hopper(67.0, 494.5, 989.5, 1979.0), _H200),
    GpuPeak("H200 NVL", ("NVIDIA H200 NVL",), _hopper(60.0, 417.5, 835.5, 1670.5), _H200),
    GpuPeak("GH200", ("NVIDIA GH200 480GB", "NVIDIA GH200 144G HBM3e"), _hopper(67.0, 494.5, 989.5, 1979.0),
            _GH200),
    GpuPeak("A100", ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB",
                     "NVIDIA A100 80GB PCIe"), _ampere(19.5, 156.0, 312.0), _A100),
    GpuPeak("L40S", ("NVIDIA L40S",), _hopper(91.6, 183.0, 362.05, 733.0), _L40S),
    GpuPeak("L40", ("NVIDIA L40",), _hopper(90.5, 90.5, 181.05, 362.0), _L40),
    GpuPeak("L4", ("NVIDIA L4",), _hopper(30.3, 60.0, 121.0, 242.5), _L4),
    GpuPeak("A10", ("NVIDIA A10",), _ampere(31.2, 62.5, 125.0), _A10),
    GpuPeak("T4", ("Tesla T4",), {FP32: 8.1, FP16: 65.0}, _T4),
    GpuPeak("V100 SXM2", ("Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB"), {FP32: 15.7, FP16: 125.0}, _V100),
    GpuPeak("V100 PCIe", ("Tesla V100-PCIE-16GB", "Tesla V100-PCIE-32GB"), {FP32: 14.0, FP16: 112.0}, _V100),
)
BY_NVML_NAME: Mapping[str, GpuPeak] = {name: gpu for gpu in GPUS for name in gpu.nvml_names}


def peak_flops(nvml_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of the GPU NVML calls `nvml_name` for `dtype`; None when the table lacks either."""
    gpu = BY_NVML_NAME.get(nvml_name)
    return gpu.peak(dtype) if gpu is not None else None


def validate_dtype(dtype: str) -> str:
    """The dtype in the table's spelling, or a ValueError that lists the accepted ones."""
    if dtype not in DTYPES:
        raise ValueError(f"flops_dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def _regex(names: tuple[str, ...]) -> str:
    """An RE2 alternation matching exactly `names`, written for a PromQL double-quoted string."""
    special = re.compile(r"([.+*?()|\[\]{}^$\\])")
    return "|".join(special.sub(r"\\\\\1", name) for name in names)


def rules_table(dtype: str, info_family: str) -> str:
    """PromQL: each GPU's dense peak FLOP/s for `dtype`, by (instance, gpu), from its NVML name (label
    `name`) in `info_family`; parts with the same peak share one term. GPUs of a part not in the table, or without
    that dtype, are absent."""
    by_peak: dict[float, list[str]] = {}
    for gpu in GPUS:
        value = gpu.peak(validate_dtype(dtype))
        if value is not None:
            by_peak.setdefault(value, []).extend(gpu.nvml_names)
    terms = [f'group by (instance, gpu) ({info_family}{{name=~"{_regex(tuple(names))}"}}) * {value:g}'
             for value, names in sorted(by_peak.items(), reverse=True)]
    return "\n  or\n".join(terms)

"""dcgm-exporter's exposition, made from a stepscope scrape: a GPU source for tests on a machine without one.

NVIDIA's dcgm-exporter (what the GPU Operator installs on most Kubernetes GPU clusters) publishes one
series per GPU and DCGM field, named after the field (`DCGM_FI_DEV_GPU_UTIL`), in DCGM's units (percent,
MiB, MHz, mJ), labelled `gpu` (index), `UUID`, `pci_bus_id`, `device` (nvidiaN), `modelName`, `Hostname`
(the node: its NODE_NAME), the label-type fields (`DCGM_FI_DRIVER_VERSION`) and, where the kubelet's
PodResources API gives the GPU to a pod, `pod`, `namespace` and `container`. The fields are those of its
documented default counters (etc/default-counters.csv) plus `EXTRA_COUNTERS`, the lines docs/cluster.md
asks a cluster to add.

The values come from a recorded stepscope scrape of the same moment (benchmarks/corpus/, an H100), converted
to DCGM's units: the same GPU readings reach the rules through either source. `without_gpu_collector`
turns the recorded scrape into what the exporter publishes with its GPU collector off and pod attribution
on, so a replay can serve both halves side by side (tests/test_dcgm_source.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from stepscope.contract import families

MIB = 1024 * 1024


@dataclass(frozen=True)
class Counter:
    """One line of a dcgm-exporter counters CSV, and where its value comes from in a stepscope scrape."""

    field: str
    kind: str  # gauge or counter, as the CSV says
    help: str
    family: str | None  # the stepscope family it is read from; None: a constant
    scale: float = 1.0  # DCGM's unit per stepscope's unit
    constant: float = 0.0  # the value where `family` is None (no fault seen, no encoder use)


# etc/default-counters.csv of dcgm-exporter, the lines not commented out (label-type fields are labels).
# DCGM_FI_DEV_MEMORY_TEMP and DCGM_FI_DEV_VGPU_LICENSE_STATUS are left out: the recording has no memory
# temperature, and a bare-metal GPU has no vGPU licence.
DEFAULT_COUNTERS = (
    Counter("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", families.GPU_SM_CLOCK, 1e-6),
    Counter("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", families.GPU_MEMORY_CLOCK, 1e-6),
    Counter("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", families.GPU_TEMPERATURE),
    Counter("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", families.GPU_POWER),
    Counter("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ).",
            families.GPU_ENERGY, 1e3),
    Counter("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.", None),
    Counter("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", families.GPU_UTILIZATION, 100),
    Counter("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", families.GPU_MEMORY_UTILIZATION, 100),
    Counter("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", None),
    Counter("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", None),
    Counter("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", None),
    Counter("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", families.GPU_MEMORY_FREE, 1 / MIB),
    Counter("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", families.GPU_MEMORY_USED, 1 / MIB),
    Counter("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).", None),  # total - free - used
    Counter("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
            "Total number of NVLink bandwidth counters for all lanes.", None),
    Counter("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
            "Number of remapped rows for uncorrectable errors", None),
    Counter("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors", None),
    Counter("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed", None),
    # The graphics engine's active share: the recording has NVML utilization, its nearest reading.
    Counter("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.",
            families.GPU_UTILIZATION),
    Counter("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active.",
            families.GPU_TENSOR_ACTIVE),
    Counter("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
            "Ratio of cycles the device memory interface is active sending or receiving data.",
            families.GPU_DRAM_ACTIVE),
    Counter("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", "The rate of data transmitted over the PCIe bus - including both "
            "protocol headers and data payloads - in bytes per second.", families.GPU_PCIE_TRANSMIT),
    Counter("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", "The rate of data received over the PCIe bus - including both "
            "protocol headers and data payloads - in bytes per second.", families.GPU_PCIE_RECEIVE),
)
# The lines docs/cluster.md asks a cluster to add: SM active tells a busy GPU with idle SMs
# (StepscopeGpuBusyButIdle) and grades utilization; the clock-event reasons (NVML's bitmask) and the SM clock's
# maximum feed StepscopeGpuThrottling. The defaults have none of them.
EXTRA_COUNTERS = (
    Counter("DCGM_FI_PROF_SM_ACTIVE", "gauge", "The ratio of cycles an SM has at least 1 warp assigned.",
            families.GPU_SM_ACTIVE),
    Counter("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "gauge", "Current clock event reasons (bitmask).", None),
    Counter("DCGM_FI_DEV_MAX_SM_CLOCK", "gauge", "Maximum supported SM clock (in MHz).", families.GPU_SM_CLOCK_MAX,
            1e-6),
)
# NVML's clock-event reason bits, as DCGM_FI_DEV_CLOCKS_EVENT_REASONS carries them.
CLOCK_EVENT_BITS = {"gpu_idle": 0x1, "applications_clocks_setting": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8,
                    "sync_boost": 0x10, "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40,
                    "hw_power_brake_slowdown": 0x80, "display_clock_setting": 0x100}


@dataclass(frozen=True)
class PodRef:
    """The pod container a GPU (or process) belongs to, as the kubelet's PodResources API names it."""

    namespace: str
    pod: str
    container: str


@dataclass(frozen=True)
class _Gpu:
    index: str
    uuid: str
    info: Mapping[str, str]  # stepscope_gpu_info's labels
    values: Mapping[str, float]  # stepscope family -> value
    events: Mapping[str, float]  # clock-event reason -> 1 while active


def _gpus(body: str) -> list[_Gpu]:
    """The GPUs of a stepscope scrape, each with its readings (families labelled only by gpu and uuid)."""
    info: dict[str, dict[str, str]] = {}
    values: dict[str, dict[str, float]] = {}
    events: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == families.GPU_CLOCK_EVENT_ACTIVE:
                events.setdefault(labels["uuid"], {})[labels["reason"]] = sample.value
            if "uuid" not in labels or (set(labels) - {"gpu", "uuid"} and sample.name != families.GPU_INFO):
                continue
            if sample.name == families.GPU_INFO:
                info[labels["uuid"]] = dict(labels)
            else:
                values.setdefault(labels["uuid"], {})[sample.name] = sample.value
    return [_Gpu(labels["gpu"], uuid, labels, values.get(uuid, {}), events.get(uuid, {}))
            for uuid, labels in info.items()]


def _value(counter: Counter, gpu: _Gpu) -> float | None:
    if counter.field == "DCGM_FI_DEV_CLOCKS_EVENT_REASONS":
        return sum(bit for reason, bit in CLOCK_EVENT_BITS.items() if gpu.events.get(reason)) if gpu.events else None
    if counter.field == "DCGM_FI_DEV_FB_RESERVED":
        total, free, used = (gpu.values.get(name) for name in
                             (families.GPU_MEMORY_TOTAL, families.GPU_MEMORY_FREE, families.GPU_MEMORY_USED))
        return None if None in (total, free, used) else max(0.0, (total - free - used) / MIB)
    if counter.family is None:
        return counter.constant
    reading = gpu.values.get(counter.family)
    return None if reading is None else reading * counter.scale


def _format(value: float, counter: Counter) -> str:
    """DCGM's integer fields (percent, MiB, MHz, mJ) as integers, its ratios and rates as floats."""
    if counter.field.startswith("DCGM_FI_PROF_"):
        return repr(float(value))
    return str(round(value))


def dcgm_body(stepscope_body: str, hostname: str, pods: Mapping[str, PodRef] | None = None,
              counters: tuple[Counter, ...] = DEFAULT_COUNTERS + EXTRA_COUNTERS,
              hostname_label: str = "Hostname") -> str:
    """dcgm-exporter's /metrics for the GPUs of `stepscope_body`, on node `hostname`; a GPU whose UUID is in
    `pods` carries that pod's labels. `hostname_label` is `hostname` from dcgm-exporter's May 2026 release on.
    A reading the scrape lacks (no GPM: no SM active) leaves that field's series out, as DCGM does."""
    pods = pods or {}
    lines: list[str] = []
    gpus = _gpus(stepscope_body)
    for counter in counters:
        rows = []
        for gpu in gpus:
            value = _value(counter, gpu)
            if value is None:
                continue
            labels = {"gpu": gpu.index, "UUID": gpu.uuid, "pci_bus_id": gpu.info.get("pci_bus_id", ""),
                      "device": f"nvidia{gpu.index}", "modelName": gpu.info.get("name", ""),
                      hostname_label: hostname, "DCGM_FI_DRIVER_VERSION": gpu.info.get("driver_version", "")}
            pod = pods.get(gpu.uuid)
            if pod is not None:
                labels |= {"container": pod.container, "namespace": pod.namespace, "pod": pod.pod}
            rendered = ",".join(f'{name}="{text}"' for name, text in labels.items())
            rows.append(f"{counter.field}{{{rendered}}} {_format(value, counter)}")
        if rows:
            lines += [f"# HELP {counter.field} {counter.help}", f"# TYPE {counter.field} {counter.kind}", *rows]
    return "\n".join(lines) + "\n"


def without_gpu_collector(stepscope_body: str, pods: Mapping[str, PodRef] | None = None) -> str:
    """The scrape as the exporter publishes it with its GPU collector off (no `stepscope_gpu_*` family, no
    per-process GPU memory, which comes from NVML) and pod attribution on: one `stepscope_process_pod_info`
    per GPU of its container for each process that held a GPU given to a pod (`pods`: UUID -> its pod)."""
    dropped = (families.PROCESS_GPU_MEMORY, "stepscope_gpu_")
    kept, holders = [], []
    for line in stepscope_body.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0] if not line.startswith("#") else line.split(" ", 3)[2]
        if name.startswith(families.PROCESS_GPU_MEMORY) and not line.startswith("#"):
            holders.append(line)
        if not name.startswith(dropped):
            kept.append(line)
    uuids = {gpu.index: gpu.uuid for gpu in _gpus(stepscope_body)}
    info = []
    for family in text_string_to_metric_families("\n".join(holders) + "\n"):
        for sample in family.samples:
            pod = (pods or {}).get(uuids.get(sample.labels["gpu"], ""))
            for uuid in sorted(uuid for uuid, holder in (pods or {}).items() if pod is not None and holder == pod):
                labels = {key: sample.labels[key] for key in ("pid", "run", "rank")}
                labels |= {"namespace": pod.namespace, "pod": pod.pod, "container": pod.container, "uuid": uuid}
                info.append(families.PROCESS_POD_INFO + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items())
                            + "} 1")
    if info:
        kept += [f"# HELP {families.PROCESS_POD_INFO} The pod container of a training process and each GPU it holds.",
                 f"# TYPE {families.PROCESS_POD_INFO} gauge", *info]
    return "\n".join(kept) + "\n"

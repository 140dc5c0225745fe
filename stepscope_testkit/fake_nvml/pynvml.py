"""Scripted stand-in for nvidia-ml-py's `pynvml`, for tests only (never shipped).

Tests select it by putting `stepscope_testkit/fake_nvml` first on PYTHONPATH (`exporter_env(scenario)` does) or
by passing it to `GpuCollector(nvml=...)` (`scenario.load_fake_pynvml()` gives a fresh copy). It
implements the subset of pynvml the GPU collector calls, with the same names, constants, exception
classes and attribute names on returned objects.

The scenario is a JSON file named by $STEPSCOPE_FAKE_NVML_SCENARIO. It is re-read whenever the file
changes (mtime, size or inode), so a test scripts changes over time by rewriting it; use
`scenario.write_scenario()` (atomic replace). Values are in NVML's own units (percent, mW, mJ, MHz,
KB/s, ns), so the collector's conversions are exercised.

    {
      "driver_version": "550.54.15",
      "init_error": null,              # or "DriverNotLoaded", "LibraryNotFound": nvmlInit raises it
      "gpus": [GPU, ...],              # index = position
      "xid_events": [{"gpu": 0, "xid": 79}, ...]   # append-only: each entry is delivered once,
    }                                              # by nvmlEventSetWait_v2, to a set that has the GPU

GPU (every key optional; a missing field raises NVMLError_NotSupported, like a GPU without it):

    "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-...", "pci_bus_id": "00000000:18:00.0",
    "lost": true,                                  # every call for this GPU raises NVMLError_GpuIsLost
    "utilization": {"gpu": 87, "memory": 41},      # percent
    "memory": {"total": B, "used": B, "reserved": B},  # bytes; free = total - used - reserved;
                                                   #   v1 reports used + reserved as used, like NVML
    "temperature_c": 61,
    "power_usage_mw": 512000, "enforced_power_limit_mw": 700000,
    "total_energy_mj": COUNTER,
    "clocks_mhz": {"sm": 1980, "mem": 2619},
    "max_clocks_mhz": {"sm": 1980, "mem": 2619},
    "clocks_event_reasons": ["sw_power_cap", "hw_thermal_slowdown"],   # names (see REASON_BITS) or int
    "violation_ns": {"power": COUNTER, "thermal": COUNTER, ...},  # keys: see POLICIES
    "pcie_kbps": {"rx": 1200000, "tx": 800000},
    "ecc_aggregate": {"corrected": COUNTER, "uncorrected": COUNTER},
    "processes": [{"pid": 1234, "used_memory": B}],  # used_memory null = not available; missing = []
    "mps_processes": [{"pid": 1235, "used_memory": B}],  # the clients of the MPS server; missing = []
    "gpm": {"sm_util": 80, "sm_occupancy": 40, "any_tensor_util": 55, "dram_bw_util": 60,
            "pcie_tx_per_sec": 781.25, "pcie_rx_per_sec": 1171.9,
            "nvlink_total_tx_per_sec": 40000, "nvlink_total_rx_per_sec": 40000,
            "c2c_total_tx_per_sec": 2000, "c2c_total_rx_per_sec": 9000},
                                                   # percent, throughputs in MiB/s; a missing key is
                                                   # refused per metric (no NVLink, no C2C); no "gpm"
                                                   # = unsupported (pre-Hopper)
    "errors": {"power_usage_mw": "Unknown", ...}   # force NVMLError_<Name> for one field; fields are
                                                   # the keys above plus "memory_v2", "gpm_sample",
                                                   # "register_events", "field_values" (the whole
                                                   # nvmlDeviceGetFieldValues call)

COUNTER is a number or {"start": n, "per_second": r}: it grows from when this module was imported,
so Prometheus rates are nonzero. `stepscope_testkit/fake_nvml/scenario.py` builds scenarios (`make_scenario`).

Cost model: every `nvml*` call is counted per calling thread (`call_counts()`, `reset_call_counts()`),
so a test can price what one collector cycle asks of NVML. A scenario key
`"latency_ms": {"nvmlDeviceGetPcieThroughput": 20.6, ..., "default": 0.0035}` makes each call really
take that long (`scenario.H100_LATENCY_MS` holds the figures measured on an H100): a busy wait below
10 ms, as the driver spent each call's latency on the CPU, a sleep from there up (the PCIe poll, which
NVML sleeps through while it samples the link).
"""

import functools
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

SCENARIO_ENV = "STEPSCOPE_FAKE_NVML_SCENARIO"

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_PERF_POLICY_POWER = 0
NVML_PERF_POLICY_THERMAL = 1
NVML_PERF_POLICY_SYNC_BOOST = 2
NVML_PERF_POLICY_BOARD_LIMIT = 3
NVML_PERF_POLICY_LOW_UTILIZATION = 4
NVML_PERF_POLICY_RELIABILITY = 5
NVML_PERF_POLICY_TOTAL_APP_CLOCKS = 10
NVML_PERF_POLICY_TOTAL_BASE_CLOCKS = 11
NVML_FI_DEV_PERF_POLICY_POWER = 74  # field ids of nvmlDeviceGetFieldValues (nvml.h): the policies' counters
NVML_FI_DEV_PERF_POLICY_THERMAL = 75
NVML_FI_DEV_PERF_POLICY_SYNC_BOOST = 76
NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT = 77
NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION = 78
NVML_FI_DEV_PERF_POLICY_RELIABILITY = 79
NVML_FI_DEV_PERF_POLICY_TOTAL_APP_CLOCKS = 80
NVML_FI_DEV_PERF_POLICY_TOTAL_BASE_CLOCKS = 81
NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION = 83
NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
nvmlMemory_v2 = 0x02000028
nvmlEventTypeXidCriticalError = 0x8

nvmlClocksEventReasonGpuIdle = 0x1
nvmlClocksEventReasonApplicationsClocksSetting = 0x2
nvmlClocksEventReasonSwPowerCap = 0x4
nvmlClocksEventReasonHwSlowdown = 0x8
nvmlClocksEventReasonSyncBoost = 0x10
nvmlClocksEventReasonSwThermalSlowdown = 0x20
nvmlClocksEventReasonHwThermalSlowdown = 0x40
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
nvmlClocksEventReasonDisplayClockSetting = 0x100

NVML_GPM_METRIC_SM_UTIL = 2
NVML_GPM_METRIC_SM_OCCUPANCY = 3
NVML_GPM_METRIC_ANY_TENSOR_UTIL = 5
NVML_GPM_METRIC_DRAM_BW_UTIL = 10
NVML_GPM_METRIC_PCIE_TX_PER_SEC = 20
NVML_GPM_METRIC_PCIE_RX_PER_SEC = 21
NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC = 60
NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC = 61
NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC = 100
NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC = 101
NVML_GPM_METRIC_MAX = 477
NVML_GPM_METRICS_GET_VERSION = 1
NVML_GPM_SUPPORT_VERSION = 1

REASON_BITS = {
    "gpu_idle": nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": nvmlClocksEventReasonHwSlowdown,
    "sync_boost": nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "display_clock_setting": nvmlClocksEventReasonDisplayClockSetting,
}
POLICIES = {
    NVML_PERF_POLICY_POWER: "power",
    NVML_PERF_POLICY_THERMAL: "thermal",
    NVML_PERF_POLICY_SYNC_BOOST: "sync_boost",
    NVML_PERF_POLICY_BOARD_LIMIT: "board_limit",
    NVML_PERF_POLICY_LOW_UTILIZATION: "low_utilization",
    NVML_PERF_POLICY_RELIABILITY: "reliability",
    NVML_PERF_POLICY_TOTAL_APP_CLOCKS: "app_clocks",
    NVML_PERF_POLICY_TOTAL_BASE_CLOCKS: "base_clocks",
}
FIELD_VALUES = {  # field id -> (scenario key, key within it): the same counters as the single calls
    NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: ("total_energy_mj", None),
    # nvml.h numbers the policies' fields 74-81 in POLICIES' order (power ... total base clocks)
    **{NVML_FI_DEV_PERF_POLICY_POWER + offset: ("violation_ns", name) for offset, name in enumerate(POLICIES.values())},
}
GPM_KEYS = {
    NVML_GPM_METRIC_SM_UTIL: "sm_util",
    NVML_GPM_METRIC_SM_OCCUPANCY: "sm_occupancy",
    NVML_GPM_METRIC_ANY_TENSOR_UTIL: "any_tensor_util",
    NVML_GPM_METRIC_DRAM_BW_UTIL: "dram_bw_util",
    NVML_GPM_METRIC_PCIE_TX_PER_SEC: "pcie_tx_per_sec",
    NVML_GPM_METRIC_PCIE_RX_PER_SEC: "pcie_rx_per_sec",
    NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: "nvlink_total_rx_per_sec",
    NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: "nvlink_total_tx_per_sec",
    NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC: "c2c_total_tx_per_sec",
    NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC: "c2c_total_rx_per_sec",
}


class NVMLError(Exception):
    """As in nvidia-ml-py: NVMLError(code) builds the subclass for that code; `.value` is the code."""

    value = NVML_ERROR_UNKNOWN

    def __new__(cls, value: int | None = None):
        if cls is NVMLError and value in _CLASSES:
            cls = _CLASSES[value]
        error = super().__new__(cls)
        if value is not None:
            error.value = value
        return error

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


class NVMLError_Uninitialized(NVMLError):
    value = NVML_ERROR_UNINITIALIZED


class NVMLError_InvalidArgument(NVMLError):
    value = NVML_ERROR_INVALID_ARGUMENT


class NVMLError_NotSupported(NVMLError):
    value = NVML_ERROR_NOT_SUPPORTED


class NVMLError_DriverNotLoaded(NVMLError):
    value = NVML_ERROR_DRIVER_NOT_LOADED


class NVMLError_Timeout(NVMLError):
    value = NVML_ERROR_TIMEOUT


class NVMLError_LibraryNotFound(NVMLError):
    value = NVML_ERROR_LIBRARY_NOT_FOUND


class NVMLError_FunctionNotFound(NVMLError):
    value = NVML_ERROR_FUNCTION_NOT_FOUND


class NVMLError_GpuIsLost(NVMLError):
    value = NVML_ERROR_GPU_IS_LOST


class NVMLError_ResetRequired(NVMLError):
    value = NVML_ERROR_RESET_REQUIRED


class NVMLError_Unknown(NVMLError):
    value = NVML_ERROR_UNKNOWN


_CLASSES = {cls.value: cls for cls in NVMLError.__subclasses__()}
_BY_NAME = {cls.__name__.removeprefix("NVMLError_"): cls for cls in NVMLError.__subclasses__()}
_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class _Struct:
    """Attribute bag standing in for pynvml's ctypes structs and friendly objects."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


class _Device:
    """A device handle; one object per index, so handles compare by identity like NVML's pointers."""

    def __init__(self, index: int) -> None:
        self.index = index


class _GpmSample:
    def __init__(self) -> None:
        self.device: int | None = None
        self.taken_at: float | None = None
        self.freed = False


class _EventSet:
    def __init__(self) -> None:
        self.devices: set[int] = set()
        self.freed = False


class c_nvmlGpmMetric_t(_Struct):
    def __init__(self) -> None:
        super().__init__(metricId=0, nvmlReturn=NVML_SUCCESS, value=0.0)


class _MetricSlots(dict):
    """The request's metrics array: NVML_GPM_METRIC_MAX slots, each made on first use (477 structs per
    request would cost the fake a millisecond, which the real ctypes array does not)."""

    def __missing__(self, slot: int) -> c_nvmlGpmMetric_t:
        if not 0 <= slot < NVML_GPM_METRIC_MAX:
            raise IndexError(slot)
        metric = self[slot] = c_nvmlGpmMetric_t()
        return metric


class c_nvmlGpmMetricsGet_t(_Struct):
    def __init__(self) -> None:
        super().__init__(version=0, numMetrics=0, sample1=None, sample2=None, metrics=_MetricSlots())


_STARTED = time.monotonic()
EVENT_POLL_SECONDS = 0.1  # how often a waiting nvmlEventSetWait_v2 looks for new scenario XIDs
# Latencies from here up are slept, shorter ones busy-waited: on an H100 every call but the PCIe poll (20 ms
# asleep while NVML samples the link) spent its whole latency on the CPU, the 3 ms energy read included.
SLEEP_FROM_SECONDS = 10e-3
_calls: Counter[tuple[str, str]] = Counter()  # (thread name, function) -> calls
_lock = threading.Lock()
_cache: dict[str, Any] = {"key": None, "scenario": {}}
_init_count = 0
_handles: dict[int, _Device] = {}
_delivered_events: set[int] = set()
_live_gpm_samples: set[int] = set()


def _scenario() -> dict[str, Any]:
    """The scenario, re-read when the file changed; a half-written file keeps the previous one."""
    path = os.environ.get(SCENARIO_ENV)
    if not path:
        raise RuntimeError(f"fake pynvml: set ${SCENARIO_ENV} to a scenario JSON file")
    stat = os.stat(path)
    key = (path, stat.st_mtime_ns, stat.st_size, stat.st_ino)
    with _lock:
        if key != _cache["key"]:
            try:
                with open(path, encoding="utf-8") as handle:
                    _cache["scenario"] = json.load(handle)
                _cache["key"] = key
            except json.JSONDecodeError:
                if _cache["key"] is None:
                    raise
        return _cache["scenario"]


def _error(name: str) -> NVMLError:
    if name not in _BY_NAME:
        raise ValueError(f"fake pynvml: unknown error {name!r} in scenario (known: {sorted(_BY_NAME)})")
    return _BY_NAME[name]()


def _check_init() -> None:
    if _init_count <= 0:
        raise NVMLError_Uninitialized()


def _gpu(handle: _Device, *fields: str) -> dict[str, Any]:
    """The GPU's scenario entry after the lost/forced-error checks for the given fields."""
    _check_init()
    gpus = _scenario().get("gpus", [])
    if handle.index >= len(gpus) or gpus[handle.index].get("lost"):
        raise NVMLError_GpuIsLost()
    gpu = gpus[handle.index]
    for name in fields:
        if name in gpu.get("errors", {}):
            raise _error(gpu["errors"][name])
    return gpu


def _field(handle: _Device, name: str, *also_errors: str) -> Any:
    gpu = _gpu(handle, *also_errors, name)
    if name not in gpu:
        raise NVMLError_NotSupported()
    return gpu[name]


def _key(mapping: dict[str, Any], key: str) -> Any:
    if key not in mapping:
        raise NVMLError_NotSupported()
    return mapping[key]


def _counter(value: Any, at: float | None = None) -> float:
    """A counter's value now, or at the time.monotonic() instant `at`."""
    if isinstance(value, dict):
        return value.get("start", 0) + value.get("per_second", 0) * ((at or time.monotonic()) - _STARTED)
    return value


def call_counts(thread: str | None = None) -> Counter[str]:
    """Test hook (not in pynvml): calls per nvml function since the last reset, of one thread or all."""
    counts: Counter[str] = Counter()
    for (name, function), count in list(_calls.items()):
        if thread is None or name == thread:
            counts[function] += count
    return counts


def reset_call_counts() -> None:
    """Test hook (not in pynvml)."""
    _calls.clear()


def _spend(seconds: float) -> None:
    if seconds >= SLEEP_FROM_SECONDS:
        time.sleep(seconds)
        return
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def _costed(function: Callable[..., Any]) -> Callable[..., Any]:
    """Counts the call and, with a scenario's latency_ms, takes that long (errors included)."""
    name = function.__name__

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        _calls[(threading.current_thread().name, name)] += 1
        try:
            return function(*args, **kwargs)
        finally:
            latency_ms = _cache["scenario"].get("latency_ms")
            if latency_ms and name != "nvmlEventSetWait_v2":  # the wait has its own timing
                _spend(latency_ms.get(name, latency_ms.get("default", 0.0)) / 1e3)

    return call


def gpm_samples_allocated() -> int:
    """Test hook (not in pynvml): GPM samples allocated and not yet freed."""
    return len(_live_gpm_samples)


def nvmlInit() -> None:
    global _init_count
    error = _scenario().get("init_error")
    if error:
        raise _error(error)
    _init_count += 1


def nvmlShutdown() -> None:
    global _init_count
    _check_init()
    _init_count -= 1


def nvmlSystemGetDriverVersion() -> str:
    _check_init()
    return _scenario().get("driver_version", "550.54.15")


def nvmlDeviceGetCount() -> int:
    _check_init()
    return len(_scenario().get("gpus", []))


def nvmlDeviceGetHandleByIndex(index: int) -> _Device:
    _check_init()
    if not 0 <= index < len(_scenario().get("gpus", [])):
        raise NVMLError_InvalidArgument()
    handle = _handles.setdefault(index, _Device(index))
    _gpu(handle)
    return handle


def nvmlDeviceGetUUID(handle: _Device) -> str:
    return _gpu(handle, "uuid").get("uuid", f"GPU-00000000-0000-0000-0000-{handle.index:012d}")


def nvmlDeviceGetName(handle: _Device) -> str:
    return _gpu(handle, "name").get("name", "NVIDIA Fake GPU")


def nvmlDeviceGetPciInfo(handle: _Device) -> _Struct:
    bus_id = _gpu(handle, "pci_bus_id").get("pci_bus_id", f"00000000:{handle.index + 0x10:02X}:00.0")
    return _Struct(busId=bus_id.encode(), domain=0, bus=int(bus_id.split(":")[1], 16), device=0)


def nvmlDeviceGetUtilizationRates(handle: _Device) -> _Struct:
    rates = _field(handle, "utilization")
    return _Struct(gpu=rates["gpu"], memory=rates["memory"])


def nvmlDeviceGetMemoryInfo(handle: _Device, version: int | None = None) -> _Struct:
    memory = _field(handle, "memory", *(["memory_v2"] if version else []))
    total, used, reserved = memory["total"], memory["used"], memory.get("reserved", 0)
    free = total - used - reserved
    if version:
        if version != nvmlMemory_v2:
            raise NVMLError(25)  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        return _Struct(version=version, total=total, reserved=reserved, free=free, used=used)
    return _Struct(total=total, free=free, used=used + reserved)


def nvmlDeviceGetTemperature(handle: _Device, sensor: int) -> int:
    if sensor != NVML_TEMPERATURE_GPU:
        raise NVMLError_InvalidArgument()
    return _field(handle, "temperature_c")


def nvmlDeviceGetPowerUsage(handle: _Device) -> int:
    return _field(handle, "power_usage_mw")


def nvmlDeviceGetEnforcedPowerLimit(handle: _Device) -> int:
    return _field(handle, "enforced_power_limit_mw")


def nvmlDeviceGetTotalEnergyConsumption(handle: _Device) -> int:
    return int(_counter(_field(handle, "total_energy_mj")))


def nvmlDeviceGetFieldValues(handle: _Device, field_ids: list[int]) -> list[_Struct]:
    """One value per id, each with its own nvmlReturn, as NVML fills them; "errors": {"field_values": ...}
    fails the whole call (a driver without it), an error forced on a field's key fails that field only."""
    _gpu(handle, "field_values")
    return [_field_value(handle, field_id) for field_id in field_ids]


def _field_value(handle: _Device, field_id: int) -> _Struct:
    """One field, stamped (Unix µs) at the instant its value is taken, as the driver stamps its samples."""
    value, status = _Struct(ullVal=0, dVal=0.0), NVML_SUCCESS
    counter = None
    try:
        if field_id not in FIELD_VALUES:
            raise NVMLError_NotSupported()
        key, within = FIELD_VALUES[field_id]
        counter = _field(handle, key)
        counter = counter if within is None else _key(counter, within)
    except NVMLError_GpuIsLost:
        raise
    except NVMLError as exc:
        status = exc.value
    at, stamp_us = time.monotonic(), time.time_ns() // 1000
    if status == NVML_SUCCESS:
        value.ullVal = int(_counter(counter, at))
    return _Struct(fieldId=field_id, scopeId=0, timestamp=stamp_us, latencyUsec=0,
                   valueType=NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, nvmlReturn=status, value=value)


def _clock(handle: _Device, field: str, clock_type: int) -> int:
    names = {NVML_CLOCK_SM: "sm", NVML_CLOCK_MEM: "mem"}
    if clock_type not in names:
        raise NVMLError_InvalidArgument()
    return _key(_field(handle, field), names[clock_type])


def nvmlDeviceGetClockInfo(handle: _Device, clock_type: int) -> int:
    return _clock(handle, "clocks_mhz", clock_type)


def nvmlDeviceGetMaxClockInfo(handle: _Device, clock_type: int) -> int:
    return _clock(handle, "max_clocks_mhz", clock_type)


def nvmlDeviceGetCurrentClocksEventReasons(handle: _Device) -> int:
    reasons = _field(handle, "clocks_event_reasons")
    if isinstance(reasons, int):
        return reasons
    bits = 0
    for name in reasons:
        bits |= REASON_BITS[name]
    return bits


nvmlDeviceGetCurrentClocksThrottleReasons = nvmlDeviceGetCurrentClocksEventReasons


def nvmlDeviceGetViolationStatus(handle: _Device, policy: int) -> _Struct:
    if policy not in POLICIES:
        raise NVMLError_InvalidArgument()
    spent = _key(_field(handle, "violation_ns"), POLICIES[policy])
    return _Struct(referenceTime=time.time_ns() // 1000, violationTime=int(_counter(spent)))


def nvmlDeviceGetPcieThroughput(handle: _Device, counter: int) -> int:
    names = {NVML_PCIE_UTIL_RX_BYTES: "rx", NVML_PCIE_UTIL_TX_BYTES: "tx"}
    if counter not in names:
        raise NVMLError_InvalidArgument()
    return _key(_field(handle, "pcie_kbps"), names[counter])


def nvmlDeviceGetTotalEccErrors(handle: _Device, error_type: int, counter_type: int) -> int:
    names = {NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected", NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected"}
    if error_type not in names or counter_type not in (NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC):
        raise NVMLError_InvalidArgument()
    return int(_counter(_key(_field(handle, "ecc_aggregate"), names[error_type])))


def _processes(listed: list[dict[str, Any]]) -> list[_Struct]:
    return [
        _Struct(pid=p["pid"], usedGpuMemory=p.get("used_memory"), gpuInstanceId=0xFFFFFFFF,
                computeInstanceId=0xFFFFFFFF)
        for p in listed
    ]


def nvmlDeviceGetComputeRunningProcesses(handle: _Device) -> list[_Struct]:
    return _processes(_gpu(handle, "processes").get("processes", []))


def nvmlDeviceGetMPSComputeRunningProcesses(handle: _Device) -> list[_Struct]:
    """The processes that run on the GPU through the MPS server, which NVML lists here and not among the compute
    processes (that list holds the server, nvidia-cuda-mps-server, instead). [] where no MPS server runs, as a
    driver answers; a driver or GPU without MPS refuses it (errors "mps_processes": "NotSupported"), and a
    driver older than the call has no such function ("FunctionNotFound")."""
    return _processes(_gpu(handle, "mps_processes").get("mps_processes", []))


def nvmlGpmQueryDeviceSupport(handle: _Device) -> _Struct:
    gpu = _gpu(handle)
    return _Struct(version=NVML_GPM_SUPPORT_VERSION, isSupportedDevice=int("gpm" in gpu))


def nvmlGpmSampleAlloc() -> _GpmSample:
    _check_init()
    sample = _GpmSample()
    _live_gpm_samples.add(id(sample))
    return sample


def nvmlGpmSampleFree(sample: _GpmSample) -> None:
    if sample.freed:
        raise NVMLError_InvalidArgument()
    sample.freed = True
    _live_gpm_samples.discard(id(sample))


def nvmlGpmSampleGet(handle: _Device, sample: _GpmSample) -> _GpmSample:
    _field(handle, "gpm", "gpm_sample")
    if sample.freed:
        raise NVMLError_InvalidArgument()
    sample.device, sample.taken_at = handle.index, time.monotonic()
    return sample


def nvmlGpmMetricsGet(request: c_nvmlGpmMetricsGet_t) -> c_nvmlGpmMetricsGet_t:
    first, second = request.sample1, request.sample2
    if (request.version != NVML_GPM_METRICS_GET_VERSION or first is None or second is None
            or first.taken_at is None or second.taken_at is None or first.device != second.device
            or second.taken_at <= first.taken_at):
        raise NVMLError_InvalidArgument()
    values = _field(_handles[second.device], "gpm")
    for metric in (request.metrics[slot] for slot in range(request.numMetrics)):
        name = GPM_KEYS.get(metric.metricId)
        if name in values:
            metric.value, metric.nvmlReturn = float(values[name]), NVML_SUCCESS
        else:
            metric.value, metric.nvmlReturn = 0.0, NVML_ERROR_NOT_SUPPORTED
    return request


def nvmlEventSetCreate() -> _EventSet:
    _check_init()
    return _EventSet()


def nvmlDeviceRegisterEvents(handle: _Device, event_types: int, event_set: _EventSet) -> None:
    _gpu(handle, "register_events")
    if event_types & ~nvmlEventTypeXidCriticalError:
        raise NVMLError_NotSupported()
    event_set.devices.add(handle.index)


def nvmlEventSetWait_v2(event_set: _EventSet, timeoutms: int) -> _Struct:
    """Delivers the next undelivered scenario XID for a registered GPU, or raises Timeout."""
    deadline = time.monotonic() + timeoutms / 1000
    while True:
        _check_init()
        if event_set.freed:
            raise NVMLError_InvalidArgument()
        for position, event in enumerate(_scenario().get("xid_events", [])):
            with _lock:
                if position in _delivered_events or event["gpu"] not in event_set.devices:
                    continue
                _delivered_events.add(position)
            return _Struct(device=_handles[event["gpu"]], eventType=nvmlEventTypeXidCriticalError,
                           eventData=event["xid"], gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NVMLError_Timeout()
        time.sleep(min(remaining, EVENT_POLL_SECONDS))


def nvmlEventSetFree(event_set: _EventSet) -> None:
    if event_set.freed:
        raise NVMLError_InvalidArgument()
    event_set.freed = True


for _name, _function in list(globals().items()):
    if _name.startswith("nvml") and callable(_function) and not isinstance(_function, type):
        globals()[_name] = _costed(_function)

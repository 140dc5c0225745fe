"""GPU readings from NVML (nvidia-ml-py): per-GPU gauges and counters, GPM on Hopper+, XID counts.

Every NVML call runs off the scrape path: the fast getters (1-15 µs each on an H100) and GPM on
the collector's timer thread, the slow ones (energy, violation time, and PCIe throughput where GPM
cannot give it) on their own thread every 10 s (`gpu_slow`), XIDs on an event thread. Each field is
read on its own, so an unsupported query drops one family of one GPU; a GPU that stops answering
drops to `stepscope_gpu_up 0` while the others keep reporting; a query failing otherwise than unsupported is
a failed reading (`failed_reading`, warned once). Without a driver, or with one listing no GPU, the collector
publishes `stepscope_gpu_collector_up 0`, logs that once and retries now and then; GPUs listed after start,
or answering only after it, are picked up (XIDs included).
"""

import contextlib
import importlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, Any

from stepscope.contract import families as fam
from stepscope.exporter.collectors.gpu_events import XidWatcher
from stepscope.exporter.collectors.gpu_gpm import GpmSampler
from stepscope.exporter.collectors.gpu_slow import (
    DEFAULT_INTERVAL_SECONDS,
    UNSUPPORTED_ERRORS,
    Reader,
    Sample,
    SlowReadings,
    SlowRound,
)
from stepscope.exporter.gpu_processes import GpuProcessTable
from stepscope.exporter.metric_families import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:  # pods.py needs grpc, which only pod attribution installs
    from stepscope.exporter.collectors.pods import PodAttribution

log = logging.getLogger(__name__)

GPU = ("gpu", "uuid")
# family name (stepscope.contract.families): (family class, help, labels)
FAMILIES: dict[str, tuple[type, str, tuple[str, ...]]] = {
    fam.GPU_COLLECTOR_UP: (GaugeMetricFamily, "1 when NVML initialised, 0 otherwise (no GPU, no driver).", ()),
    fam.GPU_UP: (GaugeMetricFamily, "1 while the GPU answers NVML queries, 0 once it stopped answering.", GPU),
    fam.GPU_INFO: (GaugeMetricFamily, "GPU identity (value 1).", (*GPU, "name", "driver_version", "pci_bus_id")),
    fam.GPU_UTILIZATION: (GaugeMetricFamily, "Fraction of the last sample period a kernel was running.", GPU),
    fam.GPU_MEMORY_UTILIZATION: (
        GaugeMetricFamily, "Fraction of the last sample period device memory was read or written.", GPU),
    fam.GPU_MEMORY_USED: (GaugeMetricFamily, "Framebuffer memory in use.", GPU),
    fam.GPU_MEMORY_FREE: (GaugeMetricFamily, "Framebuffer memory free.", GPU),
    fam.GPU_MEMORY_TOTAL: (GaugeMetricFamily, "Framebuffer memory installed.", GPU),
    fam.GPU_TEMPERATURE: (GaugeMetricFamily, "GPU die temperature.", GPU),
    fam.GPU_POWER: (GaugeMetricFamily, "Power draw of the board.", GPU),
    fam.GPU_POWER_LIMIT: (GaugeMetricFamily, "Enforced power limit.", GPU),
    fam.GPU_ENERGY: (CounterMetricFamily, "Energy used since the driver was loaded.", GPU),
    fam.GPU_ENERGY_READ_TIME: (GaugeMetricFamily, "Unix time the published energy counters were read.", ()),
    fam.GPU_SM_CLOCK: (GaugeMetricFamily, "Current SM clock.", GPU),
    fam.GPU_SM_CLOCK_MAX: (GaugeMetricFamily, "Maximum SM clock.", GPU),
    fam.GPU_MEMORY_CLOCK: (GaugeMetricFamily, "Current memory clock.", GPU),
    fam.GPU_CLOCK_EVENT_ACTIVE: (
        GaugeMetricFamily, "1 for each clock-event (throttle) reason active now.", (*GPU, "reason")),
    fam.GPU_CLOCK_EVENT_SECONDS: (
        CounterMetricFamily, "Cumulative time clocks were held down, by policy.", (*GPU, "reason")),
    fam.GPU_PCIE_RECEIVE: (
        GaugeMetricFamily, "PCIe receive throughput (GPM: since the last cycle; pre-Hopper: a 20 ms window).", GPU),
    fam.GPU_PCIE_TRANSMIT: (
        GaugeMetricFamily, "PCIe transmit throughput (GPM: since the last cycle; pre-Hopper: a 20 ms window).", GPU),
    fam.GPU_ECC_ERRORS: (CounterMetricFamily, "Aggregate ECC errors over the GPU's life.", (*GPU, "type")),
    fam.GPU_XID_ERRORS: (CounterMetricFamily, "XID critical errors seen since exporter start.", (*GPU, "xid")),
    fam.GPU_XID_LAST_SEEN: (GaugeMetricFamily, "Unix time that XID last fired.", (*GPU, "xid")),
    fam.GPU_SM_ACTIVE: (GaugeMetricFamily, "GPM: fraction of SMs busy (Hopper and newer).", GPU),
    fam.GPU_SM_OCCUPANCY: (GaugeMetricFamily, "GPM: resident warps over the theoretical maximum.", GPU),
    fam.GPU_TENSOR_ACTIVE: (GaugeMetricFamily, "GPM: fraction of time tensor cores were busy.", GPU),
    fam.GPU_DRAM_ACTIVE: (GaugeMetricFamily, "GPM: DRAM bandwidth used over the maximum.", GPU),
    fam.GPU_NVLINK_RECEIVE: (
        GaugeMetricFamily, "GPM: NVLink receive throughput, all links, since the last cycle.", GPU),
    fam.GPU_NVLINK_TRANSMIT: (
        GaugeMetricFamily, "GPM: NVLink transmit throughput, all links, since the last cycle.", GPU),
    fam.GPU_C2C_RECEIVE: (
        GaugeMetricFamily, "GPM: C2C (chip-to-chip, Grace Hopper) receive throughput since the last cycle.", GPU),
    fam.GPU_C2C_TRANSMIT: (
        GaugeMetricFamily, "GPM: C2C (chip-to-chip, Grace Hopper) transmit throughput since the last cycle.", GPU),
}

# Clock-event reason bits (nvml.h nvmlClocksEventReason*, same values as the older ThrottleReason*)
CLOCK_EVENT_REASONS = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)
# errors that mean the GPU itself stopped answering when a basic query raises them (two cycles running)
DEVICE_DOWN_ERRORS = ("NVMLError_GpuIsLost", "NVMLError_Unknown", "NVMLError_DriverNotLoaded",
                      "NVMLError_ResetRequired")
FAILURES_NAMED = 3  # failed readings `failed_reading` names; the rest are counted


def _utilization(nvml: ModuleType, handle: Any) -> Iterable[Sample]:
    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
    return [(fam.GPU_UTILIZATION, (), rates.gpu / 100), (fam.GPU_MEMORY_UTILIZATION, (), rates.memory / 100)]


def _memory(nvml: ModuleType, handle: Any) -> Iterable[Sample]:
    """v2 when the bindings and driver have it: its `used` leaves out driver-reserved memory."""
    try:
        memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
    except (AttributeError, nvml.NVMLError_FunctionNotFound):  # bindings or driver older than v2
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return [(fam.GPU_MEMORY_USED, (), memory.used), (fam.GPU_MEMORY_FREE, (), memory.free),
            (fam.GPU_MEMORY_TOTAL, (), memory.total)]


def _clock_events(nvml: ModuleType, handle: Any) -> Iterable[Sample]:
    read = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    bits = (read or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)(handle)
    return [(fam.GPU_CLOCK_EVENT_ACTIVE, (reason,), float(bool(bits & bit))) for reason, bit in CLOCK_EVENT_REASONS]


def _scaled(key: str, scale: float, call: Callable[[ModuleType, Any], float],
            nvml: ModuleType, handle: Any) -> Iterable[Sample]:
    return [(key, (), call(nvml, handle) * scale)]


def _ecc(kind: str, error_type: str, nvml: ModuleType, handle: Any) -> Iterable[Sample]:
    count = nvml.nvmlDeviceGetTotalEccErrors(handle, getattr(nvml, error_type), nvml.NVML_AGGREGATE_ECC)
    return [(fam.GPU_ECC_ERRORS, (kind,), count)]


# (family key, factor to base units, NVML call) for fields that are one number
SCALAR_FIELDS: tuple[tuple[str, float, Callable[[ModuleType, Any], float]], ...] = (
    (fam.GPU_TEMPERATURE, 1, lambda n, h: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
    (fam.GPU_POWER, 1e-3, lambda n, h: n.nvmlDeviceGetPowerUsage(h)),  # mW
    (fam.GPU_POWER_LIMIT, 1e-3, lambda n, h: n.nvmlDeviceGetEnforcedPowerLimit(h)),  # mW
    (fam.GPU_SM_CLOCK, 1e6, lambda n, h: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),  # MHz
    (fam.GPU_MEMORY_CLOCK, 1e6, lambda n, h: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM)),
)
_sm_clock_max = partial(_scaled, fam.GPU_SM_CLOCK_MAX, 1e6,
                        lambda n, h: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM))  # MHz
# Basic queries first: driver-level errors there mean the GPU is gone, elsewhere just a missing field.
BASIC_READERS: tuple[tuple[str, Reader], ...] = (("utilization", _utilization), ("memory", _memory))
READERS: tuple[tuple[str, Reader], ...] = (
    *((key, partial(_scaled, key, scale, call)) for key, scale, call in SCALAR_FIELDS),
    ("clock_events", _clock_events),
    ("ecc_corrected", partial(_ecc, "corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED")),
    ("ecc_uncorrected", partial(_ecc, "uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED")),
)


def _compute_processes(nvml: ModuleType, handle: Any) -> list[Any]:
    return nvml.nvmlDeviceGetComputeRunningProcesses(handle)


def _mps_processes(nvml: ModuleType, handle: Any) -> list[Any]:
    """The processes that run on the GPU through the MPS server: NVML lists them only here (the compute
    processes hold the server, nvidia-cuda-mps-server, instead), so under MPS no training pid was mapped to its
    GPU. Bindings without the call are refused as a driver without it is (FunctionNotFound: left out)."""
    read = getattr(nvml, "nvmlDeviceGetMPSComputeRunningProcesses", None)
    if read is None:
        raise nvml.NVMLError_FunctionNotFound()
    return read(handle)


def _held_memory(compute: Iterable[Any], through_mps: Iterable[Any]) -> list[tuple[int, int]]:
    """(pid, bytes) of every process holding memory on the GPU, from both of NVML's lists. A pid in both is one
    process (a driver may list an MPS client in both), counted once: from the compute list where it has a memory
    figure there. Two entries of one pid within a list are two contexts, which add up. Entries without a memory
    figure are left out."""
    listed = [(process.pid, process.usedGpuMemory) for process in compute if process.usedGpuMemory is not None]
    counted = {pid for pid, _ in listed}
    listed += [(process.pid, process.usedGpuMemory) for process in through_mps
               if process.usedGpuMemory is not None and process.pid not in counted]
    return listed


class _GpuDown(Exception):
    """A GPU stopped answering during this cycle."""


@dataclass
class _Gpu:
    index: str
    driver_version: str
    handle: Any = None  # None until the GPU answered the identity queries
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    gpm: GpmSampler | None = None
    sm_clock_max: list[Sample] = field(default_factory=list)  # read when identified (see _identify)
    up: bool = True
    down_errors: int = 0  # consecutive cycles a basic query raised a DEVICE_DOWN_ERRORS error
    unsupported: set[tuple[str, str]] = field(default_factory=set)  # (field, error): logged at DEBUG once
    failing: dict[str, str] = field(default_factory=dict)  # field -> error name, warned once until it reads


class _Output:
    """Families created on first use, so a family with no samples is absent rather than empty."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def add(self, key: str, labels: tuple[str, ...], value: float) -> None:
        family = self._families.get(key)
        if family is None:
            kind, doc, label_names = FAMILIES[key]
            family = self._families[key] = kind(key, doc, labels=list(label_names))
        family.add_metric(list(labels), value)

    def families(self) -> list[Metric]:
        return list(self._families.values())


class GpuCollector:
    """Reads every GPU through NVML once per cycle; see the module docstring for failure handling."""

    name = "gpu"

    def __init__(self, gpu_processes: GpuProcessTable, nvml: ModuleType | None = None,
                 init_retry_seconds: float = 60.0, slow_interval: float = DEFAULT_INTERVAL_SECONDS,
                 poll_pcie: bool = True, pods: "PodAttribution | None" = None) -> None:
        """poll_pcie=False: GPUs without GPM publish no PCIe throughput (see `gpu_slow`); pods: label each
        GPU's series with the pod container it was given to (Kubernetes, `collectors.pods`)."""
        self._gpu_processes = gpu_processes
        self._pods = pods
        self._nvml = nvml
        self._init_retry_seconds = init_retry_seconds
        self._slow_interval = slow_interval
        self._poll_pcie = poll_pcie
        self._slow: SlowReadings | None = None
        self._next_init = 0.0
        self._next_count = 0.0  # when to ask NVML again how many GPUs it lists (see `_add_listed_gpus`)
        self._unavailable_logged = False
        self._gpus: list[_Gpu] | None = None  # None until NVML initialised
        self._events: XidWatcher | None = None
        self._down_errors: tuple[type[Exception], ...] = ()
        self._unsupported: tuple[type[Exception], ...] = ()
        self._failures: list[str] = []  # this cycle's failed readings
        self.failed_reading = ""  # read by the scheduler after each cycle (collectors.Collector)

    def collect(self) -> list[Metric]:
        out = _Output()
        self._failures = []
        self.failed_reading = ""
        if self._gpus is None and not self._init():
            out.add(fam.GPU_COLLECTOR_UP, (), 0)
            self._gpu_processes.replace({})
            return out.families()
        out.add(fam.GPU_COLLECTOR_UP, (), 1)
        processes: dict[int, dict[str, int]] = {}
        now = time.monotonic()
        if now >= self._next_count:
            self._add_listed_gpus(now)
        slow = self._slow.latest() if self._slow is not None else SlowRound()
        for gpu in self._gpus or ():
            self._collect_gpu(gpu, now, out, processes, slow)
        if slow.fresh(now):
            out.add(fam.GPU_ENERGY_READ_TIME, (), slow.read_time)
            self._failures += slow.failures
        for (index, uuid, xid), count, last_seen in self._events.seen() if self._events else ():
            out.add(fam.GPU_XID_ERRORS, (index, uuid, xid), count)
            out.add(fam.GPU_XID_LAST_SEEN, (index, uuid, xid), last_seen)
        self._gpu_processes.replace(processes)
        self.failed_reading = self._failed_summary()
        if self._pods is None:
            return out.families()
        pods = self._pods  # every family but the collector's own up and the energy read time carries uuid
        pods.name_gpus({gpu.index: gpu.uuid for gpu in self._gpus or () if gpu.uuid})
        return pods.label(out.families(),
                          lambda labels: pods.gpu(labels["uuid"], labels["gpu"]) if "uuid" in labels else None)

    def close(self) -> None:
        if self._gpus is None:
            return
        if self._events is not None:
            self._events.close()
        if self._slow is not None:
            self._slow.close()
        nvml = self._nvml
        assert nvml is not None
        for gpu in self._gpus:
            if gpu.gpm is not None:
                gpu.gpm.close()
        with contextlib.suppress(nvml.NVMLError):  # best effort at exit
            nvml.nvmlShutdown()
        self._gpus = None

    def _init(self) -> bool:
        """nvmlInit and GPU discovery; False (logged once) while NVML is unavailable."""
        now = time.monotonic()
        if now < self._next_init:
            return False
        self._next_init = now + self._init_retry_seconds
        try:
            nvml = self._nvml or importlib.import_module("pynvml")
        except ImportError as exc:
            self._unavailable(f"nvidia-ml-py is not installed: {exc}")
            return False
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            self._unavailable(str(exc))
            return False
        try:
            driver = nvml.nvmlSystemGetDriverVersion()
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()
            self._unavailable(str(exc))
            return False
        if count == 0:  # retried like a missing driver: before, collector_up stayed 1 with no GPU until restart
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()
            self._unavailable("NVML lists no GPU")
            return False
        self._next_count = now + self._init_retry_seconds
        self._down_errors = tuple(getattr(nvml, name) for name in DEVICE_DOWN_ERRORS)
        self._unsupported = tuple(getattr(nvml, name) for name in UNSUPPORTED_ERRORS)
        self._gpus = [_Gpu(str(index), driver) for index in range(count)]
        for gpu in self._gpus:
            with contextlib.suppress(_GpuDown):  # reported by the first cycle, which tries again
                self._identify(gpu)
        identified = [(g.index, g.uuid, g.handle) for g in self._gpus if g.handle is not None]
        self._events = XidWatcher.start(nvml, identified)
        self._slow = SlowReadings(nvml, self._slow_interval, self._poll_pcie)
        self._slow.start(self._gpus)
        log.info("NVML initialised: driver %s, %d GPU(s) (%s)", driver, len(self._gpus), ", ".join(
            f"{g.index}: {g.name or 'not answering'}{' +GPM' if g.gpm else ''}" for g in self._gpus))
        return True

    def _add_listed_gpus(self, now: float) -> None:
        """GPUs NVML lists beyond those known (a GPU the driver finished bringing up after start); the next
        cycles identify them, register their XIDs and the slow thread reads them. Before, a GPU listed after
        start was never published. Asked every init_retry_seconds, not every cycle: nvmlDeviceGetCount has not
        been priced on a GPU (the cycle's calls were, ~0.85 ms per GPU on an H100), and GPUs appear that rarely.
        A GPU no longer listed stays: its queries fail and gpu_up says so."""
        self._next_count = now + self._init_retry_seconds
        nvml, gpus = self._nvml, self._gpus
        assert nvml is not None and gpus is not None
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            log.debug("nvmlDeviceGetCount failed (%s): GPUs listed later are looked for again later", exc)
            return
        if count <= len(gpus):
            return
        known, driver = len(gpus), gpus[0].driver_version
        gpus.extend(_Gpu(str(index), driver) for index in range(known, count))  # the slow thread's list too
        log.info("NVML lists %d GPU(s) now, %d before: reading the new ones", count, known)

    def _unavailable(self, reason: str) -> None:
        if self._unavailable_logged:
            log.debug("NVML still unavailable (%s)", reason)
            return
        self._unavailable_logged = True
        log.warning("NVML unavailable (%s): GPU metrics disabled, retrying every %gs",
                    reason, self._init_retry_seconds)

    def _identify(self, gpu: _Gpu) -> None:
        """Handle and identity of a GPU; raises _GpuDown while it does not answer."""
        nvml = self._nvml
        assert nvml is not None
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(int(gpu.index))
            uuid, name = nvml.nvmlDeviceGetUUID(handle), nvml.nvmlDeviceGetName(handle)
            bus_id = nvml.nvmlDeviceGetPciInfo(handle).busId
        except nvml.NVMLError as exc:
            if not isinstance(exc, nvml.NVMLError_GpuIsLost):  # lost: gpu_up 0 says it, no collector error
                self._failed(gpu, "identity", exc)
            raise _GpuDown(str(exc)) from None
        gpu.handle, gpu.uuid, gpu.name = handle, uuid, name
        gpu.pci_bus_id = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
        try:  # read once: the board's maximum never changes while the driver is loaded, and on an H100 (driver
            # 580) the call spends 1.46 ms of CPU, half of a whole cycle's (benchmarks/results/gpu-per-call.md)
            gpu.sm_clock_max = self._read(gpu, "sm_clock_max", _sm_clock_max) or []
        except _GpuDown:
            gpu.handle = None  # identified again by the next cycle
            raise
        gpu.gpm = GpmSampler.open(nvml, handle)

    def _collect_gpu(self, gpu: _Gpu, now: float, out: _Output, processes: dict[int, dict[str, int]],
                     slow: SlowRound) -> None:
        try:
            if gpu.handle is None:
                self._identify(gpu)
                self._watch_xids(gpu)
                self._refresh_slow()
            samples = self._read_basic(gpu)
            for what, reader in READERS:
                samples += self._read(gpu, what, reader) or ()
            gpm = self._read(gpu, "gpm", lambda _n, _h: gpu.gpm.read(now)) if gpu.gpm else None
            held = self._read(gpu, "processes", _compute_processes)
            held_through_mps = self._read(gpu, "mps_processes", _mps_processes)
        except _GpuDown as exc:
            if gpu.up:
                log.warning("GPU %s (%s) stopped answering (%s)", gpu.index, gpu.uuid, exc)
            gpu.up = False
            if gpu.gpm:
                gpu.gpm.reset()
            out.add(fam.GPU_UP, (gpu.index, gpu.uuid), 0)
            if gpu.handle is not None:
                self._add_info(gpu, out)
            return
        if not gpu.up:
            log.info("GPU %s (%s) answers again", gpu.index, gpu.uuid)
            gpu.up = True
            self._refresh_slow()
        labels = (gpu.index, gpu.uuid)
        out.add(fam.GPU_UP, labels, 1)
        self._add_info(gpu, out)
        samples += gpu.sm_clock_max
        samples += slow.samples(gpu.index, now)
        for key, extra, value in samples:
            out.add(key, (*labels, *extra), value)
        for key, value in (gpm or {}).items():
            out.add(key, labels, value)
        for pid, used in _held_memory(held or (), held_through_mps or ()):
            per_gpu = processes.setdefault(pid, {})
            per_gpu[gpu.index] = per_gpu.get(gpu.index, 0) + used

    def _watch_xids(self, gpu: _Gpu) -> None:
        """Registers a GPU identified after start for XID events (`_init` registers those identified then),
        starting the watcher when no GPU had one: before, such a GPU's XIDs were never counted."""
        if self._events is not None:
            self._events.watch(gpu.index, gpu.uuid, gpu.handle)
            return
        assert self._nvml is not None
        self._events = XidWatcher.start(self._nvml, [(gpu.index, gpu.uuid, gpu.handle)])

    def _refresh_slow(self) -> None:
        if self._slow is not None:
            self._slow.refresh_soon()

    @staticmethod
    def _add_info(gpu: _Gpu, out: _Output) -> None:
        out.add(fam.GPU_INFO, (gpu.index, gpu.uuid, gpu.name, gpu.driver_version, gpu.pci_bus_id), 1)

    def _read_basic(self, gpu: _Gpu) -> list[Sample]:
        """Utilization and memory; raises _GpuDown when neither answered (before, a GPU refusing every query
        with Timeout or Uninitialized stayed up with no reading), or when one raised a device-down error for
        the second cycle running: one Unknown on utilization flapped gpu_up 1 -> 0 -> 1 and dropped GPM."""
        nvml = self._nvml
        assert nvml is not None
        samples: list[Sample] = []
        down: Exception | None = None
        for what, reader in BASIC_READERS:
            try:
                samples += self._read(gpu, what, reader, quiet=True)
            except nvml.NVMLError as exc:
                self._failed(gpu, what, exc)
                if isinstance(exc, self._down_errors):
                    down = exc
        gpu.down_errors = gpu.down_errors + 1 if down else 0
        if not samples or gpu.down_errors >= 2:
            raise _GpuDown(str(down or "no basic reading answered"))
        return samples

    def _read(self, gpu: _Gpu, what: str, reader: Callable[[ModuleType, Any], Any], quiet: bool = False) -> Any:
        """The reader's result; None when NVML refuses this field (see `_failed`). quiet: errors other than
        GpuIsLost propagate, for the caller to judge."""
        nvml = self._nvml
        assert nvml is not None
        try:
            value = reader(nvml, gpu.handle)
        except nvml.NVMLError as exc:
            if isinstance(exc, nvml.NVMLError_GpuIsLost):
                raise _GpuDown(str(exc)) from None
            if quiet:
                raise
            self._failed(gpu, what, exc)
            return None
        if gpu.failing and gpu.failing.pop(what, None):  # one dict check per read while nothing fails
            log.info("GPU %s (%s): %s reads again", gpu.index, gpu.uuid, what)
        return value

    def _failed(self, gpu: _Gpu, what: str, exc: Exception) -> None:
        """A field NVML refused. Unsupported (the GPU has no such query): left out, logged at DEBUG once.
        Any other error is a failed reading: named in `failed_reading`, so every such cycle counts in
        stepscope_exporter_collector_errors_total, and logged at WARNING once until the field reads again
        (before, Timeout or Unknown were logged at DEBUG and counted nowhere)."""
        name = type(exc).__name__
        if isinstance(exc, self._unsupported):
            if (what, name) not in gpu.unsupported:
                gpu.unsupported.add((what, name))
                log.debug("GPU %s: %s unavailable (%s): left out", gpu.index, what, exc)
            return
        self._failures.append(f"GPU {gpu.index} {what}: {name}")
        if gpu.failing.get(what) != name:
            gpu.failing[what] = name
            log.warning("GPU %s (%s): reading %s failed (%s): left out until it reads again",
                        gpu.index, gpu.uuid or "not identified", what, exc)

    def _failed_summary(self) -> str:
        named = "; ".join(self._failures[:FAILURES_NAMED])
        more = len(self._failures) - FAILURES_NAMED
        return f"{named} (and {more} more)" if more > 0 else named

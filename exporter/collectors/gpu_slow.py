"""GPU readings too slow for every cycle, taken on a thread of their own.

On an H100 most NVML getters return in 1.5-10 µs, but energy and the eight policies' violation time take
2.9 ms of CPU together, read in one `nvmlDeviceGetFieldValues` call (8.7 ms as nine calls), and
`nvmlDeviceGetPcieThroughput` blocks 20 ms per direction while NVML samples the link. Energy and
violation time are cumulative counters, so reading them every `interval` seconds (10 by default)
loses nothing but resolution; PCIe throughput is read here only for GPUs whose GPM cannot give it
(pre-Hopper), and is then one 20 ms window every interval rather than a per-cycle reading.

The first round runs in `start()`, so the collector's first cycle already has every value; then
a daemon thread repeats it every interval, and at once when the collector asks (a GPU answered
again, or late). The collector publishes a GPU's latest values while they are at most
`STALE_INTERVALS` intervals old, so a wedged NVML call makes them absent instead of frozen.
"""

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any, Protocol

from stepscope.contract import families as fam
from stepscope.exporter.thread_cpu import collector_thread_name

log = logging.getLogger(__name__)

Sample = tuple[str, tuple[str, ...], float]  # (family key, labels after gpu+uuid, value)
Reader = Callable[[ModuleType, Any], Iterable[Sample]]

# What a GPU does not have, not a failure: left out quietly (the collector and the slow readings alike)
UNSUPPORTED_ERRORS = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")
DEFAULT_INTERVAL_SECONDS = 10.0
STALE_INTERVALS = 3
# NVML's timestamp of a field stands for the round's read time only this close to the exporter's clock: a driver
# that leaves it 0, or stamps in another clock, leaves the round on time.time().
STAMP_TRUSTED_WITHIN_SECONDS = 1.0
VIOLATION_POLICIES = (
    ("power", "NVML_PERF_POLICY_POWER"),
    ("thermal", "NVML_PERF_POLICY_THERMAL"),
    ("sync_boost", "NVML_PERF_POLICY_SYNC_BOOST"),
    ("board_limit", "NVML_PERF_POLICY_BOARD_LIMIT"),
    ("low_utilization", "NVML_PERF_POLICY_LOW_UTILIZATION"),
    ("reliability", "NVML_PERF_POLICY_RELIABILITY"),
    ("app_clocks", "NVML_PERF_POLICY_TOTAL_APP_CLOCKS"),
    ("base_clocks", "NVML_PERF_POLICY_TOTAL_BASE_CLOCKS"),
)


class GpuRef(Protocol):
    """What this module needs of the collector's per-GPU state (read, never written, here)."""

    index: str
    handle: Any
    gpm: Any  # GpmSampler | None; its `gives_pcie` says whether GPM covers PCIe


@dataclass(frozen=True)
class Counter:
    """A cumulative reading: one field of the round's nvmlDeviceGetFieldValues call, or its own call where
    that field (or the call) is refused."""

    what: str  # names it in logs
    field_id: str  # its pynvml NVML_FI_* constant
    key: str  # the family it goes to
    labels: tuple[str, ...]
    scale: float  # NVML's unit to the family's
    call: Callable[[ModuleType, Any], int]  # the single call

    def sample(self, raw: float) -> Sample:
        return self.key, self.labels, raw * self.scale

    def read(self, nvml: ModuleType, handle: Any) -> Iterable[Sample]:
        return [self.sample(self.call(nvml, handle))]


def _violation_ns(policy: str, nvml: ModuleType, handle: Any) -> int:
    return nvml.nvmlDeviceGetViolationStatus(handle, getattr(nvml, policy)).violationTime


# One nvmlDeviceGetFieldValues call reads all nine: 2.87 ms of CPU on an H100 (driver 580), against 3.06 ms
# for the energy call and 0.58-0.87 ms for each policy's (8.7 ms a round; benchmarks/results/gpu-per-call.md
# and exporter_cpu.md). The values are the same counters in the same units (mJ, ns).
COUNTERS: tuple[Counter, ...] = (
    Counter("energy", "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", fam.GPU_ENERGY, (), 1e-3,  # mJ
            lambda nvml, handle: nvml.nvmlDeviceGetTotalEnergyConsumption(handle)),
    *(Counter(f"violation_{reason}", f"NVML_FI_DEV_{policy.removeprefix('NVML_')}", fam.GPU_CLOCK_EVENT_SECONDS,
              (reason,), 1e-9, partial(_violation_ns, policy)) for reason, policy in VIOLATION_POLICIES),  # ns
)


def _pcie(key: str, counter: str, nvml: ModuleType, handle: Any) -> Iterable[Sample]:
    return [(key, (), nvml.nvmlDeviceGetPcieThroughput(handle, getattr(nvml, counter)) * 1024)]  # KB/s


PCIE_READERS: tuple[tuple[str, Reader], ...] = (
    ("pcie_receive", partial(_pcie, fam.GPU_PCIE_RECEIVE, "NVML_PCIE_UTIL_RX_BYTES")),
    ("pcie_transmit", partial(_pcie, fam.GPU_PCIE_TRANSMIT, "NVML_PCIE_UTIL_TX_BYTES")),
)


@dataclass(frozen=True)
class SlowRound:
    """One round's readings of every GPU, published whole: the node's energy read time
    (`GPU_ENERGY_READ_TIME`, one series per node to keep the series budget) must go out with the counters
    of the same round, or the rules' watts (each counter's increase over the read time's) would mix two."""

    read_at: float = 0.0  # time.monotonic() when the round started
    # When the round's energy was read, in Unix seconds; None before the first round. NVML's own timestamp of
    # the first GPU's energy field where the batched read gives one, else time.time() at the round's start: the
    # watts divide each counter's increase by this time's, and a stamp taken by this thread would add the
    # time the thread waited for a CPU between its clock and the driver's read (0.3% of a 1 s round under load).
    read_time: float | None = None
    gpus: dict[str, list[Sample]] = field(default_factory=dict)  # index -> samples
    stale_after: float = 0.0
    # the readings NVML failed to give this round, other than those the GPU does not have ("GPU 0 energy:
    # NVMLError_Timeout"): the collector names them in its failed_reading while the round is fresh
    failures: tuple[str, ...] = ()

    def fresh(self, now: float) -> bool:
        return self.read_time is not None and now - self.read_at <= self.stale_after

    def samples(self, index: str, now: float) -> list[Sample]:
        """The GPU's readings of this round; empty when there are none or they are stale."""
        return self.gpus.get(index, []) if self.fresh(now) else []


class SlowReadings:
    """The latest slow readings per GPU index, refreshed every `interval` seconds on a daemon thread."""

    def __init__(self, nvml: ModuleType, interval: float = DEFAULT_INTERVAL_SECONDS,
                 poll_pcie: bool = True) -> None:
        self._nvml = nvml
        self._interval = interval
        self._poll_pcie = poll_pcie
        self._latest = SlowRound()  # replaced whole at the end of each round
        self._failed: set[tuple[str, str, str]] = set()  # (GPU, reading, error) logged
        self._failures: list[str] = []  # the round's failed readings (`SlowRound.failures`)
        self._unsupported = tuple(getattr(nvml, name) for name in UNSUPPORTED_ERRORS if hasattr(nvml, name))
        self._gpus: Sequence[GpuRef] = ()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=collector_thread_name("gpu", "slow-readings"),
                                        daemon=True)

    def start(self, gpus: Sequence[GpuRef]) -> None:
        """Reads every GPU once now, then every interval on the thread."""
        self._gpus = gpus
        self.read_all()
        self._thread.start()

    def latest(self) -> SlowRound:
        """The last whole round: a collection cycle takes it once, so every GPU's readings and the read time
        it publishes come from the same round."""
        return self._latest

    def samples(self, index: str, now: float) -> list[Sample]:
        """The GPU's latest slow readings; empty when there are none or they are stale."""
        return self._latest.samples(index, now)

    def refresh_soon(self) -> None:
        """Starts the next round now rather than at the end of the interval."""
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.read_all()

    def read_all(self) -> None:
        """One round: every identified GPU's slow readings, now, on the calling thread."""
        read_at, read_time = time.monotonic(), time.time()
        stamped = False
        gpus: dict[str, list[Sample]] = {}
        self._failures = []
        for gpu in list(self._gpus):
            handle = gpu.handle
            if handle is None:  # not identified yet: the collector retries, the next round reads it
                continue
            readers: tuple[tuple[str, Reader], ...] = ()
            if self._poll_pcie and (gpu.gpm is None or gpu.gpm.gives_pcie is False):
                readers += PCIE_READERS
            try:
                samples, missed, stamp = self._read_batch(gpu.index, handle)
            except self._nvml.NVMLError_GpuIsLost:
                continue  # lost: its readings drop
            if not stamped and stamp is not None and abs(stamp - read_time) < STAMP_TRUSTED_WITHIN_SECONDS:
                read_time, stamped = stamp, True
            samples_too = self._read_gpu(gpu.index, handle, (*((c.what, c.read) for c in missed), *readers))
            if samples_too is not None:
                gpus[gpu.index] = samples + samples_too
        self._latest = SlowRound(read_at, read_time, gpus, STALE_INTERVALS * self._interval, tuple(self._failures))

    def _read_batch(self, index: str, handle: Any) -> tuple[list[Sample], list[Counter], float | None]:
        """The counters one nvmlDeviceGetFieldValues call gave, those it did not (read one by one: a driver or
        bindings without the call or a field id, a field refused), and NVML's timestamp of the energy it gave
        (Unix seconds; None without one); raises NVMLError_GpuIsLost."""
        nvml = self._nvml
        asked = [(counter, getattr(nvml, counter.field_id, None)) for counter in COUNTERS]
        batch = [(counter, field_id) for counter, field_id in asked if field_id is not None]
        try:
            values = nvml.nvmlDeviceGetFieldValues(handle, [field_id for _, field_id in batch]) if batch else []
        except nvml.NVMLError_GpuIsLost:
            raise
        except (AttributeError, nvml.NVMLError) as exc:
            self._log_once(index, "field_values", exc)
            values = []
        whole = getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3)
        answered = {counter.what: value for (counter, _), value in zip(batch, values, strict=False)
                    if value.nvmlReturn == nvml.NVML_SUCCESS and value.valueType == whole}
        stamp = answered["energy"].timestamp / 1e6 if "energy" in answered else None  # µs
        return ([counter.sample(answered[counter.what].value.ullVal) for counter in COUNTERS
                 if counter.what in answered], [counter for counter in COUNTERS if counter.what not in answered], stamp)

    def _log_once(self, index: str, what: str, exc: Exception) -> None:
        """A slow reading NVML refused. One the GPU does not have (NotSupported, FunctionNotFound, a driver
        without the batched call): left out, logged at DEBUG once. Any other error (Timeout, Unknown) is a
        failed reading of the round, which the collector counts, logged at WARNING once: before, a GPU whose
        energy read timed out lost its watts and energy with one DEBUG line and no count."""
        name = type(exc).__name__
        failed = not isinstance(exc, (AttributeError, *self._unsupported))
        if failed:
            self._failures.append(f"GPU {index} {what}: {name}")
        if (index, what, name) in self._failed:
            return
        self._failed.add((index, what, name))
        if failed:
            log.warning("GPU %s: slow reading %s failed (%s): left out", index, what, exc)
        else:
            log.debug("GPU %s: %s unavailable (%s): left out", index, what, exc)

    def _read_gpu(self, index: str, handle: Any, readers: Iterable[tuple[str, Reader]]) -> list[Sample] | None:
        """Every reading NVML gives for the GPU; None when it stopped answering."""
        nvml = self._nvml
        samples: list[Sample] = []
        for what, reader in readers:
            try:
                samples += reader(nvml, handle)
            except nvml.NVMLError_GpuIsLost:
                return None
            except nvml.NVMLError as exc:
                self._log_once(index, what, exc)
        return samples

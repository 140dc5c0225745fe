"""The GPU collector against the truth on a real GPU (marked gpu; skipped without NVML and CUDA).

- exported utilization within 5 points of a duty cycle measured with CUDA events (25/50/75%);
- memory used within 1% of nvidia-smi;
- GPM tensor-core activity > 0.5 under a bf16 matmul loop and < 0.05 idle (Hopper and newer);
- nothing slow on the cycle path with the real NVML either (counted, not timed).
"""

import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from stepscope.exporter.collectors.gpu import GpuCollector
from stepscope.exporter.exposition import render
from stepscope.exporter.gpu_processes import GpuProcessTable
from stepscope_testkit.processes import sample_values

torch = pytest.importorskip("torch")
pynvml = pytest.importorskip("pynvml")


def _nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not _nvml_works(),
                       reason="needs an NVIDIA driver (NVML) and a CUDA GPU visible to torch"),
]


class CountingNvml(ModuleType):
    """The real pynvml, counting the calls made from each thread."""

    def __init__(self) -> None:
        super().__init__("counting_pynvml")
        self.calls: Counter[tuple[str, str]] = Counter()

    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)
        if not (name.startswith("nvml") and callable(value)) or isinstance(value, type):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[(threading.current_thread().name, name)] += 1
            return value(*args, **kwargs)

        return call


def nvml_index() -> str:
    """NVML's index of torch's device 0 (CUDA_VISIBLE_DEVICES may renumber), matched by UUID."""
    uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", "")).removeprefix("GPU-")
    pynvml.nvmlInit()
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            if uuid and pynvml.nvmlDeviceGetUUID(handle).removeprefix("GPU-") == uuid:
                return str(index)
    finally:
        pynvml.nvmlShutdown()
    return "0"


@pytest.fixture
def collector() -> Iterator[GpuCollector]:
    made = GpuCollector(GpuProcessTable(), slow_interval=3600)
    yield made
    made.close()


def reading(collector: GpuCollector, name: str, gpu: str) -> float | None:
    values = sample_values(render(collector.collect()).decode(), name, gpu=gpu)
    return values[0] if values else None


def cycles_per_ms() -> float:
    """torch.cuda._sleep spins clock cycles: how many take a millisecond on this GPU now."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)  # wake the clocks up
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / start.elapsed_time(end)


def run_duty_cycle(duty: float, seconds: float, cycles_ms: float, period_ms: float = 20.0) -> float:
    """Keeps the GPU busy `duty` of every period; returns the duty measured with CUDA events."""
    busy_ms, started = 0.0, time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while time.perf_counter() - started < seconds:
        period_start = time.perf_counter()
        start.record()
        torch.cuda._sleep(int(duty * period_ms * cycles_ms))
        end.record()
        end.synchronize()
        busy_ms += start.elapsed_time(end)
        time.sleep(max(0.0, period_ms / 1e3 - (time.perf_counter() - period_start)))
    return busy_ms / 1e3 / (time.perf_counter() - started)


@pytest.mark.parametrize("duty", [0.25, 0.5, 0.75])
def test_utilization_matches_an_event_measured_duty_cycle(collector: GpuCollector, duty: float) -> None:
    gpu, cycles_ms = nvml_index(), cycles_per_ms()
    run_duty_cycle(duty, 1.5, cycles_ms)  # NVML averages over up to 1 s: let it settle
    readings: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.25):
            value = reading(collector, "stepscope_gpu_utilization_ratio", gpu)
            if value is not None:
                readings.append(value)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        measured = run_duty_cycle(duty, 6.0, cycles_ms)
    finally:
        stop.set()
        sampler.join()
    exported = sum(readings) / len(readings)
    assert abs(exported - measured) <= 0.05, f"exported {exported:.3f}, events {measured:.3f}, {readings}"


def test_memory_used_matches_nvidia_smi(collector: GpuCollector) -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi is not on PATH")
    gpu = nvml_index()
    block = torch.empty(4 * 1024**3, dtype=torch.uint8, device="cuda")  # 4 GiB more in use
    torch.cuda.synchronize()
    exported_mib = reading(collector, "stepscope_gpu_memory_used_bytes", gpu) / 2**20
    out = subprocess.run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", f"--id={gpu}"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert abs(exported_mib - float(out.strip())) <= 0.01 * float(out.strip()), (exported_mib, out)
    del block


def test_gpm_tensor_activity_busy_and_idle(collector: GpuCollector) -> None:
    gpu = nvml_index()
    collector.collect()
    if collector._gpus[int(gpu)].gpm is None:
        pytest.skip("this GPU has no GPM (Hopper and newer)")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    time.sleep(1.0)
    idle = reading(collector, "stepscope_gpu_tensor_active_ratio", gpu)
    started = time.perf_counter()
    while time.perf_counter() - started < 1.5:
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
    busy = reading(collector, "stepscope_gpu_tensor_active_ratio", gpu)
    assert idle is not None and idle < 0.05
    assert busy is not None and busy > 0.5
    # PCIe from the same GPM pair on this GPU: present, never polled with the blocking call
    assert reading(collector, "stepscope_gpu_pcie_receive_bytes_per_second", gpu) is not None


def test_no_slow_nvml_call_on_the_cycle_path() -> None:
    nvml = CountingNvml()
    collector = GpuCollector(GpuProcessTable(), nvml=nvml, slow_interval=3600)
    try:
        collector.collect()
        time.sleep(0.15)
        nvml.calls.clear()
        text = render(collector.collect()).decode()
    finally:
        collector.close()
    cycle = {name for (thread, name) in nvml.calls if thread == threading.current_thread().name}
    assert not cycle & {"nvmlDeviceGetPcieThroughput", "nvmlDeviceGetTotalEnergyConsumption",
                        "nvmlDeviceGetViolationStatus"}
    assert sample_values(text, "stepscope_gpu_energy_joules_total")  # from the slow round at start

"""Prices what the GPU collector asks of NVML, from the fake's call counts and a latency table.

The CI-side stand-in for timing the collector on a real GPU: which NVML calls one cycle makes, and
how many, is exact (the real collector runs against the fake); what each call costs comes from the
latencies measured on an H100 (`scenario.H100_LATENCY_MS`). Two paths are priced apart: the cycle
(the collector's timer thread, what `stepscope_exporter_collector_duration_seconds{collector="gpu"}`
times) and one round of the slow-readings thread (`stepscope.exporter.collectors.gpu_slow`).
"""

import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stepscope.exporter.collectors.gpu import GpuCollector
from stepscope.exporter.gpu_processes import GpuProcessTable
from stepscope_testkit.fake_nvml.scenario import load_fake_pynvml, make_scenario, write_scenario

GPM_GAP_SECONDS = 0.11  # GPM reads only when its two samples are >= 100 ms apart


@dataclass(frozen=True)
class Priced:
    """NVML calls of one path, for `gpus` GPUs, and what they cost at the given latencies (ms)."""

    calls: Counter[str]
    gpus: int
    latency_ms: Mapping[str, float]

    def call_ms(self, name: str) -> float:
        return self.latency_ms.get(name, self.latency_ms.get("default", 0.0))

    @property
    def ms_per_gpu(self) -> float:
        return sum(count * self.call_ms(name) for name, count in self.calls.items()) / self.gpus

    def rows(self) -> list[tuple[str, float, float, float]]:
        """(call, calls per GPU, ms per call, ms per GPU), the costliest first."""
        rows = [(name, count / self.gpus, self.call_ms(name), count * self.call_ms(name) / self.gpus)
                for name, count in self.calls.items()]
        return sorted(rows, key=lambda row: -row[3])


@dataclass(frozen=True)
class CollectorCost:
    model: str
    cycle: Priced
    slow_round: Priced

    def per_second_ms_per_gpu(self, collect_interval: float, slow_interval: float) -> float:
        """NVML time per GPU per second of wall time, both paths together."""
        return self.cycle.ms_per_gpu / collect_interval + self.slow_round.ms_per_gpu / slow_interval


def price_collector(scenario_path: Path, model: str, latency_ms: Mapping[str, float], gpus: int = 8,
                    poll_pcie: bool = True) -> CollectorCost:
    """Counts one steady-state cycle and one slow round of `gpus` GPUs of `model` (a scenario MODELS key).

    The scenario goes to `scenario_path`, which $STEPSCOPE_FAKE_NVML_SCENARIO must name. The fake
    only counts here (no latency is spent): the price is computed.
    """
    write_scenario(scenario_path, make_scenario(gpus, processes_per_gpu=8, models=(model,)))
    nvml = load_fake_pynvml()
    collector = GpuCollector(GpuProcessTable(), nvml=nvml, poll_pcie=poll_pcie)
    try:
        collector.collect()  # NVML init, discovery, the first slow round, the first GPM sample
        time.sleep(GPM_GAP_SECONDS)
        collector.collect()  # GPM now knows whether it gives PCIe
        time.sleep(GPM_GAP_SECONDS)
        nvml.reset_call_counts()
        collector.collect()
        cycle = nvml.call_counts(threading.current_thread().name)
        nvml.reset_call_counts()
        slow = collector._slow
        assert slow is not None, "NVML did not initialise on the fake"
        slow.read_all()
        slow_round = nvml.call_counts(threading.current_thread().name)
    finally:
        collector.close()
    return CollectorCost(model, Priced(cycle, gpus, latency_ms), Priced(slow_round, gpus, latency_ms))

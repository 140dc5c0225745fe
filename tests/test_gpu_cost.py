"""What the GPU collector asks of NVML, per cycle and per slow round, priced at H100 latencies.

The cost model (issue 9): the real collector runs against the fake NVML at 8 GPUs, the fake counts
every call per thread, and `scenario.H100_LATENCY_MS` prices them. Deterministic: calls are
counted, not timed. `benchmarks/bench_gpu.py` spends the same latencies for real.
"""

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stepscope.exporter.collectors import gpu_events
from stepscope.exporter.collectors.gpu import GpuCollector
from stepscope.exporter.collectors.gpu_slow import STALE_INTERVALS
from stepscope.exporter.exposition import render
from stepscope.exporter.gpu_processes import GpuProcessTable
from stepscope_testkit.fake_nvml.cost_model import GPM_GAP_SECONDS, price_collector
from stepscope_testkit.fake_nvml.scenario import (
    H100_LATENCY_MS,
    MODELS,
    PCIE_KBPS,
    load_fake_pynvml,
    make_scenario,
    write_scenario,
)
from stepscope_testkit.processes import sample_values

SCENARIO_ENV = "STEPSCOPE_FAKE_NVML_SCENARIO"
CYCLE_BUDGET_MS_PER_GPU = 5.0
BLOCKING_MS = 1.0  # no single call on the cycle path may take this long per GPU
SLOW_CALLS = {"nvmlDeviceGetPcieThroughput", "nvmlDeviceGetTotalEnergyConsumption",
              "nvmlDeviceGetViolationStatus", "nvmlDeviceGetFieldValues"}
PCIE = ("stepscope_gpu_pcie_receive_bytes_per_second", "stepscope_gpu_pcie_transmit_bytes_per_second")
# The scenarios' PCIe throughput in bytes/s: KB/s when polled, the same in MiB/s from GPM on Hopper
PCIE_RX, PCIE_TX = PCIE_KBPS["rx"] * 1024, PCIE_KBPS["tx"] * 1024


@pytest.fixture
def scenario_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "nvml.json"
    monkeypatch.setenv(SCENARIO_ENV, str(path))
    monkeypatch.setattr(gpu_events, "WAIT_TIMEOUT_MS", 100)  # close() waits for one event wait to end
    return path


@pytest.mark.parametrize("model", ["H100", "GH200", "A100"])
def test_cycle_costs_at_most_5_ms_per_gpu_at_8_gpus(scenario_path: Path, model: str) -> None:
    cost = price_collector(scenario_path, model, H100_LATENCY_MS, gpus=8)
    assert cost.cycle.ms_per_gpu <= CYCLE_BUDGET_MS_PER_GPU, cost.cycle.rows()
    assert not SLOW_CALLS & set(cost.cycle.calls), "a slow reading is on the cycle path"
    # every GPU is read every cycle: utilization and memory once per GPU
    assert cost.cycle.calls["nvmlDeviceGetUtilizationRates"] == 8
    assert cost.cycle.calls["nvmlDeviceGetMemoryInfo"] == 8
    if model != "A100":  # GPM: one sample and one metrics read per GPU (NVLink and C2C included)
        assert cost.cycle.calls["nvmlGpmSampleGet"] == cost.cycle.calls["nvmlGpmMetricsGet"] == 8
    # at the H100's measured latencies, not even GPM's pair (0.055 ms); the maximum SM clock (1.46 ms of CPU)
    # is read when the GPU is identified, not every cycle
    expensive = {name for name, _, ms, _ in cost.cycle.rows() if ms >= BLOCKING_MS}
    assert not expensive


@pytest.mark.parametrize(("model", "pcie_polls"), [("H100", 0), ("GH200", 0), ("A100", 2)])
def test_slow_round_reads_counters_and_polls_pcie_only_without_gpm(
    scenario_path: Path, model: str, pcie_polls: int
) -> None:
    cost = price_collector(scenario_path, model, H100_LATENCY_MS, gpus=8)
    calls = cost.slow_round.calls
    # energy and the 8 policies' violation time in one nvmlDeviceGetFieldValues call per GPU, not nine calls
    assert calls["nvmlDeviceGetFieldValues"] == 8
    assert calls["nvmlDeviceGetTotalEnergyConsumption"] == calls["nvmlDeviceGetViolationStatus"] == 0
    assert calls["nvmlDeviceGetPcieThroughput"] == 8 * pcie_polls  # TX and RX on pre-Hopper GPUs
    # amortized over the 10 s interval at the H100's measured latencies: 0.29 ms per GPU and second on Hopper
    # (0.87 as nine calls); pre-Hopper pays 41 ms of blocking PCIe sampling per GPU per round, off the cycle path
    per_second = cost.slow_round.ms_per_gpu / 10
    assert per_second < (5.0 if pcie_polls else 0.5)


def test_pcie_poll_can_be_switched_off(scenario_path: Path) -> None:
    cost = price_collector(scenario_path, "A100", H100_LATENCY_MS, gpus=2, poll_pcie=False)
    assert "nvmlDeviceGetPcieThroughput" not in cost.slow_round.calls | cost.cycle.calls


class Collector:
    """A GPU collector on the fake NVML (counting calls) with its scenario."""

    def __init__(self, path: Path, scenario: dict[str, Any], **kwargs: Any) -> None:
        self.path, self.scenario = path, scenario
        write_scenario(path, scenario)
        self.nvml = load_fake_pynvml()
        self.collector = GpuCollector(GpuProcessTable(), nvml=self.nvml, **kwargs)

    def rewrite(self, change: Callable[[dict[str, Any]], None]) -> None:
        change(self.scenario)
        write_scenario(self.path, self.scenario)

    def scrape(self) -> str:
        return render(self.collector.collect()).decode()

    def second_cycle(self) -> str:
        self.scrape()
        time.sleep(GPM_GAP_SECONDS)
        return self.scrape()


@pytest.fixture
def collectors(scenario_path: Path):
    made: list[Collector] = []

    def make(scenario: dict[str, Any], **kwargs: Any) -> Collector:
        made.append(Collector(scenario_path, scenario, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.collector.close()


def test_hopper_pcie_comes_from_gpm_and_never_blocks(collectors) -> None:
    c = collectors(make_scenario(gpus=2, processes_per_gpu=0, models=("H100", "A100")))
    text = c.second_cycle()
    for gpu in ("0", "1"):  # same bytes/s either way: 11_704_627 KB/s polled = 11_430.3 MiB/s from GPM
        assert sample_values(text, PCIE[0], gpu=gpu) == [PCIE_RX]
        assert sample_values(text, PCIE[1], gpu=gpu) == [PCIE_TX]
    polled = c.nvml.call_counts()["nvmlDeviceGetPcieThroughput"]
    assert polled == 2  # the A100's TX and RX, in the first slow round; never the H100's
    c.rewrite(lambda s: s["gpus"][0]["gpm"].update(pcie_rx_per_sec=50_000.0))  # an H2D copy
    time.sleep(GPM_GAP_SECONDS)
    assert sample_values(c.scrape(), PCIE[0], gpu="0") == [50_000 * 2**20]


def test_gpm_without_pcie_metrics_falls_back_to_polling(collectors, monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = make_scenario(gpus=2, processes_per_gpu=0, models=("H100",))
    del scenario["gpus"][1]["gpm"]["pcie_rx_per_sec"]  # NVML refuses one PCIe metric on GPU 1
    c = collectors(scenario)
    monkeypatch.delattr(c.nvml, "NVML_GPM_METRIC_PCIE_TX_PER_SEC")  # bindings too old for GPU 0
    text = c.second_cycle()
    assert sample_values(text, "stepscope_gpu_sm_active_ratio", gpu="0") == [
        pytest.approx(MODELS["H100"]["gpm"]["sm_util"] / 100)]
    assert sample_values(text, PCIE[0]) == []  # GPM gave no PCIe; the first slow round did not poll
    assert c.nvml.call_counts()["nvmlDeviceGetPcieThroughput"] == 0
    c.collector._slow.read_all()  # the next round polls both
    text = c.scrape()
    assert sample_values(text, PCIE[0]) == [PCIE_RX] * 2
    assert c.nvml.call_counts()["nvmlDeviceGetPcieThroughput"] == 4


def test_pre_hopper_without_pcie_poll_publishes_no_pcie(collectors) -> None:
    c = collectors(make_scenario(gpus=2, processes_per_gpu=0, models=("H100", "T4")), poll_pcie=False)
    text = c.second_cycle()
    assert sample_values(text, PCIE[0], gpu="0") == [PCIE_RX]
    assert sample_values(text, PCIE[0], gpu="1") == []
    assert sample_values(text, "stepscope_gpu_energy_joules_total", gpu="1") != []


def test_slow_counters_refresh_on_the_slow_round_not_the_cycle(collectors) -> None:
    c = collectors(make_scenario(gpus=1, processes_per_gpu=0, models=("A100",)))
    energy = "stepscope_gpu_energy_joules_total"
    c.rewrite(lambda s: s["gpus"][0].update(total_energy_mj=7_000_000))
    c.scrape()  # init: the first slow round reads 7,000 J
    c.rewrite(lambda s: s["gpus"][0].update(total_energy_mj=9_000_000))
    assert sample_values(c.scrape(), energy) == [7_000.0]  # a cycle does not read energy
    c.collector._slow.read_all()
    assert sample_values(c.scrape(), energy) == [9_000.0]


def test_the_energy_read_time_goes_out_with_the_same_rounds_counters(collectors) -> None:
    """One read time per node, taken with the round: the rules divide each GPU's energy increase by its
    increase, so a scrape must never show one round's counters with another's time."""
    c = collectors(make_scenario(gpus=2, processes_per_gpu=0, models=("A100",)))
    read_time = "stepscope_gpu_energy_read_timestamp_seconds"
    first = c.scrape()
    times = sample_values(first, read_time)
    assert len(times) == 1 and abs(times[0] - time.time()) < 60  # one series, no gpu label
    c.rewrite(lambda s: [gpu.update(total_energy_mj=9_000_000) for gpu in s["gpus"]])
    assert sample_values(c.scrape(), read_time) == times  # a cycle reads neither
    c.collector._slow.read_all()
    text = c.scrape()
    assert sample_values(text, read_time)[0] > times[0]
    assert sample_values(text, "stepscope_gpu_energy_joules_total") == [9_000.0, 9_000.0]


def test_slow_readings_go_absent_when_stale_and_lost_gpus_drop_them(collectors) -> None:
    c = collectors(make_scenario(gpus=2, processes_per_gpu=0, models=("A100",)))
    c.scrape()
    slow = c.collector._slow
    now = time.monotonic()
    assert slow.samples("0", now) != []
    assert slow.samples("0", now + STALE_INTERVALS * 10.0 + 1) == []  # a wedged round: absent, not frozen
    c.rewrite(lambda s: s["gpus"][1].update(lost=True))
    slow.read_all()
    assert slow.samples("1", time.monotonic()) == []
    assert slow.samples("0", time.monotonic()) != []

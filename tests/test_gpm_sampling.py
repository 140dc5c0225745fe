"""GPM values between sample pairs, against the scripted fake NVML: a GPM family never blinks.

NVML computes GPM metrics from two samples at least 100 ms apart. A collection that comes sooner (two
collections in quick succession, as on the H100 in tests/test_gpu_truth.py) takes no new sample; it
must publish the last pair's values again, not drop every GPM family for that cycle.
"""

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepscope.exporter.collectors import gpu as gpu_module
from stepscope.exporter.collectors import gpu_events
from stepscope.exporter.collectors.gpu import GpuCollector
from stepscope.exporter.collectors.gpu_gpm import GPM_METRICS, MIN_SAMPLE_GAP_SECONDS, PCIE_KEYS, GpmSampler
from stepscope.exporter.exposition import render
from stepscope.exporter.gpu_processes import GpuProcessTable
from stepscope_testkit.fake_nvml.scenario import load_fake_pynvml, make_scenario, write_scenario

GPM_FAMILIES = frozenset(name for name, _, _ in GPM_METRICS)
# GH200: every GPM metric, C2C included; H100: all but C2C; A100: no GPM at all
MODELS = ("GH200", "H100", "A100")


class Clock:
    """The collector's monotonic clock, moved only by the test, so "too soon" never depends on load."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def scenario_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """Writes a GH200/H100/A100 scenario whose GPM metrics all read `level` (percent and MiB/s alike);
    `errors` (the fake's forced NVML errors) go to the GH200."""
    path = tmp_path / "nvml.json"
    monkeypatch.setenv("STEPSCOPE_FAKE_NVML_SCENARIO", str(path))
    seconds = itertools.count(1)

    def write(level: float, errors: dict[str, str] | None = None) -> Path:
        scenario = make_scenario(gpus=len(MODELS), processes_per_gpu=0, models=MODELS)
        for gpu in scenario["gpus"]:
            if "gpm" in gpu:
                gpu["gpm"] = dict.fromkeys(gpu["gpm"], level)
        scenario["gpus"][0]["errors"] = errors or {}
        write_scenario(path, scenario)
        # The fake re-reads on a new (mtime, size, inode); two quick rewrites of one size can share all
        # three (a coarse mtime, a reused inode), so each write gets an mtime of its own.
        mtime = next(seconds) * 10**9
        os.utime(path, ns=(mtime, mtime))
        return path

    return write


@pytest.fixture
def nvml(scenario_file: Callable[..., Path]) -> Iterator[ModuleType]:
    scenario_file(40.0)
    module = load_fake_pynvml()
    module.nvmlInit()
    yield module
    module.nvmlShutdown()


def gpm_readings(text: str) -> dict[tuple[str, str], float]:
    """{(GPM family, gpu): value} of one scrape."""
    return {(s.name, s.labels["gpu"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in GPM_FAMILIES}


def families_of(readings: dict[tuple[str, str], float], gpu: str) -> set[str]:
    return {name for name, index in readings if index == gpu}


# --- the sampler's interval logic, on explicit times ---------------------------------------------

def test_a_read_before_the_next_pair_is_due_repeats_the_last_values_without_sampling(
    nvml: ModuleType, scenario_file: Callable[..., Path],
) -> None:
    sampler = GpmSampler.open(nvml, nvml.nvmlDeviceGetHandleByIndex(0))  # the GH200
    assert sampler is not None
    assert sampler.read(10.0) == {}  # one sample: no pair yet
    first = sampler.read(10.25)
    assert set(first) == GPM_FAMILIES
    assert first["stepscope_gpu_sm_active_ratio"] == pytest.approx(0.40)
    scenario_file(70.0)  # the GPU got busier; only a new pair can tell
    nvml.reset_call_counts()
    for now in (10.25, 10.3125, 10.25 + MIN_SAMPLE_GAP_SECONDS - 0.001):
        assert sampler.read(now) == first
    assert nvml.call_counts()["nvmlGpmSampleGet"] == nvml.call_counts()["nvmlGpmMetricsGet"] == 0
    due = sampler.read(10.375)
    assert set(due) == GPM_FAMILIES
    assert due["stepscope_gpu_sm_active_ratio"] == pytest.approx(0.70)
    assert nvml.call_counts()["nvmlGpmSampleGet"] == nvml.call_counts()["nvmlGpmMetricsGet"] == 1


def test_after_a_failed_read_no_stale_values_until_a_new_pair(
    nvml: ModuleType, scenario_file: Callable[..., Path],
) -> None:
    sampler = GpmSampler.open(nvml, nvml.nvmlDeviceGetHandleByIndex(0))
    assert sampler is not None
    sampler.read(10.0)
    assert sampler.read(10.25)
    scenario_file(40.0, errors={"gpm_sample": "Unknown"})
    with pytest.raises(nvml.NVMLError_Unknown):
        sampler.read(10.5)
    scenario_file(40.0)
    assert sampler.read(10.5625) == {}  # a fresh baseline: the pair before the failure is not repeated
    assert sampler.read(10.625) == {}  # too soon for a pair, and nothing older to repeat
    assert set(sampler.read(10.75)) == GPM_FAMILIES


# --- the collector: two collections in quick succession ------------------------------------------

def test_two_collections_in_quick_succession_both_publish_every_gpm_family(
    scenario_file: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    scenario_file(40.0)
    monkeypatch.setattr(gpu_events, "WAIT_TIMEOUT_MS", 100)  # close() waits for one event wait to end
    clock = Clock(1000.0)
    monkeypatch.setattr(gpu_module, "time", SimpleNamespace(monotonic=clock))
    collector = GpuCollector(GpuProcessTable(), nvml=load_fake_pynvml(), slow_interval=3600)
    try:
        collector.collect()  # the baseline sample
        clock.now += 0.5
        before = gpm_readings(render(collector.collect()).decode())
        scenario_file(70.0)
        clock.now += 0.05  # the next pair is not due yet
        again = gpm_readings(render(collector.collect()).decode())
        clock.now += MIN_SAMPLE_GAP_SECONDS
        after = gpm_readings(render(collector.collect()).decode())
    finally:
        collector.close()
    assert families_of(before, "0") == GPM_FAMILIES
    assert families_of(before, "1") == GPM_FAMILIES - {
        "stepscope_gpu_c2c_receive_bytes_per_second", "stepscope_gpu_c2c_transmit_bytes_per_second"}
    assert families_of(before, "2") == PCIE_KEYS  # no GPM: PCIe from the slow poll, nothing else
    assert again == before  # every family, with the previous pair's values
    assert before[("stepscope_gpu_tensor_active_ratio", "0")] == pytest.approx(0.40)
    assert after.keys() == before.keys()
    assert after[("stepscope_gpu_tensor_active_ratio", "0")] == pytest.approx(0.70)

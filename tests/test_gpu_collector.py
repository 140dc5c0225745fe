"""GPU collector against the scripted fake NVML: in-process, and through a real exporter process."""

import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepscope.exporter.collectors import gpu_events
from stepscope.exporter.collectors.gpu import CLOCK_EVENT_REASONS, GpuCollector
from stepscope.exporter.collectors.gpu_slow import VIOLATION_POLICIES
from stepscope.exporter.exposition import render
from stepscope.exporter.gpu_processes import GpuProcessTable
from stepscope_testkit.fake_nvml.scenario import (
    GIB,
    MODELS,
    load_fake_pynvml,
    load_scenario,
    make_scenario,
    write_scenario,
)
from stepscope_testkit.processes import running_exporter, sample_values, scrape

SCENARIO_ENV = "STEPSCOPE_FAKE_NVML_SCENARIO"
MIXED = load_scenario("mixed")
UUIDS = [gpu["uuid"] for gpu in MIXED["gpus"]]
GPM_FAMILIES = ("stepscope_gpu_sm_active_ratio", "stepscope_gpu_sm_occupancy_ratio",
                "stepscope_gpu_tensor_active_ratio", "stepscope_gpu_dram_active_ratio")
NVLINK = ("stepscope_gpu_nvlink_receive_bytes_per_second", "stepscope_gpu_nvlink_transmit_bytes_per_second")
C2C = ("stepscope_gpu_c2c_receive_bytes_per_second", "stepscope_gpu_c2c_transmit_bytes_per_second")
INTERCONNECT_FAMILIES = (*NVLINK, *C2C)
PER_GPU_FAMILIES = tuple(f"stepscope_gpu_{name}" for name in (
    "up", "info", "utilization_ratio", "memory_utilization_ratio", "memory_used_bytes", "memory_free_bytes",
    "memory_total_bytes", "temperature_celsius", "power_watts", "power_limit_watts", "energy_joules_total",
    "sm_clock_hertz", "sm_clock_max_hertz", "memory_clock_hertz", "clock_event_active", "clock_event_seconds_total",
    "pcie_receive_bytes_per_second", "pcie_transmit_bytes_per_second",
))


def gpm_ratios(gpu: dict[str, Any]) -> dict[str, float]:
    """The GPM ratio families a scenario GPU should publish: its GPM percentages as 0..1."""
    gpm = gpu["gpm"]
    return {"stepscope_gpu_sm_active_ratio": gpm["sm_util"] / 100,
            "stepscope_gpu_sm_occupancy_ratio": gpm["sm_occupancy"] / 100,
            "stepscope_gpu_tensor_active_ratio": gpm["any_tensor_util"] / 100,
            "stepscope_gpu_dram_active_ratio": gpm["dram_bw_util"] / 100}


def wait_for(read: Callable[[], str], ok: Callable[[str], bool], what: str, timeout: float = 20.0) -> str:
    """Reads until ok(text); a readiness wait, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while not ok(text := read()):
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}; last reading:\n{text}")
        time.sleep(0.05)
    return text


def names_for_gpu(text: str, gpu: str) -> set[str]:
    families = text_string_to_metric_families(text)
    return {s.name for f in families for s in f.samples if s.labels.get("gpu") == gpu}


def gpu_family_names(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text) if f.name.startswith("stepscope_gpu")}


def one(text: str, name: str, /, **labels: str) -> float:
    """The single sample `name` carrying `labels` (`name` may itself be a label, as in gpu_info)."""
    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(values) == 1, f"{name}{labels}: {values}"
    return values[0]


class Harness:
    """A collector on the fake NVML with its scenario file, for in-process tests."""

    def __init__(self, path: Path, scenario: dict[str, Any], **kwargs: Any) -> None:
        self.path = path
        self.scenario = scenario
        write_scenario(path, scenario)
        self.nvml = load_fake_pynvml()
        self.table = GpuProcessTable()
        self.collector = GpuCollector(self.table, nvml=self.nvml, **kwargs)

    def rewrite(self, change: Callable[[dict[str, Any]], None]) -> None:
        change(self.scenario)
        write_scenario(self.path, self.scenario)

    def scrape(self) -> str:
        return render(self.collector.collect()).decode()


@pytest.fixture
def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Harness]]:
    path = tmp_path / "nvml.json"
    monkeypatch.setenv(SCENARIO_ENV, str(path))
    monkeypatch.setattr(gpu_events, "WAIT_TIMEOUT_MS", 100)  # close() waits for one event wait to end
    made: list[Harness] = []

    def make(scenario: dict[str, Any] = MIXED, **kwargs: Any) -> Harness:
        made.append(Harness(path, load_scenario("mixed") if scenario is MIXED else scenario, **kwargs))
        return made[-1]

    yield make
    for h in made:
        h.collector.close()


def second_cycle(h: "Harness") -> str:
    """The second cycle's text: GPM values (PCIe included on Hopper) need two samples >= 100 ms apart."""
    h.scrape()
    time.sleep(0.12)
    return h.scrape()


def test_mixed_scenario_publishes_every_family_in_base_units(harness: Callable[..., Harness]) -> None:
    text = second_cycle(harness())
    assert one(text, "stepscope_gpu_collector_up") == 1
    for index, (uuid, reading) in enumerate(zip(UUIDS, MIXED["gpus"], strict=True)):
        gpu = str(index)
        assert set(PER_GPU_FAMILIES) <= names_for_gpu(text, gpu)
        assert one(text, "stepscope_gpu_up", gpu=gpu, uuid=uuid) == 1
        assert one(text, "stepscope_gpu_utilization_ratio", gpu=gpu, uuid=uuid) == pytest.approx(
            reading["utilization"]["gpu"] / 100)
        assert one(text, "stepscope_gpu_memory_utilization_ratio", gpu=gpu) == pytest.approx(
            reading["utilization"]["memory"] / 100)
        assert one(text, "stepscope_gpu_sm_clock_max_hertz", gpu=gpu, uuid=uuid) == pytest.approx(
            reading["max_clocks_mhz"]["sm"] * 1e6)
    h100 = {"gpu": "0", "uuid": UUIDS[0]}
    reading = MIXED["gpus"][0]
    assert one(text, "stepscope_gpu_info", **h100, name="NVIDIA H100 80GB HBM3", driver_version="550.54.15",
               pci_bus_id="00000000:18:00.0") == 1
    assert one(text, "stepscope_gpu_power_watts", **h100) == pytest.approx(reading["power_usage_mw"] / 1000)
    assert one(text, "stepscope_gpu_power_limit_watts", **h100) == pytest.approx(700.0)
    assert one(text, "stepscope_gpu_sm_clock_hertz", **h100) == pytest.approx(reading["clocks_mhz"]["sm"] * 1e6)
    # the H100's maximum SM clock (nvmlDeviceGetMaxClockInfo): 1.98 GHz, above the 1.695 GHz it ran at
    assert one(text, "stepscope_gpu_sm_clock_max_hertz", **h100) == pytest.approx(1.98e9)
    assert one(text, "stepscope_gpu_sm_clock_hertz", **h100) < one(text, "stepscope_gpu_sm_clock_max_hertz", **h100)
    assert one(text, "stepscope_gpu_memory_clock_hertz", **h100) == pytest.approx(2.619e9)
    assert one(text, "stepscope_gpu_temperature_celsius", **h100) == 61
    # KB/s from the scenario, read through GPM on the H100 (MiB/s): the same bytes/s either way
    assert one(text, "stepscope_gpu_pcie_receive_bytes_per_second", **h100) == reading["pcie_kbps"]["rx"] * 1024
    assert one(text, "stepscope_gpu_pcie_transmit_bytes_per_second", **h100) == reading["pcie_kbps"]["tx"] * 1024
    assert one(text, "stepscope_gpu_energy_joules_total", **h100) >= 5_000_000
    assert one(text, "stepscope_gpu_clock_event_seconds_total", **h100, reason="power") >= 12.0
    assert one(text, "stepscope_gpu_clock_event_seconds_total", **h100, reason="low_utilization") == 3.0
    assert one(text, "stepscope_gpu_ecc_errors_total", gpu="1", type="corrected") >= 17
    assert one(text, "stepscope_gpu_ecc_errors_total", gpu="1", type="uncorrected") == 1
    # memory v2 leaves driver-reserved memory out of `used`; the T4 scenario's driver only has v1
    assert one(text, "stepscope_gpu_memory_used_bytes", **h100) == 61 * GIB
    assert one(text, "stepscope_gpu_memory_free_bytes", **h100) == 80 * GIB - 61 * GIB - GIB // 2
    assert one(text, "stepscope_gpu_memory_total_bytes", **h100) == 80 * GIB
    assert one(text, "stepscope_gpu_memory_used_bytes", gpu="2") == 9 * GIB + GIB // 4
    for reason, _ in VIOLATION_POLICIES:
        assert one(text, "stepscope_gpu_clock_event_seconds_total", gpu="0", reason=reason) >= 0


def test_gpm_ratios_only_for_the_hopper_gpu(harness: Callable[..., Harness]) -> None:
    h = harness()
    first = h.scrape()
    assert not set(GPM_FAMILIES) & gpu_family_names(first), "GPM needs two samples: absent on the first cycle"
    time.sleep(0.12)  # GPM samples must be at least 100 ms apart
    text = h.scrape()
    for family, ratio in gpm_ratios(MIXED["gpus"][0]).items():
        assert one(text, family, gpu="0", uuid=UUIDS[0]) == pytest.approx(ratio)
    for gpu in ("1", "2"):
        assert not set(GPM_FAMILIES) & names_for_gpu(text, gpu)


def test_interconnect_throughput_from_gpm_is_absent_not_zero_where_unsupported(
    harness: Callable[..., Harness],
) -> None:
    """A GH200 reads NVLink and C2C, an H100 NVLink only (its GPM refuses C2C), an A100 neither (no
    GPM): unsupported links publish no series, while a link that carries nothing reads 0."""
    h = harness(make_scenario(gpus=3, processes_per_gpu=0, models=("GH200", "H100", "A100")))
    assert not set(INTERCONNECT_FAMILIES) & gpu_family_names(h.scrape()), "GPM needs two samples"
    time.sleep(0.12)
    text = h.scrape()
    mib = 2**20
    assert one(text, NVLINK[0], gpu="0") == 50_500 * mib
    assert one(text, NVLINK[1], gpu="0") == 51_000 * mib
    assert one(text, C2C[0], gpu="0") == 21_000 * mib
    assert one(text, C2C[1], gpu="0") == 6_000 * mib
    assert one(text, NVLINK[0], gpu="1") == 47_500 * mib
    assert one(text, NVLINK[1], gpu="1") == 48_000 * mib
    assert not set(C2C) & names_for_gpu(text, "1")
    assert not set(INTERCONNECT_FAMILIES) & names_for_gpu(text, "2")
    assert "stepscope_gpu_pcie_receive_bytes_per_second" in names_for_gpu(text, "2")  # polled instead

    def idle_then_refused(scenario: dict[str, Any]) -> None:
        scenario["gpus"][1]["gpm"].update(nvlink_total_rx_per_sec=0.0, nvlink_total_tx_per_sec=0.0)
        del scenario["gpus"][0]["gpm"]["c2c_total_rx_per_sec"]  # e.g. a driver that stops giving it

    h.rewrite(idle_then_refused)
    time.sleep(0.12)
    text = h.scrape()
    assert one(text, NVLINK[0], gpu="1") == one(text, NVLINK[1], gpu="1") == 0  # idle link: a zero reading
    assert C2C[0] not in names_for_gpu(text, "0"), "a refused metric goes absent, not frozen"
    assert one(text, C2C[1], gpu="0") == 6_000 * mib


def test_bindings_without_interconnect_ids_leave_them_out(
    harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness(make_scenario(gpus=1, processes_per_gpu=0, models=("GH200",)))
    for name in ("NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC", "NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC"):
        monkeypatch.delattr(h.nvml, name)  # nvidia-ml-py older than the C2C ids
    text = second_cycle(h)
    assert not set(C2C) & names_for_gpu(text, "0")
    assert one(text, NVLINK[0], gpu="0") == 50_500 * 2**20
    assert one(text, "stepscope_gpu_sm_active_ratio", gpu="0") == pytest.approx(MODELS["GH200"]["gpm"]["sm_util"] / 100)


def test_clock_event_state_set_follows_the_reason_bits(harness: Callable[..., Harness]) -> None:
    text = harness().scrape()
    active = {"0": {"sw_power_cap"}, "1": {"sw_thermal_slowdown", "hw_thermal_slowdown"}, "2": {"gpu_idle"}}
    for gpu, expected in active.items():
        states = {reason: one(text, "stepscope_gpu_clock_event_active", gpu=gpu, reason=reason)
                  for reason, _ in CLOCK_EVENT_REASONS}
        assert {reason for reason, on in states.items() if on == 1} == expected
        assert set(states.values()) == {0.0, 1.0}


def test_unsupported_or_failing_field_is_left_out_for_that_gpu_only(harness: Callable[..., Harness]) -> None:
    h = harness()
    h.rewrite(lambda s: s["gpus"][1].setdefault("errors", {}).update(power_usage_mw="Unknown"))
    text = h.scrape()
    # the T4 scenario has no ECC and no board_limit violation counter: NotSupported
    assert sample_values(text, "stepscope_gpu_ecc_errors_total", gpu="2") == []
    assert sample_values(text, "stepscope_gpu_clock_event_seconds_total", gpu="2", reason="board_limit") == []
    assert len(sample_values(text, "stepscope_gpu_clock_event_seconds_total", gpu="2")) == 7
    assert len(sample_values(text, "stepscope_gpu_ecc_errors_total", gpu="0")) == 2
    # an error on a non-basic field drops that field, the GPU stays up
    assert sample_values(text, "stepscope_gpu_power_watts", gpu="1") == []
    assert one(text, "stepscope_gpu_up", gpu="1") == 1
    assert one(text, "stepscope_gpu_power_limit_watts", gpu="1") == 400
    assert [one(text, "stepscope_gpu_power_watts", gpu=g) for g in ("0", "2")] == pytest.approx(
        [MIXED["gpus"][g]["power_usage_mw"] / 1000 for g in (0, 2)])


def test_maximum_sm_clock_is_read_once_per_gpu_and_published_every_cycle(harness: Callable[..., Harness]) -> None:
    """nvmlDeviceGetMaxClockInfo spent 1.46 ms of CPU per call on an H100, half of a cycle's; the value is the
    board's and never changes, so it is read when a GPU is identified. One the GPU refuses stays absent."""
    scenario = load_scenario("mixed")
    scenario["gpus"][2].setdefault("errors", {})["max_clocks_mhz"] = "NotSupported"
    h = harness(scenario)
    h.nvml.reset_call_counts()
    for _ in range(4):
        text = h.scrape()
        assert one(text, "stepscope_gpu_sm_clock_max_hertz", gpu="0") == pytest.approx(1.98e9)
        assert one(text, "stepscope_gpu_sm_clock_max_hertz", gpu="1") == pytest.approx(
            MIXED["gpus"][1]["max_clocks_mhz"]["sm"] * 1e6)
        assert sample_values(text, "stepscope_gpu_sm_clock_max_hertz", gpu="2") == []
        assert one(text, "stepscope_gpu_sm_clock_hertz", gpu="2") > 0  # the current clock, read every cycle
    counts = h.nvml.call_counts()
    assert counts["nvmlDeviceGetMaxClockInfo"] == 3  # once per GPU, the refusal included
    assert counts["nvmlDeviceGetClockInfo"] == 4 * 3 * 2  # SM and memory, every cycle


@pytest.mark.parametrize("batch", ["answers", "FunctionNotFound"])
def test_slow_counters_come_from_one_field_values_call_or_one_call_each(
    harness: Callable[..., Harness], batch: str
) -> None:
    """Energy and the 8 policies' violation time: one nvmlDeviceGetFieldValues call per GPU (2.9 ms of CPU on
    an H100 against 8.7 ms as nine calls); a driver without it, or a field it refuses, is read one call each,
    to the same values."""
    scenario = load_scenario("mixed")
    for index, gpu in enumerate(scenario["gpus"]):  # fixed counters: both paths must read the same numbers
        gpu["total_energy_mj"] = 5_000_000_000 + index
        gpu["violation_ns"] = {name: 1_000_000_000 * (slot + 1) + index
                               for slot, name in enumerate(gpu.get("violation_ns", {}))}
        if batch != "answers":
            gpu.setdefault("errors", {})["field_values"] = batch
    h = harness(scenario)
    h.scrape()
    h.nvml.reset_call_counts()
    h.collector._slow.read_all()
    text = h.scrape()
    calls = h.nvml.call_counts()
    assert calls["nvmlDeviceGetFieldValues"] == 3  # one per GPU, refused or not
    if batch == "answers":  # only the T4's board limit, which the batch refuses, is asked again on its own
        assert (calls["nvmlDeviceGetTotalEnergyConsumption"], calls["nvmlDeviceGetViolationStatus"]) == (0, 1)
    else:
        assert (calls["nvmlDeviceGetTotalEnergyConsumption"], calls["nvmlDeviceGetViolationStatus"]) == (3, 24)
    for index, gpu in enumerate(scenario["gpus"]):
        assert one(text, "stepscope_gpu_energy_joules_total", gpu=str(index)) == pytest.approx(5_000_000 + index / 1e3)
        published = {reason: one(text, "stepscope_gpu_clock_event_seconds_total", gpu=str(index), reason=reason)
                     for reason, _ in VIOLATION_POLICIES if reason in gpu["violation_ns"]}
        assert published == pytest.approx({name: ns / 1e9 for name, ns in gpu["violation_ns"].items()})
    assert sample_values(text, "stepscope_gpu_clock_event_seconds_total", gpu="2", reason="board_limit") == []


def test_the_energy_read_time_is_when_the_driver_read_the_counter(
    harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watts divide each energy counter's increase by the read time's increase. Stamped by the reading thread
    at the round's start, the read time missed the time the thread then waited for a CPU (test_energy_e2e read
    686.1 W for 688.456 in a loaded CI run). A round now carries NVML's timestamp of the energy field."""
    scenario = make_scenario(gpus=1, processes_per_gpu=0)
    watts = scenario["gpus"][0]["total_energy_mj"]["per_second"] / 1e3
    h = harness(scenario, slow_interval=3600)
    h.scrape()  # identified, first round read
    slow = h.collector._slow
    batched = h.nvml.nvmlDeviceGetFieldValues
    waits = iter([0.0, 0.3])  # the second round's thread waits 0.3 s between its start and the driver's read

    def late(handle: Any, field_ids: list[int]) -> Any:
        time.sleep(next(waits))
        return batched(handle, field_ids)

    monkeypatch.setattr(h.nvml, "nvmlDeviceGetFieldValues", late)
    rounds = []
    for _ in range(2):
        slow.read_all()
        rounds.append(slow.latest())
        time.sleep(0.2)
    joules = [next(value for key, _, value in r.gpus["0"] if key == "stepscope_gpu_energy_joules_total")
              for r in rounds]
    assert (joules[1] - joules[0]) / (rounds[1].read_time - rounds[0].read_time) == pytest.approx(watts, rel=1e-3)


def test_older_bindings_without_event_reasons_or_memory_v2(
    harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness()
    monkeypatch.delattr(h.nvml, "nvmlDeviceGetCurrentClocksEventReasons")
    monkeypatch.delattr(h.nvml, "nvmlMemory_v2")
    text = h.scrape()
    assert one(text, "stepscope_gpu_clock_event_active", gpu="0", reason="sw_power_cap") == 1
    assert one(text, "stepscope_gpu_memory_used_bytes", gpu="0") == 61 * GIB + GIB // 2  # v1: incl. reserved


def test_lost_gpu_reports_down_while_others_stay_fresh_then_returns(
    harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    h = harness()
    caplog.set_level(logging.INFO, logger="stepscope.exporter.collectors.gpu")
    h.scrape()

    def lose(scenario: dict[str, Any]) -> None:
        scenario["gpus"][1]["lost"] = True
        scenario["gpus"][0]["temperature_c"] = 77
    h.rewrite(lose)
    for _ in range(3):
        text = h.scrape()
        assert one(text, "stepscope_gpu_up", gpu="1", uuid=UUIDS[1]) == 0
        assert names_for_gpu(text, "1") == {"stepscope_gpu_up", "stepscope_gpu_info"}
        assert one(text, "stepscope_gpu_temperature_celsius", gpu="0") == 77
        assert one(text, "stepscope_gpu_up", gpu="2") == 1
        assert 4101 in h.table.get() and "1" not in h.table.get()[4101]
    assert sum("stopped answering" in r.message for r in caplog.records) == 1

    h.rewrite(lambda s: s["gpus"][1].pop("lost"))
    text = h.scrape()
    assert one(text, "stepscope_gpu_up", gpu="1") == 1
    assert set(PER_GPU_FAMILIES) <= names_for_gpu(text, "1")
    assert h.table.get()[4101]["1"] == 8 * GIB
    assert sum("answers again" in r.message for r in caplog.records) == 1


def test_gpu_lost_before_start_is_reported_and_picked_up_later(harness: Callable[..., Harness]) -> None:
    scenario = load_scenario("mixed")
    scenario["gpus"][1]["lost"] = True
    h = harness(scenario)
    text = h.scrape()
    assert one(text, "stepscope_gpu_up", gpu="1", uuid="") == 0  # identity unknown yet
    assert sample_values(text, "stepscope_gpu_info", gpu="1") == []
    assert one(text, "stepscope_gpu_up", gpu="0") == 1
    h.rewrite(lambda s: s["gpus"][1].pop("lost"))
    text = h.scrape()
    assert one(text, "stepscope_gpu_up", gpu="1", uuid=UUIDS[1]) == 1
    # its slow readings (energy, violation time, PCIe) come from the slow thread's next round, which
    # the late GPU starts at once rather than after the 10 s interval
    wait_for(h.scrape, lambda t: set(PER_GPU_FAMILIES) <= names_for_gpu(t, "1"), "GPU 1's slow readings")


@pytest.mark.parametrize(("field", "down"),
                         [("utilization", True), ("memory", True), ("temperature_c", False)])
def test_driver_error_on_a_basic_query_marks_the_gpu_down(
    harness: Callable[..., Harness], field: str, down: bool
) -> None:
    """Unknown on one basic query for two cycles running: the first may be a transient, the second is not."""
    h = harness()
    h.rewrite(lambda s: s["gpus"][2].setdefault("errors", {}).update({field: "Unknown"}))
    assert one(h.scrape(), "stepscope_gpu_up", gpu="2") == 1
    text = h.scrape()
    assert one(text, "stepscope_gpu_up", gpu="2") == (0 if down else 1)
    assert one(text, "stepscope_gpu_up", gpu="0") == 1


def test_process_gpu_memory_lands_in_the_table(harness: Callable[..., Harness]) -> None:
    h = harness()
    h.scrape()
    assert {pid: dict(gpus) for pid, gpus in h.table.get().items()} == {
        4101: {"0": 30 * GIB, "1": 8 * GIB},  # one process on two GPUs
        4102: {"0": 20 * GIB},
        4104: {"2": 2 * GIB},  # 4103 reports no memory figure (None): left out
    }
    h.rewrite(lambda s: s["gpus"][0]["processes"].append({"pid": 4102, "used_memory": GIB}))
    h.scrape()
    assert h.table.get()[4102] == {"0": 21 * GIB}  # two contexts of one pid on one GPU add up


def test_processes_through_mps_land_in_the_table_once(harness: Callable[..., Harness]) -> None:
    """Under MPS NVML lists the training processes only by nvmlDeviceGetMPSComputeRunningProcesses (the compute
    list holds the MPS server): before, they were never in the table, so no run was mapped to the GPU. A pid in
    both lists is one process, not two contexts."""
    h = harness()
    h.rewrite(lambda s: s["gpus"][0].update(mps_processes=[{"pid": 4105, "used_memory": 3 * GIB},
                                                           {"pid": 4102, "used_memory": 20 * GIB},
                                                           {"pid": 4106, "used_memory": None}]))
    h.rewrite(lambda s: s["gpus"][1].update(mps_processes=[{"pid": 4103, "used_memory": GIB}]))
    h.scrape()
    table = {pid: dict(gpus) for pid, gpus in h.table.get().items()}
    assert table[4105] == {"0": 3 * GIB}
    assert table[4102] == {"0": 20 * GIB}  # listed in both: counted once
    assert table[4103] == {"1": GIB}  # no figure in the compute list: the MPS list's
    assert 4106 not in table
    assert getattr(h.collector, "failed_reading", "") == ""


@pytest.mark.parametrize("refusal", ["NotSupported", "FunctionNotFound", "bindings without the call", "Unknown"])
def test_a_refused_mps_list_keeps_the_compute_processes(
    harness: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """A driver or GPU without MPS refuses the call (NotSupported), an older driver has no such function
    (FunctionNotFound), older bindings no such attribute: none of them is a failed reading, and the compute
    processes are read as before. Any other error is counted, as any failed field."""
    h = harness()
    if refusal == "bindings without the call":
        monkeypatch.delattr(h.nvml, "nvmlDeviceGetMPSComputeRunningProcesses")
    else:
        h.rewrite(lambda s: [gpu.setdefault("errors", {}).update(mps_processes=refusal) for gpu in s["gpus"]])
    text = h.scrape()
    assert {pid: dict(gpus) for pid, gpus in h.table.get().items()} == {
        4101: {"0": 30 * GIB, "1": 8 * GIB}, 4102: {"0": 20 * GIB}, 4104: {"2": 2 * GIB}}
    assert sample_values(text, "stepscope_gpu_up") == [1, 1, 1]
    failed = getattr(h.collector, "failed_reading", "")
    assert ("mps_processes" in failed) == (refusal == "Unknown"), failed


def test_generated_eight_by_eight_scenario(harness: Callable[..., Harness]) -> None:
    h = harness(make_scenario(gpus=8, processes_per_gpu=8, models=("H100", "A100")))
    text = h.scrape()
    assert sample_values(text, "stepscope_gpu_up") == [1] * 8
    assert len(h.table.get()) == 64
    assert all(len(per_gpu) == 1 for per_gpu in h.table.get().values())


def test_xid_events_count_per_gpu_and_xid(
    harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    scenario = load_scenario("mixed")
    scenario["gpus"][2]["errors"] = {"register_events": "NotSupported"}
    scenario["xid_events"] = [{"gpu": 0, "xid": 79}, {"gpu": 2, "xid": 31}]
    h = harness(scenario)
    before = time.time()
    h.scrape()  # starts the event thread
    text = wait_for(h.scrape, lambda t: bool(sample_values(t, "stepscope_gpu_xid_errors_total")),
                    "the first XID")
    assert one(text, "stepscope_gpu_xid_errors_total", gpu="0", uuid=UUIDS[0], xid="79") == 1
    last_seen = one(text, "stepscope_gpu_xid_last_seen_timestamp_seconds", gpu="0", xid="79")
    assert before <= last_seen <= time.time()
    assert sample_values(text, "stepscope_gpu_xid_errors_total", gpu="2") == []  # not registered
    assert sum("XID events unavailable" in r.message for r in caplog.records) == 1

    h.rewrite(lambda s: s["xid_events"].extend([{"gpu": 0, "xid": 79}, {"gpu": 1, "xid": 48}]))
    text = wait_for(h.scrape, lambda t: sorted(sample_values(t, "stepscope_gpu_xid_errors_total")) == [1, 2],
                    "the appended XIDs")
    assert one(text, "stepscope_gpu_xid_errors_total", gpu="0", xid="79") == 2
    assert one(text, "stepscope_gpu_xid_errors_total", gpu="1", uuid=UUIDS[1], xid="48") == 1


def test_no_driver_reports_collector_down_logs_once_and_recovers(
    harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stepscope.exporter.collectors.gpu")
    h = harness(load_scenario("no_driver"), init_retry_seconds=0)
    for _ in range(4):
        text = h.scrape()
        assert gpu_family_names(text) == {"stepscope_gpu_collector_up"}
        assert one(text, "stepscope_gpu_collector_up") == 0
        assert h.table.get() == {}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["NVML unavailable (Driver Not Loaded): GPU metrics disabled, retrying every 0s"]

    h.rewrite(lambda s: s.update(load_scenario("mixed")))
    text = h.scrape()
    assert one(text, "stepscope_gpu_collector_up") == 1
    assert one(text, "stepscope_gpu_up", gpu="2") == 1


def test_real_nvidia_ml_py_without_a_driver_is_a_clean_collector_down() -> None:
    pytest.importorskip("pynvml")
    collector = GpuCollector(GpuProcessTable())  # the real bindings; no NVIDIA driver on this machine
    try:
        text = render(collector.collect()).decode()
        if one(text, "stepscope_gpu_collector_up") == 1:
            pytest.skip("an NVIDIA driver is present here")
        assert gpu_family_names(text) == {"stepscope_gpu_collector_up"}
    finally:
        collector.close()


def test_close_frees_gpm_samples_and_shuts_nvml_down(harness: Callable[..., Harness]) -> None:
    h = harness()
    h.scrape()
    assert h.nvml.gpm_samples_allocated() == 2  # the H100's pair
    h.collector.close()
    assert h.nvml.gpm_samples_allocated() == 0
    with pytest.raises(h.nvml.NVMLError_Uninitialized):
        h.nvml.nvmlDeviceGetCount()


# --- late GPUs, failed readings, transient errors --------------------------------------------------

EVERY_QUERY = ("utilization", "memory", "memory_v2", "temperature_c", "power_usage_mw", "enforced_power_limit_mw",
               "clocks_mhz", "clocks_event_reasons", "ecc_aggregate", "gpm", "gpm_sample", "processes")


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("lost", [[1], [0, 1, 2]], ids=["one_gpu", "every_gpu"])
def test_xids_count_on_a_gpu_that_answered_only_after_start(harness: Callable[..., Harness], lost: list[int]) -> None:
    """Its XIDs were never counted: events were registered at start for the GPUs that answered then (none at
    all when no GPU did, and then no GPU ever got XIDs)."""
    scenario = load_scenario("mixed")
    for index in lost:
        scenario["gpus"][index]["lost"] = True
    h = harness(scenario)
    assert one(h.scrape(), "stepscope_gpu_up", gpu="1") == 0
    h.rewrite(lambda s: [s["gpus"][index].pop("lost") for index in lost])
    assert one(h.scrape(), "stepscope_gpu_up", gpu="1", uuid=UUIDS[1]) == 1
    h.rewrite(lambda s: s["xid_events"].extend([{"gpu": 1, "xid": 79}, {"gpu": 0, "xid": 48}]))
    text = wait_for(h.scrape, lambda t: len(sample_values(t, "stepscope_gpu_xid_errors_total")) == 2, "both XIDs")
    assert one(text, "stepscope_gpu_xid_errors_total", gpu="1", uuid=UUIDS[1], xid="79") == 1
    assert one(text, "stepscope_gpu_xid_errors_total", gpu="0", uuid=UUIDS[0], xid="48") == 1


@pytest.mark.parametrize("error", ["Timeout", "Uninitialized", "Unknown"])
def test_a_gpu_refusing_every_query_is_down_counted_and_warned_once(
    harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture, error: str
) -> None:
    """Timeout or Uninitialized on every query left gpu_up 1 with no reading and nothing counted or warned."""
    caplog.set_level(logging.DEBUG, logger="stepscope.exporter.collectors.gpu")
    h = harness()
    h.scrape()
    assert getattr(h.collector, "failed_reading", "") == ""
    h.rewrite(lambda s: s["gpus"][1].update(errors=dict.fromkeys(EVERY_QUERY, error)))
    for cycle in range(3):
        text = h.scrape()
        assert one(text, "stepscope_gpu_up", gpu="1") == 0, cycle
        assert names_for_gpu(text, "1") == {"stepscope_gpu_up", "stepscope_gpu_info"}
        assert one(text, "stepscope_gpu_up", gpu="0") == 1
        assert "GPU 1" in getattr(h.collector, "failed_reading", "")  # the scheduler counts each such cycle
        if cycle == 0:
            first = warnings_of(caplog)
            assert first and all("GPU 1" in w for w in first), first
    assert warnings_of(caplog) == first  # once, not every cycle
    h.rewrite(lambda s: s["gpus"][1].pop("errors"))
    assert one(h.scrape(), "stepscope_gpu_up", gpu="1") == 1
    assert getattr(h.collector, "failed_reading", "") == ""


def test_nvml_uninitialized_under_the_collector_marks_every_gpu_down(harness: Callable[..., Harness]) -> None:
    """The probe's driver-reset case: once NVML is shut down under it every call raises Uninitialized."""
    h = harness()
    h.scrape()
    h.nvml.nvmlShutdown()
    try:
        text = h.scrape()
    finally:
        h.nvml.nvmlInit()
    assert sample_values(text, "stepscope_gpu_up") == [0, 0, 0]
    assert getattr(h.collector, "failed_reading", "") != ""


def test_a_failing_field_is_counted_and_warned_once_unsupported_is_not(
    harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="stepscope.exporter.collectors.gpu")
    h = harness()
    h.rewrite(lambda s: s["gpus"][0].update(errors={"temperature_c": "Timeout"}))
    for _ in range(3):
        text = h.scrape()
        assert one(text, "stepscope_gpu_up", gpu="0") == 1
        assert sample_values(text, "stepscope_gpu_temperature_celsius", gpu="0") == []
        assert "temperature" in getattr(h.collector, "failed_reading", "")
    assert len(warnings_of(caplog)) == 1 and "temperature" in warnings_of(caplog)[0]
    h.rewrite(lambda s: s["gpus"][0].update(errors={"temperature_c": "NotSupported"}))
    h.scrape()
    assert getattr(h.collector, "failed_reading", "") == ""  # a field the GPU does not have is no failure


def test_gpus_appearing_after_start_are_published_with_xids(harness: Callable[..., Harness]) -> None:
    h = harness(make_scenario(gpus=1, processes_per_gpu=1), init_retry_seconds=0)
    assert sample_values(h.scrape(), "stepscope_gpu_up") == [1]
    h.rewrite(lambda s: s.update(gpus=make_scenario(gpus=2, processes_per_gpu=1)["gpus"],
                                 xid_events=[{"gpu": 1, "xid": 79}]))
    text = h.scrape()
    assert sample_values(text, "stepscope_gpu_up") == [1, 1]
    assert one(text, "stepscope_gpu_utilization_ratio", gpu="1") == 0.98
    text = wait_for(h.scrape, lambda t: bool(sample_values(t, "stepscope_gpu_xid_errors_total")), "the XID")
    assert one(text, "stepscope_gpu_xid_errors_total", gpu="1", xid="79") == 1


def test_the_gpu_count_is_rechecked_at_the_init_retry_cadence_only(harness: Callable[..., Harness]) -> None:
    h = harness(make_scenario(gpus=1, processes_per_gpu=1), init_retry_seconds=3600)
    h.scrape()
    h.nvml.reset_call_counts()
    h.rewrite(lambda s: s.update(gpus=make_scenario(gpus=2, processes_per_gpu=1)["gpus"]))
    for _ in range(3):
        assert sample_values(h.scrape(), "stepscope_gpu_up") == [1]  # not within the hour
    assert h.nvml.call_counts()["nvmlDeviceGetCount"] == 0


def test_a_driver_listing_no_gpu_is_collector_down_until_gpus_appear(
    harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stepscope.exporter.collectors.gpu")
    h = harness(make_scenario(gpus=0, processes_per_gpu=0), init_retry_seconds=0)
    for _ in range(3):
        text = h.scrape()
        assert gpu_family_names(text) == {"stepscope_gpu_collector_up"}
        assert one(text, "stepscope_gpu_collector_up") == 0
    assert len(warnings_of(caplog)) == 1 and "no GPU" in warnings_of(caplog)[0]
    h.rewrite(lambda s: s.update(gpus=make_scenario(gpus=2, processes_per_gpu=1)["gpus"]))
    text = h.scrape()
    assert one(text, "stepscope_gpu_collector_up") == 1
    assert sample_values(text, "stepscope_gpu_up") == [1, 1]


def test_one_transient_unknown_on_utilization_keeps_the_gpu_up_and_its_gpm(harness: Callable[..., Harness]) -> None:
    """One Unknown flapped gpu_up 1 -> 0 -> 1 and dropped GPM for a cycle; two in a row still mark it down."""
    h = harness()
    second_cycle(h)
    h.rewrite(lambda s: s["gpus"][0].update(errors={"utilization": "Unknown"}))
    text = h.scrape()
    assert one(text, "stepscope_gpu_up", gpu="0") == 1
    assert sample_values(text, "stepscope_gpu_utilization_ratio", gpu="0") == []
    assert one(text, "stepscope_gpu_memory_total_bytes", gpu="0") == 80 * GIB
    h.rewrite(lambda s: s["gpus"][0].pop("errors"))
    time.sleep(0.12)
    text = h.scrape()
    assert one(text, "stepscope_gpu_up", gpu="0") == 1
    assert set(GPM_FAMILIES) <= names_for_gpu(text, "0")  # the GPM pair was kept


# --- through a real exporter process -------------------------------------------------------------


def test_exporter_scrape_with_mixed_gpus_passes_promtool(tmp_path: Path) -> None:
    """Also: this test's process, a client of the MPS server on GPU 0 (listed by NVML's MPS call alone), is
    published with its GPU memory by the process collector."""
    scenario = load_scenario("mixed")
    scenario["gpus"][0]["mps_processes"] = [{"pid": os.getpid(), "used_memory": 3 * GIB}]
    path = write_scenario(tmp_path / "nvml.json", scenario)
    with running_exporter(tmp_path, "--collectors", "gpu,process", fake_nvml_scenario=path) as exporter:
        text = wait_for(lambda: scrape(exporter.url), lambda t: "stepscope_gpu_sm_active_ratio{" in t,
                        "GPM ratios (second cycle)")
    for index in range(3):
        assert set(PER_GPU_FAMILIES) <= names_for_gpu(text, str(index))
    assert one(text, "stepscope_process_gpu_memory_bytes", pid=str(os.getpid()), gpu="0") == 3 * GIB
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                             timeout=60)
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")


def test_exporter_gpu_lost_mid_run_and_back(tmp_path: Path) -> None:
    scenario = load_scenario("mixed")
    path = write_scenario(tmp_path / "nvml.json", scenario)
    with running_exporter(tmp_path, "--collectors", "gpu", fake_nvml_scenario=path) as exporter:
        assert one(scrape(exporter.url), "stepscope_gpu_up", gpu="1") == 1
        scenario["gpus"][1]["lost"] = True
        scenario["gpus"][0]["power_usage_mw"] = 650_000
        write_scenario(path, scenario)
        text = wait_for(lambda: scrape(exporter.url),
                        lambda t: sample_values(t, "stepscope_gpu_up", gpu="1") == [0], "GPU 1 down")
        assert names_for_gpu(text, "1") == {"stepscope_gpu_up", "stepscope_gpu_info"}
        assert one(text, "stepscope_gpu_power_watts", gpu="0") == 650
        assert one(text, "stepscope_gpu_up", gpu="2") == 1

        del scenario["gpus"][1]["lost"]
        write_scenario(path, scenario)
        text = wait_for(lambda: scrape(exporter.url),
                        lambda t: sample_values(t, "stepscope_gpu_up", gpu="1") == [1], "GPU 1 back")
        assert set(PER_GPU_FAMILIES) <= names_for_gpu(text, "1")
        log = exporter.log()
    assert log.count("stopped answering") == 1 and log.count("answers again") == 1


def test_exporter_without_driver_logs_once_and_keeps_other_collectors(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path / "nvml.json", load_scenario("no_driver"))
    with running_exporter(tmp_path, "--collectors", "gpu,node",
                          fake_nvml_scenario=scenario) as exporter:
        first = one(scrape(exporter.url), "stepscope_exporter_collector_last_success_timestamp_seconds",
                    collector="gpu")
        text = wait_for(lambda: scrape(exporter.url), lambda t: one(
            t, "stepscope_exporter_collector_last_success_timestamp_seconds", collector="gpu") >= first + 1.5,
            "at least three more GPU cycles")
        log = exporter.log()
    assert gpu_family_names(text) == {"stepscope_gpu_collector_up"}
    assert one(text, "stepscope_gpu_collector_up") == 0
    assert one(text, "stepscope_exporter_collector_errors_total", collector="gpu") == 0
    assert log.count("NVML unavailable") == 1, log
    assert sample_values(text, "stepscope_node_cpus") != []


def test_exporter_counts_cycles_with_a_gpu_refusing_every_query(tmp_path: Path) -> None:
    scenario = load_scenario("mixed")
    scenario["gpus"][2]["errors"] = dict.fromkeys(EVERY_QUERY, "Timeout")
    path = write_scenario(tmp_path / "nvml.json", scenario)
    with running_exporter(tmp_path, "--collectors", "gpu", fake_nvml_scenario=path) as exporter:
        text = wait_for(lambda: scrape(exporter.url), lambda t: one(
            t, "stepscope_exporter_collector_errors_total", collector="gpu") >= 2, "two counted cycles")
        log = exporter.log()
    assert one(text, "stepscope_gpu_up", gpu="2") == 0
    assert one(text, "stepscope_gpu_up", gpu="0") == 1
    assert "WARNING" in log and "Timeout" in log


def test_a_failing_slow_reading_is_counted_and_warned_once(
    harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    """The energy counter timing out (read on the slow thread): before, the GPU lost its energy and watts with
    one DEBUG line, and stepscope_exporter_collector_errors_total{collector="gpu"} stayed 0."""
    caplog.set_level(logging.DEBUG, logger="stepscope.exporter.collectors.gpu_slow")
    h = harness()
    h.scrape()  # NVML initialised, the slow readings started
    h.rewrite(lambda s: s["gpus"][0].update(errors={"total_energy_mj": "Timeout"}))
    for _ in range(2):
        h.collector._slow.read_all()
        text = h.scrape()
        assert sample_values(text, "stepscope_gpu_energy_joules_total", gpu="0") == []
        assert "GPU 0 energy: NVMLError_Timeout" in getattr(h.collector, "failed_reading", "")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "energy" in warned[0], warned
    h.rewrite(lambda s: s["gpus"][0].update(errors={"total_energy_mj": "NotSupported"}))
    h.collector._slow.read_all()
    h.scrape()
    assert getattr(h.collector, "failed_reading", "") == ""  # a counter the GPU does not have is no failure

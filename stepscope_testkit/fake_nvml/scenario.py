"""Builds, writes and loads scenarios for the fake pynvml (format: the docstring of pynvml.py here).

    from stepscope_testkit.fake_nvml.scenario import make_scenario, write_scenario
    write_scenario(tmp_path / "nvml.json", make_scenario(gpus=8, processes_per_gpu=8))

or from a shell: `python stepscope_testkit/fake_nvml/scenario.py --gpus 8 --processes-per-gpu 8 out.json`.
"""

import argparse
import copy
import importlib.util
import itertools
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
GIB = 1024**3

# Per-model templates: identity and limits of the real models; readings are a saturated training GPU as
# an H100 80GB HBM3 reported it (benchmarks/corpus/h100-2026-11-24, mlp_bf16: 4 x Linear(8192) in bf16
# at its 700 W cap): NVML utilization 98%, memory-controller 38%, SM active 73%, SM occupancy 18%,
# tensor 57%, DRAM 30%, 688 W, SM clock 1.695-1.815 of 1.98 GHz, 61 C. The H200 template is the H200's own
# recording of the same model (benchmarks/corpus/h200-2026-11-26, mlp_bf16, medians of steady training).
# No other model has been recorded: the GH200 (the same Hopper SMs) takes the H100's GPM readings, and
# every other model the same NVML utilization (a saturated GPU reads 98-100% on any of them); power,
# clocks and temperatures keep each model's own limits.
BUSY_UTILIZATION = {"gpu": 98, "memory": 38}
PCIE_KBPS = {"rx": 11_704_627, "tx": 703_386}  # 12.0 and 0.72 GB/s: the batches copied in from pinned memory
HOPPER_GPM = {"sm_util": 72.5, "sm_occupancy": 17.6, "any_tensor_util": 57.5, "dram_bw_util": 29.9}
MODELS: dict[str, dict[str, Any]] = {
    "H100": {
        "name": "NVIDIA H100 80GB HBM3",
        "memory": {"total": 80 * GIB, "used": 61 * GIB, "reserved": GIB // 2},
        "power_usage_mw": 688_456, "enforced_power_limit_mw": 700_000,
        "clocks_mhz": {"sm": 1695, "mem": 2619}, "max_clocks_mhz": {"sm": 1980, "mem": 2619}, "temperature_c": 61,
        "gpm": {**HOPPER_GPM,
                "pcie_tx_per_sec": PCIE_KBPS["tx"] / 1024, "pcie_rx_per_sec": PCIE_KBPS["rx"] / 1024,  # MiB/s
                "nvlink_total_tx_per_sec": 48_000.0, "nvlink_total_rx_per_sec": 47_500.0},  # no C2C
    },
    "H200": {  # recorded: 4 x Linear(8192) bf16 at its 700 W cap (its memory use is that small model's)
        "name": "NVIDIA H200",
        "utilization": {"gpu": 99, "memory": 31},
        "memory": {"total": 150_754_820_096, "used": 2_502_754_304, "reserved": GIB // 2},
        "power_usage_mw": 693_000, "enforced_power_limit_mw": 700_000,
        "clocks_mhz": {"sm": 1620, "mem": 3201}, "max_clocks_mhz": {"sm": 1980, "mem": 3201}, "temperature_c": 50,
        "gpm": {"sm_util": 83.1, "sm_occupancy": 17.8, "any_tensor_util": 69.8, "dram_bw_util": 22.6,
                "pcie_tx_per_sec": 402_170_274 / 2**20, "pcie_rx_per_sec": 6_656_715_267 / 2**20,  # MiB/s
                "nvlink_total_tx_per_sec": 0.0, "nvlink_total_rx_per_sec": 0.0},  # one GPU, no NVLink peer
    },
    "GH200": {  # Grace Hopper: the GPU reaches its CPU over NVLink-C2C, so host copies bypass PCIe
        "name": "NVIDIA GH200 480GB",
        "memory": {"total": 96 * GIB, "used": 70 * GIB, "reserved": GIB // 2},
        "power_usage_mw": 610_000, "enforced_power_limit_mw": 900_000,
        "clocks_mhz": {"sm": 1980, "mem": 2619}, "max_clocks_mhz": {"sm": 1980, "mem": 2619}, "temperature_c": 58,
        "gpm": {**HOPPER_GPM,
                "pcie_tx_per_sec": 2.0, "pcie_rx_per_sec": 3.0,
                "nvlink_total_tx_per_sec": 51_000.0, "nvlink_total_rx_per_sec": 50_500.0,
                "c2c_total_tx_per_sec": 6_000.0, "c2c_total_rx_per_sec": 21_000.0},
    },
    "A100": {
        "name": "NVIDIA A100-SXM4-80GB",
        "memory": {"total": 80 * GIB, "used": 52 * GIB, "reserved": GIB // 2},
        "power_usage_mw": 301_000, "enforced_power_limit_mw": 400_000,
        "clocks_mhz": {"sm": 1410, "mem": 1593}, "max_clocks_mhz": {"sm": 1410, "mem": 1593}, "temperature_c": 55,
    },
    "T4": {
        "name": "Tesla T4",
        "memory": {"total": 15 * GIB, "used": 9 * GIB, "reserved": GIB // 4},
        "power_usage_mw": 63_000, "enforced_power_limit_mw": 70_000,
        "clocks_mhz": {"sm": 1590, "mem": 5001}, "max_clocks_mhz": {"sm": 1590, "mem": 5001}, "temperature_c": 71,
    },
}

# Median NVML call latencies on an H100 80GB HBM3, driver 580.159.04, measured by `bench_gpu.py --per-call`
# (benchmarks/results/gpu-per-call.md, 2026-11-27), for the fake's "latency_ms". Each call's CPU equalled its
# wall time except the PCIe poll (20.6 ms of wall, 0.55 ms of CPU: NVML sleeps while it samples the link).
# The fast getters (utilization, temperature, power, clocks, clock-event reasons, ECC) took 0.0015-0.0035 ms:
# "default" is the top of that range. nvmlDeviceGetMaxClockInfo is not fast: 1.46 ms (p90 2.1) of CPU.
H100_LATENCY_MS: dict[str, float] = {
    "nvmlDeviceGetPcieThroughput": 20.6,  # NVML samples the link for 20 ms
    "nvmlDeviceGetTotalEnergyConsumption": 3.06,
    "nvmlDeviceGetMaxClockInfo": 1.46,
    "nvmlDeviceGetViolationStatus": 0.7,  # per policy: 0.58 (thermal) to 0.87 (board limit)
    "nvmlDeviceGetFieldValues": 2.87,  # energy and the 8 policies' counters in one call (0.54 without energy)
    "nvmlGpmSampleGet": 0.034,
    "nvmlGpmMetricsGet": 0.021,  # 10 metrics in one call
    "nvmlDeviceGetMemoryInfo": 0.010,
    "nvmlDeviceGetComputeRunningProcesses": 0.007,
    "default": 0.0035,
}


def make_gpu(index: int, model: str = "H100", *, processes: Iterable[tuple[int, int | None]] = (),
             throttle: Sequence[str] = (), **overrides: Any) -> dict[str, Any]:
    """One GPU of `model` (a MODELS key) holding (pid, bytes) processes; overrides replace keys."""
    power_mw = MODELS[model]["power_usage_mw"]
    gpu = {
        "uuid": f"GPU-{index:08x}-5eed-4e1d-9a7e-{model.lower():0>12}",
        "pci_bus_id": f"00000000:{0x18 + index * 0x10:02X}:00.0",
        "utilization": dict(BUSY_UTILIZATION),
        **copy.deepcopy(MODELS[model]),
        "total_energy_mj": {"start": 5_000_000_000, "per_second": power_mw},  # energy rate = power
        "clocks_event_reasons": list(throttle),
        "violation_ns": {  # held down 10% of the time for an active reason
            "power": {"start": 12_000_000_000, "per_second": 1e8 if "sw_power_cap" in throttle else 0},
            "thermal": {"start": 0, "per_second": 1e8 if "sw_thermal_slowdown" in throttle else 0},
            "sync_boost": 0, "board_limit": 0, "low_utilization": 3_000_000_000, "reliability": 0,
            "app_clocks": 0, "base_clocks": 0,
        },
        "pcie_kbps": dict(PCIE_KBPS),
        "ecc_aggregate": {"corrected": 3, "uncorrected": 0},
        "processes": [{"pid": pid, "used_memory": used} for pid, used in processes],
    }
    gpu.update(overrides)
    return gpu


def make_scenario(gpus: int = 8, processes_per_gpu: int = 8, *, models: Sequence[str] = ("H100",),
                  pids: Sequence[int] | None = None, first_pid: int = 3_000_000,
                  process_memory: int = 6 * GIB, throttle: Sequence[str] = (),
                  xid_events: Sequence[dict[str, int]] = (),
                  driver_version: str = "550.54.15",
                  latency_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """`gpus` GPUs (models cycled) with `processes_per_gpu` processes each.

    Pids come from `pids` (cycled; pass real pids when the process collector must find them) or
    count up from `first_pid`, one distinct pid per (GPU, slot). `latency_ms` (e.g. H100_LATENCY_MS)
    makes every NVML call take its latency.
    """
    pid_source = itertools.cycle(pids) if pids else itertools.count(first_pid)
    scenario = {
        "driver_version": driver_version,
        "init_error": None,
        "gpus": [
            make_gpu(index, models[index % len(models)], throttle=throttle,
                     processes=[(next(pid_source), process_memory) for _ in range(processes_per_gpu)])
            for index in range(gpus)
        ],
        "xid_events": list(xid_events),
    }
    if latency_ms:
        scenario["latency_ms"] = dict(latency_ms)
    return scenario


def write_scenario(path: Path | str, scenario: dict[str, Any]) -> Path:
    """Writes atomically (temp file + rename) so the fake never reads half a file."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(scenario, indent=1), encoding="utf-8")
    os.replace(temporary, path)
    return path


def load_scenario(name: str) -> dict[str, Any]:
    """One of the example scenarios in stepscope_testkit/fake_nvml/scenarios (without .json)."""
    return json.loads((HERE / "scenarios" / f"{name}.json").read_text(encoding="utf-8"))


def load_fake_pynvml() -> ModuleType:
    """A fresh copy of the fake module (own init count, handles and delivered events) for in-process use."""
    spec = importlib.util.spec_from_file_location("fake_pynvml", HERE / "pynvml.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a fake-NVML scenario JSON file.")
    parser.add_argument("output", type=Path)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes-per-gpu", type=int, default=8)
    parser.add_argument("--models", default="H100", help=f"comma-separated, cycled; from {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r} (known: {', '.join(MODELS)})")
    write_scenario(args.output, make_scenario(args.gpus, args.processes_per_gpu, models=models))
    return 0


if __name__ == "__main__":
    sys.exit(main())

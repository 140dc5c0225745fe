"""Where each collector's cycle spends CPU on a real GPU node, and whether one nvmlDeviceGetFieldValues call
can replace the slow round's energy and eight violation reads (issue 20).

    PYTHONPATH=. python3 benchmarks/probe_gpu_cycle.py     # a GPU machine with torch (about 45 s)

A CUDA process holds GPU memory all along, as bench_gpu.py --side-by-side's matmul does, so the process
collector reads one GPU process. Prints each call's wall and CPU, the field values beside the single calls'
(same counters, same units), then each collector's run_once: CPU without a profiler, then cProfile's top
(Python 3.12's cProfile sees every thread: the XID thread's event wait shows up in each).
Results of 2026-11-27 on an H100: benchmarks/results/exporter_cpu.md.
"""

import cProfile
import io
import pstats
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_gpu
from bench_scrape import percentile

from stepscope.exporter.collectors.gpu import GpuCollector
from stepscope.exporter.collectors.gpu_slow import COUNTERS, VIOLATION_POLICIES
from stepscope.exporter.collectors.node import NodeCollector
from stepscope.exporter.collectors.process import ProcessCollector
from stepscope.exporter.exposition import ExpositionStore
from stepscope.exporter.gpu_processes import GpuProcessTable
from stepscope.exporter.scheduler import Scheduler

HOLD_GPU_MEMORY = ("import torch, time; x = torch.ones(1 << 28, device='cuda'); print('ready', flush=True); "
                   "time.sleep(600)")


def timed(call: Callable[[], object], repeats: int) -> str:
    """Median wall and CPU of the calling thread (bench_gpu.timed), and the CPU's p90, in ms."""
    walls, cpus = bench_gpu.timed(call, repeats)
    return (f"wall {bench_gpu.median(walls):.4f} ms, CPU {bench_gpu.median(cpus):.4f} ms "
            f"(p90 {percentile(cpus, 0.9):.4f})")


def field_values(nvml: Any, handle: Any) -> None:
    ids = [getattr(nvml, counter.field_id) for counter in COUNTERS]  # energy first, then the 8 policies
    print("FieldValues (energy and 8 policies):", timed(partial(nvml.nvmlDeviceGetFieldValues, handle, ids), 30))
    print("FieldValues (energy only):", timed(partial(nvml.nvmlDeviceGetFieldValues, handle, ids[:1]), 30))
    print("FieldValues (8 policies):", timed(partial(nvml.nvmlDeviceGetFieldValues, handle, ids[1:]), 30))
    for value in nvml.nvmlDeviceGetFieldValues(handle, ids):
        print(f"  field {value.fieldId}: return {value.nvmlReturn}, type {value.valueType}, {value.value.ullVal}")
    for reason, policy in VIOLATION_POLICIES:
        try:
            spent = nvml.nvmlDeviceGetViolationStatus(handle, getattr(nvml, policy)).violationTime
        except nvml.NVMLError as exc:
            spent = exc
        print(f"  violation {reason}: {spent}")
    print(f"  energy: {nvml.nvmlDeviceGetTotalEnergyConsumption(handle)}")
    print("ComputeRunningProcesses, one process:",
          timed(partial(nvml.nvmlDeviceGetComputeRunningProcesses, handle), 50))


def collector_cycles(repeats: int = 50) -> None:
    table = GpuProcessTable()
    collectors = [GpuCollector(table), NodeCollector(["/"]), ProcessCollector(table, registered=list)]
    scheduler = Scheduler(collectors, 1.0, ExpositionStore())
    for _ in range(2):  # GPM's first pair, every cache filled
        for collector in collectors:
            scheduler.run_once(collector)
        time.sleep(0.3)
    for collector in collectors:
        started = time.thread_time()
        for _ in range(repeats):
            time.sleep(0.12)
            scheduler.run_once(collector)
        print(f"\n## {collector.name}: {(time.thread_time() - started) / repeats * 1e3:.3f} ms CPU per run_once")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(repeats):
            time.sleep(0.12)
            scheduler.run_once(collector)
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(16)
        print("\n".join(line[:160] for line in out.getvalue().splitlines()[4:30] if line.strip()))
    collectors[0].close()


def main() -> None:
    import pynvml

    holder = subprocess.Popen([sys.executable, "-c", HOLD_GPU_MEMORY], stdout=subprocess.PIPE, text=True)
    try:
        print(holder.stdout.readline().strip() if holder.stdout else "")
        pynvml.nvmlInit()
        field_values(pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
        pynvml.nvmlShutdown()
        collector_cycles()
    finally:
        holder.kill()


if __name__ == "__main__":
    main()

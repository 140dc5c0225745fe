"""One GPU node's real /metrics: a real exporter with 8 fake GPUs and 8 ranks that push the body the
real hooks render after a few hundred steps of the 9 standard phases.

The series budget test counts it; benchmarks/bench_scale.py serves copies of it as a cluster, and
benchmarks/bench_quantiles.py counts it per hook configuration.
"""

import dataclasses
import random
import subprocess
import time
from pathlib import Path

import requests

import stepscope.hooks as th
from stepscope.contract import STANDARD_PHASES
from stepscope.hooks.cuda_memory import AllocatorMemory
from stepscope.hooks.render import render
from stepscope_testkit.fake_nvml.scenario import make_scenario, write_scenario
from stepscope_testkit.processes import running_exporter, scrape

GPUS = 8  # one rank per GPU
# Seconds per phase of a ~60 ms step (dataloader_next: prefetched, now and then a stall).
PHASE_SECONDS = {"dataloader_next": 5e-5, "to_device": 0.002, "forward": 0.018, "backward": 0.03,
                 "optimizer_step": 0.006, "train_batch": 0.054, "step_lr_schedulers": 2e-5,
                 "from_device": 3e-4, "reduce_metrics": 1e-3}
SAMPLES_PER_STEP = 32


def trained_tracker(rank: int, rng: random.Random, run: str = "budget", world_size: int = GPUS,
                    **settings: object) -> th.Tracker:
    """A tracker in state train after 300 steps of the 9 standard phases (~60 ms steps, 5% loader stalls)."""
    tracker = th.init(run=run, rank=rank, world_size=world_size, push_url="", handle_sigterm=False,
                      **settings)  # type: ignore[arg-type]
    tracker.state("train")
    hists = [tracker.phase(name)._hist for name in STANDARD_PHASES]  # type: ignore[union-attr]
    for _ in range(6):  # six pushes of 50 steps
        for _ in range(50):
            stall = rng.random() < 0.05
            for name, hist in zip(STANDARD_PHASES, hists, strict=True):
                seconds = PHASE_SECONDS[name] * (100 if stall and name == "dataloader_next" else 1)
                hist.observe_ns(round(seconds * rng.lognormvariate(0, 0.05) * 1e9))
            tracker._step_hist.observe_ns(round(0.06 * rng.lognormvariate(0, 0.05) * 1e9))
        tracker.render()
    return tracker


# The ranks train on the GPUs, so they push their caching allocator's memory too (six series a rank).
GPU_RANK_ALLOCATOR = AllocatorMemory(40 * 2**30, 60 * 2**30, 52 * 2**30, 2**30, 0, 0)


def capture_node_scrape(workdir: Path, run: str = "budget", world_size: int = GPUS, **settings: object) -> str:
    """The exporter's /metrics once every rank's process shows on its GPU (8 sleeping processes stand
    in for the ranks' pids: the hooks' body names them, the fake NVML puts one on each GPU)."""
    sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(GPUS)]
    try:
        pids = [proc.pid for proc in sleepers]
        scenario = write_scenario(workdir / "nvml.json", make_scenario(gpus=GPUS, processes_per_gpu=1, pids=pids))
        with running_exporter(workdir, fake_nvml_scenario=scenario) as exporter:
            rng = random.Random(1)
            for rank, pid in enumerate(pids):
                tracker = trained_tracker(rank, rng, run=run, world_size=world_size, **settings)
                snapshot = tracker.snapshot()
                info = {**snapshot.info, "pid": str(pid), "local_rank": str(rank)}
                info.pop("start_time", None)  # the sleeper is the rank's process, in our pid namespace
                steps = snapshot.step.count  # the trained tracker observes steps without step()
                body = render(dataclasses.replace(snapshot, info=info, steps=steps, samples=SAMPLES_PER_STEP * steps,
                                                  allocator=GPU_RANK_ALLOCATOR))
                tracker.close()
                url = f"{exporter.url}/metrics/job/stepscope/run/{run}/rank/{rank}"
                requests.put(url, data=body.encode(), timeout=10).raise_for_status()
            deadline = time.monotonic() + 30
            while True:  # the process collector maps every rank's pid to its GPU
                text = scrape(exporter.url)
                mapped = sum(1 for line in text.splitlines()
                             if line.startswith("stepscope_process_gpu_memory_bytes{") and f'run="{run}"' in line)
                if mapped == GPUS:
                    return text
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {mapped} of {GPUS} ranks mapped to a GPU:\n{text}")
                time.sleep(0.5)
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()

"""Real training runs for end-to-end tests: `python -m stepscope.hooks.demo` processes pushing to an
exporter, one per rank, the synchronous (DDP over gloo) ones wired up the way torchrun does it."""

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from stepscope_testkit.processes import REPO_ROOT, free_port


def start_demo(
    run: str,
    rank: int,
    world_size: int,
    push_url: str,
    log: Path,
    *extra: str,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """One rank of the demo, pushing every second; its output goes to `log`."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        **(env or {}),
    }
    argv = [
        sys.executable,
        "-m",
        "stepscope.hooks.demo",
        "--run",
        run,
        "--rank",
        str(rank),
        "--world-size",
        str(world_size),
        "--push-url",
        push_url,
        "--push-interval",
        "1",
        *extra,
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


def start_ddp_demos(
    run: str, world_size: int, push_url: str, logs: Path, *extra: str
) -> dict[tuple[str, int], subprocess.Popen]:
    """`world_size` ranks of one synchronous run (--ddp), rendezvous through env as torchrun sets it,
    without torchrun's overhead."""
    rendezvous = {"WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return {
        (run, rank): start_demo(
            run, rank, world_size, push_url, logs / f"{run}-{rank}.log", "--ddp", *extra,
            env={**rendezvous, "RANK": str(rank)},
        )
        for rank in range(world_size)
    }


def gpus_for_runs(layout: dict[int, tuple[int, float, tuple[str, int] | None]],
                  pids: dict[tuple[str, int], int], memory: int = 4 * 1024**3) -> dict:
    """A fake-NVML scenario of H100s: GPU index -> (NVML utilization %, SM active %, the (run, rank)
    holding `memory` bytes on it); `pids` maps (run, rank) to the process's pid once it runs."""
    from stepscope_testkit.fake_nvml.scenario import make_gpu, make_scenario

    scenario = make_scenario(gpus=0, processes_per_gpu=0)
    scenario["gpus"] = [
        make_gpu(index, "H100", processes=[(pids[holder], memory)] if holder in pids else [],
                 utilization={"gpu": nvml, "memory": nvml // 2},
                 gpm={"sm_util": sm, "sm_occupancy": sm / 2, "any_tensor_util": sm / 2, "dram_bw_util": sm / 2})
        for index, (nvml, sm, holder) in layout.items()
    ]
    return scenario


def stop(processes: Iterable[subprocess.Popen]) -> None:
    """SIGTERM (the hooks push their final state), then SIGKILL after 10 s."""
    processes = list(processes)
    for proc in processes:
        proc.terminate()
    for proc in processes:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

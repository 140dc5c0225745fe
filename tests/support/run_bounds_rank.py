"""One rank of a two-rank gloo run whose ranks step at different paces (tests/test_run_bounds.py).

argv: rank, world size, the rendezvous file, the step seconds of this rank, and optionally an exporter's
URL: then the ranks start no process group (they meet at files beside the rendezvous file) and push to the
exporter every 0.1 s. Prints one JSON line: the step histogram's exported bounds and cumulative counts after
each snapshot, and the true count of this rank's steps at or below each bound of the last one.
"""

import json
import random
import sys
import time
from bisect import bisect_right
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

import stepscope.hooks as th
import stepscope.hooks.timing
import stepscope.hooks.tracker

SNAPSHOTS = 12
STEPS_PER_SNAPSHOT = 100


class Clock:
    """The rank's scripted perf_counter_ns: steps take their drawn time without taking it."""

    now = 10**12

    def __call__(self) -> int:
        return self.now


def file_barrier(rendezvous: str, name: str, rank: int, world: int) -> None:
    """Waits until every rank has reached the barrier `name` (ranks without a process group)."""
    Path(f"{rendezvous}.{name}.{rank}").touch()
    deadline = time.monotonic() + 60
    while not all(Path(f"{rendezvous}.{name}.{other}").exists() for other in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other ranks did not reach {name}")
        time.sleep(0.05)


def main() -> None:
    rank, world, rendezvous, step_seconds = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    exporter = sys.argv[5] if len(sys.argv) > 5 else ""
    clock = Clock()
    stepscope.hooks.tracker.perf_counter_ns = clock
    stepscope.hooks.timing.perf_counter_ns = clock
    if exporter:
        file_barrier(rendezvous, "start", rank, world)
    else:
        # A file rendezvous: a TCP port picked beforehand can be taken by a parallel test, leaving the other rank
        # waiting on a stranger's socket.
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    tracker = th.init(run="paces", rank=rank, world_size=world, push_url=exporter, push_interval=0.1,
                      handle_sigterm=False)
    tracker.state("train")
    rng = random.Random(rank)
    durations: list[int] = []
    snapshots = []
    for _ in range(SNAPSHOTS):
        for _ in range(STEPS_PER_SNAPSHOT):
            duration = round(step_seconds * (1 + 0.03 * rng.gauss(0, 1)) * 1e9)
            clock.now += duration
            durations.append(duration)
            tracker.step()
        snapshot = tracker.snapshot().step
        snapshots.append({"bounds": snapshot.bounds, "cumulative": snapshot.cumulative})
        time.sleep(0.3)  # the agreement's thread does a round every 0.1 s, and so does a pusher
    durations.sort()
    truth = [bisect_right(durations, round(bound * 1e9)) for bound in snapshots[-1]["bounds"]]
    if exporter:
        file_barrier(rendezvous, "done", rank, world)
    else:
        dist.barrier()
    tracker.close()
    if not exporter:
        dist.destroy_process_group()
    print(json.dumps({"snapshots": snapshots, "truth": truth, "steps": len(durations)}))


if __name__ == "__main__":
    main()

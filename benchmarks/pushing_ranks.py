"""A node's training ranks, pushing to an exporter: real `stepscope.hooks` trackers in this process, each
timing five phases of a 50 ms step and pushing every 5 s, as the hooks do by default.

The exporter's cost with ranks pushing is the one users meet; without them a benchmark measures only its
collectors and scrapes (nvitop-exporter, beside it in bench_gpu.py, has no push API to load).
"""

from __future__ import annotations

import threading

import stepscope.hooks as th

RANKS = 8
PUSH_INTERVAL = 5.0
STEP_SECONDS = 0.05
PHASES = ("dataloader_next", "to_device", "forward", "backward", "optimizer_step")


class PushingRanks:
    """`ranks` trackers of one run stepping on a thread of their own until `close`."""

    def __init__(self, url: str, ranks: int = RANKS) -> None:
        self.trackers = [th.init(run="bench", rank=rank, local_rank=rank, world_size=ranks, push_url=url,
                                 push_interval=PUSH_INTERVAL, handle_sigterm=False) for rank in range(ranks)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._train, daemon=True)
        self._thread.start()

    def _train(self) -> None:
        for tracker in self.trackers:
            tracker.state("train")
        while not self._stop.wait(STEP_SECONDS):
            for tracker in self.trackers:
                for phase in PHASES:
                    with tracker.phase(phase):
                        pass
                tracker.step(samples=32)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)
        for tracker in self.trackers:
            tracker.close()

"""GPU phase timing with CUDA events, resolved lazily so the hot path never waits for the GPU.

A phase records a start and an end event on the current stream; the pair waits in a bounded queue
until `resolve()` (called by the training thread at each step boundary) finds the end event complete
with `Event.query()`. Only the training thread resolves, so histograms keep their single writer.
`torch` is never imported here: the caller passes `torch.cuda` (or anything with the same `Event`
and `synchronize`).
"""

from __future__ import annotations

from collections import deque
from time import perf_counter_ns
from typing import Any

from training_hooks.timing import Histogram

DEFAULT_MAX_PENDING = 4096


class CudaTimer:
    """Owns the pending event pairs and a pool of reusable events."""

    def __init__(self, cuda: Any, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.cuda = cuda
        self.max_pending = max_pending
        self._pending: deque[tuple[Histogram, Any, Any]] = deque()
        self._free: list[Any] = []

    def record(self) -> Any:
        event = self._free.pop() if self._free else self.cuda.Event(enable_timing=True)
        event.record()
        return event

    def submit(self, hist: Histogram, start: Any, end: Any) -> None:
        self._pending.append((hist, start, end))
        if len(self._pending) > self.max_pending:
            # The GPU is thousands of phases behind: wait for the oldest rather than grow without bound.
            self._resolve_oldest(block=True)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def resolve(self, block: bool = False) -> int:
        """Moves every completed pair into its histogram (all of them when block); returns how many."""
        done = 0
        while self._pending and self._resolve_oldest(block):
            done += 1
        return done

    def _resolve_oldest(self, block: bool) -> bool:
        hist, start, end = self._pending[0]
        if block:
            end.synchronize()
        elif not end.query():
            return False
        self._pending.popleft()
        hist.observe_ns(max(0, round(start.elapsed_time(end) * 1e6)))  # elapsed_time is in ms
        self._free += (start, end)
        return True


class CudaPhase:
    """`with phase:` brackets GPU work on the current stream with two events; no host synchronization."""

    __slots__ = ("_hist", "_start_event", "_timer", "name")

    def __init__(self, name: str, hist: Histogram, timer: CudaTimer) -> None:
        self.name = name
        self._hist = hist
        self._timer = timer
        self._start_event: Any = None

    def __enter__(self) -> CudaPhase:
        self._start_event = self._timer.record()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._start_event is not None:
            self._timer.submit(self._hist, self._start_event, self._timer.record())
            self._start_event = None

    def start(self) -> None:
        self.__enter__()

    def end(self) -> None:
        self.__exit__(None, None, None)


class SyncCudaPhase:
    """Debug mode (`sync=True`): synchronize before and after, then time on the host, for comparison."""

    __slots__ = ("_cuda", "_hist", "_start", "name")

    def __init__(self, name: str, hist: Histogram, cuda: Any) -> None:
        self.name = name
        self._hist = hist
        self._cuda = cuda
        self._start = 0

    def __enter__(self) -> SyncCudaPhase:
        self._cuda.synchronize()
        self._start = perf_counter_ns()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._cuda.synchronize()
        self._hist.observe_ns(perf_counter_ns() - self._start)

    def start(self) -> None:
        self.__enter__()

    def end(self) -> None:
        self.__exit__(None, None, None)

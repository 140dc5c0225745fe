"""GPU phase timing with CUDA events: one event per phase boundary, on a sample of the steps.

Costs measured on an H100 (torch 2.11, CUDA 13) set the design: `Event.record()` takes 9.2 µs, 4.1 of
them in the `torch.cuda.current_stream()` it calls when given no stream; `query()` 0.3 µs,
`elapsed_time()` 1.1 µs. Two records per phase on every step cost +40% at 1.3 ms steps. So:

- Boundaries are shared: a phase that starts within `SHARED_BOUNDARY_NS` of the previous GPU phase's
  end (on the same stream, in the same step) starts at that phase's end event, so six back-to-back
  phases record seven events, not twelve. GPU work queued in such a gap (at most a launch or two)
  counts towards the later phase.
- No `current_stream()` on the hot path: the current stream object is cached and checked with
  torch's raw stream lookup (`torch._C._cuda_getCurrentRawStream`, a C call returning an int), so a
  `with torch.cuda.stream(s):` is still followed. Without that lookup every record asks
  `current_stream()`.
- Events are pooled and reused.
- Steps are sampled: events are recorded on about one step in k (random gaps with mean k, so loops
  with a period do not alias), host timing still runs on every step. A timed occurrence counts for
  the occurrences of that phase since the previous timed one (its weight), so the histogram's count
  and sum estimate every occurrence and per-step rates stay right; quantiles come from the timed
  ones. k is chosen from measurement: the host time spent in event calls per sampled step (timed
  around every call) over the median step time, so that events cost at most `DEFAULT_BUDGET` (0.5%)
  of a typical step; it is re-chosen every window of steps.

Pairs wait in a FIFO until `resolve()` (called by the training thread at each step boundary) finds
their end event complete with `Event.query()`: no host synchronization on the hot path. Only the
training thread touches any of this, so histograms keep their single writer. `torch` is never
imported here: the caller passes `torch.cuda` (or anything with the same `Event`, `current_stream`
and `synchronize`).
"""

from __future__ import annotations

import logging
import math
import random
import sys
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from stepscope.hooks.timing import Histogram

log = logging.getLogger("stepscope.hooks")

DEFAULT_MAX_PENDING = 4096
DEFAULT_BUDGET = 0.005  # events may cost this fraction of the median step time
SHARED_BOUNDARY_NS = 10_000  # a phase starting this soon after the previous one's end shares its event
MAX_SAMPLE_EVERY = 100
MIN_WINDOW_STEPS = 50  # k is re-chosen after max(this, 8 k) steps
OPPORTUNISTIC_RESOLVE = 256  # pending pairs beyond which a phase end also resolves what is done


def _raw_stream_lookup(cuda: Any) -> Callable[[], int] | None:
    """A cheap `() -> raw stream id` of the current stream, when the CUDA module offers one.

    torch keeps it in `torch._C`; a stand-in may carry `_cuda_getCurrentRawStream` and
    `_cuda_getDevice` itself.
    """
    torch = sys.modules.get("torch")
    source = torch._C if torch is not None and cuda is getattr(torch, "cuda", None) else cuda
    get_raw = getattr(source, "_cuda_getCurrentRawStream", None)
    get_device = getattr(source, "_cuda_getDevice", None)
    if get_raw is None or get_device is None:
        return None
    return lambda: get_raw(get_device())


class _CurrentStream:
    """The current stream object, re-fetched only when the raw lookup says it changed."""

    __slots__ = ("_cached", "_cached_raw", "_cuda", "_raw")

    def __init__(self, cuda: Any) -> None:
        self._cuda = cuda
        self._raw = _raw_stream_lookup(cuda)
        self._cached: Any = None
        self._cached_raw: int | None = None

    def get(self) -> Any:
        if self._raw is None:
            return self._cuda.current_stream()
        if self._cached is None:  # current_stream() first: it lets torch initialise CUDA lazily
            self._cached = self._cuda.current_stream()
            self._cached_raw = self._raw()
            return self._cached
        raw = self._raw()
        if raw != self._cached_raw:
            self._cached, self._cached_raw = self._cuda.current_stream(), raw
        return self._cached


class _Pair:
    """A timed occurrence waiting for its end event; `end_shared` when a later pair starts at `end`."""

    __slots__ = ("end", "end_shared", "hist", "start", "weight")

    def __init__(self, hist: Histogram, start: Any, end: Any, weight: int) -> None:
        self.hist, self.start, self.end, self.weight = hist, start, end, weight
        self.end_shared = False


def choose_sample_every(cost_ns_per_sampled_step: float, step_ns: float, budget: float = DEFAULT_BUDGET) -> int:
    """The smallest k with (event cost per sampled step) / k <= budget x (step time)."""
    if step_ns <= 0:
        return 1
    k = math.ceil(cost_ns_per_sampled_step / (budget * step_ns))
    return min(max(k, 1), MAX_SAMPLE_EVERY)


class CudaTimer:
    """Event pool, pending pairs, shared boundaries and step sampling for one tracker."""

    def __init__(self, cuda: Any, *, max_pending: int = DEFAULT_MAX_PENDING, budget: float = DEFAULT_BUDGET,
                 sample_every: int | None = None, clock: Callable[[], int] = perf_counter_ns,
                 seed: int | None = None) -> None:
        """sample_every fixes k (1 = every step) instead of choosing it from measurement."""
        self.cuda = cuda
        self.max_pending = max_pending
        self.budget = budget
        self.sample_every = sample_every or 1
        self.adaptive = sample_every is None
        self.sampling = True  # whether phases of the current step record events
        self._clock = clock
        self._rng = random.Random(seed)
        self._stream = _CurrentStream(cuda)
        self._countdown = 1
        self._pending: deque[_Pair] = deque()
        self._free: dict[int, list[Any]] = {}  # device index -> reusable events (an event stays on its device)
        self._failed_pairs = 0
        self._last: _Pair | None = None  # the latest pair, while a next phase may share its end
        self._last_end_ns = 0
        self._last_stream: Any = None
        self._window_sampled = self._spent_ns = 0
        self._window_steps_ns: list[int] = []  # durations of the window's steps

    # -- the phase hot path -----------------------------------------------------------------------

    def start(self) -> Any:
        """The start event of a timed phase: the previous phase's end when adjacent, else a new one."""
        began = self._clock()
        stream = self._stream.get()
        last = self._last
        if last is not None and began - self._last_end_ns <= SHARED_BOUNDARY_NS and stream == self._last_stream:
            last.end_shared = True
            self._last = None  # one phase starts at a boundary
            event = last.end
        else:
            event = self._record(stream)
        self._spent_ns += self._clock() - began
        return event

    def end(self, hist: Histogram, start: Any, weight: int) -> None:
        """Records the end event and queues the pair; resolves early if the queue grew long."""
        began = self._clock()
        stream = self._stream.get()
        pair = _Pair(hist, start, self._record(stream), weight)
        self._pending.append(pair)
        self._last, self._last_stream = pair, stream
        if len(self._pending) > OPPORTUNISTIC_RESOLVE:
            self._resolve(block=len(self._pending) > self.max_pending)
        self._last_end_ns = self._clock()
        self._spent_ns += self._last_end_ns - began

    def step_done(self, step_ns: int) -> None:
        """At a step boundary: resolve what completed, choose whether the next step is timed."""
        self._last = None  # boundaries are not shared across steps
        if self._pending:
            began = self._clock()
            self._resolve(block=False)
            self._spent_ns += self._clock() - began
        self._window_sampled += self.sampling
        self._window_steps_ns.append(step_ns)
        if self.adaptive and len(self._window_steps_ns) >= max(MIN_WINDOW_STEPS, 8 * self.sample_every):
            self._choose_sample_every()
        self._countdown -= 1
        self.sampling = self._countdown <= 0
        if self.sampling:
            self._countdown = self._rng.randint(1, 2 * self.sample_every - 1)  # mean k

    # -- resolution -------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._pending)

    def resolve(self, block: bool = False) -> int:
        """Moves completed pairs into their histograms (all of them when block); returns how many."""
        return self._resolve(block)

    def _resolve(self, block: bool) -> int:
        done = 0
        pending = self._pending
        while pending:
            pair = pending[0]
            if block:
                pair.end.synchronize()
                pair.start.synchronize()
            elif not (pair.end.query() and pair.start.query()):  # a phase may end on another stream
                break
            pending.popleft()
            if pair is self._last:
                self._last = None  # its end goes back to the pool: nothing may start at it now
            self._observe(pair)
            self._release(pair.start)  # the pair that ended at it, if any, resolved before
            if not pair.end_shared:
                self._release(pair.end)
            done += 1
        return done

    def _observe(self, pair: _Pair) -> None:
        try:
            elapsed_ms = pair.start.elapsed_time(pair.end)
        except RuntimeError as exc:  # e.g. a phase that began on one device and ended on another
            self._failed_pairs += 1
            if self._failed_pairs == 1:
                log.warning("stepscope: a CUDA-timed phase could not be timed and is left out (%s)", exc)
            return
        _observe(pair.hist, max(0, round(elapsed_ms * 1e6)), pair.weight)

    def _release(self, event: Any) -> None:
        self._free.setdefault(event.stepscope_device, []).append(event)

    def _record(self, stream: Any) -> Any:
        device = getattr(stream, "device_index", 0)
        free = self._free.get(device)
        if free:
            event = free.pop()
        else:
            event = self.cuda.Event(enable_timing=True)
            event.stepscope_device = device  # CUDA binds an event to the device it is first recorded on
        event.record(stream)
        return event

    def _choose_sample_every(self) -> None:
        """k for the next window, from the median step: a pause (eval, a checkpoint) does not lower it."""
        steps = sorted(self._window_steps_ns)
        if self._window_sampled:
            self.sample_every = choose_sample_every(
                self._spent_ns / self._window_sampled, steps[len(steps) // 2], self.budget)
        self._window_sampled = self._spent_ns = 0
        self._window_steps_ns = []


def _observe(hist: Histogram, duration_ns: int, weight: int) -> None:
    """Histogram.observe_ns counting `weight` occurrences of the same duration."""
    hist.counts[bisect_left(hist.bounds_ns, duration_ns)] += weight
    hist.sum_ns += duration_ns * weight


class CudaPhase:
    """`with phase:` times GPU work on the current stream with events, on the steps the timer samples."""

    __slots__ = ("_hist", "_start_event", "_timer", "_untimed", "name")

    def __init__(self, name: str, hist: Histogram, timer: CudaTimer) -> None:
        self.name = name
        self._hist = hist
        self._timer = timer
        self._start_event: Any = None
        self._untimed = 0  # occurrences since the last timed one, this one included

    def __enter__(self) -> CudaPhase:
        self._untimed += 1
        timer = self._timer
        self._start_event = timer.start() if timer.sampling else None
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._start_event is not None:
            self._timer.end(self._hist, self._start_event, self._untimed)
            self._start_event = None
            self._untimed = 0

    @property
    def is_open(self) -> bool:
        """Entered on a timed step and not yet left (an untimed occurrence's end does nothing anyway)."""
        return self._start_event is not None

    def start(self) -> None:
        self.__enter__()

    def end(self) -> None:
        self.__exit__(None, None, None)

    def leave(self) -> None:
        """Leaves the phase without timing it (Tracker.close): its start event is dropped."""
        self._start_event = None


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
        if not self._start:  # not open (see HostPhase): nothing to observe
            return
        self._cuda.synchronize()
        self._hist.observe_ns(perf_counter_ns() - self._start)
        self._start = 0  # left (see HostPhase)

    @property
    def is_open(self) -> bool:
        return self._start != 0

    def start(self) -> None:
        self.__enter__()

    def end(self) -> None:
        self.__exit__(None, None, None)

    def leave(self) -> None:
        self._start = 0  # left without observing (see HostPhase.leave)

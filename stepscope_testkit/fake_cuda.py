"""A stand-in for the part of `torch.cuda` the training hooks call: a simulated GPU with per-call costs.

Host cost per call, measured on an H100 80GB HBM3 with torch 2.11 + CUDA 13 (issue 9), in µs:
`Event.record()` 9.2 when it looks the current stream up itself, of which `current_stream()` is 4.1
(so 5.1 given a stream), `query()` 0.3, `elapsed_time()` 1.1, a new `Event` 0.8. Not measured there,
so assumed: the raw stream lookup (`torch._C._cuda_getCurrentRawStream` + `_cuda_getDevice`, two C
calls returning ints) 0.3, `synchronize()` 5 plus the wait.

    cuda = FakeCuda(spend=True)    # costs are spent as CPU work on the calling thread (benchmarks)
    cuda = FakeCuda(spend=False)   # costs advance a virtual host clock, `cuda.clock()` (tests)

Spent costs are a spin loop calibrated in thread CPU time, so they cost the same CPU on a busy
machine (where a busy wait on the wall clock would stretch with every preemption).

The GPUs: `launch(seconds)` queues that much GPU work on the current stream of the current device
(`device(i)` switches, as `torch.cuda.device` does); it starts when the stream's earlier work ends, or
now if the stream is idle. An event recorded on a stream completes when the work queued before it is
done; `elapsed_time` is the GPU time between two events, in ms. As in CUDA, an event belongs to the
device it was first recorded on: recording it on another device's stream, or timing two events of
different devices, raises RuntimeError.
`calls` counts every API call by name, so tests can check what the hot path asks for.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Iterator
from functools import cache
from time import perf_counter_ns, thread_time_ns

COSTS_US = {
    "Event.record": 5.1,
    "current_stream": 4.1,
    "Event.query": 0.3,
    "Event.elapsed_time": 1.1,
    "Event": 0.8,
    "_cuda_getDevice": 0.15,  # assumed (see the module docstring)
    "_cuda_getCurrentRawStream": 0.15,  # assumed
    "synchronize": 5.0,  # assumed, before the wait
    "Event.synchronize": 5.0,  # assumed, before the wait
}


class _StreamState:
    """One CUDA stream of a simulated GPU: when its queued work ends, in host nanoseconds."""

    def __init__(self, stream_id: int, device: int) -> None:
        self.stream_id = stream_id
        self.device = device
        self.busy_until_ns = 0


class FakeStream:
    """What `current_stream()` returns: a new wrapper per call, equal when the stream is the same."""

    def __init__(self, state: _StreamState) -> None:
        self.state = state
        self.cuda_stream = state.stream_id
        self.device_index = state.device

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.state is self.state

    def __hash__(self) -> int:
        return self.state.stream_id


class FakeEvent:
    """torch.cuda.Event's timing subset; `done_ns` is when the GPU reaches it (None until recorded)."""

    def __init__(self, cuda: FakeCuda, enable_timing: bool = False) -> None:
        if not enable_timing:
            raise ValueError("the hooks must ask for timing events")
        cuda.spend("Event")
        self._cuda = cuda
        self.done_ns: int | None = None
        self.device: int | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        cuda = self._cuda
        if stream is None:
            stream = cuda.current_stream()
        cuda.spend("Event.record")
        if self.device is not None and self.device != stream.device_index:
            raise RuntimeError("Event device does not match recording stream's device")
        self.device = stream.device_index
        self.done_ns = max(stream.state.busy_until_ns, cuda.clock())

    def query(self) -> bool:
        self._cuda.spend("Event.query")
        if self.done_ns is None:
            return True  # torch: an event never recorded has nothing to wait for
        return self.done_ns <= self._cuda.clock()

    def synchronize(self) -> None:
        self._cuda.spend("Event.synchronize")
        if self.done_ns is not None:
            self._cuda.wait_until(self.done_ns)

    def elapsed_time(self, end: FakeEvent) -> float:
        self._cuda.spend("Event.elapsed_time")
        if self.done_ns is None or end.done_ns is None or max(self.done_ns, end.done_ns) > self._cuda.clock():
            raise RuntimeError("elapsed_time needs two completed events (torch raises too)")
        if self.device != end.device:
            raise RuntimeError("Both events must be recorded on the same device")
        return (end.done_ns - self.done_ns) / 1e6


class FakeAllocator:
    """PyTorch's caching allocator on one device, as `torch.cuda.memory_stats()` reports it.

    Enough of its behaviour for what the hooks read: `allocate` takes the first cached block large
    enough (what is left of it stays cached) or reserves new memory in 2 MiB segments; freed blocks
    stay cached. A request that fits no cached block and would pass the device's `capacity` frees the
    cache and retries (`num_alloc_retries`), then raises out of memory (`num_ooms`). All cached bytes
    count as inactive split bytes.
    """

    SEGMENT = 2 * 1024 * 1024

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.allocated = self.reserved = self.peak = 0
        self.allocations = self.retries = self.ooms = 0
        self.cached: list[int] = []  # sizes of the cached (free) blocks

    def allocate(self, nbytes: int) -> int:
        """Allocates `nbytes`; returns the block to `free`."""
        self.allocations += 1
        fit = next((block for block in self.cached if block >= nbytes), None)
        if fit is not None:
            self.cached.remove(fit)
            if fit > nbytes:
                self.cached.append(fit - nbytes)
        else:
            self._reserve(nbytes)
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        return nbytes

    def _reserve(self, nbytes: int) -> None:
        grow = -(-nbytes // self.SEGMENT) * self.SEGMENT
        if self.reserved + grow > self.capacity:
            self.retries += 1
            self.reserved -= sum(self.cached)  # empty the cache, then try again
            self.cached.clear()
            if self.reserved + grow > self.capacity:
                self.ooms += 1
                raise RuntimeError("CUDA out of memory (fake allocator)")
        self.reserved += grow
        if grow > nbytes:
            self.cached.append(grow - nbytes)

    def free(self, block: int) -> None:
        self.allocated -= block
        self.cached.append(block)  # the bytes stay reserved: cached for reuse

    def stats(self) -> dict[str, int]:
        return {"allocation.all.allocated": self.allocations, "allocated_bytes.all.current": self.allocated,
                "allocated_bytes.all.peak": self.peak, "reserved_bytes.all.current": self.reserved,
                "inactive_split_bytes.all.current": sum(self.cached),
                "num_alloc_retries": self.retries, "num_ooms": self.ooms}


class FakeCuda:
    """The `torch.cuda` subset: Event, current_stream, stream, Stream, synchronize, is_available, and the
    allocator's memory_stats / reset_peak_memory_stats (a FakeAllocator per device)."""

    def __init__(self, spend: bool = False, costs_us: dict[str, float] | None = None,
                 raw_stream_lookup: bool = True, devices: int = 1, device_memory: int = 80 * 2**30) -> None:
        self.spending = spend
        self.costs_ns = {name: round(us * 1000) for name, us in {**COSTS_US, **(costs_us or {})}.items()}
        self.calls: Counter[str] = Counter()
        self._virtual_ns = 0
        self._ids = itertools.count(1)
        self._device = 0
        self._current = {0: _StreamState(next(self._ids), 0)}  # device -> its current stream
        self._streams = [self._current[0]]
        self.allocators = [FakeAllocator(device_memory) for _ in range(devices)]
        if not raw_stream_lookup:  # an older torch: the hooks must fall back to current_stream()
            self._cuda_getDevice = None  # type: ignore[method-assign]
            self._cuda_getCurrentRawStream = None  # type: ignore[method-assign]

    # -- clocks -------------------------------------------------------------------------------------

    def clock(self) -> int:
        """Host time in ns: real (perf_counter_ns) when spending, virtual otherwise."""
        return perf_counter_ns() if self.spending else self._virtual_ns

    def advance(self, seconds: float) -> None:
        """Host work: virtual time passes, or that much CPU is spent, like host code in a step."""
        self._work(round(seconds * 1e9))

    def spend(self, what: str) -> None:
        self.calls[what] += 1
        self._work(self.costs_ns.get(what, 0))

    def wait_until(self, when_ns: int) -> None:
        """Waiting for the GPU: virtual time passes, or the wall clock (a spin, as CUDA's default)."""
        if not self.spending:
            self._virtual_ns = max(self._virtual_ns, when_ns)
            return
        while perf_counter_ns() < when_ns:
            pass

    def _work(self, ns: int) -> None:
        if ns <= 0:
            return
        if not self.spending:
            self._virtual_ns += ns
            return
        for _ in range(round(ns / _spin_ns())):
            pass

    # -- the simulated GPU --------------------------------------------------------------------------

    def launch(self, seconds: float) -> None:
        """Queues `seconds` of GPU work on the current stream (costs the host nothing here)."""
        state = self._current_state()
        state.busy_until_ns = max(state.busy_until_ns, self.clock()) + round(seconds * 1e9)

    def gpu_idle_at(self) -> int:
        return max(state.busy_until_ns for state in self._streams)

    # -- the torch.cuda API -------------------------------------------------------------------------

    def Event(self, enable_timing: bool = False) -> FakeEvent:
        return FakeEvent(self, enable_timing)

    def Stream(self) -> FakeStream:
        state = _StreamState(next(self._ids), self._device)
        self._streams.append(state)
        return FakeStream(state)

    def current_stream(self) -> FakeStream:
        self.spend("current_stream")
        return FakeStream(self._current_state())

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        device = stream.device_index
        previous, self._current[device] = self._current_state(device), stream.state
        try:
            with self.device(device):
                yield
        finally:
            self._current[device] = previous

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        previous, self._device = self._device, index
        try:
            yield
        finally:
            self._device = previous

    def _current_state(self, device: int | None = None) -> _StreamState:
        device = self._device if device is None else device
        if device not in self._current:
            self._current[device] = _StreamState(next(self._ids), device)
            self._streams.append(self._current[device])
        return self._current[device]

    def synchronize(self) -> None:
        self.spend("synchronize")
        self.wait_until(self.gpu_idle_at())

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.allocators)

    def memory_stats(self, device: int) -> dict[str, int]:
        return self.allocators[device].stats()

    def reset_peak_memory_stats(self, device: int) -> None:
        allocator = self.allocators[device]
        allocator.peak = allocator.allocated

    # torch keeps these in torch._C; the hooks look for them on a stand-in itself
    def _cuda_getDevice(self) -> int:
        self.spend("_cuda_getDevice")
        return self._device

    def _cuda_getCurrentRawStream(self, device: int) -> int:
        self.spend("_cuda_getCurrentRawStream")
        return self._current_state(device).stream_id


@cache
def _spin_ns() -> float:
    """Thread CPU nanoseconds one iteration of `for _ in range(n): pass` takes here (over 50 ms)."""
    iterations = 2_000_000
    for _ in range(3):
        started = thread_time_ns()
        for _ in range(iterations):
            pass
        spent = thread_time_ns() - started
        if spent > 50_000_000:
            break
        iterations *= 2
    return spent / iterations

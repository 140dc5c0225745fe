"""The loader and compute limits of a run: the seeds' mock-component measurement.

- Loader limit: samples per second drawing batches from the real loader and discarding them
  (training mocked out).
- Compute limit: samples per second running the training step again and again on one cached batch
  already on the device (the loader mocked out), synchronized at the end so queued GPU work counts.

The loader must deliver more samples per second than training consumes: when its limit is below the
compute limit, the run can never go faster than the loader, whatever the GPU. The rules compare both
with the run's real samples per second. Never imports torch: the tracker passes `torch.cuda` when the
process uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from time import perf_counter
from typing import Any

DEFAULT_WARMUP_STEPS = 3


@dataclass(frozen=True)
class Limits:
    loader_samples_per_second: float
    compute_samples_per_second: float
    samples_per_batch: int  # of the cached batch the compute limit ran on
    loader_batches: int  # batches timed
    compute_batches: int

    @property
    def loader_bound(self) -> bool:
        return self.loader_samples_per_second < self.compute_samples_per_second

    def __str__(self) -> str:
        verdict = ("the loader is the limit: more workers, pinned memory, pre-decoded or cached data, sequential "
                   "reads" if self.loader_bound else "the loader keeps up: the training step is the limit")
        return (f"the loader can deliver {self.loader_samples_per_second:.1f} samples/s; training consumes "
                f"{self.compute_samples_per_second:.1f} samples/s; {verdict}")


def samples_in(batch: Any) -> int | None:
    """The number of samples in a batch: the first dimension of its first tensor (searching tuples,
    lists and mappings), or the length of a flat list; None when neither exists."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else None
    values: Iterable[Any]
    if isinstance(batch, Mapping):
        values = batch.values()
    elif isinstance(batch, (list, tuple)):
        values = batch
    else:
        return None
    for value in values:
        found = samples_in(value)
        if found is not None:
            return found
    return len(batch) if isinstance(batch, list) and batch else None


def to_device(batch: Any, device: Any) -> Any:
    """The batch with every tensor in it (nested in tuples, lists and dicts) moved to `device`."""
    if hasattr(batch, "to") and hasattr(batch, "shape"):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({key: to_device(value, device) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def prefetched_batches(loader: Any) -> int:
    """Batches a torch DataLoader's workers prepare ahead (0 for other iterables)."""
    workers = getattr(loader, "num_workers", 0)
    if not isinstance(workers, int) or workers <= 0:
        return 0
    factor = getattr(loader, "prefetch_factor", None)
    return workers * (factor if isinstance(factor, int) and factor > 0 else 2)


def measure(
    loader: Iterable[Any], train_step: Callable[[Any], object], batches: int, *,
    warmup_steps: int = DEFAULT_WARMUP_STEPS, device: Any = None, samples_per_batch: int | None = None,
    cuda: Any = None,
) -> Limits:
    """Both limits; ValueError with a clear message on bad arguments or a loader that runs dry.

    The loader is timed from its first batch after the ones its workers prefetched (worker start-up
    and the prefetch queue would flatter it) until the last of `batches` more, as samples over the
    time between arrivals. The first batch is the cached one: moved to `device` once when given, then
    `train_step(batch)` runs `warmup_steps` times untimed (lazy initialisation, autotuning,
    compilation) and `batches` times timed. `cuda` (torch.cuda, when the process uses it) is
    synchronized before and after the timed steps.
    """
    if not isinstance(batches, int) or isinstance(batches, bool) or batches < 2:
        raise ValueError(f"batches must be an integer >= 2, got {batches!r}")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    if samples_per_batch is not None and (not isinstance(samples_per_batch, int) or samples_per_batch < 1):
        raise ValueError(f"samples_per_batch must be an integer >= 1, got {samples_per_batch!r}")
    if not callable(train_step):
        raise ValueError(f"train_step must be callable (it gets one batch), got {train_step!r}")
    first, loader_rate, timed = _loader_rate(loader, batches, samples_per_batch)
    size = samples_per_batch or samples_in(first)
    if size is None:
        raise ValueError(f"cannot tell how many samples a {type(first).__name__} batch holds: pass samples_per_batch=")
    compute_rate = _compute_rate(to_device(first, device) if device is not None else first, train_step, batches,
                                 warmup_steps, size, cuda)
    return Limits(loader_rate, compute_rate, size, timed, batches)


def _loader_rate(loader: Iterable[Any], batches: int, samples_per_batch: int | None) -> tuple[Any, float, int]:
    """(the first batch, samples per second, batches timed)."""
    iterator = _fresh_iterator(loader)
    skipped: list[Any] = []
    for _ in range(1 + prefetched_batches(loader)):
        skipped.append(_next(iterator, len(skipped), batches))
    first = skipped[0]
    _next(iterator, len(skipped), batches)  # the clock starts at this arrival
    start = perf_counter()
    samples = 0
    for drawn in range(batches):
        batch = _next(iterator, len(skipped) + 1 + drawn, batches)
        found = samples_per_batch or samples_in(batch)
        if found is None:
            raise ValueError(f"cannot tell how many samples a {type(batch).__name__} batch holds: pass "
                             "samples_per_batch=")
        samples += found
    elapsed = max(perf_counter() - start, 1e-9)
    return first, samples / elapsed, batches


def _fresh_iterator(loader: Iterable[Any]) -> Iterator[Any]:
    """An iterator of `loader` of the measure's own, which leaves any other iterator of it as it is.

    A DataLoader with persistent workers hands every `iter()` its one iterator, reset to a new epoch: measured at a
    checkpoint mid-epoch, the training loop's iterator was reset and drained by the measure, and the loop then went on
    from where the measure left it (10 batches an epoch: the loop got 4, 24 of 40 samples never trained). Its own
    iterator starts workers of its own, shut down when the measure drops it.
    """
    live = getattr(loader, "_iterator", None) is not None and getattr(loader, "persistent_workers", False) is True
    make = getattr(loader, "_get_iterator", None)
    return make() if live and callable(make) else iter(loader)


def _next(iterator: Any, drawn: int, batches: int) -> Any:
    try:
        return next(iterator)
    except StopIteration:
        raise ValueError(f"the loader ran dry after {drawn} batches; measuring needs {batches} plus the ones its "
                         "workers prefetch and two more: lower batches=") from None


def _compute_rate(batch: Any, train_step: Callable[[Any], object], batches: int, warmup_steps: int, size: int,
                  cuda: Any) -> float:
    for _ in range(warmup_steps):
        train_step(batch)
    _synchronize(cuda)
    start = perf_counter()
    for _ in range(batches):
        train_step(batch)
    _synchronize(cuda)
    elapsed = max(perf_counter() - start, 1e-9)
    return batches * size / elapsed


def _synchronize(cuda: Any) -> None:
    if cuda is not None and cuda.is_initialized():
        cuda.synchronize()

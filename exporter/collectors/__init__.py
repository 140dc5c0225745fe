"""Collectors read hardware on the scheduler's timer; each one module, one job, no HTTP."""

from collections.abc import Iterable
from typing import Protocol

from stepscope.exporter.metric_families import Metric


class Collector(Protocol):
    """What the scheduler runs: `collect` returns complete families; raising marks the cycle failed. A collector
    that publishes a cycle with a reading left out may say what in an attribute `failed_reading` ("" when
    nothing is): the scheduler counts that cycle as an error and still as a success, its readings being fresh.
    One that reads what another collects may name it in an attribute `first_after` (a tuple of names): its
    first cycle then waits for theirs, at most one interval."""

    name: str

    def collect(self) -> Iterable[Metric]: ...

    def close(self) -> None: ...

"""One set of step-time bounds for every rank of a run, agreed through the run's torch.distributed store.

Each rank places fine buckets where its own steps fall (stepscope.hooks.timing), so ranks whose steps
differ, even by chance (a lognormal spread, a rank a few per cent slower), export different `le`. A run's
histogram is the ranks' buckets summed per bound, and a bound only some ranks export lacks the others'
counts: the sum dips there. Prometheus' histogram_quantile raises a dip to the bound below and
VictoriaMetrics lowers the bounds below to the dip; neither is the run's quantile when the ranks' steps
differ (measured: two groups of ranks 3x apart read p50 -56% on Prometheus, +22% on VictoriaMetrics;
ranks a few per cent apart read +236% on VictoriaMetrics). Every rank counts on the whole fine grid and
can export exact counts at any bound of it, so the fix is agreement: each rank publishes the blocks it
wants, reads what the others want, and exports all of it (stepscope.hooks.timing.FollowingLayout).

The store is the one torch.distributed already has (the default process group's, reached without a
collective), under the prefix `stepscope/<run>/`: `count/<histogram>/<block>` counts the ranks that want
a block (each rank adds 1 when it starts wanting one, -1 when it stops), `keys` lists the counters, and
`version` counts changes. A round reads one counter when nothing changed, and every counter (a few
hundred at most, whatever the run's size) when something did: each rank reading every other rank's
blocks would move 1.3 MB per rank and round at 2,048 ranks (benchmarks/bench_run_bounds.py). A rank
that dies keeps its blocks wanted. Store calls run in a thread of their own: a store busy with the
trainer's own waits (barriers, NCCL set-up) delays the agreement, never a push or a step. Any store
error turns the agreement off for the process, with one warning.

Ranks without a store (no process group, or its store failed) agree through the exporter of their node
instead (stepscope.exporter.ingest.node_bounds): each push carries the rank's wanted blocks (`headers`) and
its answer the counts of the run's ranks pushing there (`on_answer`). Ranks of one node then export the
same bounds; ranks on different nodes still export their own (docs/engines.md), and so do ranks pushing
to a Pushgateway, which answers no counts.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from stepscope.contract import json_text

log = logging.getLogger("stepscope.hooks")

STEP_HISTOGRAM = "step"  # phases are keyed "phase:<name>", so a phase named "step" cannot collide
# The exporter's side channel (stepscope.exporter.ingest.node_bounds): this rank's blocks out, the run's in.
BOUNDS_HEADER = "Stepscope-Bounds"
RUN_BOUNDS_HEADER = "Stepscope-Run-Bounds"


class Store(Protocol):
    """The part of torch.distributed.Store the agreement uses: calls that never wait for a key."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def append(self, key: str, value: str) -> None: ...
    def check(self, keys: list[str]) -> bool: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...


def run_store(run: str, given: object | None = None) -> Callable[[], Store | None]:
    """The run's prefix of `given` (a torch.distributed Store the run's ranks share), or else of
    torch.distributed's default store once a process group is initialized (None before, and without
    torch.distributed, for which nothing is imported)."""

    def connect() -> Store | None:
        dist: Any = sys.modules.get("torch.distributed")
        if dist is None or getattr(dist.__spec__, "_initializing", False):
            return None  # not imported, or being imported by the training thread right now
        if given is None and not (dist.is_available() and dist.is_initialized()):
            return None
        store = given if given is not None else dist.distributed_c10d._get_default_store()
        return dist.PrefixStore(f"stepscope/{run}", store)  # keys stepscope/<run>/...

    return connect


class RunBounds:
    """This rank's wanted blocks per histogram, published to the run's store, and the run's, read back.

    `publish` and `wanted` are what the layouts call (in the pusher thread): they touch only memory.
    `exchange` does one round with the store; `start` runs it every `interval` seconds in a daemon thread.
    `headers` and `on_answer` are the pusher's, for the exporter's counts while no store is connected.
    """

    def __init__(self, connect: Callable[[], Store | None], interval: float) -> None:
        self._connect = connect
        self._interval = interval
        self._store: Store | None = None
        self._own: dict[str, list[int]] = {}
        self._published: dict[str, list[int]] | None = None
        self._seen_version = -1
        # The run's wanted blocks as last read, and this rank's part of them (what it had published then),
        # swapped together: `wanted` takes this rank's part out and its blocks of now in.
        self._view: tuple[dict[str, Counter[int]], dict[str, list[int]]] = ({}, {})
        self._lock = threading.Lock()  # one round at a time (the thread, or a caller's exchange)
        self._failed = False
        self._sent: dict[str, list[int]] = {}  # this rank's blocks as the last push's headers gave them
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self, histogram: str, blocks: frozenset[int]) -> None:
        """Records the blocks this rank wants for `histogram`; the next round sends them."""
        self._own = {**self._own, histogram: sorted(blocks)}  # a new dict: the round reads a consistent one

    def wanted(self, histogram: str) -> Mapping[int, int]:
        """Block -> how many ranks of the run want it: the others' as of the last round, this rank's as of
        its last `publish` (so a rank's new blocks are its own at once, and the others' a round later)."""
        run, mine = self._view
        counts = Counter(run.get(histogram, ()))
        counts.subtract(mine.get(histogram, ()))
        counts.update(self._own.get(histogram, ()))
        return +counts

    def exchange(self) -> None:
        """One round: publish this rank's blocks if they changed, read the run's if anyone published since."""
        with self._lock:
            if self._failed:
                return
            try:
                self._round()
            except Exception as exc:  # any store failure: fall back to the exporter's answers (headers)
                self._failed = True
                self._view = ({}, {})
                log.warning("stepscope: cannot share step-time bounds through torch.distributed's store (%r); "
                            "this rank now agrees only with the run's ranks that push to its exporter, and the "
                            "run's quantiles may read off where ranks elsewhere differ (docs/engines.md)", exc)

    def headers(self) -> dict[str, str]:
        """This rank's blocks for the next push, while the run's store is not connected (none connected yet, or
        it failed): the exporter answers the counts of the run's ranks on its node."""
        if self._store is not None and not self._failed:
            return {}
        self._sent = own = self._own  # sent even while empty: the answer brings the others' blocks at once
        return {BOUNDS_HEADER: json.dumps(own, separators=(",", ":"))}

    def on_answer(self, headers: Mapping[str, str]) -> None:
        """Takes the counts a push's answer carries (none from a Pushgateway, or while the store serves)."""
        raw = headers.get(RUN_BOUNDS_HEADER)
        if not raw or (self._store is not None and not self._failed):
            return
        try:
            run = {name: Counter({int(block): int(count) for block, count in blocks.items()})
                   for name, blocks in json_text.loads(raw).items()}
        except (ValueError, TypeError, AttributeError):
            log.debug("stepscope: ignoring an unreadable %s header: %.80r", RUN_BOUNDS_HEADER, raw)
            return
        self._view = (run, self._sent)

    def _round(self) -> None:
        if self._store is None:
            self._store = self._connect()
            if self._store is None:
                return
        own = self._own
        if own and own != self._published:
            self._count_changes(self._store, self._published or {}, own)
            self._store.add("version", 1)
            self._published = own
        if self._published is None:
            return  # nothing of ours out yet: "keys" may not exist, and reading it would wait for it
        version = self._store.add("version", 0)
        if version != self._seen_version:
            self._view = (self._read_run(self._store), self._published)
            self._seen_version = version

    @staticmethod
    def _count_changes(store: Store, before: Mapping[str, list[int]], now: Mapping[str, list[int]]) -> None:
        """Adds 1 to the counter of each block this rank wants now and did not, -1 to each it no longer
        wants; a counter that this makes 1 goes into `keys` (after it exists: a reader never waits)."""
        for histogram in now.keys() | before.keys():
            wanted, had = set(now.get(histogram, ())), set(before.get(histogram, ()))
            for block, change in [*((b, 1) for b in wanted - had), *((b, -1) for b in had - wanted)]:
                key = f"{histogram}/{block}"
                if store.add(f"count/{key}", change) == 1 and change == 1:
                    store.append("keys", f"{key},")

    @staticmethod
    def _read_run(store: Store) -> dict[str, Counter[int]]:
        if not store.check(["keys"]):  # no rank wants a block yet (a get would wait for the key)
            return {}
        keys = sorted({key for key in store.get("keys").decode().split(",") if key})
        run: dict[str, Counter[int]] = {}
        for key, value in zip(keys, store.multi_get([f"count/{key}" for key in keys]), strict=True):
            histogram, block = key.rsplit("/", 1)
            if int(value) > 0:
                run.setdefault(histogram, Counter())[int(block)] = int(value)
        return run

    def start(self) -> None:
        """Starts the thread; again after stop() (a reopened tracker), with a stop event of its own, so that the
        stopped thread, still waiting on its event, ends."""
        if self._thread is None or self._stop.is_set():
            self._stop = stop = threading.Event()
            self._thread = threading.Thread(target=self._loop, args=(stop,), name="stepscope-run-bounds", daemon=True)
            self._thread.start()

    def _loop(self, stop: threading.Event) -> None:
        while not stop.wait(self._interval):
            self.exchange()

    def stop(self) -> None:
        self._stop.set()

    def histogram(self, name: str) -> SharedHistogram:
        """The agreement on one histogram, for its FollowingLayout."""
        return SharedHistogram(self, name)


class SharedHistogram:
    """One histogram's view of the run's agreement (stepscope.hooks.timing.RunBlocks)."""

    def __init__(self, bounds: RunBounds, name: str) -> None:
        self._bounds = bounds
        self._name = name

    def publish(self, blocks: frozenset[int]) -> None:
        self._bounds.publish(self._name, blocks)

    def wanted(self) -> Mapping[int, int]:
        return self._bounds.wanted(self._name)

"""Runs every collector on its own timer thread and publishes rendered results.

One thread per collector: a wedged NVML call stalls the GPU families only, and scrapes keep serving the last good
snapshot of everything else. Not of the wedged collector's own: a cycle under way for STALE_CYCLES intervals (at
least MIN_STALE_SECONDS) has its families left out of /metrics until it returns (a watchdog thread checks once an
interval), where before a GPU whose NVML call hung stayed `gpu_up 1` at 98% busy and 61 °C for as long as the
call did, while it read 0% and 95 °C. Each source re-renders only the families that changed since its last cycle
and is published only when its text changed, so an idle node costs little more than the readings themselves. The
self metrics (collector durations, errors, last success) change every cycle of every collector but are rendered
only when a scrape after a cycle asks for them; the exporter's CPU by part is read once an interval, on a
collector's thread.
"""

import logging
import platform
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from stepscope.contract import families
from stepscope.contract.scrape_gaps import SETTLE_SECONDS
from stepscope.exporter import __version__
from stepscope.exporter.collectors import Collector
from stepscope.exporter.exposition import CachedRenderer, Chunk, ExpositionStore
from stepscope.exporter.metric_families import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from stepscope.exporter.thread_cpu import CpuByPart, collector_thread_name

log = logging.getLogger(__name__)
STALE_CYCLES = 3  # as the GPU's slow readings, which go absent when older than three of their intervals
# ... and at least this long: at a short --collect-interval (1 s) a first cycle that walks a big node's process
# table, or a kubelet List, may take seconds and is no hung call; left out, its series would gap at each one
MIN_STALE_SECONDS = 10.0


@dataclass
class _CollectorStats:
    duration_seconds: float = 0.0
    errors: int = 0
    last_success: float = 0.0
    cycles: int = 0
    last_error: str = ""
    cycle_started: float | None = None  # monotonic, while a cycle is under way
    left_out: bool = False  # its families are out of /metrics: its cycle ran past STALE_CYCLES intervals


class Scheduler:
    """Collects on a fixed interval and keeps the exporter's self metrics current."""

    def __init__(self, collectors: list[Collector], interval: float, store: ExpositionStore) -> None:
        self._collectors = collectors
        self._interval = interval
        self._store = store
        self._stats = {c.name: _CollectorStats() for c in collectors}
        self._first_cycle = {c.name: threading.Event() for c in collectors}  # set at each one's first cycle's end
        self._renderers = {c.name: CachedRenderer() for c in collectors}
        self._self_renderer = CachedRenderer()
        self._self_lock = threading.Lock()  # the renderer serves one scrape at a time
        self._stats_lock = threading.Lock()
        self._publish_lock = threading.Lock()  # a cycle's end and the watchdog publish a collector's body in turn
        self._stats_version = 0  # counts changes of the stats, for the store's cache of this source
        self._cpu_by_part = CpuByPart()
        self._cpu: dict[str, float] = {}  # part -> CPU seconds, read once an interval
        self._cpu_read = float("-inf")
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = time.time()  # before the first scrape can be served
        store.attach("stepscope_exporter", self)

    def start(self) -> None:
        """One thread per collector, each on its own phase of the interval (`_loop`)."""
        for slot, collector in enumerate(self._collectors):
            phase = self._interval * slot / len(self._collectors)
            thread = threading.Thread(
                target=self._loop, args=(collector, phase), name=collector_thread_name(collector.name), daemon=True
            )
            thread.start()
            self._threads.append(thread)
        watchdog = threading.Thread(target=self._watch, name=collector_thread_name("watchdog"), daemon=True)
        watchdog.start()
        self._threads.append(watchdog)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2)
        for collector in self._collectors:
            try:
                collector.close()
            except Exception:  # closing is best effort at shutdown
                log.debug("closing collector %s failed", collector.name, exc_info=True)

    def ready(self) -> bool:
        """True once every collector finished one cycle, successful or not."""
        with self._stats_lock:
            return all(s.cycles > 0 for s in self._stats.values())

    def run_once(self, collector: Collector) -> None:
        started = time.perf_counter()
        with self._stats_lock:
            self._stats[collector.name].cycle_started = time.monotonic()
        renderer = self._renderers[collector.name]
        try:
            body, changed = renderer.render(list(collector.collect()))
            error = ""
        except Exception as exc:
            (body, changed), error = renderer.render([]), f"{type(exc).__name__}: {exc}"
        left_out = "" if error else getattr(collector, "failed_reading", "")  # the collector logged it
        duration = time.perf_counter() - started
        with self._publish_lock:  # not under _stats_lock: a scrape holds the store's lock, then takes that one
            with self._stats_lock:
                stats = self._stats[collector.name]
                stats.cycle_started = None
                returned, stats.left_out = stats.left_out, False
            if changed or returned:
                self._store.publish(collector.name, body)
        if returned and not self._stop.is_set():  # a cycle that a shutdown's close() ended returns to nobody
            log.warning("collector %s returned after %.1f s; its readings are published again", collector.name,
                        duration)
        self._first_cycle[collector.name].set()
        self._read_cpu(started)
        with self._stats_lock:
            stats = self._stats[collector.name]
            stats.duration_seconds = duration
            stats.cycles += 1
            if error or left_out:
                stats.errors += 1
            if error:
                if error != stats.last_error:
                    log.error("collector %s failed: %s", collector.name, error)
            else:
                stats.last_success = time.time()
                if stats.last_error:
                    log.info("collector %s recovered", collector.name)
            stats.last_error = error
            self._stats_version += 1

    def _read_cpu(self, now: float) -> None:
        """The exporter's CPU by part, at most once an interval and on a collector's thread: never in a scrape."""
        if now - self._cpu_read < self._interval:
            return
        self._cpu_read = now  # two collectors ending at once may both read: harmless
        seconds = self._cpu_by_part.read()
        with self._stats_lock:
            self._cpu = seconds

    def _loop(self, collector: Collector, phase: float) -> None:
        """Every collector's first cycle at once (the exporter is ready within one), but after the first cycles of
        those it names in `first_after` (at most an interval), then each at its phase.

        Collectors that tick together contend for the GIL: each /proc read or NVML call hands it to another
        thread, a futex call and a wake-up on another CPU each time (about 190 per thread per cycle with three
        collectors in step), and a VM pays for every cross-CPU wake-up. Apart, each cycle runs alone.
        """
        next_run = time.monotonic() + phase
        for name in getattr(collector, "first_after", ()):
            if name in self._first_cycle:
                self._first_cycle[name].wait(self._interval)
        self.run_once(collector)
        while True:
            next_run += self._interval
            delay = next_run - time.monotonic()
            if delay < 0:  # fell behind (slow collector): skip missed ticks rather than burst
                next_run = time.monotonic()
                delay = 0
            if self._stop.wait(delay):
                return
            self.run_once(collector)

    def _watch(self) -> None:
        """Once an interval: leaves out of /metrics the families of a collector whose cycle has been under way for
        STALE_CYCLES intervals, MIN_STALE_SECONDS at least (a hung NVML call, a read of a hung mount), so
        that a stuck reading is absent, not served as current; counts it as a failed cycle and logs it once.
        The cycle's end publishes again."""
        while not self._stop.wait(self._interval):
            with self._publish_lock:
                for name, running in self._overdue():
                    self._store.publish(name, b"")
                    log.warning("collector %s has been in one cycle for %.1f s (a hung call?): its readings are left "
                                "out of /metrics until it returns", name, running)

    def _overdue(self) -> list[tuple[str, float]]:
        """The collectors whose cycle has now run for STALE_CYCLES intervals (at least MIN_STALE_SECONDS), with its
        seconds; each marked left out and counted as a failed cycle, once."""
        overdue = []
        now = time.monotonic()
        with self._stats_lock:
            for name, stats in self._stats.items():
                running = now - stats.cycle_started if stats.cycle_started is not None else 0.0
                if running >= max(STALE_CYCLES * self._interval, MIN_STALE_SECONDS) and not stats.left_out:
                    stats.left_out = True
                    stats.errors += 1
                    self._stats_version += 1
                    overdue.append((name, running))
        return overdue

    def version(self) -> object:
        """The store's ChunkSource: it renders the self metrics at a scrape after a cycle ended."""
        return self._stats_version

    def chunks(self) -> Sequence[Chunk]:
        with self._self_lock:
            body, _ = self._self_renderer.render(self._self_families())
        return (Chunk(body),)

    def _self_families(self) -> list[Metric]:
        duration = GaugeMetricFamily(
            families.COLLECTOR_DURATION,
            "Wall time of the collector's last cycle, or of the cycle under way once its families are left out "
            "(it has run for three intervals, 10 s at least: a hung call).",
            labels=["collector"],
        )
        errors = CounterMetricFamily(
            families.COLLECTOR_ERRORS,  # CounterMetricFamily drops the _total suffix
            "Collector cycles that failed, as a whole or leaving a reading out (the exporter's log says which).",
            labels=["collector"],
        )
        last_success = GaugeMetricFamily(
            families.COLLECTOR_LAST_SUCCESS,
            "Unix time of the collector's last successful cycle (0 = never).",
            labels=["collector"],
        )
        with self._stats_lock:
            now = time.monotonic()
            for name in sorted(self._stats):
                stats = self._stats[name]
                under_way = now - stats.cycle_started if stats.left_out and stats.cycle_started is not None else 0.0
                duration.add_metric([name], max(stats.duration_seconds, under_way))
                errors.add_metric([name], stats.errors)
                last_success.add_metric([name], stats.last_success)
            cpu = _cpu_by_part(self._cpu)
        build = InfoMetricFamily(families.BUILD_INFO.removesuffix("_info"), "Exporter version and runtime.")
        build.add_metric([], {"version": __version__, "python_version": platform.python_version()})
        started = GaugeMetricFamily(
            families.EXPORTER_START_TIME,
            f"Unix time the exporter started: the rules hold its readings {SETTLE_SECONDS} s after (ranks push again).",
            value=self._started,
        )
        return [build, started, duration, errors, last_success, *cpu]


def _cpu_by_part(seconds: dict[str, float]) -> list[Metric]:
    """The exporter's CPU by part (Linux): what it costs the node, and which part costs it."""
    if not seconds:
        return []
    family = CounterMetricFamily(
        families.EXPORTER_CPU,
        "CPU time (user + system) of the exporter by part: a collector's (its cycles and helper threads), "
        "or server (HTTP: scrapes, pushes, password checks).",
        labels=["part"],
    )
    for name in sorted(seconds):
        family.add_metric([name], seconds[name])
    return [family]

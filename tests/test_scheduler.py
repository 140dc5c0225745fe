"""Collection runs off the scrape path: a wedged or failing collector never stalls the others."""

import itertools
import threading
import time
from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from stepscope.exporter import exposition
from stepscope.exporter import scheduler as scheduler_module
from stepscope.exporter.exposition import ExpositionStore
from stepscope.exporter.scheduler import Scheduler
from stepscope.exporter.thread_cpu import collector_thread_name
from stepscope_testkit.processes import sample_values

HELPER_CPU_S = 0.15  # what the idle collector's helper thread spends in the CPU-by-part test


class CountingCollector:
    def __init__(self, name: str) -> None:
        self.name = name
        self.cycles = 0
        self.fail = False
        self.failed_reading = ""

    def collect(self) -> Iterable[Metric]:
        if self.fail:
            raise RuntimeError("device fell off the bus")
        self.cycles += 1
        return [GaugeMetricFamily(f"stepscope_test_{self.name}_cycles", "Cycles so far.", value=self.cycles)]

    def close(self) -> None:
        pass


class WedgedCollector:
    name = "wedged"

    def __init__(self) -> None:
        self.release = threading.Event()

    def collect(self) -> Iterable[Metric]:
        self.release.wait(30)
        return []

    def close(self) -> None:
        self.release.set()


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_wedged_collector_does_not_stall_others_or_scrapes() -> None:
    store = ExpositionStore()
    healthy, wedged = CountingCollector("healthy"), WedgedCollector()
    scheduler = Scheduler([healthy, wedged], interval=0.05, store=store)
    scheduler.start()
    try:
        wait_until(lambda: healthy.cycles >= 5)
        assert not scheduler.ready()  # the wedged one never finished a cycle
        text = store.body().decode()
        assert sample_values(text, "stepscope_test_healthy_cycles")[0] >= 1
        assert sample_values(text, "stepscope_exporter_collector_last_success_timestamp_seconds",
                             collector="wedged") == [0.0]
    finally:
        scheduler.stop()


def test_failures_are_counted_and_drop_stale_families() -> None:
    store = ExpositionStore()
    collector = CountingCollector("flaky")
    scheduler = Scheduler([collector], interval=60, store=store)
    scheduler.run_once(collector)
    assert sample_values(store.body().decode(), "stepscope_test_flaky_cycles") == [1.0]
    collector.fail = True
    scheduler.run_once(collector)
    scheduler.run_once(collector)
    text = store.body().decode()
    assert sample_values(text, "stepscope_test_flaky_cycles") == []
    assert sample_values(text, "stepscope_exporter_collector_errors_total", collector="flaky") == [2.0]
    collector.fail = False
    scheduler.run_once(collector)
    text = store.body().decode()
    assert sample_values(text, "stepscope_test_flaky_cycles") == [2.0]
    assert sample_values(text, "stepscope_exporter_collector_last_success_timestamp_seconds",
                         collector="flaky")[0] > time.time() - 5
    assert scheduler.ready()


def test_a_cycle_that_left_a_reading_out_is_counted_and_still_fresh(caplog) -> None:
    """The node collector without PID 1's network counters (`failed_reading`): its other readings are published
    and fresh (last success moves: StepscopeExporterCollectionStale stays quiet), and every such cycle counts in
    errors_total (StepscopeExporterCollectionFailing fires) without a second log line of the scheduler's."""
    store = ExpositionStore()
    collector = CountingCollector("node")
    collector.failed_reading = "network readings: cannot read /proc/1/net/dev: Permission denied"
    scheduler = Scheduler([collector], interval=60, store=store)
    for _ in range(2):
        scheduler.run_once(collector)
    text = store.body().decode()
    assert sample_values(text, "stepscope_test_node_cycles") == [2.0]
    assert sample_values(text, "stepscope_exporter_collector_errors_total", collector="node") == [2.0]
    assert sample_values(text, "stepscope_exporter_collector_last_success_timestamp_seconds",
                         collector="node")[0] > time.time() - 5
    assert not caplog.records
    collector.failed_reading = ""
    scheduler.run_once(collector)
    assert sample_values(store.body().decode(), "stepscope_exporter_collector_errors_total", collector="node") == [2.0]


def test_gzip_body_matches_plain_and_follows_updates() -> None:
    import gzip

    store = ExpositionStore()
    store.publish("a", b"# one\n")
    assert gzip.decompress(store.body(compressed=True)) == store.body() == b"# one\n"
    store.publish("b", b"# two\n")
    assert gzip.decompress(store.body(compressed=True)) == b"# one\n# two\n"


def test_bodies_replaced_before_a_gzip_scrape_are_never_compressed(monkeypatch) -> None:
    """Collectors publish every cycle, Prometheus scrapes every 15 s: only what a scrape serves is deflated."""
    import gzip
    import zlib

    compressors: list[int] = []
    real = zlib.compressobj
    monkeypatch.setattr(zlib, "compressobj", lambda *args: (compressors.append(1), real(*args))[1])
    store = ExpositionStore()
    for cycle in range(5):
        store.publish("gpu", f"stepscope_test_cycle {cycle}\n".encode())
    assert compressors == []
    assert gzip.decompress(store.body(compressed=True)) == b"stepscope_test_cycle 4\n"
    assert len(compressors) == 1
    store.body(compressed=True)
    store.body()
    assert len(compressors) == 1  # served again from the same chunk
    store.publish("gpu", b"stepscope_test_cycle 5\n")
    assert gzip.decompress(store.body(compressed=True)) == b"stepscope_test_cycle 5\n"
    assert len(compressors) == 2


def test_each_scrape_ends_with_its_own_clock_in_one_gzip_member_and_nothing_recompressed(monkeypatch) -> None:
    """The node's clock is read per scrape (its offset is the value less the scrape's timestamp), behind the
    cached sources: one gzip member (a client may read only the first) whose CRC goes on
    from the cached one, with no compressor run for it."""
    import zlib

    compressors: list[int] = []
    real = zlib.compressobj
    monkeypatch.setattr(zlib, "compressobj", lambda *args: (compressors.append(1), real(*args))[1])
    store = ExpositionStore()
    store.publish("gpu", b"stepscope_test_cycle 1\n")
    for now in (1764000000.25, 1764000015.5):
        clock = exposition.node_time(now)
        assert store.body(tail=clock) == b"stepscope_test_cycle 1\n" + clock
        first_member = zlib.decompressobj(31)
        assert first_member.decompress(store.body(compressed=True, tail=clock)) == store.body(tail=clock)
        assert first_member.eof and first_member.unused_data == b""
        assert sample_values(clock.decode(), "stepscope_exporter_time_seconds") == [now]
    assert len(compressors) == 1  # the cached source's chunk, once


class RecordingStore(ExpositionStore):
    """An ExpositionStore that remembers every publish, to see what the scheduler skips."""

    def __init__(self) -> None:
        super().__init__()
        self.published: list[tuple[str, bytes]] = []

    def publish(self, source: str, body: bytes) -> None:
        self.published.append((source, body))
        super().publish(source, body)


class SteadyCollector:
    """An idle node: the same readings every cycle, except one gauge when told."""

    name = "steady"

    def __init__(self) -> None:
        self.temperature = 40.0

    def collect(self) -> Iterable[Metric]:
        memory = GaugeMetricFamily("stepscope_test_memory_total_bytes", "Installed memory.", labels=["gpu"])
        for gpu in range(8):
            memory.add_metric([str(gpu)], 80 * 2**30)
        return [memory, GaugeMetricFamily("stepscope_test_temperature_celsius", "Die temperature.",
                                          value=self.temperature)]

    def close(self) -> None:
        pass


def test_unchanged_readings_are_neither_re_rendered_nor_republished(monkeypatch) -> None:
    store = RecordingStore()
    collector = SteadyCollector()
    scheduler = Scheduler([collector], interval=60, store=store)
    rendered: list[str] = []  # the families exposition.render (generate_latest) was asked to render
    real_render = exposition.render
    monkeypatch.setattr(exposition, "render", lambda families: (
        rendered.extend(f.name for f in families), real_render(families))[1])
    scheduler.run_once(collector)
    assert "stepscope_test_memory_total_bytes" in rendered
    first_cycle = len(rendered)
    scheduler.run_once(collector)
    scheduler.run_once(collector)
    steady = [body for source, body in store.published if source == "steady"]
    assert len(steady) == 1
    assert steady[0] == real_render(collector.collect())  # byte for byte what a full render gives
    # a new duration is written from the lines' prefixes kept since the first cycle: no render at all
    assert rendered[first_cycle:] == []
    collector.temperature = 41.0
    scheduler.run_once(collector)
    assert rendered[first_cycle:] == []  # a changed value needs no render either, only its new number
    assert [body for source, body in store.published if source == "steady"][-1] == real_render(collector.collect())
    assert sample_values(store.body().decode(), "stepscope_test_temperature_celsius") == [41.0]
    assert sample_values(store.body().decode(), "stepscope_exporter_collector_errors_total",
                         collector="steady") == [0.0]


def test_self_metrics_are_rendered_at_a_scrape_after_a_cycle_not_at_every_cycle(monkeypatch) -> None:
    """Every cycle of every collector changes the self metrics (its duration); rendering them each time
    cost 3 renders a second at a 1 s interval, 9 per 15 s scrape at the default 5 s."""
    store = ExpositionStore()
    collectors = [CountingCollector("a"), CountingCollector("b")]
    scheduler = Scheduler(collectors, interval=60, store=store)
    renders: list[int] = []
    real = Scheduler._self_families
    monkeypatch.setattr(Scheduler, "_self_families", lambda self: (renders.append(1), real(self))[1])
    for _ in range(3):
        for collector in collectors:
            scheduler.run_once(collector)
    assert renders == []
    text = store.body().decode()
    assert len(renders) == 1
    assert sample_values(text, "stepscope_exporter_collector_last_success_timestamp_seconds", collector="b")[0] > 0
    store.body(compressed=True)
    store.body()
    assert len(renders) == 1  # no cycle since: the same text
    collectors[0].fail = True
    scheduler.run_once(collectors[0])
    assert sample_values(store.body().decode(), "stepscope_exporter_collector_errors_total", collector="a") == [1.0]
    assert len(renders) == 2


def test_a_failing_cycle_publishes_the_empty_text_once() -> None:
    store = RecordingStore()
    collector = CountingCollector("flaky")
    scheduler = Scheduler([collector], interval=60, store=store)
    scheduler.run_once(collector)
    collector.fail = True
    scheduler.run_once(collector)
    scheduler.run_once(collector)
    assert [body for source, body in store.published if source == "flaky"][1:] == [b""]


class BurningCollector(CountingCollector):
    """Spends `seconds` of CPU in each cycle."""

    def __init__(self, name: str, seconds: float) -> None:
        super().__init__(name)
        self.seconds = seconds

    def collect(self) -> Iterable[Metric]:
        started = time.thread_time()
        while time.thread_time() - started < self.seconds:
            pass
        return super().collect()


def test_each_collector_shows_the_cpu_its_threads_spent_and_an_idle_one_next_to_none() -> None:
    """The kernel's per-thread accounting, summed by part, says which part of the exporter costs the node
    what (Linux): a collector's helper thread counts for it, the test's own thread for the server."""
    store = ExpositionStore()
    busy, idle = BurningCollector("busy", 0.1), CountingCollector("idle")
    burnt_enough, release = threading.Event(), threading.Event()
    spent: list[float] = []
    helper = threading.Thread(target=_burn_then_wait, args=(burnt_enough, release, spent),
                              name=collector_thread_name("idle", "helper"))
    scheduler = Scheduler([busy, idle], interval=0.05, store=store)
    scheduler.start()
    try:
        wait_until(lambda: busy.cycles >= 6 and idle.cycles >= 6, timeout=30)  # 0.6 s of CPU, however loaded
        text = store.body().decode()
        helper.start()
        assert burnt_enough.wait(30)
        burnt_at = busy.cycles
        wait_until(lambda: busy.cycles >= burnt_at + 2)  # read while the helper lives, all it spent included
        release.set()
        helper.join()
        ended = busy.cycles
        wait_until(lambda: busy.cycles >= ended + 2)  # read again after the helper ended
        later = store.body().decode()
    finally:
        release.set()
        scheduler.stop()
    [burnt] = sample_values(text, "stepscope_exporter_cpu_seconds_total", part="busy")
    [idled] = sample_values(text, "stepscope_exporter_cpu_seconds_total", part="idle")
    assert 0.3 <= burnt <= 2.0, burnt  # read once an interval: at least 4 whole cycles of 0.1 s by then
    assert idled <= 0.05, idled
    assert sample_values(text, "stepscope_exporter_cpu_seconds_total", part="server")  # this test's thread
    [helped] = sample_values(later, "stepscope_exporter_cpu_seconds_total", part="idle")
    # its helper ended: what it spent stays counted (the kernel counts in 10 ms ticks), once. The idle
    # collector's own thread spends a little meanwhile, more on a loaded machine (0.04 s beside eight busy
    # test workers), and counting the helper twice would add all of its spent again
    assert spent[0] - 0.02 <= helped - idled <= 1.5 * spent[0], (helped, idled, spent)


def _burn_then_wait(burnt_enough: threading.Event, release: threading.Event, spent: list[float]) -> None:
    """Spins (sharing the GIL with the busy collector) until it has spent HELPER_CPU_S of CPU, however
    loaded the machine, appends what it spent, then waits without spending until released."""
    while time.thread_time() < HELPER_CPU_S:
        pass
    spent.append(time.thread_time())
    burnt_enough.set()
    release.wait(30)


def test_cpu_is_read_once_an_interval_on_a_collectors_thread_never_in_a_scrape(monkeypatch) -> None:
    reads: list[str] = []
    monkeypatch.setattr(scheduler_module.CpuByPart, "read",
                        lambda self: (reads.append(threading.current_thread().name), {"a": 0.5})[1])
    store = ExpositionStore()
    collectors = [CountingCollector("a"), CountingCollector("b")]
    scheduler = Scheduler(collectors, interval=60, store=store)
    for _ in range(3):
        for collector in collectors:
            scheduler.run_once(collector)
            store.body()
    assert len(reads) == 1  # six cycles and six scrapes within one interval
    assert sample_values(store.body().decode(), "stepscope_exporter_cpu_seconds_total", part="a") == [0.5]


class TimedCollector(CountingCollector):
    """Notes when each of its cycles started."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.started: list[float] = []

    def collect(self) -> Iterable[Metric]:
        self.started.append(time.monotonic())
        return super().collect()


def test_collectors_run_their_first_cycle_at_once_then_each_at_its_own_phase_of_the_interval() -> None:
    """Collectors in step contend for the GIL: every /proc read or NVML call hands it to another thread, a
    futex call and a cross-CPU wake-up each (5,745 futex calls in 20 s with three in step, 77 apart), which a
    VM pays dearly for. Three collectors at 0.9 s tick 0.3 s apart, in order; the first cycles come at once
    so that the exporter is ready within one cycle."""
    collectors = [TimedCollector(name) for name in ("first", "second", "third")]
    scheduler = Scheduler(collectors, interval=0.9, store=ExpositionStore())
    scheduler.start()
    try:
        wait_until(lambda: all(len(c.started) >= 3 for c in collectors), timeout=10)
    finally:
        scheduler.stop()
    firsts = [c.started[0] for c in collectors]
    assert max(firsts) - min(firsts) < 0.25
    for cycle in (1, 2):
        starts = [c.started[cycle] for c in collectors]
        gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
        assert all(0.15 < gap < 0.45 for gap in gaps), (cycle, gaps)  # 0.3 s apart, slack for a loaded machine


class HangingCollector:
    """Publishes the same reading every cycle until `hang` is set; then its next call waits for `release`."""

    name = "gpu"

    def __init__(self) -> None:
        self.hang = threading.Event()
        self.release = threading.Event()

    def collect(self) -> Iterable[Metric]:
        if self.hang.is_set():
            self.release.wait(30)
        return [GaugeMetricFamily("stepscope_test_gpu_up", "Whether the GPU answers.", value=1)]

    def close(self) -> None:
        self.release.set()


def test_a_collector_stuck_in_a_cycle_has_its_readings_left_out_until_it_returns(caplog, monkeypatch) -> None:
    """A hung NVML call: before, /metrics served the GPU's last readings (gpu_up 1, 98% busy) for as long as the
    call hung. After three intervals the collector's families are left out, the cycle counts as failed and its
    duration shows how long it has run; the cycle's end publishes again, the same readings too."""
    monkeypatch.setattr(scheduler_module, "MIN_STALE_SECONDS", 0.0)  # three of this test's short intervals
    store = ExpositionStore()
    collector = HangingCollector()
    scheduler = Scheduler([collector], interval=0.2, store=store)
    scheduler.start()
    try:
        wait_until(lambda: sample_values(store.body().decode(), "stepscope_test_gpu_up") == [1.0])
        collector.hang.set()
        wait_until(lambda: sample_values(store.body().decode(), "stepscope_test_gpu_up") == [])
        text = store.body().decode()
        assert sample_values(text, "stepscope_exporter_collector_errors_total", collector="gpu") == [1.0]
        assert sample_values(text, "stepscope_exporter_collector_duration_seconds", collector="gpu")[0] >= 0.6
        assert "collector gpu has been in one cycle for" in caplog.text
        time.sleep(0.5)  # left out once, counted once
        assert sample_values(store.body().decode(), "stepscope_exporter_collector_errors_total",
                             collector="gpu") == [1.0]
        collector.hang.clear()
        collector.release.set()
        wait_until(lambda: sample_values(store.body().decode(), "stepscope_test_gpu_up") == [1.0])
        assert "collector gpu returned after" in caplog.text
    finally:
        scheduler.stop()


def test_a_real_exporter_leaves_out_a_gpu_whose_nvml_call_hangs(tmp_path) -> None:
    """The fake NVML's temperature call starts to take 60 s, as NVML does on a GPU in a bad state, while the GPU
    goes idle and hot: before, scrapes 12 s in still read gpu_up 1, 98% busy and 61 °C."""
    from stepscope_testkit.fake_nvml.scenario import make_scenario, write_scenario
    from stepscope_testkit.processes import running_exporter, scrape

    scenario = make_scenario(gpus=1, processes_per_gpu=0)
    path = tmp_path / "nvml.json"
    write_scenario(path, scenario)
    with running_exporter(tmp_path, "--collectors", "gpu", "--collect-interval", "1",
                          fake_nvml_scenario=path) as exporter:
        wait_until(lambda: sample_values(scrape(exporter.url), "stepscope_gpu_up") == [1.0], timeout=20)
        scenario["gpus"][0]["temperature_c"] = 95
        scenario["gpus"][0]["utilization"] = {"gpu": 0, "memory": 0}
        scenario["latency_ms"] = {"nvmlDeviceGetTemperature": 60000}
        write_scenario(path, scenario)
        wait_until(lambda: sample_values(scrape(exporter.url), "stepscope_gpu_up") == [], timeout=20)
        text = scrape(exporter.url)
        assert sample_values(text, "stepscope_gpu_utilization_ratio") == []
        assert sample_values(text, "stepscope_gpu_temperature_celsius") == []
        assert sample_values(text, "stepscope_exporter_collector_errors_total", collector="gpu") == [1.0]
    assert "collector gpu has been in one cycle for" in exporter.log()


def test_a_collector_that_reads_another_takes_its_first_cycle_after_that_ones() -> None:
    """The process collector reads the GPU collector's process table: before, both first cycles ran at once, the
    table was still empty, and a rank's GPU memory came with the second cycle, 8.3 s after the exporter was ready."""
    store = ExpositionStore()
    seen: list[bool] = []

    class SlowGpu(CountingCollector):
        def collect(self) -> Iterable[Metric]:
            time.sleep(0.3)  # NVML's first reads
            return super().collect()

    class ReadsGpu(CountingCollector):
        first_after = ("gpu",)

        def collect(self) -> Iterable[Metric]:
            seen.append(gpu.cycles > 0)
            return super().collect()

    gpu, process = SlowGpu("gpu"), ReadsGpu("process")
    scheduler = Scheduler([gpu, process], interval=60, store=store)
    scheduler.start()
    try:
        wait_until(scheduler.ready)
        assert seen == [True]
    finally:
        scheduler.stop()

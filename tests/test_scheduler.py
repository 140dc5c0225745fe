"""Collection runs off the scrape path: a wedged or failing collector never stalls the others."""

import threading
import time
from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from exporter.exposition import ExpositionStore
from exporter.scheduler import Scheduler
from tests.support.processes import sample_values


class CountingCollector:
    def __init__(self, name: str) -> None:
        self.name = name
        self.cycles = 0
        self.fail = False

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


def test_gzip_body_matches_plain_and_follows_updates() -> None:
    import gzip

    store = ExpositionStore()
    store.publish("a", b"# one\n")
    assert gzip.decompress(store.body(compressed=True)) == store.body() == b"# one\n"
    store.publish("b", b"# two\n")
    assert gzip.decompress(store.body(compressed=True)) == b"# one\n# two\n"

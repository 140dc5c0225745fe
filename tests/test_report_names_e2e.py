"""Run names the exporter accepts, as the report asks Prometheus for them: a real exporter and Prometheus,
a run pushed under each name by the hooks, and the report's own queries (its run matcher) find each one.
"""

import time
from collections.abc import Iterator

import pytest

import stepscope.hooks as hooks
from stepscope.report.prometheus import Prometheus
from stepscope.report.window import run_life, run_matcher, runs_seen
from stepscope_testkit.processes import running_exporter
from tests.support.prometheus import running_prometheus, wait_for

pytestmark = pytest.mark.timeout(90)

# the exporter refuses control characters (a newline, a tab) in a run name
NAMES = ("emoji🚀", 'a"quote', "back\\slash", "héllo wörld", "日本語 run", "dollar$ {brace} 'single'")


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    tmp = tmp_path_factory.mktemp("names")
    with running_exporter(tmp) as exporter, \
            running_prometheus(tmp, {"n": exporter.url.removeprefix("http://")}) as prometheus:
        for name in NAMES:
            tracker = hooks.init(run=name, push_url=exporter.url, push_interval=1, handle_sigterm=False,
                                 share_bounds=False)
            tracker.step(samples=1)
            tracker.close()
        client = Prometheus(prometheus.url, timeout=10)
        assert wait_for(lambda: {s.run for s in runs_seen(client, 0, time.time())} >= set(NAMES) or None, 20)
        yield client


@pytest.mark.parametrize("name", NAMES, ids=ascii)
def test_the_report_finds_a_run_by_any_name_the_exporter_accepts(prom: Prometheus, name: str) -> None:
    [info] = prom.query(f"stepscope_training_info{{{run_matcher(name)}}}", time.time())
    assert info.labels["run"] == name
    first, last, _ = run_life(prom, name, time.time() - 600, time.time())
    assert 0 < first <= last

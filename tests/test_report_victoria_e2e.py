"""End to end: stepscope-report reads VictoriaMetrics (+ vmalert, docs/engines.md) as it reads Prometheus.

One real exporter (fake NVML, one H100) and a real data-bound training run (`stepscope.hooks.demo`, a slow
loader), scraped every second by both engines at once: Prometheus evaluating the shipped rules, and
VictoriaMetrics with vmalert evaluating the same files and writing their recordings back, both started
before the run as on a cluster. The run trains until both engines recorded its verdict, then stops; the
report is made from each engine.

VictoriaMetrics moves a range query's start and end to multiples of its step unless asked `nocache=1`; the
report's run search (hour buckets from the search range's start) then missed the run's last hour, and the
report said the run "has no samples" on VictoriaMetrics. The two reports must now agree on everything read
from the raw series (the window's start, steps, samples, step times, the loader's share, throughput) and on
the verdict. vmalert's recordings of a new run begin later than Prometheus' (each level is written back
before the next reads it), so the columns made from recordings over the whole run (energy, the critical
path's first seconds) are not compared.
"""

import csv
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from grafana.rules import RULE_FILES
from stepscope.contract.recordings import RUN_VERDICT
from stepscope.contract.verdicts import IDLE, UNDETERMINED
from stepscope.report import cli
from stepscope_testkit.fake_nvml.scenario import write_scenario
from stepscope_testkit.processes import running_exporter
from tests.support.demos import gpus_for_runs, start_demo, stop
from tests.support.prometheus import query, running_prometheus, wait_for
from tests.support.victoria import running_victoria, running_vmalert

RUN = "vm-data"
NODE = "node-vm"
LAYOUT = {0: (30, 22, (RUN, 0))}  # GPU 0: NVML 30%, SM active 22%, held by the run's rank 0
# VictoriaMetrics' first verdict: 38-62 s into a run alone; this fixture took 144 s beside five e2e modules
VERDICT_DEADLINE_S = 240
EXACT = ("start", "ranks", "nodes", "steps", "samples", "verdict")
CLOSE = ("mean_step_seconds", "p50_step_seconds", "p95_step_seconds", "dataloader_share",
         "training_samples_per_second", "gpu_utilization_ratio", "gpu_effective_utilization_ratio")

pytestmark = pytest.mark.timeout(420)


def _verdict(url: str) -> str | None:
    found = query(url, f'{RUN_VERDICT}{{run="{RUN}"}}')
    return found[0]["metric"]["verdict"] if found else None


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """engine -> the report of RUN made from it."""
    tmp = tmp_path_factory.mktemp("report-victoria")
    scenario = write_scenario(tmp / "nvml.json", gpus_for_runs(LAYOUT, {}))
    with running_exporter(tmp, fake_nvml_scenario=scenario) as exporter:
        target = exporter.url.removeprefix("http://")
        scrape = [{"job_name": "stepscope", "static_configs": [{"targets": [target], "labels": {"instance": NODE}}]}]
        (tmp / "prometheus").mkdir()
        with running_prometheus(tmp / "prometheus", {NODE: target}, RULE_FILES) as prometheus, \
                running_victoria(tmp / "victoria", scrape) as victoria, \
                running_vmalert(tmp / "vmalert", victoria.url, RULE_FILES):
            engines = {"prometheus": prometheus.url, "victoriametrics": victoria.url}
            demo = start_demo(RUN, 0, 1, exporter.url, tmp / "demo.log", "--steps", "100000", "--slow-loader", "0.05")
            try:
                write_scenario(scenario, gpus_for_runs(LAYOUT, {(RUN, 0): demo.pid}))
                seen: dict[str, str | None] = {}

                def both_judged() -> bool:  # idle until the rank trains, undetermined until the evidence comes
                    seen.update({engine: _verdict(url) for engine, url in engines.items()})
                    return all(verdict not in (None, IDLE, UNDETERMINED) for verdict in seen.values())

                assert wait_for(both_judged, VERDICT_DEADLINE_S), seen
                assert seen == {"prometheus": "data_bound", "victoriametrics": "data_bound"}
                assert demo.poll() is None, (tmp / "demo.log").read_text()
            finally:
                stop([demo])
            idle = f'stepscope_training_state{{run="{RUN}",state="idle"}} == 1'
            assert wait_for(lambda: all(query(url, idle) for url in engines.values()), 30)  # the final push read
            time.sleep(2)
            made = {}
            for engine, url in engines.items():
                made[engine] = tmp / f"report-{engine}"
                assert cli.main(["--prometheus", url, "--run", RUN, "--out", str(made[engine])]) == 0, engine
            yield made


def _summary(report: Path) -> dict[str, str]:
    with (report / "run_summary.csv").open(newline="", encoding="utf-8") as file:
        (row,) = csv.DictReader(file)
    return row


def test_the_report_from_victoriametrics_agrees_with_the_one_from_prometheus(reports: dict[str, Path]) -> None:
    prometheus, victoria = (_summary(reports[engine]) for engine in ("prometheus", "victoriametrics"))
    assert prometheus["verdict"] == "data_bound" and int(prometheus["steps"]) > 0, prometheus
    assert {column: victoria[column] for column in EXACT} == {column: prometheus[column] for column in EXACT}
    for column in CLOSE:
        assert float(victoria[column]) == pytest.approx(float(prometheus[column]), rel=0.02), column
    # the window's end is each engine's last sample of the run: the two reports ran a moment apart
    assert victoria["end"] >= prometheus["end"]


def test_the_victoriametrics_page_names_the_verdict(reports: dict[str, Path]) -> None:
    page = (reports["victoriametrics"] / "index.html").read_text()
    assert "Data-bound" in page and "No verdict yet" not in page

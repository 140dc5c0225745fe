"""dcgm-exporter as the GPU source: the H100 corpus (benchmarks/corpus/) replayed as a Kubernetes node whose GPU
readings come only from dcgm-exporter's exposition (its default counters plus SM active, its label set, the
pod each GPU is given to) and whose stepscope exporter runs with its GPU collector off and pod attribution on.

A real Prometheus scrapes both targets and runs the shipped rules; every workload must get the verdict and
exactly the alerts it gets from stepscope's own GPU collector (tests/test_corpus_verdicts.py), with no
`stepscope_gpu_*` series anywhere.
"""

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from grafana.rules import RULE_FILES
from stepscope.contract import families, recordings, verdicts
from stepscope_testkit.dcgm import PodRef, dcgm_body, without_gpu_collector
from stepscope_testkit.replay import Recording, Workload, replaying
from stepscope_testkit.replay import recordings as corpus
from tests.support.prometheus import query, running_prometheus_config
from tests.support.replay_judge import SETTLE_MARGIN_S, Judged, _read, alerts_without_for
from tests.test_corpus_verdicts import TRUE_ALERTS

pytestmark = pytest.mark.timeout(300)

RECORDING = corpus()[0]
DCGM = "dcgm-"  # the dcgm-exporter target of workload w is served as workload dcgm-w


def _pods(workload: Workload) -> dict[str, PodRef]:
    """The recorded GPU given to the workload's pod (one node per workload, as the corpus replay has it)."""
    uuid = workload.bodies[0].split('stepscope_gpu_info{', 1)[1].split('uuid="', 1)[1].split('"', 1)[0]
    return {uuid: PodRef("ml", f"{workload.name.replace('_', '-')}-0", "pytorch")}


def _as_cluster_node(recording: Recording) -> dict[str, Workload]:
    """Each workload as its stepscope exporter (GPU collector off) plus its node's dcgm-exporter target."""
    served = {}
    for name, workload in recording.workloads.items():
        pods = _pods(workload)
        served[name] = replace(workload, bodies=tuple(without_gpu_collector(body, pods) for body in workload.bodies))
        served[DCGM + name] = replace(workload, name=DCGM + name,
                                      bodies=tuple(dcgm_body(body, name, pods) for body in workload.bodies))
    return served


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Judged], dict[str, list], set]]:
    """The corpus judged with dcgm-exporter as the GPU source (~80 s), what Prometheus held at the end, and
    every (node, run) the rank <-> GPU join found on the way."""
    tmp = tmp_path_factory.mktemp("dcgm")
    served = _as_cluster_node(RECORDING)
    judged = {name: Judged(workload) for name, workload in served.items() if not name.startswith(DCGM)}
    loaded = [str(path) for path in RULE_FILES] + [str(alerts_without_for(tmp))]
    with replaying(served) as replay:
        stepscope, dcgm = [], []
        for target in replay.targets():
            name = target["labels"]["instance"]
            if name.startswith(DCGM):  # dcgm-exporter's own address is its instance, as a ServiceMonitor has it
                target = {**target, "labels": {**target["labels"], "instance": f"10.0.0.{len(dcgm) + 7}:9400"}}
            (dcgm if name.startswith(DCGM) else stepscope).append(target)
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": loaded,
                  "scrape_configs": [{"job_name": "stepscope", "static_configs": stepscope},
                                     {"job_name": "dcgm-exporter", "static_configs": dcgm}]}
        with running_prometheus_config(Path(tmp), config) as prometheus:
            end = max(workload.duration for workload in RECORDING.workloads.values()) + SETTLE_MARGIN_S
            ranks: set[tuple[str, str]] = set()
            while replay.elapsed() < end:
                tick = time.monotonic()
                _read(prometheus.url, prometheus.url, replay.elapsed(), judged)  # Prometheus serves both
                ranks |= {(item["metric"]["instance"], item["metric"]["run"])
                          for item in query(prometheus.url, recordings.RANK_GPU_MEMORY)}
                time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
            held = {expr: query(prometheus.url, expr) for expr in
                    ("count({__name__=~'stepscope_gpu_.*'})", recordings.GPU_SOURCE_UTILIZATION,
                     "count(DCGM_FI_DEV_GPU_UTIL)", f"count({families.PROCESS_GPU_MEMORY})")}
    yield judged, held, ranks


WORKLOADS = sorted(RECORDING.workloads)


@pytest.mark.parametrize("name", WORKLOADS)
def test_each_workload_gets_its_verdict_from_dcgm_readings(judged: tuple, name: str) -> None:
    result = judged[0][name]
    expected = result.workload.expected_verdict
    seen = {reading.verdict for reading in result.training()} - {None, verdicts.IDLE}
    assert seen == {expected}, f"{name}: {dict(result.shares())}"
    last = [reading.verdict for reading in result.training()][-10:]
    assert last == [expected] * 10, f"{name}: the last 10 s of training read {last}"


@pytest.mark.parametrize("name", WORKLOADS)
def test_exactly_the_native_alerts_fire_from_dcgm_readings(judged: tuple, name: str) -> None:
    result = judged[0][name]
    spoken = [reading for reading in result.training() if reading.verdict == result.workload.expected_verdict]
    fired = {alert for reading in spoken for alert in reading.alerts}
    assert fired == TRUE_ALERTS[result.workload.expected_verdict], f"{name}: {sorted(fired)}"


def test_the_readings_came_from_dcgm_exporter_alone(judged: tuple) -> None:
    held = judged[1]
    assert held["count({__name__=~'stepscope_gpu_.*'})"] == []  # no GPU collector anywhere
    assert held["count(DCGM_FI_DEV_GPU_UTIL)"][0]["value"][1] == str(len(WORKLOADS))
    by_node = {item["metric"]["instance"] for item in held[recordings.GPU_SOURCE_UTILIZATION]}
    assert by_node == set(WORKLOADS)  # dcgm-exporter's Hostname, not its target address
    assert held[f"count({families.PROCESS_GPU_MEMORY})"] == []  # NVML's per-process memory: none either
    # each run found its GPU through the pod join alone
    assert {(name, RECORDING.workloads[name].run) for name in WORKLOADS} <= judged[2]

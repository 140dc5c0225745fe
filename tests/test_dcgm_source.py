"""dcgm-exporter as the GPU source: the H100 corpus (benchmarks/corpus/) replayed as a Kubernetes node whose GPU
readings come only from dcgm-exporter's exposition (its default counters plus SM active, its label set, the
pod each GPU is given to) and whose stepscope exporter runs with its GPU collector off and pod attribution on.

A real Prometheus scrapes both targets and runs the shipped rules; every workload must get the verdict and
exactly the alerts it gets from stepscope's own GPU collector (tests/test_corpus_verdicts.py), with no
`stepscope_gpu_*` series anywhere; the Node dashboard's GPU panels and the report's GPU memory read the same
readings through the GPU source layer and dcgm-exporter's fill-ins.
"""

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import pytest

from grafana.rules import RULE_FILES
from stepscope.contract import families, recordings, verdicts
from stepscope.report.queries import build
from stepscope.report.window import Window
from stepscope_testkit.dcgm import PodRef, dcgm_body, without_gpu_collector
from stepscope_testkit.replay import Recording, Workload, replaying
from stepscope_testkit.replay import recordings as corpus
from tests.support.dashboard_queries import load_dashboards, panel_queries, substitute, variable_queries
from tests.support.prometheus import query, running_prometheus_config, series
from tests.support.replay_judge import SETTLE_MARGIN_S, Judged, Reading, _missed_iterations, _read, alerts_without_for
from tests.test_corpus_verdicts import TRUE_ALERTS

pytestmark = pytest.mark.timeout(300)

RECORDING = corpus()[0]
T = TypeVar("T")
WORKLOADS = sorted(RECORDING.workloads)
DCGM = "dcgm-"  # the dcgm-exporter target of workload w is served as workload dcgm-w
GPU_ROWS = ("GPU", "GPU $gpu: NVLink, step phases, host link")  # the Node dashboard's rows of GPU panels
# The Node dashboard's GPU queries that stay empty here, and why: each reads a field that is not among
# dcgm-exporter's default counters (docs/cluster.md says which lines to add), or something this corpus lacks.
EMPTY_IN_DCGM_MODE = {
    ("GPM: SM active, SM occupancy, tensor cores, DRAM", "B"): "DCGM_FI_PROF_SM_OCCUPANCY: not a default counter",
    ("GPU memory in PyTorch's allocators", "A"): "pushed by ranks through the hooks; the corpus's ranks did not",
    ("GPU memory in PyTorch's allocators", "B"): "pushed by ranks through the hooks; the corpus's ranks did not",
    ("Power", "B"): "DCGM_FI_DEV_ENFORCED_POWER_LIMIT: not a default counter",
    ("SM clock lost below its maximum", "A"): "the H100 corpus predates stepscope_gpu_sm_clock_max_hertz, so no "
    "DCGM_FI_DEV_MAX_SM_CLOCK either: grafana/rules/tests/dcgm_source.yml reads it",
    ("ECC errors", "A"): "DCGM_FI_DEV_ECC_*_VOL_TOTAL: not default counters",
    ("XID errors", "A"): "stepscope's XID count: dcgm-exporter has the last XID only",
    ("XID errors", "B"): "no XID in the corpus: grafana/rules/tests/dcgm_source.yml proves it",
    ("NVLink (GPU ↔ GPU), GPU $gpu", "A"): "DCGM_FI_PROF_NVLINK_RX_BYTES: not a default counter",
    ("NVLink (GPU ↔ GPU), GPU $gpu", "B"): "DCGM_FI_PROF_NVLINK_TX_BYTES: not a default counter",
    ("Host link (PCIe, C2C), GPU $gpu", "C"): "NVLink-C2C: Grace Hopper only, not mapped",
    ("Host link (PCIe, C2C), GPU $gpu", "D"): "NVLink-C2C: Grace Hopper only, not mapped",
}


# The Cluster dashboard's panels that read GPUs, and those of them that stay empty here, and why.
CLUSTER_GPU = {"GPUs", "Idle GPUs", "GPU utilization in runs", "GPU utilization, node x GPU", "GPU-hours held but idle",
               "GPU-hours held but idle per namespace", "GPU utilization per node", "GPU utilization in runs per node",
               "Runs", "Nodes"}
CLUSTER_EMPTY_IN_DCGM_MODE = {
    ("Idle GPUs", "A"): "every GPU of the corpus is its run's",
}


def _pods(workload: Workload) -> dict[str, PodRef]:
    """The recorded GPU given to the workload's pod (one node per workload, as the corpus replay has it)."""
    uuid = workload.bodies[0].split('stepscope_gpu_info{', 1)[1].split('uuid="', 1)[1].split('"', 1)[0]
    return {uuid: PodRef("ml", f"{workload.name.replace('_', '-')}-0", "pytorch")}


def _node_gpu_queries() -> dict[tuple[str, str], str]:
    """{(panel, refId): PromQL} of the Node dashboard's GPU rows, variables as `.*`."""
    found, row = {}, ""
    for panel in load_dashboards()["stepscope-node.json"]["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        elif row in GPU_ROWS:
            found |= {(panel["title"], target["refId"]): substitute(target["expr"]) for target in panel["targets"]}
    return found


def _cluster_gpu_queries() -> dict[tuple[str, str], str]:
    """{(panel, refId): PromQL} of the Cluster dashboard's queries that read a GPU, variables as `.*`: the
    `GPUs` row, the fleet counters and the Nodes table's columns."""
    found = {}
    for query_ in panel_queries():
        if query_.dashboard == "stepscope-cluster.json" and ("gpu" in query_.raw_expr or query_.panel in CLUSTER_GPU):
            found[(query_.panel, query_.ref_id)] = query_.expr
    return found


def _dashboards_and_report(url: str) -> dict:
    """What the Node dashboard's GPU queries and its `gpu` variable return, the Cluster dashboard's GPU queries,
    and the report's GPU memory per run."""
    gpu_variable = next(v for v in variable_queries() if (v.dashboard, v.variable) == ("stepscope-node.json", "gpu"))
    report = {name: query(url, build(RECORDING.workloads[name].run, Window(0, 1, 1), []).over_time["gpu_memory"])
              for name in WORKLOADS}
    return {"panels": {key: query(url, expr) for key, expr in _node_gpu_queries().items()},
            "gpu": {(item["instance"], item["gpu"]) for item in series(url, gpu_variable.selector)},
            "cluster": {key: query(url, expr) for key, expr in _cluster_gpu_queries().items()},
            "report": report}


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
            scrape_failed_at: set[float] = set()  # readings with a failed scrape of the replay in the 3 s before
            while replay.elapsed() < end:
                tick = time.monotonic()
                offset = replay.elapsed()
                if query(prometheus.url, "min_over_time(up[3s]) == 0"):
                    scrape_failed_at.add(offset)
                # Prometheus serves both
                _read(prometheus.url, prometheus.url, offset, judged, _missed_iterations(prometheus.url))
                ranks |= {(item["metric"]["instance"], item["metric"]["run"])
                          for item in query(prometheus.url, recordings.RANK_GPU_MEMORY)}
                time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
            held, shown = _between_failed_scrapes(prometheus.url, lambda: (
                {expr: query(prometheus.url, expr) for expr in
                 ("count({__name__=~'stepscope_gpu_.*'})", recordings.GPU_SOURCE_UTILIZATION,
                  "count(DCGM_FI_DEV_GPU_UTIL)", f"count({families.PROCESS_GPU_MEMORY})")},
                _dashboards_and_report(prometheus.url)))
    yield judged, held, ranks, shown, scrape_failed_at


def _between_failed_scrapes(url: str, read: Callable[[], T], timeout: float = 20.0) -> T:
    """What `read` returns at a moment no target's scrape failed in the 3 s around it (the last read if none
    came within `timeout`, for the assertions to judge).

    The replay serves every target from one Python server, and Prometheus gives up on a scrape after the 1 s
    interval. On a loaded CI machine all five dcgm-exporter targets once read `up` 0 for 3 s at the end of the
    run: their series went stale, and the GPU source recordings with them, so the dashboards read empty."""
    deadline = time.monotonic() + timeout
    while True:
        if not query(url, "up == 0"):
            result = read()
            if not query(url, "min_over_time(up[3s]) == 0") or time.monotonic() > deadline:
                return result
        elif time.monotonic() > deadline:
            return read()
        time.sleep(0.5)


def _judgeable(result: Judged, scrape_failed_at: set[float]) -> list[Reading]:
    """The training readings taken at Prometheus' 1 s evaluation pace (Judged.paced) with no failed scrape of
    the replay in the 3 s before, as tests/test_corpus_verdicts.py judges its own; at least half must remain.
    In a clean-clone CI run three workloads read no verdict at the same two readings of their last 10 s;
    the module then recorded neither the engine's pace nor failed scrapes, so `_said` now shows both."""
    training = result.training()
    kept = [reading for reading in result.paced() if reading.offset not in scrape_failed_at]
    assert 2 * len(kept) >= len(training), f"{result.workload.name}: {len(kept)} of {len(training)} readings kept"
    return kept


def _said(result: Judged, scrape_failed_at: set[float]) -> str:
    """Each of the last 14 training readings as offset:verdict, marked where `_judgeable` leaves it out."""
    paced = {reading.offset for reading in result.paced()}
    marks = [f"{reading.offset:.0f}:{reading.verdict}{'' if reading.offset in paced else ' (unpaced)'}"
             f"{' (failed scrape)' if reading.offset in scrape_failed_at else ''}" for reading in result.training()]
    return f"{result.missed_iterations()} rule-group iterations missed; {', '.join(marks[-14:])}"


@pytest.mark.parametrize("name", WORKLOADS)
def test_each_workload_gets_its_verdict_from_dcgm_readings(judged: tuple, name: str) -> None:
    result = judged[0][name]
    expected = result.workload.expected_verdict
    seen = {reading.verdict for reading in result.training()} - {None, verdicts.IDLE}
    assert seen == {expected}, f"{name}: {dict(result.shares())}"
    last = [reading.verdict for reading in _judgeable(result, judged[4])][-10:]
    assert last == [expected] * 10, f"{name}: the last 10 s of training read {last}: {_said(result, judged[4])}"


@pytest.mark.parametrize("name", WORKLOADS)
def test_exactly_the_native_alerts_fire_from_dcgm_readings(judged: tuple, name: str) -> None:
    """Judged where the verdict is the workload's, at the readings `_judgeable` keeps: the alerts run without
    their `for`, so one failed scrape of dcgm-exporter (`up` 0, the one Python server behind every target late
    under load) shows StepscopeGpuCollectorDown, which takes five minutes of them (it did beside eight busy
    workers)."""
    result = judged[0][name]
    spoken = [reading for reading in _judgeable(result, judged[4])
              if reading.verdict == result.workload.expected_verdict]
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


def test_every_node_dashboard_gpu_query_has_data_from_dcgm_readings(judged: tuple) -> None:
    """Every query of the Node dashboard's GPU rows returns data with dcgm-exporter as the only GPU source, but
    those that read a field outside its default counters (or what the corpus lacks), each said why above."""
    panels = judged[3]["panels"]
    assert set(EMPTY_IN_DCGM_MODE) <= set(panels)
    empty = {key for key, result in panels.items() if not result}
    assert empty == set(EMPTY_IN_DCGM_MODE), f"empty: {sorted(empty - set(EMPTY_IN_DCGM_MODE))}, " \
        f"not empty: {sorted(set(EMPTY_IN_DCGM_MODE) - empty)}"
    nodes = {item["metric"]["instance"] for item in panels[("GPU memory", "A")]}
    assert nodes == set(WORKLOADS)  # each node's GPU, by dcgm-exporter's Hostname
    assert judged[3]["gpu"] == {(name, "0") for name in WORKLOADS}  # the `gpu` variable offers them


def test_the_report_reads_each_runs_gpu_memory_from_dcgm_readings(judged: tuple) -> None:
    """The report's per-GPU memory of each run: dcgm-exporter's FB_USED (MiB) in bytes, on the run's GPU."""
    for name in WORKLOADS:
        result = judged[3]["report"][name]
        assert [(item["metric"]["instance"], item["metric"]["gpu"]) for item in result] == [(name, "0")], name
        used = float(result[0]["value"][1])
        assert used > 0 and used % 2**20 == 0, (name, used)  # whole MiB, as dcgm-exporter reports them


def test_every_cluster_dashboard_gpu_query_has_data_from_dcgm_readings(judged: tuple) -> None:
    """The Cluster dashboard's GPU panels read the GPU source layer, not stepscope's own GPU families that a
    node with dcgm-exporter as its GPU source lacks: each GPU's namespace (the GPU-hours held idle per namespace)
    and each node's GPU count (the Nodes table) come from dcgm-exporter's readings too."""
    panels = judged[3]["cluster"]
    assert set(CLUSTER_EMPTY_IN_DCGM_MODE) <= set(panels)
    empty = {key for key, result in panels.items() if not result}
    assert empty == set(CLUSTER_EMPTY_IN_DCGM_MODE), f"empty: {sorted(empty - set(CLUSTER_EMPTY_IN_DCGM_MODE))}, " \
        f"not empty: {sorted(set(CLUSTER_EMPTY_IN_DCGM_MODE) - empty)}"
    gpus = {item["metric"]["instance"]: item["value"][1] for item in panels[("Nodes", "D")]}
    assert gpus == dict.fromkeys(WORKLOADS, "1")  # each node's one GPU, counted from dcgm-exporter's readings
    namespaces = {item["metric"]["namespace"] for item in panels[("GPU-hours held but idle per namespace", "A")]}
    assert namespaces == {"ml"}  # the pod the data-bound run's idle GPU is given to

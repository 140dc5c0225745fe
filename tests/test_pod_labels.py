"""Pod labels on every series of a rank: with the kubelet's PodResources socket given, the GPU, process and
pushed run series of a training process carry its pod, namespace and container (as dcgm-exporter labels its
GPU series), and the shipped rules give such a run the same recordings as a run without them.

Everything is real: a gRPC PodResources server on a unix socket, two exporters over the scripted fake NVML
(node-a with the socket, node-b without: the same two H100s, one rank holding memory on GPU 0), a rank of
the demo pushing to each through the hooks, Prometheus with the shipped rules scraping both.
"""

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from grafana.rules import RULE_FILES
from stepscope.contract import families, recordings, verdicts
from stepscope.exporter.collectors import gpu_events
from stepscope.exporter.collectors.gpu import GpuCollector
from stepscope.exporter.collectors.pods import PodAttribution, PodCollector, PodContainer, PodResourcesClient
from stepscope.exporter.exposition import render
from stepscope.exporter.gpu_processes import GpuProcessTable
from stepscope.exporter.ingest.families import FAMILIES as PUSHED
from stepscope.exporter.registered import RegisteredProcess
from stepscope_testkit.fake_nvml.scenario import load_fake_pynvml, make_gpu, write_scenario
from stepscope_testkit.podresources import FixtureContainer, FixturePod, serving
from stepscope_testkit.processes import Running, running_exporter, scrape
from tests.support.demos import gpus_for_runs, start_demo, stop
from tests.support.prometheus import query, running_prometheus, wait_for

pytestmark = pytest.mark.timeout(150)

GIVEN = make_gpu(0)["uuid"]  # the fake NVML's GPU 0; GPU 1 is given to no pod
POD = {"namespace": "ml", "pod": "trainer-0", "container": "pytorch"}
NO_POD = dict.fromkeys(POD, "")
LAYOUT = {0: (98, 72.5, ("podded", 0)), 1: (0, 0.0, None)}  # GPU index -> (NVML %, SM active %, holder)
PUSHED_NAMES = {name.removesuffix("_total") for name in PUSHED} | {"stepscope_training_last_push_timestamp_seconds"}


@dataclass(frozen=True)
class Nodes:
    podded: Running  # node-a: pod attribution on
    plain: Running  # node-b: off the cluster
    prometheus: Running
    rank_pid: int  # the podded rank's process


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    tmp = tmp_path_factory.mktemp("pod-labels")
    socket = tmp / "kubelet.sock"
    container = FixtureContainer(POD["container"], {"nvidia.com/gpu": (GIVEN,)})
    pods = [FixturePod(POD["namespace"], POD["pod"], (container,))]
    scenarios = {node: write_scenario(tmp / f"{node}.json", gpus_for_runs(LAYOUT, {})) for node in ("a", "b")}
    with serving(socket, pods), \
            running_exporter(tmp, f"--kubelet-pod-resources-socket={socket}", fake_nvml_scenario=scenarios["a"]) as a, \
            running_exporter(tmp, fake_nvml_scenario=scenarios["b"]) as b, \
            running_prometheus(tmp, {"node-a": a.url.removeprefix("http://"), "node-b": b.url.removeprefix("http://")},
                               RULE_FILES) as prometheus:
        demo = ("--steps", "0", "--slow-loader", "0.05")
        given = {"NVIDIA_VISIBLE_DEVICES": GIVEN}  # as the device plugin sets it in the container
        ranks = {"a": start_demo("podded", 0, 1, a.url, tmp / "podded.log", *demo, env=given),
                 "b": start_demo("plain", 0, 1, b.url, tmp / "plain.log", *demo)}
        try:
            for node, holder in (("a", ("podded", 0)), ("b", ("plain", 0))):
                layout = {**LAYOUT, 0: (*LAYOUT[0][:2], holder)}
                write_scenario(scenarios[node], gpus_for_runs(layout, {holder: ranks[node].pid}))
            yield Nodes(a, b, prometheus, ranks["a"].pid)
        finally:
            stop(ranks.values())


def _scrape_with(url: str, *names: str) -> list:
    """The parsed families of the first scrape that has samples of every one of `names`."""
    def found() -> list | None:
        parsed = list(text_string_to_metric_families(scrape(url)))
        present = {sample.name for family in parsed for sample in family.samples}
        return parsed if all(any(s.startswith(name) for s in present) for name in names) else None
    # the demo's first push after its torch import and first step: seconds alone, over 30 s on a 2-core machine
    # busy with the rest of the suite (a clean-clone run failed both tests at 30)
    parsed = wait_for(found, 120, 0.5)
    assert parsed, f"no scrape of {url} with {names}"
    return parsed


def _pod_of(labels: dict[str, str]) -> dict[str, str | None]:
    return {name: labels.get(name) for name in POD}


def test_every_gpu_process_and_pushed_series_of_the_rank_carries_its_pod(nodes: Nodes) -> None:
    parsed = _scrape_with(nodes.podded.url, families.PROCESS_GPU_MEMORY, "stepscope_step_seconds")
    checked: dict[str, set[str]] = {"gpu": set(), "process": set(), "pushed": set()}
    for family in parsed:
        for sample in family.samples:
            if family.name in (families.GPU_POD_INFO, families.PROCESS_POD_INFO):
                continue
            if "uuid" in sample.labels:  # every per-GPU family: GPU 0's pod, GPU 1 of none (empty values)
                expected = POD if sample.labels["uuid"] == GIVEN else NO_POD
                assert _pod_of(sample.labels) == expected, sample
                checked["gpu"].add(family.name)
            elif family.name.startswith("stepscope_process_"):
                expected = POD if sample.labels["pid"] == str(nodes.rank_pid) else NO_POD
                assert _pod_of(sample.labels) == expected, sample
                checked["process"].add(family.name)
            elif family.name in PUSHED_NAMES:
                assert _pod_of(sample.labels) == POD, sample
                checked["pushed"].add(family.name)
            else:  # node, collector-up and self families describe no pod
                assert not set(POD) & set(sample.labels), sample
    assert {families.GPU_UTILIZATION, families.GPU_INFO, families.GPU_SM_ACTIVE} <= checked["gpu"]
    assert {families.PROCESS_GPU_MEMORY, families.PROCESS_CPU_SECONDS.removesuffix("_total")} <= checked["process"]
    assert {"stepscope_step_seconds", "stepscope_steps", families.TRAINING_INFO} <= checked["pushed"]


def test_off_the_cluster_no_series_carries_pod_labels(nodes: Nodes) -> None:
    _scrape_with(nodes.plain.url, families.PROCESS_GPU_MEMORY, "stepscope_step_seconds")
    text = scrape(nodes.plain.url)  # as written: an empty label value would show here
    assert not [line for line in text.splitlines()
                if any(f'{{{label}="' in line or f',{label}="' in line for label in POD)]  # not pid_namespace


def _valueless(text: bytes) -> bytes:
    """The exposition with each sample's value blanked: two collectors read the fake's time-driven counters
    (energy, throttle time) a moment apart."""
    return re.sub(rb"(?m)^([^#].*) \S+$", rb"\1 _", text)


def test_the_labels_add_no_series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU cycle of the same fake NVML without and with attribution: the same series and values, the pod
    labels added (empty for the GPU of no pod) and nothing else."""
    monkeypatch.setenv("STEPSCOPE_FAKE_NVML_SCENARIO", str(write_scenario(tmp_path / "nvml.json", gpus_for_runs(
        LAYOUT, {("podded", 0): os.getpid()}))))
    monkeypatch.setattr(gpu_events, "WAIT_TIMEOUT_MS", 100)  # close() waits for one event wait to end
    attribution = PodAttribution()
    attribution.update([PodContainer("ml", "trainer-0", "pytorch", (GIVEN,))], {})
    cycles = []
    for pods in (None, attribution):
        collector = GpuCollector(GpuProcessTable(), nvml=load_fake_pynvml(), pods=pods)
        cycles.append(collector.collect())
        collector.close()
    plain = _valueless(render(cycles[0]))
    labelled = {s.labels["uuid"]: _pod_of(s.labels) for f in cycles[1] for s in f.samples if "uuid" in s.labels}
    assert labelled == {GIVEN: POD, make_gpu(1)["uuid"]: NO_POD}
    for family in cycles[1]:  # the labels taken off again: byte for byte the cycle without attribution
        family.samples = [s._replace(labels={k: v for k, v in s.labels.items() if k not in POD})
                          for s in family.samples]
    assert _valueless(render(cycles[1])) == plain and plain.count(b"\n") > 40
    assert b"pod=" not in plain


def test_a_podded_run_gets_the_same_recordings_as_one_without(nodes: Nodes) -> None:
    """Per recorded name, as many series for the podded run (and node) as for the plain one: no join lost
    (fewer), none split by the pod labels (more); bucket-wise series (`le`) left out, their bounds follow
    each run's own step times. The verdict is the same."""
    def per_name(selector: str) -> dict[str, str]:
        found = query(nodes.prometheus.url, f'count by (__name__) ({{{selector}, __name__=~".+:.+", le=""}})')
        return {item["metric"]["__name__"]: item["value"][1] for item in found}

    def same() -> tuple[dict, dict] | None:
        pairs = (per_name('run="podded"'), per_name('run="plain"')), \
            (per_name('instance="node-a", run=""'), per_name('instance="node-b", run=""'))
        found = [query(nodes.prometheus.url, f'{recordings.RUN_VERDICT}{{run="{run}"}}') for run in ("podded", "plain")]
        ready = all(found) and {v[0]["metric"]["verdict"] for v in found} == {verdicts.DATA_BOUND}
        return pairs if ready and all(podded == plain for podded, plain in pairs) else None

    assert wait_for(same, 60), (per_name('run="podded"'), per_name('run="plain"'))
    steps = query(nodes.prometheus.url, f'{families.STEPS_TOTAL}{{run="podded"}}')
    assert [_pod_of(item["metric"]) for item in steps] == [POD]  # the labels reached Prometheus


def test_a_group_keeps_its_pod_after_its_process_ends(tmp_path: Path) -> None:
    """A finished rank's group lives on until the ingest TTL (its last pushes: state idle); its series keep the
    pod they had rather than start again without it. Once the group is gone, so are its labels."""
    pods = [FixturePod("ml", "trainer-0", (FixtureContainer("pytorch", {"nvidia.com/gpu": (GIVEN,)}),))]
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={"NVIDIA_VISIBLE_DEVICES": GIVEN})
    groups = [RegisteredProcess(rank.pid, "done", "0", psutil.Process(rank.pid).create_time())]
    with serving(tmp_path / "kubelet.sock", pods) as kubelet:
        collector = PodCollector(PodResourcesClient(str(kubelet.socket)), registered=lambda: list(groups))
        try:
            collector.collect()
            assert collector.attribution.rank("done", "0") == tuple(POD.values())
            rank.kill()
            rank.wait()
            collector.collect()  # the process is gone, its group is not
            assert collector.attribution.rank("done", "0") == tuple(POD.values())
            groups.clear()  # the TTL dropped the group
            collector.collect()
            assert collector.attribution.rank("done", "0") == tuple(NO_POD.values())
        finally:
            rank.kill()
            collector.close()

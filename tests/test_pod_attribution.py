"""Pod attribution: with the kubelet's PodResources socket given, the exporter labels the GPUs and the training
processes of a node with their pod, namespace and container, and the rules join a rank to the GPUs that
dcgm-exporter reports for its pod.

Everything is real: a gRPC server implementing PodResources v1 `List` on a unix socket (fixture pods), the
exporter, training processes pushing through the hooks (one given GPUs by the device plugin's
NVIDIA_VISIBLE_DEVICES, one not), a dcgm-exporter exposition of an H100 corpus reading, Prometheus with the
shipped rules.
"""

import logging
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from grafana.rules import RULE_FILES
from stepscope.contract import FAMILIES, families, recordings
from stepscope.exporter.collectors import gpu_events
from stepscope.exporter.collectors import pods as pod_attribution
from stepscope.exporter.collectors.gpu import GpuCollector
from stepscope.exporter.collectors.pods import PodAttribution, PodCollector, PodContainer, PodResourcesClient
from stepscope.exporter.exposition import render
from stepscope.exporter.gpu_processes import GpuProcessTable
from stepscope.exporter.registered import RegisteredProcess
from stepscope_testkit.dcgm import PodRef, dcgm_body
from stepscope_testkit.fake_nvml.scenario import load_fake_pynvml, make_gpu, write_scenario
from stepscope_testkit.podresources import (
    FixtureContainer,
    FixturePod,
    PodResourcesServer,
    list_response,
    serving,
    serving_bytes,
)
from stepscope_testkit.processes import Running, running_exporter, sample_values, samples, scrape
from stepscope_testkit.replay import Workload, replaying
from stepscope_testkit.replay import recordings as corpus
from tests.support.dashboard_queries import panel_queries
from tests.support.demos import gpus_for_runs, start_demo, stop
from tests.support.prometheus import query, running_prometheus_config

pytestmark = pytest.mark.timeout(120)

WORKLOAD = corpus()[0].workloads["data_bound"]
BODY = WORKLOAD.bodies[len(WORKLOAD.bodies) // 2]
UUID = BODY.split("stepscope_gpu_info{", 1)[1].split('uuid="', 1)[1].split('"', 1)[0]  # the corpus H100
SECOND_GPU = "GPU-5a1e0000-0000-0000-0000-000000000001"
PODS = (
    FixturePod("ml", "trainer-0", (FixtureContainer("pytorch", {"nvidia.com/gpu": (UUID, SECOND_GPU)}),
                                   FixtureContainer("sidecar"))),
    FixturePod("ml", "other-0", (FixtureContainer("main", {"nvidia.com/gpu": ("GPU-b0",),
                                                           "example.com/fpga": ("fpga0",)}),)),
)
NODE = "node-a"
RUN = "podded"


@dataclass(frozen=True)
class Cluster:
    kubelet: PodResourcesServer
    exporter: Running
    prometheus: Running
    ranks: dict[str, subprocess.Popen]  # rank -> process


def _wait(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout} s")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("pods")
    socket = tmp / "kubelet.sock"
    dcgm = Workload(NODE, (0.0,), (dcgm_body(BODY, NODE, {UUID: PodRef("ml", "trainer-0", "pytorch")}),), {}, 0.0)
    flags = ("--collectors=node,process", f"--kubelet-pod-resources-socket={socket}")
    with serving(socket, PODS) as kubelet, running_exporter(tmp, *flags) as exporter, \
            replaying({NODE: dcgm}) as dcgm_target:
        paced = ("--steps", "0", "--slow-loader", "0.05")  # labelling needs no speed: 2% of a core each, not 100%
        ranks = {"0": start_demo(RUN, 0, 2, exporter.url, tmp / "rank0.log", *paced,
                                 env={"NVIDIA_VISIBLE_DEVICES": f"{UUID},{SECOND_GPU}"}),
                 "1": start_demo(RUN, 1, 2, exporter.url, tmp / "rank1.log", *paced)}
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(path) for path in RULE_FILES],
                  "scrape_configs": [
                      {"job_name": "stepscope", "static_configs": [
                          {"targets": [exporter.url.removeprefix("http://")], "labels": {"instance": NODE}}]},
                      {"job_name": "dcgm-exporter", "metrics_path": f"/{NODE}/metrics",
                       "static_configs": [{"targets": [dcgm_target.address]}]}]}
        try:
            with running_prometheus_config(tmp, config) as prometheus:
                yield Cluster(kubelet, exporter, prometheus, ranks)
        finally:
            stop(ranks.values())


def _scrape_once(url: str, good: Callable[[str], bool]) -> str | None:
    """A scrape of the exporter at `url` if `good` says so, else None (for _wait)."""
    body = scrape(url)
    return body if good(body) else None


def _named(text: str, family: str) -> list[dict[str, str]]:
    """The label sets of every sample of `family` in a scrape."""
    return [dict(labels) for (name, labels) in samples(text) if name == family]


def test_each_gpu_given_to_a_pod_carries_its_pod(cluster: Cluster) -> None:
    text = _wait(lambda: _scrape_once(cluster.exporter.url, lambda body: families.GPU_POD_INFO in body))
    gpus = {labels["uuid"]: (labels["namespace"], labels["pod"], labels["container"])
            for labels in _named(text, families.GPU_POD_INFO)}
    assert gpus == {UUID: ("ml", "trainer-0", "pytorch"), SECOND_GPU: ("ml", "trainer-0", "pytorch"),
                    "GPU-b0": ("ml", "other-0", "main")}  # not the FPGA, not the sidecar


def test_a_rank_carries_its_pod_container_once_per_gpu_of_it(cluster: Cluster) -> None:
    found = _wait(lambda: {tuple(sorted(labels.items()))
                           for labels in _named(scrape(cluster.exporter.url), families.PROCESS_POD_INFO)})
    pid = str(cluster.ranks["0"].pid)
    assert found == {tuple(sorted({"pid": pid, "run": RUN, "rank": "0", "namespace": "ml", "pod": "trainer-0",
                                   "container": "pytorch", "uuid": uuid}.items())) for uuid in (UUID, SECOND_GPU)}
    # rank 1 was given no GPU by a device plugin (no NVIDIA_VISIBLE_DEVICES): it stays unlabelled


def test_the_rules_join_the_rank_to_its_dcgm_gpu_by_pod(cluster: Cluster) -> None:
    """dcgm-exporter knows the corpus GPU (index 0) only: rank 0 is found on it through its pod, container and
    UUID, valued with the GPU's memory in use; rank 1 (no pod container) on none."""
    joined = _wait(lambda: query(cluster.prometheus.url, f'{recordings.RANK_GPU_MEMORY}{{run="{RUN}"}}'))
    assert [(item["metric"]["instance"], item["metric"]["gpu"], item["metric"]["rank"]) for item in joined] == [
        (NODE, "0", "0")]
    used = sample_values(BODY, families.GPU_MEMORY_USED)[0]
    assert abs(float(joined[0]["value"][1]) - used) <= 1024 * 1024  # MiB from dcgm-exporter
    # waited for as the join is: a late scrape of dcgm-exporter on a busy machine left it empty at one reading
    source = _wait(lambda: query(cluster.prometheus.url, recordings.GPU_SOURCE_UTILIZATION))
    assert [(item["metric"]["instance"], item["metric"]["gpu"]) for item in source] == [(NODE, "0")]


def test_the_cluster_dashboard_counts_the_gpus_dcgm_exporter_reports(cluster: Cluster) -> None:
    """The Cluster dashboard's "GPUs" stat reads each GPU's up from the node's GPU source: here dcgm-exporter's one
    GPU, with stepscope's GPU collector off (stepscope_gpu_up alone left it blank)."""
    (stat,) = [q.expr for q in panel_queries() if (q.dashboard, q.panel) == ("stepscope-cluster.json", "GPUs")]
    shown = _wait(lambda: query(cluster.prometheus.url, stat))
    assert [float(item["value"][1]) for item in shown] == [1.0]


def test_one_list_call_per_collection_cycle(cluster: Cluster) -> None:
    """The cost on the kubelet: the exporter collects every 0.5 s here (5 s by default) and calls List once."""
    before, started = cluster.kubelet.answered(), time.monotonic()
    time.sleep(3)
    calls, cycles = cluster.kubelet.answered() - before, (time.monotonic() - started) / 0.5
    assert 0 < calls <= cycles + 1


def test_off_the_cluster_nothing_changes(tmp_path: Path) -> None:
    with running_exporter(tmp_path, "--collectors=node,process") as exporter:
        text = scrape(exporter.url)
    assert "pod_info" not in text and 'collector="pods"' not in text


def test_an_unreachable_kubelet_fails_the_pods_collector_alone(tmp_path: Path) -> None:
    with running_exporter(tmp_path, "--collectors=node,process",
                          f"--kubelet-pod-resources-socket={tmp_path / 'absent.sock'}") as exporter:
        text = _wait(lambda: _scrape_once(exporter.url, lambda body: sample_values(
            body, families.COLLECTOR_ERRORS, collector="pods") not in ([], [0.0])))
        assert requests.get(f"{exporter.url}/-/healthy", timeout=5).ok
    assert sample_values(text, families.COLLECTOR_ERRORS, collector="pods")[0] >= 1
    (line,) = [line for line in exporter.log().splitlines() if "collector pods failed" in line]
    assert f"PodResources List on {tmp_path / 'absent.sock'}: UNAVAILABLE" in line  # one line, no gRPC dump
    assert sample_values(text, families.COLLECTOR_ERRORS, collector="node") == [0.0]
    assert families.PROCESS_POD_INFO not in text


def test_the_pod_families_are_the_contract_s(cluster: Cluster) -> None:
    """tests/test_metric_contract.py checks every other family of a full scrape; these need a kubelet (and,
    for the process family, the trainer's first pass through the process collector)."""
    text = _wait(lambda: _scrape_once(cluster.exporter.url, lambda body: all(
        _named(body, family) for family in (families.GPU_POD_INFO, families.PROCESS_POD_INFO))))
    for family in text_string_to_metric_families(text):
        if family.name in (families.GPU_POD_INFO, families.PROCESS_POD_INFO):
            spec = FAMILIES[family.name]
            assert family.type == spec.type and {tuple(sorted(s.labels)) for s in family.samples} == {
                tuple(sorted(spec.labels))}, family.name
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


# Shared and time-sliced GPUs, and a kubelet that stops answering: the collector and the attribution on their own,
# against the same PodResources server, with real processes for the ranks.

SHARED = "GPU-5a1e0000-0000-0000-0000-00000000000a"
ALONE = "GPU-5a1e0000-0000-0000-0000-00000000000b"


def _pod(name: str, *devices: str, container: str = "train") -> FixturePod:
    return FixturePod("ml", name, (FixtureContainer(container, {"nvidia.com/gpu": devices}),))


def _sleeper(hostname: str | None, visible: str) -> subprocess.Popen:
    """A process as a container's: the device plugin's NVIDIA_VISIBLE_DEVICES, the runtime's HOSTNAME (the pod's
    name), or none (a runtime that does not set it)."""
    env = {"NVIDIA_VISIBLE_DEVICES": visible, **({"HOSTNAME": hostname} if hostname is not None else {})}
    return subprocess.Popen(["sleep", "60"], env=env)


def _registered(processes: dict[str, subprocess.Popen]) -> list[RegisteredProcess]:
    return [RegisteredProcess(p.pid, "shared", rank, psutil.Process(p.pid).create_time())
            for rank, p in processes.items()]


def _collected(socket: Path, pods: list[FixturePod], processes: dict[str, subprocess.Popen]) -> tuple[
        dict[str, set[tuple[str, ...]]], PodCollector, str]:
    """gpu_pod_info (uuid -> label sets) and process_pod_info (rank -> label sets) of one cycle, the collector and
    the cycle's text."""
    with serving(socket, pods):
        collector = PodCollector(PodResourcesClient(str(socket)), registered=lambda: _registered(processes))
        text = render(collector.collect()).decode()
    found: dict[str, set[tuple[str, ...]]] = {}
    for name, pairs in samples(text):
        labels = dict(pairs)
        key = labels["uuid"] if name == families.GPU_POD_INFO else labels["rank"]
        found.setdefault(key, set()).add(tuple(labels[label] for label in ("namespace", "pod", "uuid")))
    return found, collector, text


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_two_pods_sharing_a_gpu_each_get_their_own_pod_and_the_gpu_no_single_one(
        tmp_path: Path, order: tuple[int, int]) -> None:
    """Before, pod b's rank was labelled pod a (the first container sharing a GPU) and the GPU series got the
    pod listed last, flipping with the kubelet's order."""
    pods = [_pod("a", SHARED), _pod("b", SHARED, ALONE)]
    pods = [pods[i] for i in order]
    processes = {"0": _sleeper("a", SHARED), "1": _sleeper("b", f"{SHARED},{ALONE}"), "2": _sleeper(None, SHARED)}
    try:
        found, collector, _ = _collected(tmp_path / "kubelet.sock", pods, processes)
        attribution = collector.attribution
        assert attribution.rank("shared", "0") == ("ml", "a", "train")
        assert attribution.rank("shared", "1") == ("ml", "b", "train")
        assert attribution.rank("shared", "2") == ("", "", "")  # no hostname: cannot be told, no pod
        assert found["0"] == {("ml", "a", SHARED)} and found["1"] == {("ml", "b", SHARED), ("ml", "b", ALONE)}
        assert "2" not in found
        assert found[SHARED] == {("ml", "a", SHARED), ("ml", "b", SHARED)}  # the info lists every holder
        assert attribution.gpu(SHARED) == ("", "", "")  # several pods: no single one on its series
        assert attribution.gpu(ALONE) == ("ml", "b", "train")
        pids = {rank: p.pid for rank, p in processes.items()}
        assert attribution.processes(pids.values()) == {pids["0"]: ("ml", "a", "train"),
                                                        pids["1"]: ("ml", "b", "train"), pids["2"]: ("", "", "")}
        collector.close()
    finally:
        stop(processes.values())


def test_time_sliced_gpus_are_attributed_by_uuid(tmp_path: Path) -> None:
    """NVIDIA's device plugin with time-slicing lists `<uuid>::<replica>`: before, such a GPU carried no pod and
    gpu_pod_info{uuid="GPU-...::0"} joined nothing. A container given two replicas of one GPU lists it once."""
    pods = [_pod("a", f"{SHARED}::0"), _pod("b", f"{SHARED}::3"), _pod("c", f"{ALONE}::1", f"{ALONE}::2")]
    processes = {"0": _sleeper("a", SHARED), "1": _sleeper("c", ALONE)}
    try:
        found, collector, text = _collected(tmp_path / "kubelet.sock", pods, processes)
        attribution = collector.attribution
        assert found[SHARED] == {("ml", "a", SHARED), ("ml", "b", SHARED)}
        assert found[ALONE] == {("ml", "c", ALONE)}
        assert len([line for line in text.splitlines()  # no duplicate series
                    if line.startswith(families.GPU_POD_INFO) and f'uuid="{ALONE}"' in line]) == 1
        assert attribution.gpu(SHARED) == ("", "", "") and attribution.gpu(ALONE) == ("ml", "c", "train")
        assert attribution.rank("shared", "0") == ("ml", "a", "train")
        assert attribution.rank("shared", "1") == ("ml", "c", "train")
        collector.close()
    finally:
        stop(processes.values())


@pytest.mark.parametrize("answer", [b"\xff\xfe\xfd not protobuf \x00\x01",
                                    list_response([_pod("pX", SHARED)]).SerializeToString().replace(b"pX", b"p\xff")],
                         ids=["garbage", "invalid-utf8-pod-name"])
def test_a_kubelet_answer_that_is_no_list_response_fails_in_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, answer: bytes) -> None:
    """A socket that answers garbage, or a pod name that is not UTF-8: gRPC logged the deserializer's traceback
    at ERROR (7 lines, 112 in 10 s of an exporter at --collect-interval 0.5) besides the collector's own line."""
    socket = tmp_path / "kubelet.sock"
    with serving_bytes(socket, answer), caplog.at_level(logging.DEBUG):
        client = PodResourcesClient(str(socket))
        with pytest.raises(ConnectionError) as failed:
            client.containers()
        client.close()
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == []
    assert f"the answer ({len(answer)} bytes) is no ListPodResourcesResponse" in str(failed.value)


def test_a_container_listed_twice_publishes_each_gpu_once(tmp_path: Path) -> None:
    """A List answer naming one pod container twice (a pod recreated under its name while the old one is listed, a
    broken kubelet): each of its GPUs was published twice with the same labels, a duplicate series."""
    pods = [_pod("a", SHARED), _pod("a", SHARED, ALONE)]
    found, collector, text = _collected(tmp_path / "kubelet.sock", pods, {})
    collector.close()
    lines = [line for line in text.splitlines() if line.startswith(families.GPU_POD_INFO + "{")]
    assert len(lines) == len(set(lines)) == 2
    assert found == {SHARED: {("ml", "a", SHARED)}, ALONE: {("ml", "a", ALONE)}}
    assert collector.attribution.gpu(SHARED) == collector.attribution.gpu(ALONE) == ("ml", "a", "train")


def _answer(collector: PodCollector) -> list | None:
    """A cycle's families, None while List fails (for _wait)."""
    try:
        return list(collector.collect())
    except ConnectionError:
        return None


def test_labels_outlive_a_kubelet_hiccup_and_not_a_kubelet_gone(tmp_path: Path) -> None:
    """Before, the first failed List dropped gpu_pod_info while the GPU series kept their pod for as long as the
    kubelet stayed away. Now the last answer stands for STALE_AFTER_FAILED_LISTS - 1 failed cycles (counted as
    errors), then the attribution is cleared with it; the kubelet back, the labels are back."""
    socket = tmp_path / "kubelet.sock"
    processes = {"0": _sleeper("a", SHARED)}
    try:
        with serving(socket, [_pod("a", SHARED)]):
            collector = PodCollector(PodResourcesClient(str(socket)), registered=lambda: _registered(processes))
            answered = render(collector.collect())
        for _ in range(pod_attribution.STALE_AFTER_FAILED_LISTS - 1):  # a hiccup: nothing changes, each an error
            assert render(collector.collect()) == answered and "UNAVAILABLE" in collector.failed_reading
            assert collector.attribution.gpu(SHARED) == ("ml", "a", "train")
            assert collector.attribution.rank("shared", "0") == ("ml", "a", "train")
        with pytest.raises(ConnectionError, match="UNAVAILABLE"):
            collector.collect()
        assert collector.attribution.gpu(SHARED) == ("", "", "")  # as gpu_pod_info: gone
        assert collector.attribution.rank("shared", "0") == ("", "", "")
        assert collector.attribution.processes([processes["0"].pid]) == {processes["0"].pid: ("", "", "")}
        with serving(socket, [_pod("a", SHARED)]):  # the channel reconnects after its backoff (1 s, growing)
            assert render(_wait(lambda: _answer(collector))) == answered and collector.failed_reading == ""
        assert collector.attribution.gpu(SHARED) == ("ml", "a", "train")
        collector.close()
    finally:
        stop(processes.values())


def test_labels_come_back_soon_after_a_kubelet_gone_for_half_a_minute(tmp_path: Path) -> None:
    """gRPC's reconnect backoff grows to 120 s by default (1 s, x1.6 an attempt): after a kubelet gone for 30 s
    its next attempt came about 13 s after the kubelet was back, up to two minutes after a longer absence. The
    channel tries at least every 2 s (pods.RECONNECT_MAX_MS), so the next cycles find it."""
    socket = tmp_path / "kubelet.sock"
    with serving(socket, [_pod("a", SHARED)]):
        client = PodResourcesClient(str(socket))
        assert client.containers()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the pods collector asks every cycle meanwhile
        with pytest.raises(ConnectionError):
            client.containers()
        time.sleep(1)
    with serving(socket, [_pod("a", SHARED)]):
        back = time.monotonic()
        while True:
            try:
                assert client.containers()
                break
            except ConnectionError:
                time.sleep(0.2)
        waited = time.monotonic() - back
    client.close()
    assert waited < 6, f"List answered {waited:.1f} s after the kubelet was back"


def test_a_list_answer_past_grpc_s_default_4_mib_is_read(tmp_path: Path) -> None:
    """A node of 100 pods whose device plugin lists one id per MiB of GPU memory (HAMi's vGPU sharing) answers
    List with 4.6 MB: gRPC's default limit, 4 MiB, failed every cycle with RESOURCE_EXHAUSTED ('Received
    message larger than max (4600790 vs. 4194304)') and the node's pods were never labelled, as dcgm-exporter's
    were on such nodes until it raised its limit. The kubelet's tools take 16 MiB, and so does the client now."""
    pods = [FixturePod("ml", f"infer-{index}", (FixtureContainer("server", {
        "nvidia.com/gpu": (f"GPU-{index:08d}-0000-0000-0000-000000000000",),
        "volcano.sh/vgpu-memory": tuple(f"GPU-{index:08d}-0000-0000-0000-000000000000-{mib}" for mib in range(1000)),
    }),)) for index in range(100)]
    assert list_response(pods).ByteSize() > 4 * 1024 * 1024
    with serving(tmp_path / "kubelet.sock", pods):
        client = PodResourcesClient(str(tmp_path / "kubelet.sock"))
        try:
            containers = client.containers()
        finally:
            client.close()
    assert len(containers) == 100
    assert containers[99].labels == ("ml", "infer-99", "server")
    assert containers[99].devices == ("GPU-00000099-0000-0000-0000-000000000000",)


@pytest.mark.parametrize("written", ["kubelet.sock", "unix://{socket}"])
def test_the_socket_flag_takes_a_relative_path_and_the_kubelet_s_url_form(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str) -> None:
    """gRPC read `kubelet.sock` (run from its directory) as a URL's host and `unix:///...` (the kubelet's own way of
    writing it) as a path under `unix:`: the exporter started and every pods cycle failed with 'the target uri is
    not valid', though the socket was there. Both now reach it."""
    from stepscope.exporter.cli import build_parser

    socket = tmp_path / "kubelet.sock"
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["--kubelet-pod-resources-socket", written.format(socket=socket)])
    with serving(socket, [_pod("a", SHARED)]):
        client = PodResourcesClient(args.kubelet_pod_resources_socket)
        try:
            assert [container.labels for container in client.containers()] == [("ml", "a", "train")]
        finally:
            client.close()


def _nvml_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: int) -> list[str]:
    """The fake NVML with `gpus` idle H100s for this test's GPU collectors; their UUIDs by index."""
    layout = {index: (0, 0.0, None) for index in range(gpus)}
    monkeypatch.setenv("STEPSCOPE_FAKE_NVML_SCENARIO", str(write_scenario(tmp_path / "nvml.json",
                                                                          gpus_for_runs(layout, {}))))
    monkeypatch.setattr(gpu_events, "WAIT_TIMEOUT_MS", 100)  # close() waits for one event wait to end
    return [make_gpu(index)["uuid"] for index in range(gpus)]


def test_gpu_indices_of_the_index_strategy_are_published_by_the_gpu_s_uuid(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """NVIDIA's device plugin with --device-id-strategy=index lists NVML indices ("0"; "2:1" for a MIG device) and
    puts them in NVIDIA_VISIBLE_DEVICES. Before, gpu_pod_info and process_pod_info carried uuid="0" and the GPU
    series (labelled by UUID) no pod. Now the GPU collector's index -> UUID names them; a MIG index, which names
    no whole GPU, stays off the info families (warned about once); the rank gets its pod either way. The daemon's
    first List runs before the GPU collector's first cycle: the indices it cannot name yet are not warned about."""
    uuids = _nvml_of(tmp_path, monkeypatch, 3)
    mig = FixturePod("ml", "mig", (FixtureContainer("main", {"nvidia.com/mig-1g.10gb": ("2:1",)}),))
    pods = [_pod("a", "0", "1"), mig]
    processes = {"0": _sleeper("a", "0,1")}
    try:
        with serving(tmp_path / "kubelet.sock", pods):
            collector = PodCollector(PodResourcesClient(str(tmp_path / "kubelet.sock")),
                                     registered=lambda: _registered(processes))
            gpu = GpuCollector(GpuProcessTable(), nvml=load_fake_pynvml(), pods=collector.attribution)
            collector.collect()  # the daemon's first List (`prime`), before the GPU collector ran
            text = render([*gpu.collect(), *collector.collect()]).decode()
            for _ in range(pod_attribution.UNPUBLISHED_WARN_CYCLES):
                collector.collect()
            gpu.close()
            collector.close()
    finally:
        stop(processes.values())
    info = {(name, labels["uuid"], labels["pod"]) for name, pairs in samples(text) for labels in [dict(pairs)]
            if name in (families.GPU_POD_INFO, families.PROCESS_POD_INFO)}
    assert info == {(family, uuid, "a") for family in (families.GPU_POD_INFO, families.PROCESS_POD_INFO)
                    for uuid in uuids[:2]}
    up = {dict(pairs)["gpu"]: dict(pairs).get("pod", "") for name, pairs in samples(text) if name == families.GPU_UP}
    assert up == {"0": "a", "1": "a", "2": ""}  # the MIG device's GPU: no pod, as with MIG UUIDs
    assert collector.attribution.rank("shared", "0") == ("ml", "a", "train")
    warned = [record.args[0] for record in caplog.records if "names no GPU UUID" in record.getMessage()]
    assert warned == ["2:1"]


def test_a_reused_pid_does_not_keep_the_pod_of_the_process_it_named_before(tmp_path: Path) -> None:
    """The process collector's pod labels come from each process's environment, read once per process. Keyed by
    the pid alone, a pid the kernel gave to a process of another pod kept the first pod's labels for as long as
    the process collector saw the pid every cycle. Keyed by pid and start time, the new process is read."""
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)

    def started(ticks: int, visible: str) -> None:
        (proc / "4242" / "environ").write_bytes(f"NVIDIA_VISIBLE_DEVICES={visible}\0".encode())
        (proc / "4242" / "stat").write_text(f"4242 (python) S {' '.join(['1'] * 18)} {ticks} 0 0\n")

    attribution = PodAttribution(str(proc))
    attribution.update([PodContainer("ml", "a", "train", (SHARED,)), PodContainer("ml", "b", "train", (ALONE,))], {})
    started(100, SHARED)
    assert attribution.processes([4242]) == {4242: ("ml", "a", "train")}
    (proc / "4242" / "environ").write_bytes(f"NVIDIA_VISIBLE_DEVICES={ALONE}\0".encode())
    assert attribution.processes([4242]) == {4242: ("ml", "a", "train")}  # the same process: read once
    started(900, ALONE)  # the pid reused by a process of pod b
    assert attribution.processes([4242]) == {4242: ("ml", "b", "train")}

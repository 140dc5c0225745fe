"""What pod attribution costs the exporter per collection cycle (docs/cluster.md, "What it costs").

A real PodResources server (stepscope_testkit.podresources, gRPC on a unix socket) lists a full node: 110
pods (the kubelet's default maximum), of which 8 hold one H100 each, the rest none (their answer is still
read and skipped). The pods collector runs its cycle against it with 0 and with 8 registered training
processes (real sleeping processes, each given its GPU in NVIDIA_VISIBLE_DEVICES), and beside it the
process collector's cycle for the same 8 processes, the collector it runs next to. Medians and the
interquartile range over many cycles, CPU time of this process per cycle (the server's share included).
Prints a markdown table and writes benchmarks/results/pods.md.

    python benchmarks/bench_pods.py [--cycles 300]
"""

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from stepscope.exporter.collectors.gpu import GpuCollector  # noqa: E402
from stepscope.exporter.collectors.pods import PodCollector, PodResourcesClient  # noqa: E402
from stepscope.exporter.collectors.process import ProcessCollector  # noqa: E402
from stepscope.exporter.exposition import ExpositionStore  # noqa: E402
from stepscope.exporter.gpu_processes import GpuProcessTable  # noqa: E402
from stepscope.exporter.ingest.access import AccessPolicy  # noqa: E402
from stepscope.exporter.ingest.api import PushApi  # noqa: E402
from stepscope.exporter.ingest.parser import PushLimits  # noqa: E402
from stepscope.exporter.ingest.store import GroupStore, StoreLimits  # noqa: E402
from stepscope.exporter.registered import RegisteredProcess  # noqa: E402
from stepscope.exporter.scheduler import Scheduler  # noqa: E402
from stepscope.exporter.server import PushRequest  # noqa: E402
from stepscope_testkit.fake_nvml.scenario import load_fake_pynvml, make_gpu, make_scenario, write_scenario  # noqa: E402
from stepscope_testkit.ingest_bodies import hooks_body  # noqa: E402
from stepscope_testkit.podresources import FixtureContainer, FixturePod, serving  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "pods.md"
GPUS = [make_gpu(i)["uuid"] for i in range(8)]  # the fake NVML's H100s


def node() -> list[FixturePod]:
    """110 pods: 8 training pods with one GPU each, 102 without devices (system and CPU pods)."""
    gpu_pods = [FixturePod("ml", f"train-{i}", (FixtureContainer("pytorch", {"nvidia.com/gpu": (uuid,)}),))
                for i, uuid in enumerate(GPUS)]
    other = [FixturePod("kube-system", f"agent-{i}", (FixtureContainer("main"), FixtureContainer("sidecar")))
             for i in range(102)]
    return gpu_pods + other


def timed(cycle: Callable[[], object], cycles: int) -> tuple[list[float], list[float]]:
    """(wall ms, CPU ms of this process) of each cycle."""
    me = psutil.Process()
    wall, cpu = [], []
    for _ in range(cycles):
        cpu_before, start = sum(me.cpu_times()[:2]), time.perf_counter()
        list(cycle())
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((sum(me.cpu_times()[:2]) - cpu_before) * 1e3)
    return wall, cpu


def row(name: str, wall: list[float], cpu: list[float]) -> str:
    q = statistics.quantiles(wall, n=4)
    return (f"| {name} | {statistics.median(wall):.2f} | {q[0]:.2f}-{q[2]:.2f} | "
            f"{statistics.mean(cpu):.2f} |")


@contextlib.contextmanager
def exporter_parts(pids: list[int], client: PodResourcesClient | None, scenario: Path):
    """The exporter's collectors, push API and store for the node, with pod attribution when `client` is
    given; yields (scheduler, collectors by name, push of one rank, store)."""
    os.environ["STEPSCOPE_FAKE_NVML_SCENARIO"] = str(scenario)
    store, table = ExpositionStore(), GpuProcessTable()
    push_api = PushApi(store, GroupStore(StoreLimits(512, 2000, 32, 600.0)), AccessPolicy(None, (), ()),
                       max_body_bytes=1 << 20, limits=PushLimits(128, 2000, 32))
    pods = PodCollector(client, registered=push_api.registered_processes) if client else None
    attribution = pods.attribution if pods else None
    collectors = [GpuCollector(table, nvml=load_fake_pynvml(), pods=attribution),
                  ProcessCollector(table, registered=push_api.registered_processes, pods=attribution)]
    if pods:
        push_api.label_pods(pods.attribution)

    started = [f'start_time="{psutil.Process(pid).create_time():.2f}"'.encode() for pid in pids]

    def push(rank: int, steps: int) -> None:  # as the rank's own process, so the exporter finds it
        body = hooks_body(pid=pids[rank], steps=steps, seed=rank).encode().replace(
            b'start_time="1712345678.25"', started[rank])
        request = PushRequest("PUT", f"/metrics/job/stepscope/run/bench/rank/{rank}", {}, "127.0.0.1", len(body))
        assert push_api.handle(request, body).status == 200

    for rank in range(len(pids)):
        push(rank, 1000)
    every = [*([pods] if pods else []), *collectors]
    scheduler = Scheduler(every, 5.0, store)
    for _ in range(2):  # the pods' answer first, then GPM's second sample
        for collector in every:
            scheduler.run_once(collector)
    try:
        yield scheduler, {c.name: c for c in collectors}, push, store
    finally:
        for collector in collectors:
            collector.close()


def _ms(call: Callable[..., object], *args: object) -> float:
    """Wall milliseconds of one call."""
    start = time.perf_counter()
    call(*args)
    return (time.perf_counter() - start) * 1e3


def _push_and_scrape(push: Callable[[int, int], None], steps: int, store: ExpositionStore) -> None:
    push(0, steps)
    store.body()


def exposition_rows(pids: list[int], client: PodResourcesClient, scenario: Path, cycles: int) -> list[str]:
    """Series, bytes and times of the node's scrape without and with pod attribution; the two exporters'
    cycles alternate, so both see the same load on a shared machine."""
    modes = {"off the cluster": None, "pod attribution": client}
    with contextlib.ExitStack() as stack:
        parts = {mode: stack.enter_context(exporter_parts(pids, given, scenario)) for mode, given in modes.items()}
        times: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}
        steps = iter(range(2000, 2000 + 2 * cycles))
        for _ in range(cycles):
            for mode, (scheduler, collectors, push, store) in parts.items():
                for name, collector in collectors.items():
                    times[mode].setdefault(name, []).append(_ms(scheduler.run_once, collector))
                times[mode].setdefault("push + scrape", []).append(_ms(_push_and_scrape, push, next(steps), store))
        rows = []
        for mode, (_, _, _, store) in parts.items():
            lines = [line for line in store.body().splitlines() if line and not line.startswith(b"#")]
            series = sum(1 for line in lines if b"_pod_info{" not in line and b'collector="pods"' not in line)
            labelled = sum(1 for line in lines if b'pod="train-' in line and b"_pod_info{" not in line)
            cells = " | ".join(f"{statistics.median(t):.3f} ({statistics.quantiles(t, n=4)[0]:.3f}-"
                               f"{statistics.quantiles(t, n=4)[2]:.3f})" for t in times[mode].values())
            rows.append(f"| {mode} | {series} | {labelled} | {len(store.body())} | "
                        f"{len(store.body(compressed=True))} | {cells} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=300)
    cycles = parser.parse_args().cycles
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                                 env={"NVIDIA_VISIBLE_DEVICES": uuid}) for uuid in GPUS]
    try:
        registered = [RegisteredProcess(p.pid, "bench", str(rank), psutil.Process(p.pid).create_time())
                      for rank, p in enumerate(sleepers)]
        with tempfile.TemporaryDirectory() as tmp, serving(Path(tmp) / "kubelet.sock", node()) as kubelet:
            client = PodResourcesClient(str(kubelet.socket))
            rows = []
            for label, processes in (("0 registered processes", []), ("8 registered processes", registered)):
                collector = PodCollector(client, registered=lambda processes=processes: processes)
                list(collector.collect())  # warm: the channel connects, environments read once
                rows.append(row(f"pods collector, {label}", *timed(collector.collect, cycles)))
            rows.append(row("List call alone (110 pods)", *timed(client.containers, cycles)))
            process = ProcessCollector(GpuProcessTable(), registered=lambda: registered)
            list(process.collect())
            rows.append(row("process collector, 8 registered processes (for scale)", *timed(process.collect, cycles)))
            calls = kubelet.answered()
            scenario = make_scenario(gpus=0, processes_per_gpu=0)
            scenario["gpus"] = [make_gpu(i, processes=[(p.pid, 4 << 30)]) for i, p in enumerate(sleepers)]
            exposition = exposition_rows([p.pid for p in sleepers], client,
                                         write_scenario(Path(tmp) / "nvml.json", scenario), cycles)
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    table = "\n".join([
        "| cycle | median ms | IQR ms | CPU ms (mean) |", "|---|---:|---:|---:|", *rows])
    labels = "\n".join([
        "| exporter | series | of them with a pod | scrape bytes | gzip bytes | GPU cycle ms | process cycle ms | "
        "push + scrape ms |", "|---|---:|---:|---:|---:|---:|---:|---:|", *exposition])
    text = (f"# Pod attribution cost per collection cycle\n\n`python benchmarks/bench_pods.py --cycles {cycles}` "
            f"({cycles} cycles each, a 110-pod node with 8 GPU pods; {calls} List calls answered: one per cycle "
            f"of the first three rows plus one warm-up per collector). The gRPC server runs in the measuring "
            f"process, so the CPU column holds the kubelet's side of each call too.\n\n{table}\n\n"
            f"## The pod labels on the exposition\n\nThe node's scrape (8 fake H100s, each held by one of 8 "
            f"ranks, each rank's hooks body pushed: 9 phases, 16 buckets) from the exporter's own collectors, "
            f"push API and store, off the cluster and with pod attribution (every GPU, process and pushed series "
            f"labelled with its namespace, pod and container). Series: those of both (the pod info families "
            f"and the pods collector's own series aside: 8 + 8 + 3 with attribution). Times: median (IQR) over "
            f"{cycles} cycles, in ms, the two exporters' cycles alternating; "
            f"'push + scrape' is one rank's push followed by assembling the scrape, where the pushed group's "
            f"chunks are relabelled and compressed.\n\n{labels}\n")
    print(text)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()

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

from stepscope.exporter.collectors.pods import PodCollector, PodResourcesClient  # noqa: E402
from stepscope.exporter.collectors.process import ProcessCollector  # noqa: E402
from stepscope.exporter.gpu_processes import GpuProcessTable  # noqa: E402
from stepscope.exporter.registered import RegisteredProcess  # noqa: E402
from stepscope_testkit.podresources import FixtureContainer, FixturePod, serving  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "pods.md"
GPUS = [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(8)]


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
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    table = "\n".join([
        "| cycle | median ms | IQR ms | CPU ms (mean) |", "|---|---:|---:|---:|", *rows])
    text = (f"# Pod attribution cost per collection cycle\n\n`python benchmarks/bench_pods.py --cycles {cycles}` "
            f"({cycles} cycles each, a 110-pod node with 8 GPU pods; {calls} List calls answered: one per cycle "
            f"of the first three rows plus one warm-up per collector). The gRPC server runs in the measuring "
            f"process, so the CPU column holds the kubelet's side of each call too.\n\n{table}\n")
    print(text)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()

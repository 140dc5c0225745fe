"""What serving HTTP costs the exporter, this tree against a revision (issue 20: no more RSS than
nvitop-exporter; the server moved from aiohttp to h11 at e4bfa3d): RSS after importing the exporter,
CPU per keep-alive request and CPU per connection churned over the connection cap.

    PYTHONPATH=. python benchmarks/bench_http_cost.py --baseline-rev 6fb22ff [--rounds 3] [--peer-python PYTHON]

Each round measures both trees one after the other, alternating which goes first; an exporter runs
with no collectors so only the HTTP layer spends CPU. Results: benchmarks/results/http_cost.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import baseline_tree, commit_of

from stepscope_testkit import results
from stepscope_testkit.processes import REPO_ROOT, free_port, wait_http_ok

RESULTS = REPO_ROOT / "benchmarks" / "results" / "http_cost.md"
REQUESTS = 4000
PIPELINED = 50
CHURN_ROUNDS = 10
CHURN_BATCH = 200  # connections opened at once: twice the cap below, so half of them evict others
CAP = 100
SCRAPE = (b"GET {path} HTTP/1.1\r\nHost: x\r\nUser-Agent: Prometheus/2.42\r\nAccept: */*\r\n"
          b"Accept-Encoding: gzip\r\n\r\n")


def import_rss(tree: Path) -> float:
    """MiB of RSS in a fresh interpreter after importing what a plain-HTTP exporter of `tree` serves with: its
    cli, then (where the tree has them) ssl kept out as the cli does and the daemon it imports after that."""
    code = ("import importlib.util, psutil, stepscope.exporter.cli as cli\n"
            "getattr(cli, 'keep_ssl_unloaded', lambda: None)()\n"
            "if importlib.util.find_spec('stepscope.exporter.daemon'): import stepscope.exporter.daemon\n"
            "print(psutil.Process().memory_info().rss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree).stdout
    return int(out) / 2**20


def peer_import_rss(python: str) -> float | None:
    """MiB of RSS in a fresh `python` after importing nvitop-exporter's command, as import_rss reads ours (before
    NVML is loaded); None where that Python cannot import it."""
    code = "import psutil, nvitop_exporter.cli; print(psutil.Process().memory_info().rss)"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return int(done.stdout) / 2**20 if done.returncode == 0 else None


@contextmanager
def exporter(tree: Path) -> Iterator[tuple[int, psutil.Process]]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "stepscope.exporter", "--web.listen-address", f"127.0.0.1:{port}",
                             "--collectors", "", "--web.max-connections", str(CAP)],
                            env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/-/ready", proc, 30)
        yield port, psutil.Process(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def per_request_us(port: int, process: psutil.Process, path: str) -> float:
    request = SCRAPE.replace(b"{path}", path.encode())
    with socket.create_connection(("127.0.0.1", port)) as sock:
        def batch() -> None:
            sock.sendall(request * PIPELINED)
            answered = 0
            while answered < PIPELINED:
                answered += sock.recv(1 << 20).count(b"HTTP/1.1 ")
        batch()
        before = cpu(process)
        for _ in range(REQUESTS // PIPELINED):
            batch()
        return (cpu(process) - before) / REQUESTS * 1e6


def per_connection_ms(port: int, process: psutil.Process) -> float:
    before = cpu(process)
    for _ in range(CHURN_ROUNDS):
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(CHURN_BATCH)]
        for sock in held:
            sock.close()
        time.sleep(0.3)
    return (cpu(process) - before) / (CHURN_ROUNDS * CHURN_BATCH) * 1e3


def measure(tree: Path) -> dict[str, float]:
    with exporter(tree) as (port, process):
        return {"imports RSS MiB": import_rss(tree),
                "CPU µs per GET /-/healthy": per_request_us(port, process, "/-/healthy"),
                "CPU µs per GET /metrics": per_request_us(port, process, "/metrics"),
                "CPU ms per connection churned": per_connection_ms(port, process)}


def report(measured: dict[str, list[dict[str, float]]], names: dict[str, str]) -> str:
    keys = list(next(iter(measured.values()))[0])
    lines = ["| measure | " + " | ".join(names[tree] for tree in measured) + " |",
             "|---|" + "---:|" * len(measured)]
    for key in keys:
        cells = []
        for runs in measured.values():
            values = [run[key] for run in runs]
            cells.append(f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peer_line(python: str, rounds: int) -> str:
    values = [peer_import_rss(python) for _ in range(rounds)]
    if None in values:
        return f"nvitop-exporter's imports: not measured ({python} cannot import nvitop_exporter; --peer-python)."
    return (f"nvitop-exporter's imports, read the same way with {python}: "
            f"{statistics.median(values):.3g} MiB ({min(values):.3g}-{max(values):.3g}).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", required=True, help="the 'before' tree (a git revision)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peer-python", default=sys.executable,
                        help="a Python with nvitop-exporter installed, for its imports' RSS beside ours")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = baseline_tree(args.baseline_rev, Path(tmp))
        if base is None:
            return 1
        trees = {"base": base, "this": REPO_ROOT}
        measured: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for round_ in range(args.rounds):
            for name in (list(trees) if round_ % 2 == 0 else list(reversed(trees))):
                measured[name].append(measure(trees[name]))
        names = {"base": f"{args.baseline_rev}", "this": f"this tree ({commit_of('HEAD')}+)"}
        text = (f"## HTTP cost: {names['this']} against {names['base']} ({results.machine()}, "
                f"{results.load_average()})\n\n"
                f"`PYTHONPATH=. python benchmarks/bench_http_cost.py --baseline-rev {args.baseline_rev} "
                f"--rounds {args.rounds}"
                + (f" --peer-python {args.peer_python}" if args.peer_python != sys.executable else "")
                + f"`: median (min-max) of {args.rounds} rounds, the trees alternating. "
                f"No collectors; {REQUESTS} keep-alive requests pipelined {PIPELINED} at a time; "
                f"{CHURN_ROUNDS} x {CHURN_BATCH} connections opened and closed against a cap of {CAP}.\n\n"
                + report(measured, names) + "\n\n" + peer_line(args.peer_python, args.rounds) + "\n")
    results.publish(RESULTS, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the ranks' bounds agreement (stepscope.hooks.run_bounds) costs the run's torch.distributed store.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_run_bounds.py --ranks 8,64,512,2048

A real TCPStore server (as torchrun's agent or rank 0 hosts one) holds the counters of N ranks that
want the same 13 fine blocks (the most that fit under the 40-bound cap) for the step histogram and 9
phases (a run with per-phase buckets; without them only the step's). One more rank (a real RunBounds
over its own client connection) then times its rounds:

- a steady round (nothing changed anywhere: one counter read), the per-push cost of every rank;
- a round after another rank changed its blocks (the version, the counter list and every counter read),
  which each rank does once per push interval while ranks' blocks change (warm-up, a change of pace).

The store's load per push interval is N times a round's: the table gives the bytes a changed round
reads. Medians and the 10th-90th percentiles of --rounds rounds.

A run's ranks do their rounds at once, not one after another: the second table has --concurrent ranks,
each a thread with its own client connection (store calls release the GIL), all doing changed rounds
against the one server at the same time, and gives how many changed rounds per second the server
served and each round's latency while it did. A push interval absorbs a run whose ranks' rounds take
less than the interval together.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from stepscope.hooks.run_bounds import STEP_HISTOGRAM, RunBounds

PHASES = 9
BLOCKS = list(range(60, 73))  # 13 fine blocks: the most that fit under the 40-bound cap


def _populate(store: dist.Store, ranks: int) -> int:
    """`ranks` ranks wanting the blocks, counted as RunBounds counts them; returns the bytes a reader gets."""
    keys = [f"{histogram}/{block}" for histogram in (STEP_HISTOGRAM, *(f"phase:p{i}" for i in range(PHASES)))
            for block in BLOCKS]
    for key in keys:
        store.add(f"stepscope/bench/count/{key}", ranks)
    registry = "".join(f"{key}," for key in keys)
    store.set("stepscope/bench/keys", registry)
    store.add("stepscope/bench/version", ranks)
    return len(registry) + sum(len(str(ranks + 1)) for _ in keys)


def _percentiles(values: list[float]) -> str:
    deciles = statistics.quantiles(values, n=10)
    return f"{statistics.median(values) * 1e3:.3f} ({deciles[0] * 1e3:.3f}-{deciles[-1] * 1e3:.3f})"


def measure(ranks: int, rounds: int) -> dict[str, str | int]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    read_bytes = _populate(client, ranks)
    prefixed = dist.PrefixStore("stepscope/bench", client)
    bounds = RunBounds(lambda: prefixed, interval=3600)
    bounds.publish(STEP_HISTOGRAM, frozenset(BLOCKS))
    bounds.exchange()  # publishes, joins the rank list, reads the run
    steady, changed = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        bounds.exchange()
        steady.append(time.perf_counter() - started)
        client.add("stepscope/bench/version", 1)  # another rank published
        started = time.perf_counter()
        bounds.exchange()
        changed.append(time.perf_counter() - started)
    assert bounds.wanted(STEP_HISTOGRAM)[BLOCKS[0]] == ranks + 1
    return {"ranks": ranks, "steady": _percentiles(steady), "changed": _percentiles(changed),
            "bytes": read_bytes}


def concurrent(ranks: int, rounds: int) -> dict[str, str | float]:
    """`ranks` RunBounds, each on its own client, each doing `rounds` changed rounds at the same time."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    seed = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
    _populate(seed, ranks)
    latencies: list[float] = []
    start = threading.Barrier(ranks + 1)

    def rank() -> None:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
        prefixed = dist.PrefixStore("stepscope/bench", client)
        bounds = RunBounds(lambda: prefixed, interval=3600)
        bounds.publish(STEP_HISTOGRAM, frozenset(BLOCKS))
        bounds.exchange()
        start.wait()
        for _ in range(rounds):
            client.add("stepscope/bench/version", 1)  # a change somewhere in the run
            began = time.perf_counter()
            bounds.exchange()
            latencies.append(time.perf_counter() - began)

    threads = [threading.Thread(target=rank) for _ in range(ranks)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    return {"ranks": ranks, "per_second": ranks * rounds / elapsed, "latency": _percentiles(latencies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,64,512,2048", help="comma-separated run sizes")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--concurrent", default="64,256", help="comma-separated ranks doing rounds at once")
    args = parser.parse_args()
    print("| ranks in the run | steady round, ms | round after a change, ms | bytes read after a change |")
    print("|---|---|---|---|")
    for ranks in (int(part) for part in args.ranks.split(",")):
        row = measure(ranks, args.rounds)
        print(f"| {row['ranks']} | {row['steady']} | {row['changed']} | {row['bytes']:,} |")
    print("\n| ranks doing changed rounds at once | changed rounds served per second | round latency, ms |")
    print("|---|---|---|")
    for ranks in (int(part) for part in args.concurrent.split(",")):
        row = concurrent(ranks, rounds=20)
        print(f"| {ranks} | {row['per_second']:,.0f} | {row['latency']} |")


if __name__ == "__main__":
    main()

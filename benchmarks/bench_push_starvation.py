"""Legitimate pushes, scrapes and health checks while the exporter is attacked (issue 20, item 3): their
latency (p50/p99) and how many were refused or failed, the old code against this checkout, in one
interleaved run.

    git worktree add /tmp/h20b-base 0781a5f       # the code before the fix
    PYTHONPATH=. .venv/bin/python benchmarks/bench_push_starvation.py --base /tmp/h20b-base   # ~3 minutes

Both exporters run at once (no collectors, default limits); each attack window hits one of them while a
pusher (the hooks' pace and timeout: a 16 KiB push every 0.2 s, 2 s timeout, kept-alive session), a
scraper (every 0.5 s, 10 s timeout, kept alive) and a health probe (every 0.5 s on a fresh connection,
kubelet's 1 s timeout) use it. Attackers reopen every connection the exporter closes. Windows alternate
between old and new code and between attacks, so a busy moment of the shared machine hits both.
Writes benchmarks/results/push_starvation.md.
"""

from __future__ import annotations

import argparse
import contextlib
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(Path(__file__).resolve().parent)]

import requests  # noqa: E402
from bench_hooks import table  # noqa: E402

from stepscope_testkit import results  # noqa: E402
from stepscope_testkit.ingest_bodies import STANDARD_PHASES, full_body  # noqa: E402
from stepscope_testkit.processes import exporter_env, free_port, running  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "push_starvation.md"
WINDOW_SECONDS = 6.0  # measured per attack window
SETTLE_SECONDS = 1.0  # the attack builds up before measuring; the exporter recovers after it
PUSH_PATH = "/metrics/job/stepscope/run/bench/rank/0"
ONE_MIB = 1 << 20


@dataclass(frozen=True)
class Attack:
    name: str
    connections: int
    opening: bytes  # what each attacking connection sends, then nothing more


def _announced(sent: int) -> bytes:
    return (f"PUT /metrics/job/stepscope/run/attack/rank/0 HTTP/1.1\r\nHost: x\r\nContent-Length: {ONE_MIB}\r\n\r\n"
            .encode() + b"#" * sent)


ATTACKS = (
    Attack("none", 0, b""),
    Attack("8 bodies announced (1 MiB), 1 byte sent", 8, _announced(1)),
    Attack("8 bodies stalled after 900 KiB of 1 MiB", 8, _announced(900 * 1024)),
    Attack("1,000 idle connections", 1000, b""),
)


class Attacker(threading.Thread):
    """Keeps `attack.connections` connections open, each having sent its opening; reopens closed ones."""

    def __init__(self, port: int, attack: Attack) -> None:
        super().__init__(daemon=True)
        self.port, self.attack = port, attack
        self.stop = threading.Event()
        self.reopened = 0

    def run(self) -> None:
        with selectors.DefaultSelector() as selector:
            for _ in range(self.attack.connections):
                self._open(selector)
            while not self.stop.is_set():
                for key, events in selector.select(0.05):
                    self._serve(selector, key, events)
            for key in list(selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]

    def _open(self, selector: selectors.BaseSelector) -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=1)
        except OSError:
            return
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, [self.attack.opening])

    def _serve(self, selector: selectors.BaseSelector, key: selectors.SelectorKey, events: int) -> None:
        sock, pending = key.fileobj, key.data
        assert isinstance(sock, socket.socket)
        try:
            if events & selectors.EVENT_READ and not sock.recv(65536):
                raise ConnectionResetError
            if events & selectors.EVENT_WRITE:
                if pending[0]:
                    pending[0] = pending[0][sock.send(pending[0][:65536]):]
                if not pending[0]:
                    selector.modify(sock, selectors.EVENT_READ, pending)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # closed by the exporter (a 503, a 408, an eviction): open another
            selector.unregister(sock)
            sock.close()
            self.reopened += 1
            self._open(selector)


@dataclass
class Outcomes:
    seconds: list[float] = field(default_factory=list)
    refused: int = 0  # an HTTP answer other than 200
    failed: int = 0  # no answer: timeout, reset


class Client(threading.Thread):
    """Sends one kind of request every `every` seconds until stopped, recording each outcome."""

    def __init__(self, call: Callable[[], int], every: float, timeout: float) -> None:
        super().__init__(daemon=True)
        self.call, self.every, self.timeout = call, every, timeout
        self.stop = threading.Event()
        self.outcomes = Outcomes()

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                status = self.call()
            except requests.RequestException:
                status = 0
            elapsed = time.perf_counter() - started
            self.outcomes.seconds.append(elapsed)
            if status == 0:
                self.outcomes.failed += 1
            elif status != 200:
                self.outcomes.refused += 1
            self.stop.wait(max(0.0, self.every - elapsed))


def push_body() -> str:
    """A 9-phase push padded with comments to the hooks' 16 KiB: families the old code accepts too."""
    body = full_body(phases=STANDARD_PHASES)
    return body + ("# " + "x" * 98 + "\n") * ((16 * 1024 - len(body)) // 101)


def clients(url: str) -> dict[str, Client]:
    pushes, scrapes, body = requests.Session(), requests.Session(), push_body()
    return {
        "pusher": Client(lambda: pushes.put(url + PUSH_PATH, data=body, timeout=2).status_code, 0.2, 2),
        "scraper": Client(lambda: scrapes.get(url + "/metrics", timeout=10).status_code, 0.5, 10),
        "health probe": Client(lambda: requests.get(url + "/-/healthy", timeout=1).status_code, 0.5, 1),
    }


def window(url: str, port: int, attack: Attack) -> dict[str, Outcomes]:
    attacker = Attacker(port, attack)
    attacker.start()
    time.sleep(SETTLE_SECONDS)
    started = clients(url)
    for client in started.values():
        client.start()
    time.sleep(WINDOW_SECONDS)
    for client in started.values():
        client.stop.set()
    for client in started.values():
        client.join()
    attacker.stop.set()
    attacker.join()
    time.sleep(SETTLE_SECONDS)
    return {name: client.outcomes for name, client in started.items()}


@contextlib.contextmanager
def exporter(root: Path, log_dir: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    env = {**exporter_env(), "PYTHONPATH": str(root)}
    # -P: `exporter` comes from PYTHONPATH (root), not from the working directory
    argv = [sys.executable, "-P", "-m", "stepscope.exporter", "--listen-address", f"127.0.0.1:{port}",
            "--collectors", ""]
    with running(argv, f"http://127.0.0.1:{port}/-/ready", log_dir / f"exporter-{root.name}.log", env=env):
        yield f"http://127.0.0.1:{port}", port


def _ms(seconds: list[float], q: float) -> str:
    if not seconds:
        return "-"
    ordered = sorted(seconds)
    return f"{1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.1f}"


def report(measured: dict[tuple[str, str, str], Outcomes], rounds: int, base: str, seconds: float) -> str:
    rows = []
    for attack in ATTACKS:
        for who in ("pusher", "scraper", "health probe"):
            for code in ("old", "new"):
                got = measured[(attack.name, code, who)]
                total = len(got.seconds)
                rows.append([attack.name, who, code, str(total), _ms(got.seconds, 0.5), _ms(got.seconds, 0.99),
                             f"{got.refused} ({100 * got.refused / max(total, 1):.0f} %)",
                             f"{got.failed} ({100 * got.failed / max(total, 1):.0f} %)"])
    return (f"# Legitimate clients under attack: old code vs new\n\n"
            f"{results.machine(f'h11 {_h11_version()}')}, {results.load_average()} at the end (shared "
            f"machine); total {seconds:.0f} s. Old code: {base}; new: this checkout.\n\n"
            f"{rounds} rounds; each round measures every attack {WINDOW_SECONDS:g} s against each code, in "
            "alternating order. Latency over every request of the row (refused and failed ones included, a "
            "failure counts its timeout); p99 of a few dozen requests is close to their maximum.\n\n"
            + table(["attack", "client", "code", "requests", "p50 ms", "p99 ms", "refused (HTTP != 200)",
                     "failed (timeout, reset)"], rows)
            + "\n\nThe old code's refusals are 503s: `server_busy` for pushes under the body attacks (its "
              "8 MiB budget was charged by Content-Length), 'too many connections' for every client under "
              "the idle connections (the cap of 512 full of them). The new code reserves a body's room only "
              "while its bytes come at 1 MiB/s, needs none for a body that came whole with its head, and "
              "gives a connection over the cap the slot of an idle one (exporter/server_limits.py); the "
              "latency it adds under 1,000 reconnecting idle connections is the churn of closing and "
              "accepting them on a 2-core machine the attacker shares.\n")


def _commit(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "an unknown commit"


def _h11_version() -> str:
    import h11

    return h11.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base", type=Path, default=Path("/tmp/h20b-base"), help="a checkout of the old code")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not (args.base / "exporter" / "server.py").is_file():
        parser.error(f"--base {args.base} is no checkout of stepscope: git worktree add {args.base} <commit>")
    started = time.perf_counter()
    measured: dict[tuple[str, str, str], Outcomes] = {}
    log_dir = Path("/tmp") / "bench_push_starvation"
    log_dir.mkdir(exist_ok=True)
    with exporter(args.base, log_dir) as old, exporter(REPO_ROOT, log_dir) as new:
        for round_ in range(args.rounds):
            for attack in ATTACKS:
                order = [("old", old), ("new", new)]
                for code, (url, port) in order if round_ % 2 == 0 else order[::-1]:
                    for who, got in window(url, port, attack).items():
                        total = measured.setdefault((attack.name, code, who), Outcomes())
                        total.seconds += got.seconds
                        total.refused += got.refused
                        total.failed += got.failed
                    print(f"round {round_ + 1}: {attack.name}, {code} code done", file=sys.stderr)
    base = f"{_commit(args.base)} (the worktree at {args.base})"
    results.publish(RESULTS, report(measured, args.rounds, base, time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())

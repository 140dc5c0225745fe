"""A wrong-password flood against basic auth: does the legitimate scraper, and the health probe, get through?

    PYTHONPATH=. .venv/bin/python benchmarks/bench_auth_flood.py --before /tmp/h20a-base   # ~8 minutes
    PYTHONPATH=. .venv/bin/python benchmarks/bench_auth_flood.py --before /tmp/wt20 --cases many-uncached

`--before` is a checkout of the code to compare with (`git worktree add /tmp/h20a-base <commit>`); the
code here is "after". Each run starts a fresh exporter with one cost-10 bcrypt user (what
`htpasswd -nBC 10` makes), lets the legitimate client scrape once (its credentials are then cached, as
in production), then attacks from another process while the legitimate client sends, every second and
each on a new connection, an authenticated GET /metrics (10 s timeout, Prometheus' default) and a
GET /-/healthy (1 s timeout, a kubelet liveness probe's default). Two attacks, each a new wrong
password per request for the legitimate user's name:

- burst: 1,500 requests sent and closed at once (the client never waits for the answer);
- guessers: 200 concurrent clients, each sending its next guess as soon as it has an answer.

The attacker connects from other loopback addresses than the legitimate client (127.0.0.2 and up), as
another host would. Two more runs show what a login that is not cached yet meets (the first scrape
after an exporter restart or a password change): the legitimate client sends no warm-up scrape and
the guessers come from one address, or from 200; in a third the legitimate client's address was let
in before with other credentials, as before a password change; in a fourth it logged in once to an exporter that
was then SIGKILLed and started again on the same `--web.auth.state-file` (given as STEPSCOPE_WEB_AUTH_STATE_FILE,
which code without the setting ignores). Before and after alternate run by run (--rounds), so
machine noise hits both alike. `--cases` picks scenarios by key. Each run adds a dated section to
benchmarks/results/auth_flood.md, keeping the earlier ones.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import bcrypt
import requests

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(Path(__file__).resolve().parent)]

from bench_hooks import table  # noqa: E402

from stepscope_testkit import results  # noqa: E402
from stepscope_testkit.processes import free_port, wait_http_ok  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "auth_flood.md"
USER, PASSWORD = "prometheus", "the-right-one"
EARLIER_USER = "before-rotation"  # the legitimate client's earlier login: its password is PASSWORD too
WINDOW_SECONDS = 20.0  # --window: long enough for many new addresses to have been denied once
ATTACK_AT_SECONDS = 2.0
TIMEOUTS = {"/metrics": 10.0, "/-/healthy": 1.0}
BURST = 1500
GUESSERS = 200


@dataclass(frozen=True)
class Scenario:
    key: str  # what --cases names
    name: str
    kind: str  # burst or guessers
    addresses: int  # the attacker's source addresses, 127.0.0.2 and up
    warm: bool  # whether the legitimate client's credentials are cached before the attack
    known: bool = False  # whether its address was let in before with EARLIER_USER (a password change)
    restarted: bool = False  # whether it logged in to an exporter killed and started again before the attack


SCENARIOS = (
    Scenario("burst", "burst, login cached", "burst", 1, True),
    Scenario("guessers-cached", "guessers, login cached", "guessers", 1, True),
    Scenario("guessers-uncached", "guessers, login not cached", "guessers", 1, False),
    Scenario("many-uncached", f"guessers from {GUESSERS} addresses, login not cached", "guessers", GUESSERS, False),
    Scenario("many-changed", f"guessers from {GUESSERS} addresses, password changed", "guessers", GUESSERS, False,
             known=True),
    Scenario("many-restarted", f"guessers from {GUESSERS} addresses, exporter restarted", "guessers", GUESSERS,
             False, restarted=True),
)


def source(index: int, addresses: int) -> tuple[str, int]:
    """The attacker's local address for its index-th connection: 127.0.0.2 and up, any port."""
    n = 2 + index % addresses
    return f"127.0.{n // 256}.{n % 256}", 0


@dataclass
class Probes:
    """The legitimate client's outcomes for one path: seconds taken, the failures' reasons, and when
    (seconds into the window) the first one succeeded: once one has, a login is cached."""

    seconds: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    first_ok: float | None = None


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def request_bytes(port: int, guess: str) -> bytes:
    return (f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: {basic(USER, guess)}\r\n"
            "Connection: close\r\n\r\n").encode()


async def _send_and_close(port: int, guess: str, local: tuple[str, int], answers: Counter[str]) -> None:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=local)
        writer.write(request_bytes(port, guess))
        await writer.drain()
        writer.close()
        answers["sent and closed"] += 1
    except OSError as exc:
        answers[type(exc).__name__] += 1


async def _guess_until(port: int, stop_at: float, worker: int, local: tuple[str, int],
                       answers: Counter[str]) -> None:
    for attempt in itertools.count():
        if time.monotonic() >= stop_at:
            return
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=local)
            writer.write(request_bytes(port, f"guess-{worker}-{attempt}"))
            reply = await asyncio.wait_for(reader.read(64), 15)
            writer.close()
            answers[reply.split(b" ")[1].decode() if reply.startswith(b"HTTP/") else "closed"] += 1
        except (OSError, asyncio.TimeoutError) as exc:
            answers[type(exc).__name__] += 1
            await asyncio.sleep(0.05)


def attack(scenario: Scenario, port: int, seconds: float, out: multiprocessing.Queue) -> None:
    """Runs in its own process, so its CPU and its event loop do not slow the legitimate client's."""
    answers: Counter[str] = Counter()

    async def run() -> None:
        if scenario.kind == "burst":
            await asyncio.gather(*(_send_and_close(port, f"burst-{i}", source(i, scenario.addresses), answers)
                                   for i in range(BURST)))
        else:
            stop_at = time.monotonic() + seconds
            await asyncio.gather(*(_guess_until(port, stop_at, worker, source(worker, scenario.addresses), answers)
                                   for worker in range(GUESSERS)))

    asyncio.run(run())
    out.put(dict(answers))


def probe(url: str, path: str) -> tuple[float, str | None]:
    started = time.perf_counter()
    try:
        answer = requests.get(url + path, auth=(USER, PASSWORD) if path == "/metrics" else None,
                              timeout=TIMEOUTS[path])
        failure = None if answer.status_code == 200 else str(answer.status_code)
    except requests.Timeout:
        failure = "timeout"
    except requests.ConnectionError:
        failure = "connection error"
    return time.perf_counter() - started, failure


def legitimate_client(url: str, seconds: float) -> dict[str, Probes]:
    """Both probes every second, each on a new connection, whether or not the last one answered."""
    pending: list[tuple[str, Future]] = []
    with ThreadPoolExecutor(max_workers=64) as pool:
        start = time.monotonic()
        for tick in range(int(seconds)):
            time.sleep(max(0.0, start + tick - time.monotonic()))
            pending += [(path, pool.submit(probe, url, path)) for path in TIMEOUTS]
    outcomes = {path: Probes() for path in TIMEOUTS}
    for index, (path, future) in enumerate(pending):
        taken, failure = future.result()
        probes = outcomes[path]
        probes.seconds.append(taken)
        if failure is not None:
            probes.failures[failure] += 1
        elif probes.first_ok is None:
            probes.first_ok = index // len(TIMEOUTS) + taken  # sent at its tick, answered `taken` later
    return outcomes


def start_exporter(root: Path, workdir: Path, port: int, label: str, state: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "stepscope.exporter", "--web.listen-address", f"127.0.0.1:{port}",
            "--web.config.file", str(workdir / "web.yml"), "--no-collector.gpu", "--no-collector.process",
            "--collect-interval", "1"]
    log = open(workdir / f"{label}-{port}.log", "wb")  # noqa: SIM115 - the child writes to it until it ends
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1", "STEPSCOPE_WEB_AUTH_STATE_FILE": str(state)}
    process = subprocess.Popen(argv, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    wait_http_ok(f"http://127.0.0.1:{port}/-/ready", process)
    return process


def one_run(root: Path, workdir: Path, label: str, scenario: Scenario,
            window: float) -> tuple[dict[str, Probes], dict[str, int]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state = workdir / f"{label}-auth-state.json"
    state.unlink(missing_ok=True)
    if scenario.restarted:  # logged in once, then the exporter dies and comes back on the same state file
        first = start_exporter(root, workdir, port, label, state)
        try:
            requests.get(url + "/metrics", auth=(USER, PASSWORD), timeout=10).raise_for_status()
        finally:
            first.kill()
            first.wait()
    process = start_exporter(root, workdir, port, label, state)
    try:
        if scenario.warm or scenario.known:
            earlier = (USER if scenario.warm else EARLIER_USER, PASSWORD)
            requests.get(url + "/metrics", auth=earlier, timeout=10).raise_for_status()  # cached now
        answers: multiprocessing.Queue = multiprocessing.Queue()
        attacker = multiprocessing.Process(target=attack, args=(scenario, port, window + ATTACK_AT_SECONDS,
                                                                answers))
        attacker.start()
        time.sleep(0 if scenario.warm else ATTACK_AT_SECONDS)  # a login not cached meets the attack running
        outcomes = legitimate_client(url, window)
        attacker.join(timeout=60)
        attacked = answers.get(timeout=5) if attacker.exitcode == 0 else {"attacker did not finish": 1}
        if attacker.is_alive():
            attacker.kill()
        return outcomes, attacked
    finally:
        process.kill()
        process.wait()


def ms(values: list[float], q: float) -> str:
    ordered = sorted(values)
    return f"{1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]:.1f}"


def row(name: str, label: str, outcomes: dict[str, Probes], attacked: dict[str, int]) -> list[str]:
    cells = [name, label]
    for path in TIMEOUTS:
        probes = outcomes[path]
        failed = sum(probes.failures.values())
        reasons = ", ".join(f"{n} {reason}" for reason, n in probes.failures.most_common())
        cells += [f"{ms(probes.seconds, 0.5)} / {ms(probes.seconds, 0.99)}",
                  f"{failed} of {len(probes.seconds)}" + (f" ({reasons})" if failed else ""),
                  "never" if probes.first_ok is None else f"{probes.first_ok:.1f}"]
    cells.append(", ".join(f"{n} {status}" for status, n in sorted(attacked.items(), key=lambda kv: -kv[1])))
    return cells


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the code to compare with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cases", nargs="+", choices=[s.key for s in SCENARIOS], default=[s.key for s in SCENARIOS],
                        help="the scenarios to run (default: all)")
    parser.add_argument("--window", type=float, default=WINDOW_SECONDS, help="seconds the legitimate client probes")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
        (workdir / "web.yml").write_text(f"basic_auth_users:\n  {USER}: '{hashed}'\n  {EARLIER_USER}: '{hashed}'\n")
        for round_number in range(args.rounds):
            for scenario in (s for s in SCENARIOS if s.key in args.cases):
                for label, root in (("before", args.before.resolve()), ("after", REPO_ROOT)):
                    outcomes, attacked = one_run(root, workdir, label, scenario, args.window)
                    rows.append(row(scenario.name, f"{label} (round {round_number + 1})", outcomes, attacked))
                    print(" | ".join(rows[-1]), flush=True)
    before = subprocess.run(["git", "-C", str(args.before), "log", "-1", "--format=%h"], capture_output=True,
                            text=True).stdout.strip()
    after = subprocess.run(["git", "-C", str(REPO_ROOT), "log", "-1", "--format=%h"], capture_output=True,
                           text=True).stdout.strip()
    headers = ["attack", "code", "/metrics p50 / p99 ms", "/metrics failed", "/metrics first 200 at s",
               "/-/healthy p50 / p99 ms", "/-/healthy failed", "/-/healthy first 200 at s", "what the attacker got"]
    title = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: {', '.join(args.cases)}"
    text = (f"\n## {title}\n\n{results.machine(f'bcrypt {bcrypt.__version__}')}, "
            f"{results.load_average()} at the end (shared machine); before = {before}, after = {after} "
            f"(plus the working tree); total {time.perf_counter() - started:.0f} s.\n\n"
            f"Each run: a fresh exporter with one cost-10 bcrypt user; a {args.window:g} s window in which "
            f"the legitimate client (127.0.0.1) sends, every second on a new connection, an authenticated "
            f"GET /metrics (timeout {TIMEOUTS['/metrics']:g} s) and GET /-/healthy (timeout "
            f"{TIMEOUTS['/-/healthy']:g} s), each probe counted whether or not the last one answered. "
            f"'login cached': the legitimate client scraped once before, and the attack starts with the window; "
            f"'not cached': no scrape before, and the window opens {ATTACK_AT_SECONDS:g} s into the attack; "
            f"'password changed': the same, but the legitimate client's address was let in once before, as "
            f"another user; 'exporter restarted': the same, but it logged in once to an exporter that was then "
            f"SIGKILLed and started again on the same STEPSCOPE_WEB_AUTH_STATE_FILE. "
            f"burst: {BURST} requests, each a new wrong password for the legitimate user, sent and closed at "
            f"once. guessers: {GUESSERS} concurrent clients, a new wrong password each time, from 127.0.0.2 "
            f"(or one address each from 127.0.0.2 up). Latencies include the failed probes (a timeout counts "
            f"as its timeout); 'first 200 at': seconds into the window of the first success.\n\n"
            + table(headers, rows) + "\n")
    earlier = RESULTS.read_text() if RESULTS.exists() else "# Wrong-password flood against basic auth\n"
    results.publish(RESULTS, earlier + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

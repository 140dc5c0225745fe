"""Start real processes (the exporter, Prometheus, the Pushgateway) on free loopback ports."""

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from stepscope.contract import families

REPO_ROOT = Path(__file__).resolve().parents[1]
FAKE_NVML_DIR = REPO_ROOT / "stepscope_testkit" / "fake_nvml"
SKEWED_CLOCK_DIR = REPO_ROOT / "stepscope_testkit" / "skewed_clock"
_RANDOM = random.Random()  # its own: a test seeding the module's generator must not replay our picks
_HANDED_OUT: dict[int, float] = {}  # port -> when free_port gave it
_HANDED_OUT_SECONDS = 300.0


def free_port() -> int:
    """A loopback port free now, for a process about to listen on it.

    Taken below the kernel's ephemeral range: a port from bind(0) goes back into the range that every
    outgoing connection takes its source port from, so another test's scrape could hold it by the time
    the process binds it, or a client of ours could reach a stranger there. Each pytest-xdist worker
    draws from its own share, so the workers' picks never meet.
    """
    share, now = _port_share(), time.monotonic()
    for port in _RANDOM.sample(share, min(len(share), 64)):
        if now - _HANDED_OUT.get(port, -_HANDED_OUT_SECONDS) < _HANDED_OUT_SECONDS:
            continue  # picked a moment ago: its process may not have bound it yet
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT[port] = now
        return port
    with socket.socket() as sock:  # no room below the ephemeral range: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_share() -> range:
    """This worker's share of the ports from 10000 up to the ephemeral range (Linux's 32768 by default)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = max(0, ephemeral - 10000) // max(workers, 1)
    start = 10000 + worker * size
    return range(start, start + size)


def wait_http_ok(url: str, process: subprocess.Popen, timeout: float = 30.0, **kwargs) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before {url} answered")
        try:
            if requests.get(url, timeout=2, **kwargs).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer 200 within {timeout}s")


@dataclass
class Running:
    process: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def running(
    argv: Sequence[str], ready_url: str, log_path: Path, env: Mapping[str, str] | None = None,
    timeout: float = 30.0, base_url: str | None = None, verify: bool | str = True,
    cert: tuple[str, str] | None = None,
) -> Iterator[Running]:
    """Runs argv until the block ends; its stdout+stderr go to log_path, shown on failure."""
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            list(argv), stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    try:
        try:
            wait_http_ok(ready_url, process, timeout, verify=verify, cert=cert)
        except Exception as exc:
            raise RuntimeError(f"{exc}\n--- log of {argv[0]} ---\n{log_path.read_text(errors='replace')}") from None
        yield Running(process, base_url or ready_url.rsplit("/", 1)[0], log_path)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def exporter_env(fake_nvml_scenario: Path | str | None = None) -> dict[str, str]:
    """Environment for an exporter subprocess; a scenario puts the fake pynvml first on the path."""
    env = {"PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    if fake_nvml_scenario is not None:
        env["PYTHONPATH"] = f"{FAKE_NVML_DIR}{os.pathsep}{REPO_ROOT}"
        env["STEPSCOPE_FAKE_NVML_SCENARIO"] = str(fake_nvml_scenario)
    return env


def skewed_clock_env(skew_seconds: float) -> dict[str, str]:
    """Environment for a Python subprocess (an exporter, a training process) on a node whose wall clock is
    `skew_seconds` off (negative: behind), through stepscope_testkit/skewed_clock/sitecustomize.py."""
    return {"PYTHONPATH": f"{SKEWED_CLOCK_DIR}{os.pathsep}{REPO_ROOT}",
            "STEPSCOPE_TEST_CLOCK_SKEW_SECONDS": str(skew_seconds)}


@contextmanager
def running_exporter(
    tmp_path: Path, *args: str, fake_nvml_scenario: Path | str | None = None,
    env: Mapping[str, str] | None = None, port: int | None = None,
) -> Iterator[Running]:
    """A real `python -m stepscope.exporter` on a free loopback port, ready (first collection done)."""
    port = port or free_port()
    argv = [sys.executable, "-m", "stepscope.exporter", "--listen-address", f"127.0.0.1:{port}",
            "--collect-interval", "0.5", *args]
    full_env = {**exporter_env(fake_nvml_scenario), **(env or {})}
    with running(argv, f"http://127.0.0.1:{port}/-/ready", tmp_path / f"exporter-{port}.log",
                 env=full_env, base_url=f"http://127.0.0.1:{port}") as proc:
        yield proc


def scrape(base_url: str, timeout: float = 10, **kwargs) -> str:
    response = requests.get(f"{base_url}/metrics", timeout=timeout, **kwargs)
    response.raise_for_status()
    return response.text


def without_clock(body: bytes) -> bytes:
    """A scrape's body less the node's clock (stepscope_exporter_time_seconds), which the exporter appends as it
    answers each scrape after its cached snapshot: two scrapes of one snapshot are then equal."""
    head = f"# HELP {families.NODE_TIME} ".encode()
    return body[:body.index(head)] if head in body else body


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset of label items): value} for quick lookups in assertions."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample_values(text: str, name: str, **labels: str) -> list[float]:
    """Values of every sample called `name` whose labels include `labels`."""
    return [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]

"""The HTTP layer's limits and edges under attack (issue 20, the server half): bodies announced and never
sent, pushes that stall half-way, 1,000 idle connections, an open-files limit below the connection cap,
a client that half-closes after a complete push, JSON nested past the interpreter's stack.

Real exporter processes over raw sockets. Deadlines here only tell "answered" from "refused or held";
latencies under attack are measured in benchmarks/bench_push_starvation.py.
"""

import contextlib
import os
import resource
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from stepscope_testkit.ingest_bodies import counter, full_body, hooks_body
from stepscope_testkit.processes import (
    REPO_ROOT,
    Running,
    exporter_env,
    free_port,
    running,
    running_exporter,
    samples,
    scrape,
)
from tests.support.certs import make_cert

NO_COLLECTORS = ("--collectors", "")
GROUP = "/metrics/job/stepscope/run/{run}/rank/{rank}"


def port_of(exporter: Running) -> int:
    return int(exporter.url.rsplit(":", 1)[1])


def push_head(run: str, length: int, rank: int = 0, extra: str = "") -> bytes:
    return (f"PUT {GROUP.format(run=run, rank=rank)} HTTP/1.1\r\nHost: x\r\n{extra}"
            f"Content-Length: {length}\r\n\r\n").encode()


def stall(port: int, head: bytes, body: bytes = b"") -> socket.socket:
    """A connection that sent `head` and `body` and then nothing more."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head + body)
    return sock


def read_reply(sock: socket.socket, wait: float = 5.0) -> bytes:
    """What the server sends until it closes or `wait` passes."""
    received = b""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        received += chunk
    return received


def rejected(exporter: Running, reason: str) -> float:
    return samples(scrape(exporter.url))[("stepscope_exporter_ingest_rejected_total", frozenset({("reason", reason)}))]


def steps_of(exporter: Running, run: str, rank: str = "0") -> float | None:
    return samples(scrape(exporter.url)).get(("stepscope_steps_total", frozenset({("run", run), ("rank", rank)})))


def padded_body(steps: int, size: int) -> bytes:
    """A valid push of `size` bytes: the steps counter and plain comments."""
    body = counter("stepscope_steps_total", steps).encode()
    line = b"# " + b"x" * 1000 + b"\n"
    padding = line * ((size - len(body)) // len(line))
    return body + padding + b"#" * (size - len(body) - len(padding) - 1) + b"\n"


@pytest.fixture(scope="module")
def exporter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with running_exporter(tmp_path_factory.mktemp("attacks"), *NO_COLLECTORS) as proc:
        yield proc


# --- item 3: announced bytes never starve pushes -----------------------------------------------

def test_bodies_announced_and_not_sent_starve_no_push(exporter: Running) -> None:
    """8 connections announce 1 MiB each (the whole 8 MiB budget by Content-Length) and send 1 byte:
    the pushes of 16 ranks and a 300 KiB push, sent at line rate meanwhile, are all stored."""
    port = port_of(exporter)
    holders = [stall(port, push_head(f"liar{i}", 1 << 20), b"#") for i in range(8)]
    try:
        time.sleep(0.5)
        body = hooks_body()

        def push(rank: int) -> int:
            return requests.put(exporter.url + GROUP.format(run="honest", rank=rank), data=body,
                                timeout=10).status_code

        with ThreadPoolExecutor(max_workers=16) as pool:
            statuses = list(pool.map(push, range(16)))
        large = requests.put(exporter.url + GROUP.format(run="large", rank=0), data=padded_body(7, 300 * 1024),
                             timeout=10)
        assert statuses == [200] * 16
        assert large.status_code == 200, large.text
        assert steps_of(exporter, "large") == 7
    finally:
        for sock in holders:
            sock.close()


def test_a_body_stalled_half_way_gives_its_room_to_a_push_that_sends(exporter: Running) -> None:
    """8 bodies of 1 MiB arrive 900 KiB and stall: a 300 KiB push needs their room and gets it; the one
    that lost its room is answered 408 (incomplete_body) and nothing of it is stored."""
    port = port_of(exporter)
    before = rejected(exporter, "incomplete_body")
    holders = []
    for i in range(8):
        sock = stall(port, push_head(f"stalled{i}", 1 << 20))
        sock.setblocking(False)
        sent = 0
        deadline = time.monotonic() + 5
        while sent < 900 * 1024 and time.monotonic() < deadline:
            try:
                sent += sock.send(b"#" * min(65536, 900 * 1024 - sent))
            except BlockingIOError:
                time.sleep(0.01)
        holders.append(sock)
    try:
        time.sleep(1.5)  # behind 1 MiB/s by now: 900 KiB of 1 MiB in 1.5 s, then nothing
        large = requests.put(exporter.url + GROUP.format(run="large2", rank=0), data=padded_body(9, 300 * 1024),
                             timeout=10)
        assert large.status_code == 200, large.text
        assert steps_of(exporter, "large2") == 9
        assert rejected(exporter, "incomplete_body") >= before + 1
        evicted = [sock for sock in holders if read_reply(sock, wait=0.5).startswith(b"HTTP/1.1 408")]
        assert evicted
    finally:
        for sock in holders:
            sock.close()


# --- item 3: idle connections never cost a scrape its slot --------------------------------------

def test_a_thousand_idle_connections_fail_no_scrape_or_health_check(tmp_path: Path) -> None:
    """1,000 connections that send nothing (reopened as the exporter closes them) against a cap of 64:
    every scrape and health check gets through, because a newcomer takes the slot of the longest idle."""
    with running_exporter(tmp_path, *NO_COLLECTORS, "--web.max-connections", "64") as exp:
        port = port_of(exp)
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(1000)]
        try:
            answers = []
            for _ in range(20):
                for path in ("/metrics", "/-/healthy"):
                    try:
                        answers.append(requests.get(exp.url + path, timeout=5).status_code)
                    except requests.RequestException as exc:
                        answers.append(type(exc).__name__)
            assert answers == [200] * 40
        finally:
            for sock in idle:
                sock.close()


def test_clients_that_never_read_a_large_scrape_fail_no_probe_or_scrape(tmp_path: Path) -> None:
    """16 connections (the cap) ask for a 4 MB /metrics and never read it: each waits on its client, so a
    newcomer takes the slot of the one that waited longest, as from an idle connection."""
    with running_exporter(tmp_path, *NO_COLLECTORS, "--web.max-connections", "16") as exp:
        body = hooks_body()
        with requests.Session() as session:
            for run in range(200):
                session.put(exp.url + GROUP.format(run=f"big{run}", rank=0), data=body, timeout=10).raise_for_status()
        port = port_of(exp)
        readers = []
        for _ in range(16):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            readers.append(sock)
        try:
            time.sleep(1)
            answers = []
            for path in ("/-/healthy", "/metrics") * 5:
                try:
                    answers.append(requests.get(exp.url + path, timeout=5).status_code)
                except requests.RequestException as exc:
                    answers.append(type(exc).__name__)
            assert answers == [200] * 10
        finally:
            for sock in readers:
                sock.close()


# --- item 5: an open-files limit below the connection cap ---------------------------------------

def test_an_open_files_limit_below_the_cap_is_fitted_and_logs_little(tmp_path: Path) -> None:
    """RLIMIT_NOFILE 128 with --web.max-connections 512 and 300 connections held: one line says the cap
    was fitted, the log stays small, and scrapes still work."""
    port = free_port()
    log_path = tmp_path / "exporter.log"

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    argv = [sys.executable, "-m", "stepscope.exporter", "--listen-address", f"127.0.0.1:{port}", *NO_COLLECTORS,
            "--web.max-connections", "512"]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=limit_files,
                                   env={**os.environ, **exporter_env()}, cwd=REPO_ROOT)
    held: list[socket.socket] = []
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ok(url + "/-/healthy", process)
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]  # one burst of accepts
        time.sleep(1)
        answers = []
        for _ in range(10):
            try:
                answers.append(requests.get(url + "/metrics", timeout=5).status_code)
            except requests.RequestException as exc:
                answers.append(type(exc).__name__)
        assert answers == [200] * 10
    finally:
        for sock in held:
            sock.close()
        process.terminate()
        process.wait(timeout=10)
    log = log_path.read_text(errors="replace")
    print(log)
    assert log.count("open-files limit (RLIMIT_NOFILE 128") == 1
    assert "Traceback" not in log
    assert log.count("accept() failed") <= 2
    assert len(log) < 4096


def _wait_ok(url: str, process: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the exporter exited"
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.RequestException:
            time.sleep(0.1)
    raise TimeoutError(url)


# --- item 6: a client that half-closes after its push is answered -------------------------------

@pytest.mark.parametrize("size", [0, 200 * 1024])  # 0: just the counter; a large body is read in pieces
def test_a_complete_push_then_half_close_is_stored_and_answered(exporter: Running, size: int) -> None:
    body = padded_body(4321 + size, size) if size else counter("stepscope_steps_total", 4321).encode()
    with socket.create_connection(("127.0.0.1", port_of(exporter))) as sock:
        sock.sendall(push_head(f"halfclose{size}", len(body)) + body)
        sock.shutdown(socket.SHUT_WR)  # what `nc -N` and HTTP/1.0-style clients do
        reply = read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    assert steps_of(exporter, f"halfclose{size}") == 4321 + size


def test_a_scrape_then_half_close_is_answered(exporter: Running) -> None:
    with socket.create_connection(("127.0.0.1", port_of(exporter))) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        sock.shutdown(socket.SHUT_WR)
        reply = read_reply(sock)
    # an HTTP/1.1 server answers in its own version (RFC 9110 6.2), and a 1.0 client's connection closes
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    assert b"\r\nConnection: close\r\n" in reply.split(b"\r\n\r\n", 1)[0] + b"\r\n"
    assert b"stepscope_exporter_build_info" in reply


@contextlib.contextmanager
def tls_exporter(tmp_path: Path) -> Iterator[tuple[Running, int, ssl.SSLContext]]:
    """An exporter serving TLS with a fresh certificate; its port and a client context trusting it."""
    cert, key = make_cert(tmp_path, "127.0.0.1")
    port = free_port()
    argv = [sys.executable, "-m", "stepscope.exporter", "--listen-address", f"127.0.0.1:{port}", *NO_COLLECTORS,
            "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    with running(argv, f"https://127.0.0.1:{port}/-/ready", tmp_path / "tls.log", env=exporter_env(),
                 verify=False) as exp:
        yield exp, port, ssl.create_default_context(cafile=str(cert))


def test_a_tls_client_that_half_closes_logs_nothing(tmp_path: Path) -> None:
    """TLS transports close on EOF whatever the protocol asks, and warn if asked to stay open: a
    half-closing TLS client (a flood of them) must not write to the log."""
    with tls_exporter(tmp_path) as (exp, port, context):
        for _ in range(3):
            raw = socket.create_connection(("127.0.0.1", port))
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                tls.shutdown(socket.SHUT_WR)  # a TCP half-close, no TLS close_notify
                with contextlib.suppress(OSError):
                    tls.recv(65536)
        time.sleep(0.5)
        assert "eof_received" not in exp.log() and "Traceback" not in exp.log()


# --- item 4: JSON nested deeper than the interpreter's stack -------------------------------------

def test_deeply_nested_json_is_a_400_without_a_traceback(exporter: Running) -> None:
    answer = requests.post(exporter.url + "/api/v1/profiles", data=b"[" * 2000, timeout=10)
    assert answer.status_code == 400
    assert "not JSON" in answer.json()["error"]
    push = requests.put(exporter.url + GROUP.format(run="nested", rank=0), data=full_body(),
                        headers={"Stepscope-Profile": "[" * 4000}, timeout=10)
    assert push.status_code == 200, push.text
    time.sleep(0.2)
    assert "Traceback" not in exporter.log()


def test_a_broken_tls_record_after_the_handshake_logs_nothing(tmp_path: Path) -> None:
    """Bytes that are no TLS record, sent on a connection after its handshake, fail the read with an
    SSLError: the connection closes, and nothing (no 'Unhandled exception', no traceback) is logged."""
    with tls_exporter(tmp_path) as (exp, port, context):
        for _ in range(3):
            raw = socket.create_connection(("127.0.0.1", port), timeout=5)
            tls = context.wrap_socket(raw, server_hostname="127.0.0.1")
            tls.sendall(b"GET /metrics HTTP/1.1\r\nHo")  # a head begun: the exporter is reading
            raw_again = socket.socket(fileno=tls.detach())  # the same TCP connection, TLS left aside
            raw_again.sendall(b"\x17\x03\x03\x00\x10" + bytes(16))  # an application record that fails to decrypt
            with contextlib.suppress(OSError):
                assert raw_again.recv(65536) is not None
            raw_again.close()
        assert requests.get(f"https://127.0.0.1:{port}/-/healthy", verify=False, timeout=5).status_code == 200
        time.sleep(0.5)
        assert "Traceback" not in exp.log() and "Unhandled exception" not in exp.log(), exp.log()[-2000:]

"""The HTTP layer under a hostile network, a killed client and a busy node: the failures of issue 10.

Each test drives a real exporter process over raw sockets where a well-behaved client library would
hide the problem (a body cut short, a request hidden in a body, an HTTP/0.9 line, TLS bytes on the
plain port). Deadlines in these tests are generous upper bounds that tell "closed at once" from
"held until the 10 s header deadline", not timing budgets: those live in benchmarks/.
"""

import asyncio
import base64
import gzip
import os
import pty
import random
import select
import shutil
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests

from stepscope.exporter import http_exchange
from stepscope_testkit.ingest_bodies import counter, full_body, hooks_body
from stepscope_testkit.processes import (
    REPO_ROOT,
    Running,
    exporter_env,
    free_port,
    running_exporter,
    samples,
    scrape,
    without_clock,
)

NO_COLLECTORS = ("--collectors", "")
GROUP = "/metrics/job/stepscope/run/{run}/rank/{rank}"


def port_of(exporter: Running) -> int:
    return int(exporter.url.rsplit(":", 1)[1])


def exchange(port: int, data: bytes, wait: float = 5.0, half_close: bool = False) -> tuple[bytes, bool]:
    """Sends raw bytes; returns what came back within `wait` seconds and whether the server closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return received, False
            except ConnectionResetError:
                return received, True
            if not chunk:
                return received, True
            received += chunk
        return received, False


def steps_of(exporter: Running, run: str, rank: str = "0", timeout: float = 10) -> float | None:
    return samples(scrape(exporter.url, timeout=timeout)).get(
        ("stepscope_steps_total", frozenset({("run", run), ("rank", rank)})))


def rejected(exporter: Running, reason: str) -> float:
    return samples(scrape(exporter.url))[("stepscope_exporter_ingest_rejected_total", frozenset({("reason", reason)}))]


def put(exporter: Running, run: str, body: str, rank: str = "0") -> None:
    requests.put(exporter.url + GROUP.format(run=run, rank=rank), data=body, timeout=10).raise_for_status()


@pytest.fixture(scope="module")
def exporter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with running_exporter(tmp_path_factory.mktemp("hardening"), *NO_COLLECTORS) as proc:
        yield proc


# --- 1. a body cut short is never stored ---------------------------------------------------------

@pytest.mark.parametrize("how", ["half_close", "process_died"])
def test_a_push_cut_short_changes_nothing(exporter: Running, how: str) -> None:
    put(exporter, "short", counter("stepscope_steps_total", 1234))
    before = rejected(exporter, "incomplete_body")
    full = counter("stepscope_steps_total", 12).encode() + b"#" * 200
    head = (f"PUT {GROUP.format(run='short', rank='0')} HTTP/1.1\r\nHost: x\r\n"
            f"Content-Length: {len(full)}\r\n\r\n").encode()
    cut = full[: full.index(b"12") + 2]  # '...stepscope_steps_total 12' and no more
    if how == "half_close":
        reply, closed = exchange(port_of(exporter), head + cut, half_close=True)
    else:
        with socket.create_connection(("127.0.0.1", port_of(exporter))) as sock:
            sock.sendall(head + cut)
        reply, closed = b"", True
    assert closed
    assert not reply.startswith(b"HTTP/1.1 200")
    assert steps_of(exporter, "short") == 1234
    deadline = time.monotonic() + 10
    while rejected(exporter, "incomplete_body") == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rejected(exporter, "incomplete_body") == before + 1


# --- 2. no request hidden in a body ever runs ----------------------------------------------------

HIDDEN = (f"DELETE {GROUP.format(run='victim', rank='0')} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n").encode()
SMUGGLERS = {
    "405 on /": b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(HIDDEN) + HIDDEN,
    "405 on /-/healthy": b"PUT /-/healthy HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(HIDDEN) + HIDDEN,
    "400 bad Content-Length": b"PUT /metrics/job/stepscope/run/victim/rank/0 HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Length: 1x\r\n\r\n" + HIDDEN,
    "411 chunked": b"PUT /metrics/job/stepscope/run/victim/rank/0 HTTP/1.1\r\nHost: x\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(HIDDEN) + HIDDEN + b"\r\n0\r\n\r\n",
    "GET /metrics with a body": b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(HIDDEN)
                                + HIDDEN,
    "413 oversized": b"PUT /metrics/job/stepscope/run/victim/rank/0 HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 99999999\r\n\r\n" + HIDDEN,
}


@pytest.mark.parametrize("case", list(SMUGGLERS))
def test_a_request_hidden_in_a_body_never_runs(exporter: Running, case: str) -> None:
    put(exporter, "victim", counter("stepscope_steps_total", 7))
    reply, _ = exchange(port_of(exporter), SMUGGLERS[case], wait=3)
    assert reply.count(b"HTTP/1.") == 1, reply  # one answer: the hidden DELETE got none
    assert steps_of(exporter, "victim") == 7


# --- 3. a listen backlog for many ranks starting at once ----------------------------------------

def test_64_ranks_pushing_at_once_on_fresh_connections_all_land(exporter: Running) -> None:
    body = hooks_body()
    barrier = threading.Barrier(64)

    def first_push(rank: int) -> int:
        barrier.wait()
        # A fresh connection each, as 64 pushers starting together. 10 s, not the hooks' 2 s: a clean-clone
        # run once starved this process or the exporter past 2 s under the suite's load (pushes got no answer)
        try:
            return requests.put(exporter.url + GROUP.format(run="start", rank=rank), data=body, timeout=10).status_code
        except requests.RequestException:
            return 0

    with ThreadPoolExecutor(max_workers=64) as pool:
        statuses = list(pool.map(first_push, range(64)))
    assert statuses == [200] * 64
    if shutil.which("ss"):
        listing = subprocess.run(["ss", "-ltnH", f"sport = :{port_of(exporter)}"], capture_output=True, text=True,
                                 check=True).stdout.split()
        assert int(listing[2]) >= 128  # Send-Q of a listening socket is its backlog


# --- 4. stalled bodies never stall scrapes; the token is checked before a body is read ----------

def _stall(port: int, head: bytes, send: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head)
    try:
        sock.setblocking(False)
        sock.send(b"#" * send)  # as much as the buffers take; the rest never comes
    except BlockingIOError:
        pass
    return sock


def _held(stalled: list[socket.socket]) -> int:
    """How many of the stalled pushes the exporter still holds: neither answered nor closed."""
    held = 0
    for sock in stalled:
        try:
            sock.recv(1)
        except BlockingIOError:
            held += 1
        except OSError:
            pass
    return held


def test_stalled_bodies_do_not_stall_scrapes_or_memory(tmp_path: Path) -> None:
    """Scrapes beside held stalled bodies answer with the data. The first scrape waits behind the burst's
    200 connections, whose heads the exporter reads first (0.06 s of its CPU idle, so well under a second;
    5.8 s here with the exporter starved to about 3% of a core, and past 10 s once in a clean-clone CI
    run): that queue, not a stalled body, is what it waits for, so it alone gets a minute."""
    with running_exporter(tmp_path, *NO_COLLECTORS) as exp:
        put(exp, "kept", counter("stepscope_steps_total", 3))
        rss_before = psutil.Process(exp.process.pid).memory_info().rss
        head = (f"PUT {GROUP.format(run='stall', rank='0')} HTTP/1.1\r\nHost: x\r\n"
                "Content-Length: 1048576\r\n\r\n").encode()
        stalled = [_stall(port_of(exp), head, 512 * 1024) for _ in range(200)]
        try:
            time.sleep(1)
            assert steps_of(exp, "kept", timeout=60) == 3
            assert _held(stalled) > 0  # bodies the exporter is still waiting for
            for _ in range(4):
                assert steps_of(exp, "kept") == 3  # each scrape answers (10 s timeout) with the data
            assert _held(stalled) > 0  # ... and still was through every scrape
            growth = psutil.Process(exp.process.pid).memory_info().rss - rss_before
            print(f"RSS grew by {growth / 2**20:.1f} MiB")
            assert growth < 64 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"
            assert rejected(exp, "server_busy") > 0
        finally:
            for sock in stalled:
                sock.close()


def test_a_wrong_token_is_refused_before_the_body_is_read(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with running_exporter(tmp_path, *NO_COLLECTORS, "--ingest-token-file", str(token_file)) as exp:
        head = (f"PUT {GROUP.format(run='tok', rank='0')} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
                "Content-Length: 1048576\r\n\r\n").encode()
        reply, closed = exchange(port_of(exp), head, wait=5)  # no body byte sent
        assert reply.startswith(b"HTTP/1.1 401")
        assert b"missing or wrong bearer token" in reply
        assert closed


# --- 5. protocol oddities -----------------------------------------------------------------------

@pytest.mark.parametrize(("name", "data"), [
    ("HTTP/0.9 request line", b"GET /metrics\r\n"),
    ("HTTP/0.9 with LF only", b"GET /metrics\n"),
    ("TLS ClientHello", bytes.fromhex("16030100a5010000a10303") + bytes(32) + b"\x00\x00\x02\x13\x01\x01\x00"),
])
def test_non_http_bytes_are_answered_and_closed_at_once(exporter: Running, name: str, data: bytes) -> None:
    reply, closed = exchange(port_of(exporter), data, wait=5)  # the header deadline is 10 s
    assert closed, name
    assert reply == b"" or reply.startswith(b"HTTP/1.1 400") or reply.startswith(b"HTTP/1.0 400")


@pytest.mark.parametrize("method", ["TRACE", "OPTIONS", "PATCH", "PROPFIND", "CONNECT"])
def test_other_methods_get_405_in_plain_text(exporter: Running, method: str) -> None:
    target = "127.0.0.1:1" if method == "CONNECT" else "/"
    request = f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    reply, _ = exchange(port_of(exporter), request.encode(), wait=3)
    status, _, rest = reply.partition(b"\r\n")
    assert status in (b"HTTP/1.1 405 Method Not Allowed", b"HTTP/1.1 400 Bad Request"), reply
    assert b"Content-Type: text/plain; charset=utf-8" in rest
    assert b"<html" not in reply.lower()


def test_patch_on_a_push_path_is_a_counted_405(exporter: Running) -> None:
    before = rejected(exporter, "bad_method")
    response = requests.patch(exporter.url + GROUP.format(run="x", rank="0"), data="", timeout=5)
    assert response.status_code == 405
    assert response.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert "use PUT, POST or DELETE" in response.text
    assert rejected(exporter, "bad_method") == before + 1


def test_a_raw_utf8_path_is_refused_and_an_encoded_one_read_as_utf8(exporter: Running) -> None:
    body = counter("stepscope_steps_total", 5).encode()
    for run in ("lr-ü-é", "lr-%C3%BC-%C3%A9"):
        head = (f"PUT {GROUP.format(run=run, rank='0')} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        reply, _ = exchange(port_of(exporter), head + body, wait=3)
        # raw bytes outside ASCII are no valid request target (RFC 9112): a 400 in plain text, not a guess
        assert reply.startswith(b"HTTP/1.1 200" if "%" in run else b"HTTP/1.1 400"), reply
    text = scrape(exporter.url)
    assert steps_of(exporter, "lr-ü-é") == 5
    assert "Ã" not in text


def test_basic_auth_scheme_is_case_insensitive(tmp_path: Path) -> None:
    password_file = tmp_path / "password"
    password_file.write_text("s3cret\n")
    with running_exporter(tmp_path, *NO_COLLECTORS, "--basic-auth-user", "prom",
                          "--basic-auth-password-file", str(password_file)) as exp:
        credentials = base64.b64encode(b"prom:s3cret").decode()
        for scheme in ("Basic", "basic", "BASIC"):
            response = requests.get(exp.url + "/metrics", headers={"Authorization": f"{scheme} {credentials}"},
                                    timeout=5)
            assert response.status_code == 200, scheme
        assert requests.get(exp.url + "/metrics", headers={"Authorization": f"Bearer {credentials}"},
                            timeout=5).status_code == 401


def test_an_encrypted_tls_key_fails_with_one_line_and_never_prompts(tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-days", "1", "-subj", "/CN=x",
                    "-passout", "pass:secret", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    controller, terminal = pty.openpty()  # a terminal OpenSSL could prompt on, as under a person's shell

    def own_terminal() -> None:
        os.setsid()
        import fcntl
        import termios
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    process = subprocess.Popen(
        [sys.executable, "-m", "stepscope.exporter", *NO_COLLECTORS, "--listen-address", f"127.0.0.1:{free_port()}",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key)],
        stdin=terminal, stdout=terminal, stderr=terminal, env={**os.environ, **exporter_env()},
        preexec_fn=own_terminal, cwd=REPO_ROOT,
    )
    os.close(terminal)
    output = b""
    try:
        deadline = time.monotonic() + 20
        while process.poll() is None and time.monotonic() < deadline:
            if select.select([controller], [], [], 0.2)[0]:
                try:
                    output += os.read(controller, 4096)
                except OSError:
                    break
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running (waiting for a passphrase?): {output!r}")
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        try:
            while select.select([controller], [], [], 0.1)[0]:
                chunk = os.read(controller, 4096)
                if not chunk:
                    break
                output += chunk
        except OSError:
            pass
        os.close(controller)
    text = output.decode(errors="replace").strip()
    assert process.returncode == 2
    assert "pass phrase" not in text.lower()
    assert text.splitlines() == [text.splitlines()[0]]
    assert text.startswith("stepscope-exporter: error: cannot load TLS: ")
    assert "is encrypted" in text


# --- 7. memory: the defaults bound the exporter ------------------------------------------------

def _worst_case_body(rng: random.Random, series: int, label_length: int) -> str:
    """`series` samples whose every label value (a free one: dtype) is as long as allowed and incompressible."""
    alphabet = string.ascii_letters + string.digits

    def value() -> str:
        return "".join(rng.choice(alphabet) for _ in range(label_length))

    lines = ["# TYPE stepscope_model_flops_total counter"]
    lines += [f'stepscope_model_flops_total{{dtype="{value()}"}} 0' for _ in range(series)]
    return "\n".join(lines) + "\n"


def test_the_exporter_stays_under_256_mib_at_every_default_limit(tmp_path: Path) -> None:
    rng = random.Random(7)
    with running_exporter(tmp_path, *NO_COLLECTORS) as exp:
        statuses = []
        for rank in range(512):  # the default --ingest-max-groups
            run = "".join(rng.choice(string.ascii_lowercase) for _ in range(128))
            body = _worst_case_body(rng, 2000, 128)  # --ingest-max-series-per-group, label length
            response = requests.put(exp.url + GROUP.format(run=run, rank=rank), data=body, timeout=30)
            statuses.append(response.status_code)
            if response.status_code == 429:
                assert "--ingest-max-series" in response.text
                break
        assert statuses[-1] == 429 and set(statuses[:-1]) == {200}
        for encoding in ("identity", "gzip"):
            assert requests.get(exp.url + "/metrics", headers={"Accept-Encoding": encoding}, timeout=60).ok
        rss = psutil.Process(exp.process.pid).memory_info().rss
    print(f"RSS {rss / 2**20:.0f} MiB after {len(statuses) - 1} groups")
    assert rss < 256 * 2**20, f"RSS {rss / 2**20:.0f} MiB"


# --- 9. SIGTERM finishes the scrapes in flight --------------------------------------------------

def _read_response(sock: socket.socket, begun: threading.Barrier, signalled: threading.Event) -> bytes:
    """The body of one response, up to its Content-Length: its head first (then `begun`), the rest only once
    the exporter was signalled, so every response is in flight then however loaded the machine. Read 16 KiB
    every 5 ms throughout after a fixed 0.5 s, two of five did not finish within the exporter's 5 s for
    in-flight responses in a clean-clone CI run at -n 6 (cut at 94% and 93%): the pace was the test's. It still
    was: the body grew as `bytes`, each recv copying all of it (3.4 s of CPU per 10.7 MB response in 16 KiB
    reads, against 0.01 s into a bytearray), and a clean-clone run cut the third of three at 95%."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(16384)
    head, _, first = data.partition(b"\r\n\r\n")
    lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    length = int(lengths[0])
    begun.wait(30)
    signalled.wait(30)
    body = bytearray(first)
    while len(body) < length:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        body += chunk
    return bytes(body)


def test_sigterm_finishes_large_scrapes_in_flight(tmp_path: Path) -> None:
    with running_exporter(tmp_path, *NO_COLLECTORS) as exp:
        body = hooks_body()
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda rank: put(exp, "big", body, str(rank)), range(512)))
        expected = requests.get(exp.url + "/metrics", headers={"Accept-Encoding": "identity"}, timeout=10).content
        assert len(expected) > 8_000_000  # more than the kernel's socket buffers hold for a slow reader
        scrapes = []
        # three at once: five (53 MB for the test's Python to read within the exporter's 5 s) were cut at 91% in a
        # clean-clone run on a slower 2-core machine, where the pace measured was the test's again
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", port_of(exp)), timeout=30)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)  # the server must wait for the reader
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n\r\n")
            scrapes.append(sock)
        stuck = socket.create_connection(("127.0.0.1", port_of(exp)))  # never reads: shutdown stays bounded
        stuck.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        begun, signalled = threading.Barrier(len(scrapes) + 1), threading.Event()
        with ThreadPoolExecutor(max_workers=len(scrapes)) as pool:
            reading = [pool.submit(_read_response, sock, begun, signalled) for sock in scrapes]
            begun.wait(30)  # every response begun, held by its full socket buffers
            exp.process.send_signal(signal.SIGTERM)
            signalled.set()
            received = [future.result() for future in reading]
        assert exp.process.wait(timeout=30) == 0
        stuck.close()
    snapshot = without_clock(expected)  # each scrape ends with the node's clock as it was answered
    assert [len(without_clock(r)) for r in received] == [len(snapshot)] * len(scrapes)
    assert all(without_clock(r).endswith(snapshot[-200:]) for r in received)


# --- gzip from stored blocks, and Prometheus reads it ------------------------------------------

def test_gzip_scrape_is_one_valid_member_equal_to_the_plain_body(exporter: Running) -> None:
    for rank in range(3):
        put(exporter, "gz", full_body(steps=rank + 1), str(rank))
    plain = requests.get(exporter.url + "/metrics", headers={"Accept-Encoding": "identity"}, timeout=10).content
    packed = requests.get(exporter.url + "/metrics", headers={"Accept-Encoding": "gzip"}, stream=True, timeout=10)
    raw = packed.raw.read(decode_content=False)
    assert packed.headers["Content-Encoding"] == "gzip"
    assert without_clock(gzip.decompress(raw)) == without_clock(plain)  # the clock is each scrape's own
    assert raw[:2] == b"\x1f\x8b" and len(raw) < len(plain)



# --- HTTP/1.1 framing on one connection (exporter.http_exchange) ------------------------------------

def responses_in(data: bytes, methods: list[str]) -> list[tuple[bytes, dict[bytes, bytes], bytes]]:
    """(status line, headers with lower-case names, body) of each response in a byte stream, answering
    `methods` in turn: a body is Content-Length bytes, none after a HEAD."""
    found = []
    for method in methods:
        head, _, rest = data.partition(b"\r\n\r\n")
        status, *lines = head.split(b"\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (line.partition(b":") for line in lines)}
        length = int(headers[b"content-length"]) if method != "HEAD" else 0
        found.append((status, headers, rest[:length]))
        data = rest[length:]
    assert data == b"", data[:200]
    return found


def test_pipelined_requests_are_answered_in_order_and_head_sends_no_body(exporter: Running) -> None:
    put(exporter, "pipe", counter("stepscope_steps_total", 7))
    body = counter("stepscope_steps_total", 8).encode()
    requests_sent = (b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n\r\n"
                     b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n"
                     + f"PUT {GROUP.format(run='pipe', rank='0')} HTTP/1.1\r\nHost: x\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n".encode() + body
                     + b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    reply, closed = exchange(port_of(exporter), requests_sent, wait=5)
    assert closed
    head, healthy, pushed, missing = responses_in(reply, ["HEAD", "GET", "PUT", "GET"])
    assert head[0] == b"HTTP/1.1 200 OK" and head[2] == b""
    assert int(head[1][b"content-length"]) > 1000  # the length a GET would get
    assert healthy[0] == b"HTTP/1.1 200 OK" and healthy[2] == b"OK\n"
    assert pushed[0] == b"HTTP/1.1 200 OK"
    assert missing[0] == b"HTTP/1.1 404 Not Found" and missing[1][b"connection"] == b"close"
    assert steps_of(exporter, "pipe") == 8


def test_a_kept_alive_connection_serves_scrapes_until_the_client_ends_it(exporter: Running) -> None:
    with socket.create_connection(("127.0.0.1", port_of(exporter)), timeout=5) as sock:
        for _ in range(3):
            sock.sendall(b"GET /-/ready HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while not reply.endswith(b"\r\n\r\nOK\n"):
                chunk = sock.recv(65536)
                assert chunk, reply  # closed before the answer
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: close" not in reply


@pytest.mark.parametrize(("name", "data", "status"), [
    ("no Host in HTTP/1.1", b"GET /metrics HTTP/1.1\r\n\r\n", b"400"),
    ("a head over 16 KiB", b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n", b"431"),
    ("two different Content-Lengths", f"PUT {GROUP.format(run='cl', rank='0')} HTTP/1.1\r\nHost: x\r\n"
     "Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd".encode(), b"400"),
])
def test_malformed_heads_are_answered_and_closed(exporter: Running, name: str, data: bytes, status: bytes) -> None:
    reply, closed = exchange(port_of(exporter), data, wait=5)
    assert reply.startswith(b"HTTP/1.1 " + status), (name, reply[:200])
    assert closed, name
    assert steps_of(exporter, "cl") is None


def test_expect_100_continue_is_answered_only_when_the_body_is_wanted(tmp_path: Path) -> None:
    """curl sends `Expect: 100-continue` with larger bodies and waits for it (up to 1 s) before sending."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    body = counter("stepscope_steps_total", 9).encode()
    with running_exporter(tmp_path, *NO_COLLECTORS, "--ingest-token-file", str(token_file)) as exp:
        for token, expected in (("wrong", b"HTTP/1.1 401"), ("s3cret", b"HTTP/1.1 100 Continue\r\n\r\n")):
            with socket.create_connection(("127.0.0.1", port_of(exp)), timeout=5) as sock:
                sock.sendall(f"PUT {GROUP.format(run='expect', rank='0')} HTTP/1.1\r\nHost: x\r\n"
                             f"Authorization: Bearer {token}\r\nExpect: 100-continue\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n".encode())
                assert sock.recv(65536).startswith(expected)
                if token == "s3cret":
                    sock.sendall(body)
                    assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")
        assert samples(scrape(exp.url))[
            ("stepscope_steps_total", frozenset({("run", "expect"), ("rank", "0")}))] == 9


def test_a_request_sent_a_byte_at_a_time_is_answered_and_a_split_http09_line_refused(exporter: Running) -> None:
    """The first line is checked as it arrives, piece by piece (exporter.http_exchange)."""
    for request, expected in ((b"\r\nGET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"HTTP/1.1 200"),
                              (b"GET /metrics\r\n", b"HTTP/1.1 400")):
        with socket.create_connection(("127.0.0.1", port_of(exporter)), timeout=5) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for byte in request:
                sock.sendall(bytes([byte]))
                time.sleep(0.002)  # each its own segment, mostly its own read
            assert sock.recv(65536).startswith(expected), request


def test_a_pipelined_request_whose_head_ends_in_a_later_read_is_answered(exporter: Running) -> None:
    """The second request's first line arrives with the first request; its head's end comes later."""
    with socket.create_connection(("127.0.0.1", port_of(exporter)), timeout=5) as sock:
        sock.sendall(b"GET /-/ready HTTP/1.1\r\nHost: x\r\n\r\nGET /-/healthy HTTP/1.1\r\nHo")
        time.sleep(0.2)
        sock.sendall(b"st: x\r\nConnection: close\r\n\r\n")
        reply, closed = b"", False
        while not closed:
            chunk = sock.recv(65536)
            reply, closed = reply + chunk, not chunk
    ready, healthy = responses_in(reply, ["GET", "GET"])
    assert ready[0] == healthy[0] == b"HTTP/1.1 200 OK"


def test_a_head_that_comes_as_its_idle_limit_passes_is_served_whole_or_closed_unanswered(monkeypatch) -> None:
    """A push's head that reaches a kept-alive connection as the idle limit passes: the head's data and its
    deadline come in one turn of the event loop (here the loop is kept busy past the deadline meanwhile).
    Either outcome is HTTP's: the request served whole, or the connection closed unanswered and the push
    sent again on a new one (the hooks' pusher does). Not a 408 for a body that had no time to come: an
    exception the deadline set on the reader outlived it and failed the body's first read (pushes 10 s
    apart to a real exporter met it once in 21)."""
    monkeypatch.setattr(http_exchange, "HEADER_TIMEOUT_SECONDS", 0.2)
    body = counter("stepscope_steps_total", 3).encode()
    head = f"PUT {GROUP.format(run='late', rank='0')} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"

    async def serve(ours: socket.socket, client: socket.socket) -> str:
        reader, writer = await asyncio.open_connection(sock=ours)
        exchange = http_exchange.Exchange(reader, writer)
        heading = asyncio.ensure_future(exchange.next_request())
        await asyncio.sleep(0)  # it waits for the head, its deadline set
        client.sendall(head.encode())
        time.sleep(0.3)  # the loop busy past the deadline
        if await heading is None:
            return "closed"
        client.sendall(body)
        try:
            return "served whole" if await exchange.read_body() == body else "body cut"
        except http_exchange.DeadlinePassed:
            return "408 at once"
        finally:
            writer.close()

    ours, client = socket.socketpair()
    with client:
        assert asyncio.run(serve(ours, client)) in ("served whole", "closed")


@pytest.mark.parametrize(("target", "length_header", "answer"), [
    (GROUP.format(run="empty", rank="0"), b"Content-Length: 0\r\n", b"has an empty body"),
    (GROUP.format(run="empty", rank="0"), b"", b"has an empty body"),  # no length at all: no body (RFC 9112 6.3)
    ("/api/v1/profiles", b"Content-Length: 0\r\n", b"the body is not JSON"),
], ids=["push-length-0", "push-no-length", "profile-length-0"])
def test_a_request_without_a_body_is_answered_at_once_with_a_pipelined_one_behind_it(
        tmp_path: Path, target: str, length_header: bytes, answer: bytes) -> None:
    """A PUT or POST with no body, a scrape pipelined behind it: a 400 and the scrape's 200 at once, and
    the exporter goes on. Before, the handler waited for a body whose end h11 had already given with the
    head: alone, 10 s and a 408; with a request behind it, h11 said PAUSED for ever and the event loop
    spun at 100% CPU, no scrape or probe answered again (an exporter of its own: it would not recover)."""
    with running_exporter(tmp_path, *NO_COLLECTORS) as exp:
        methods = ["PUT", "POST"] if target.startswith("/metrics/") else ["POST"]
        for method in methods:
            empty = f"{method} {target} HTTP/1.1\r\nHost: x\r\n".encode() + length_header + b"\r\n"
            started = time.monotonic()
            reply, closed = exchange(port_of(exp), empty + b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n"
                                                         b"Connection: close\r\n\r\n", wait=3)
            assert closed and time.monotonic() - started < 2, (method, reply)
            refused, healthy = responses_in(reply, [method, "GET"])
            assert refused[0] == b"HTTP/1.1 400 Bad Request" and answer in refused[2], refused
            assert healthy[0] == b"HTTP/1.1 200 OK"
        assert requests.get(f"{exp.url}/-/healthy", timeout=3).status_code == 200

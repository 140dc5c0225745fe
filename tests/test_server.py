"""The HTTP layer through a real exporter process: endpoints, gzip, concurrency, TLS, basic auth."""

import gzip
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from stepscope.exporter.cli import build_parser
from stepscope.exporter.http_exchange import origin_form
from stepscope.exporter.server import accepts_gzip
from stepscope_testkit import no_ipv6
from stepscope_testkit.ingest_bodies import counter
from stepscope_testkit.processes import (
    exporter_env,
    free_port,
    running,
    running_exporter,
    sample_values,
    scrape,
)
from tests.support.certs import make_cert

NO_COLLECTORS = ("--collectors", "")


def test_endpoints_and_self_metrics(tmp_path: Path) -> None:
    with running_exporter(tmp_path, *NO_COLLECTORS) as exporter:
        text = scrape(exporter.url)
        assert sample_values(text, "stepscope_exporter_build_info") == [1.0]
        assert requests.get(f"{exporter.url}/-/healthy", timeout=5).text == "OK\n"
        assert requests.get(f"{exporter.url}/-/ready", timeout=5).status_code == 200
        index = requests.get(f"{exporter.url}/", timeout=5).text
        for link in ("metrics", "-/healthy", "-/ready"):
            assert f'href="{link}"' in index
        assert requests.get(f"{exporter.url}/nope", timeout=5).status_code == 404
        response = requests.get(f"{exporter.url}/metrics", timeout=5)
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_listen_address_is_logged_and_refused_in_brackets(tmp_path: Path) -> None:
    """The logged URL can be pasted: `http://[::1]:PORT/metrics`, and a busy port reads `[::1]:PORT`.
    Before, `http://::1:PORT/metrics`, which no client parses as that address."""
    port = free_port()
    argv = [sys.executable, "-m", "stepscope.exporter", "--web.listen-address", f"[::1]:{port}", *NO_COLLECTORS]
    with running(argv, f"http://[::1]:{port}/-/ready", tmp_path / "exporter.log", env=exporter_env()) as exporter:
        served = f"http://[::1]:{port}/metrics"
        assert f" serving {served} (collectors: none)" in exporter.log(), exporter.log()
        assert requests.get(served, timeout=5).status_code == 200  # the logged URL, as written
    with socket.socket(socket.AF_INET6) as busy:
        busy.bind(("::1", 0))
        busy.listen()
        busy_port = busy.getsockname()[1]
        result = subprocess.run([*argv[:-3], f"[::1]:{busy_port}", *NO_COLLECTORS], capture_output=True, text=True,
                                timeout=30, env={**exporter_env()})
    assert result.returncode == 2
    assert result.stderr.startswith(f"stepscope-exporter: error: cannot listen on [::1]:{busy_port}: "), result.stderr


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_the_default_address_answers_ipv6_and_ipv4_clients(tmp_path: Path) -> None:
    """`:PORT` (the default, `:9847`) listens on IPv6 and IPv4 alike, as node_exporter's `:9100`. Before, the
    default was 0.0.0.0: an IPv6-only cluster's Prometheus and kubelet probes, which go to the pod's IPv6
    address, got connection refused, and so did `http://[::1]:PORT` here."""
    assert build_parser().parse_args([]).listen_address == ("", 9847)
    port = free_port()
    argv = [sys.executable, "-m", "stepscope.exporter", "--web.listen-address", f":{port}", *NO_COLLECTORS]
    with running(argv, f"http://127.0.0.1:{port}/-/ready", tmp_path / "exporter.log", env=exporter_env()) as exporter:
        for url in (f"http://[::1]:{port}/metrics", f"http://127.0.0.1:{port}/metrics"):
            assert requests.get(url, timeout=5).status_code == 200, url
        assert f" serving http://[::]:{port}/metrics (collectors: none)" in exporter.log(), exporter.log()


@pytest.mark.skipif(bool(no_ipv6.available()), reason=no_ipv6.available() or "")
def test_where_the_kernel_has_no_ipv6_the_default_address_is_every_ipv4_one(tmp_path: Path) -> None:
    """A kernel booted with ipv6.disable=1 refuses IPv6 sockets (EAFNOSUPPORT; here a seccomp filter gives that
    refusal to a real exporter): the default listens on 0.0.0.0 without an error, and an explicit `[::]:PORT`
    is refused in one line, since it asks for what the node lacks."""
    port = free_port()
    argv = [sys.executable, "-m", "stepscope_testkit.no_ipv6", sys.executable, "-m", "stepscope.exporter",
            "--web.listen-address", f":{port}", *NO_COLLECTORS]
    with running(argv, f"http://127.0.0.1:{port}/-/ready", tmp_path / "exporter.log", env=exporter_env()) as exporter:
        assert f" serving http://0.0.0.0:{port}/metrics (collectors: none)" in exporter.log(), exporter.log()
        assert "Traceback" not in exporter.log() and " ERROR " not in exporter.log()
    argv[argv.index(f":{port}")] = f"[::]:{port}"
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={**exporter_env()})
    assert (result.returncode, result.stderr) == (
        2, f"stepscope-exporter: error: cannot listen on [::]:{port}: Address family not supported by protocol\n")


def test_gzip_only_when_asked(tmp_path: Path) -> None:
    with running_exporter(tmp_path, *NO_COLLECTORS) as exporter:
        plain = requests.get(f"{exporter.url}/metrics", headers={"Accept-Encoding": "identity"}, timeout=5)
        assert "Content-Encoding" not in plain.headers
        packed = requests.get(
            f"{exporter.url}/metrics", headers={"Accept-Encoding": "gzip"}, stream=True, timeout=5
        )
        assert packed.headers["Content-Encoding"] == "gzip"
        raw = packed.raw.read(decode_content=False)
        assert gzip.decompress(raw).decode().startswith("# HELP")
        assert b"stepscope_exporter_build_info" in gzip.decompress(raw)
        refused = requests.get(f"{exporter.url}/metrics", headers={"Accept-Encoding": "gzip;q=0, *"}, timeout=5)
        assert "Content-Encoding" not in refused.headers
        assert refused.text.startswith("# HELP")


@pytest.mark.parametrize(("header", "gzipped"), [
    ("gzip", True), ("GZIP", True), ("x-gzip", True), ("deflate, gzip;q=0.5", True), ("*", True),
    ("br;q=1.0, *;q=0.1", True),
    ("", False), ("identity", False), ("gzip;q=0", False), ("gzip; q=0.000", False), ("xgzip", False),
    ("*;q=0", False), ("gzip;q=0, *", False), ("gzip;q=x", False),
])
def test_gzip_is_what_accept_encoding_admits(header: str, gzipped: bool) -> None:
    """RFC 9110's Accept-Encoding: a weight of 0 refuses a coding, `*` stands for the codings not named, names
    are case-insensitive (a substring test gzipped for `gzip;q=0` and `xgzip`, and not for `GZIP`)."""
    assert accepts_gzip(header) is gzipped


def test_a_target_in_absolute_form_is_served_as_its_path(tmp_path: Path) -> None:
    """RFC 9112 3.2.2: a server must accept `PUT http://host:port/path` (a client going through a proxy); it was
    refused as 'PUT is not allowed on http://...' (405)."""
    with running_exporter(tmp_path, *NO_COLLECTORS) as exporter:
        port = int(exporter.url.rsplit(":", 1)[1])
        body = counter("stepscope_steps_total", 3).encode()
        head = (f"PUT http://127.0.0.1:{port}/metrics/job/stepscope/run/absolute/rank/0 HTTP/1.1\r\nHost: x\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + body)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        assert 'stepscope_steps_total{rank="0",run="absolute"} 3.0' in scrape(exporter.url)
    assert [origin_form(t) for t in ("/metrics", "HTTPS://h:1?x=1", "http://h", "*", "ftp://h/x")] == [
        "/metrics", "/?x=1", "/", "*", "ftp://h/x"]


def test_sighup_keeps_the_exporter_and_its_pushed_groups(tmp_path: Path) -> None:
    """SIGHUP's default action ends a process; the pushed groups live in memory only."""
    with running_exporter(tmp_path, *NO_COLLECTORS) as exporter:
        body = counter("stepscope_steps_total", 7)
        pushed = requests.put(f"{exporter.url}/metrics/job/stepscope/run/hup/rank/0", data=body, timeout=5)
        assert pushed.status_code == 200
        exporter.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "received SIGHUP" not in exporter.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exporter.process.poll() is None, exporter.log()
        assert "received SIGHUP: not stopping (SIGTERM stops the exporter)" in exporter.log()
        assert 'stepscope_steps_total{rank="0",run="hup"} 7.0' in scrape(exporter.url)


def test_idle_and_slow_clients_do_not_block_scrapes(tmp_path: Path) -> None:
    with running_exporter(tmp_path, *NO_COLLECTORS) as exporter:
        port = int(exporter.url.rsplit(":", 1)[1])
        idle = socket.create_connection(("127.0.0.1", port))
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        try:
            results: list[int] = []

            def scrape_once() -> None:
                results.append(requests.get(f"{exporter.url}/metrics", timeout=5).status_code)

            threads = [threading.Thread(target=scrape_once) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=10)
            assert results == [200] * 8
        finally:
            idle.close()
            slow.close()


def test_basic_auth_protects_metrics_but_not_probes(tmp_path: Path) -> None:
    password_file = tmp_path / "password"
    password_file.write_text("s3cret\n")
    with running_exporter(
        tmp_path, *NO_COLLECTORS, "--basic-auth-user", "prom", "--basic-auth-password-file", str(password_file)
    ) as exporter:
        denied = requests.get(f"{exporter.url}/metrics", timeout=5)
        assert denied.status_code == 401
        assert denied.headers["WWW-Authenticate"].startswith("Basic")
        assert requests.get(f"{exporter.url}/metrics", auth=("prom", "wrong"), timeout=5).status_code == 401
        assert requests.get(f"{exporter.url}/metrics", auth=("prom", "s3cret"), timeout=5).status_code == 200
        assert requests.get(f"{exporter.url}/-/healthy", timeout=5).status_code == 200


def _served_common_name(port: int) -> str:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port)) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    pem = ssl.DER_cert_to_PEM_cert(der)
    subject = subprocess.run(["openssl", "x509", "-noout", "-subject"], input=pem, capture_output=True,
                             text=True, check=True).stdout
    return subject.strip().rsplit("=", 1)[1].strip()


def test_tls_serves_and_reloads_changed_certificate(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "first")
    port = free_port()
    argv = [sys.executable, "-m", "stepscope.exporter", "--listen-address", f"127.0.0.1:{port}", "--collectors", "",
            "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    with running(argv, f"https://127.0.0.1:{port}/-/ready", tmp_path / "tls.log", env=exporter_env(),
                 verify=False) as exporter:
        assert requests.get(f"https://127.0.0.1:{port}/metrics", verify=str(cert), timeout=5).status_code == 200
        assert _served_common_name(port) == "first"
        with socket.create_connection(("127.0.0.1", port)):  # a client that never starts its handshake
            assert requests.get(f"https://127.0.0.1:{port}/-/healthy", verify=str(cert), timeout=5).ok
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5)  # plain HTTP is refused

        renewed = tmp_path / "renewed"
        renewed.mkdir()
        _renew(renewed, "second", cert, key)
        assert _served_after_renewal(port, "second")

        cert.write_text("not a certificate")  # a broken renewal keeps the loaded certificate, said once
        for _ in range(4):  # a connection a second: before, each one logged the failure again
            time.sleep(1.1)
            assert _served_common_name(port) == "second"
        assert exporter.log().count("TLS reload failed") == 1
        cert.unlink()  # mid-replace: also said once
        for _ in range(3):
            time.sleep(1.1)
            assert _served_common_name(port) == "second"
        assert exporter.log().count("unreadable, keeping the loaded certificate") == 1
        _renew(renewed, "third", cert, key)  # back: served again
        assert _served_after_renewal(port, "third")


def _renew(directory: Path, common_name: str, cert: Path, key: Path) -> None:
    """A renewal in place: a new pair made in `directory` moved over the served files, key first."""
    new_cert, new_key = make_cert(directory, common_name)
    new_key.replace(key)
    new_cert.replace(cert)


def _served_after_renewal(port: int, common_name: str) -> bool:
    """Whether the exporter serves `common_name`'s certificate within 10 s (it looks once a second)."""
    deadline = time.monotonic() + 10
    while _served_common_name(port) != common_name and time.monotonic() < deadline:
        time.sleep(0.2)
    return _served_common_name(port) == common_name


FAULTY_HANDLER = """
import logging, sys
from stepscope.exporter.exposition import ExpositionStore
from stepscope.exporter.server import ExporterServer

class Faulty:
    def check(self, request):
        return None
    def handle(self, request, body):
        raise RuntimeError("a bug in the push handler")
    def refuse(self, request, status, reason, message):
        raise AssertionError("not reached")

logging.basicConfig(level=logging.INFO)
ExporterServer(("127.0.0.1", int(sys.argv[1])), ExpositionStore(), lambda: True, Faulty()).serve()
"""


def test_a_handler_that_raises_is_a_500_and_serving_goes_on(tmp_path: Path) -> None:
    """A bug behind a route answers that request 500 and closes its connection, with one traceback in
    the log; the next requests are served."""
    port = free_port()
    argv = [sys.executable, "-c", FAULTY_HANDLER, str(port)]
    with running(argv, f"http://127.0.0.1:{port}/-/ready", tmp_path / "faulty.log", env=exporter_env(),
                 base_url=f"http://127.0.0.1:{port}") as server:
        for _ in range(2):
            response = requests.put(f"{server.url}/metrics/job/stepscope/run/r/rank/0", data=b"x 1\n", timeout=5)
            assert response.status_code == 500
            assert response.headers["Connection"] == "close"
        assert requests.get(f"{server.url}/-/healthy", timeout=5).text == "OK\n"
    log = server.log()
    assert log.count("Traceback") == 2 and log.count("answering PUT /metrics/job/stepscope/run/r/rank/0 failed") == 2
    assert "Unhandled exception" not in log

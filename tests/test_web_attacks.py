"""Basic auth and the web config file under attack (issue 20): a wrong-password flood must not lock the
legitimate scraper or the health probe out, hostile Authorization headers are a 401 (never a 500), a
half-written web config never opens the endpoint, and an expired certificate is said and published.

Real exporters, real bcrypt, real sockets; the flood's timings are in benchmarks/bench_auth_flood.py."""

import asyncio
import base64
import logging
import socket
import ssl
import subprocess
import sys
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path

import bcrypt
import pytest
import requests
import urllib3

from stepscope.contract import families
from stepscope.exporter import file_watch, web_reload
from stepscope.exporter.web_auth import HASH_WAITING, HASH_WORKERS, AuthBusy, BcryptUsers, Client
from stepscope.exporter.web_config import load
from stepscope.exporter.web_reload import ReloadingUsers, WebConfigSource
from stepscope_testkit.processes import Running, exporter_env, free_port, running, sample_values
from tests.support.certs import make_cert

PASSWORD = "s3cret"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()  # cost 4: quick, same code path
SLOW_HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()  # what htpasswd -nBC 10 makes
HERE = Client("127.0.0.1")


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def serving(config: Path, tmp_path: Path, port: int, scheme: str = "http") -> AbstractContextManager[Running]:
    """A real exporter with this web config, no collectors, ready; its url is the base URL."""
    argv = [sys.executable, "-m", "stepscope.exporter", "--web.listen-address", f"127.0.0.1:{port}",
            "--web.config.file", str(config), "--collectors", "", "--collect-interval", "0.5"]
    base = f"{scheme}://127.0.0.1:{port}"
    return running(argv, f"{base}/-/ready", tmp_path / "exporter.log", env=exporter_env(), base_url=base,
                   verify=scheme == "http")


def raw_get(port: int, authorization: bytes) -> bytes:
    """The status line of a GET /metrics whose Authorization header is these bytes, as sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: " + authorization
                     + b"\r\nConnection: close\r\n\r\n")
        return sock.makefile("rb").readline().strip()


# -- item 4: hostile Authorization headers --------------------------------------------------------

def test_hostile_authorization_headers_are_a_401_with_nothing_logged(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users: {{prometheus: '{HASH}'}}\n")
    port = free_port()
    hostile = [
        "Basic é".encode("latin-1"),  # raw non-ASCII bytes where base64 belongs
        b"Basic \xff\xfe\xfd",
        b"Basic " + base64.b64encode(b"prometheus:\xff\xfe"),  # base64 of bytes that are not UTF-8
        b"Basic " + base64.b64encode(b"prometheus:" + b"a" * 73),  # over bcrypt's 72 bytes: bcrypt 5 raises
        b"Basic " + base64.b64encode("prometheus:pässwörd".encode()),  # UTF-8, just wrong
    ]
    with serving(config, tmp_path, port) as exporter:
        assert [raw_get(port, header) for header in hostile] == [b"HTTP/1.1 401 Unauthorized"] * len(hostile)
        assert requests.get(f"{exporter.url}/metrics", auth=("prometheus", PASSWORD), timeout=5).status_code == 200
    log = exporter.log()
    assert "Traceback" not in log and "Error handling request" not in log


# -- item 1: a wrong-password flood ---------------------------------------------------------------

def test_a_flood_of_wrong_passwords_never_evicts_the_granted_login() -> None:
    users = BcryptUsers({"prometheus": HASH})

    async def flood_between_two_scrapes() -> list[bool]:
        first = await users.allows(basic("prometheus", PASSWORD), HERE)
        wrong = [await users.allows(basic("prometheus", f"guess-{n}"), Client(f"10.0.{n // 256}.{n % 256}"))
                 for n in range(300)]  # each from its own address: one waits after a few denials
        return [first, *set(wrong), await users.allows(basic("prometheus", PASSWORD), HERE)]

    assert asyncio.run(flood_between_two_scrapes()) == [True, False, True]
    assert users.bcrypt_calls == 1 + 300  # the second scrape was a cache hit: no hash
    asyncio.run(users.allows(basic("prometheus", "guess-299"), HERE))  # a repeated wrong one is cached too
    assert users.bcrypt_calls == 301


def test_new_credentials_beyond_the_bound_are_refused_at_once() -> None:
    users = BcryptUsers({"prometheus": SLOW_HASH})

    async def at_once(clients: list[Client], guess: str) -> list[object]:
        return await asyncio.gather(*(users.allows(basic("prometheus", f"{guess}-{n}"), client)
                                      for n, client in enumerate(clients)), return_exceptions=True)

    answers = asyncio.run(at_once([Client(f"10.0.0.{n}") for n in range(20)], "guess"))
    busy = [answer for answer in answers if isinstance(answer, AuthBusy)]
    new = HASH_WORKERS + HASH_WAITING - 1  # the last slot is kept for an address let in before
    assert len(busy) == 20 - new and "retry" in str(busy[0])
    assert answers.count(False) == new == users.bcrypt_calls
    same_client = asyncio.run(at_once([Client("10.0.0.1"), Client("10.0.0.1")], "another"))  # one at a time per address
    assert same_client[0] is False and isinstance(same_client[1], AuthBusy)
    same_host = asyncio.run(at_once([Client("2001:db8::1"), Client("2001:db8::2:1")], "v6"))  # one IPv6 /64
    assert same_host[0] is False and isinstance(same_host[1], AuthBusy)
    mapped = asyncio.run(at_once([Client("::ffff:10.1.0.1"), Client("::ffff:10.1.0.2")], "mapped"))  # two hosts
    assert mapped == [False, False]


def test_a_check_whose_client_left_costs_no_hash_and_is_not_remembered() -> None:
    users = BcryptUsers({"prometheus": HASH})
    left = Client("127.0.0.1", connected=lambda: False)
    assert asyncio.run(users.allows(basic("prometheus", PASSWORD), left)) is False
    assert users.bcrypt_calls == 0
    assert asyncio.run(users.allows(basic("prometheus", PASSWORD), HERE)) is True  # not cached as denied


def test_the_same_new_credentials_sent_twice_at_once_cost_one_hash() -> None:
    """A second scrape sent before the first was answered (a retry, a second Prometheus behind the same
    address) waits for the first one's outcome instead of a 429 or a second bcrypt."""
    users = BcryptUsers({"prometheus": SLOW_HASH})

    async def twice(first: Client, second: Client) -> list[bool]:
        return list(await asyncio.gather(users.allows(basic("prometheus", PASSWORD), first),
                                         users.allows(basic("prometheus", PASSWORD), second)))

    assert asyncio.run(twice(HERE, HERE)) == [True, True] and users.bcrypt_calls == 1
    users = BcryptUsers({"prometheus": SLOW_HASH})
    left = Client("127.0.0.1", connected=lambda: False)  # the first one left: the second checks for itself
    assert asyncio.run(twice(left, HERE)) == [False, True] and users.bcrypt_calls == 1


def test_a_burst_of_wrong_passwords_leaves_scrapes_and_the_health_probe_up(tmp_path: Path) -> None:
    """300 new wrong passwords sent and closed at once, then a scrape with the cached credentials and a
    probe: before, the burst evicted the scraper's cached outcome and queued ~20 s of bcrypt ahead of it."""
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users: {{prometheus: '{SLOW_HASH}'}}\n")
    port = free_port()
    with serving(config, tmp_path, port) as exporter:
        auth = ("prometheus", PASSWORD)
        assert requests.get(f"{exporter.url}/metrics", auth=auth, timeout=5).status_code == 200
        for n in range(300):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: {basic('prometheus', str(n))}"
                             "\r\n\r\n".encode())
        assert requests.get(f"{exporter.url}/-/healthy", timeout=2).status_code == 200
        for _ in range(3):
            assert requests.get(f"{exporter.url}/metrics", auth=auth, timeout=5).status_code == 200
        deadline = time.monotonic() + 10  # the burst's last admitted checks drain, then a new one is heard
        while (guess := requests.get(f"{exporter.url}/metrics", auth=("prometheus", "guess"), timeout=5)
               .status_code) == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert guess == 401
    assert "Traceback" not in exporter.log()


# -- item 2: a reload never turns auth off by accident ---------------------------------------------

LOADED = f"basic_auth_users: {{prometheus: '{HASH}'}}\nhttp_server_config: {{headers: {{X-Frame-Options: deny}}}}\n"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "basic_auth_users is gone or empty"),
        ("# being edited\n", "basic_auth_users is gone or empty"),
        ("basic_auth_users:\n", "basic_auth_users is gone or empty"),
        ("basic_auth_users:\n  prometheus:", "not a bcrypt hash"),
        (f"basic_auth_users:\n  prometheus: '{HASH[:20]}", "not YAML"),
        ("http_server_config: {headers: {X-Frame-Options: deny}}\n", "basic_auth_users is gone or empty"),
        (f"basic_auth_users: {{prometheus: '{HASH}'}}\n", "http_server_config.headers is gone or empty"),
        (f"basic_auth_users: {{prometheus: '{HASH}'}}\nhttp_server_config:\n  headers:\n    X-Frame-Options:",
         "X-Frame-Options: no value"),
    ],
    # fixed ids: HASH has a random salt, and pytest-xdist's workers must collect the same test names
    ids=["empty", "comment-only", "users-key-only", "user-without-hash", "truncated-yaml", "headers-only",
         "users-only", "header-without-value"],
)
def test_a_reload_that_would_drop_users_or_headers_keeps_them(
    tmp_path: Path, text: str, reason: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(file_watch, "CHECK_SECONDS", 0.0)
    config = tmp_path / "web.yml"
    config.write_text(LOADED)
    source = WebConfigSource(str(config), load(str(config)))
    auth = ReloadingUsers(source)
    config.write_text(text)
    with caplog.at_level(logging.INFO, logger=web_reload.__name__):
        for _ in range(3):
            assert asyncio.run(auth.allows(None, HERE)) is False
            assert source.headers() == {"X-Frame-Options": "deny"}
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(errors) == 1 and reason in errors[0] and "keeping the loaded users" in errors[0], errors


def test_only_an_explicit_file_turns_basic_auth_and_headers_off(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_watch, "CHECK_SECONDS", 0.0)
    config = tmp_path / "web.yml"
    config.write_text(LOADED)
    source = WebConfigSource(str(config), load(str(config)))
    auth = ReloadingUsers(source)
    config.write_text("basic_auth_users: {}\nhttp_server_config: {headers: {}}\n")
    assert asyncio.run(auth.allows(None, HERE)) is True and source.headers() == {}


def test_a_reload_without_the_tls_section_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(file_watch, "CHECK_SECONDS", 0.0)
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config: {{cert_file: tls.crt, key_file: tls.key}}\n{LOADED}")
    source = WebConfigSource(str(config), load(str(config)))
    config.write_text(f"basic_auth_users: {{prometheus: '{HASH}'}}\n")  # users kept, TLS and headers gone
    with caplog.at_level(logging.ERROR, logger=web_reload.__name__):
        assert source.current().tls is not None and source.headers() == {"X-Frame-Options": "deny"}
    assert "tls_server_config is gone" in caplog.text


def test_a_web_config_rewritten_in_small_writes_never_opens_the_endpoint(tmp_path: Path) -> None:
    """An editor that truncates, then writes a piece at a time: every moment of the file is reloaded by
    someone polling, and none of them may let an unauthenticated request in."""
    config = tmp_path / "web.yml"
    pieces = ["http_server_config:\n", "  headers: {X-Frame-Options: deny}\n", "basic_auth_users:\n",
              f"  prometheus: '{HASH}'\n"]
    config.write_text("".join(pieces))
    port = free_port()
    statuses: list[int] = []
    done = threading.Event()

    def poll(url: str) -> None:
        while not done.is_set():
            statuses.append(requests.get(url, timeout=5).status_code)
            time.sleep(0.02)

    with serving(config, tmp_path, port) as exporter:
        poller = threading.Thread(target=poll, args=(f"{exporter.url}/metrics",))
        poller.start()
        try:
            for _ in range(5):
                with open(config, "w") as handle:  # truncated: an empty file for a while, then each piece
                    time.sleep(0.25)
                    for piece in pieces:
                        handle.write(piece)
                        handle.flush()
                        time.sleep(0.25)
        finally:
            time.sleep(1.2)
            done.set()
            poller.join()
        assert requests.get(f"{exporter.url}/metrics", auth=("prometheus", PASSWORD), timeout=5).status_code == 200
    assert statuses and 200 not in statuses and set(statuses) == {401}
    assert "is gone or empty" in exporter.log() and "Traceback" not in exporter.log()


# -- item 7: an expired server certificate ---------------------------------------------------------

def make_expired_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 that expired a day before it was made."""
    cert, key, request = directory / "tls.crt", directory / "tls.key", directory / "tls.csr"
    subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=expired", "-keyout", str(key),
                    "-out", str(request)], check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", str(request), "-signkey", str(key), "-days", "-1", "-out",
                    str(cert)], check=True, capture_output=True)
    return cert, key


def not_after(cert: Path) -> float:
    """The certificate's expiry as openssl prints it, for comparing with what the exporter read."""
    printed = subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-enddate"], check=True,
                             capture_output=True, text=True).stdout
    return float(ssl.cert_time_to_seconds(printed.strip().removeprefix("notAfter=")))


def test_an_expired_certificate_is_logged_at_start_and_on_reload_and_published(tmp_path: Path) -> None:
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    cert, key = make_expired_cert(tmp_path)
    expired_at = not_after(cert)
    assert expired_at < time.time()
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config: {{cert_file: {cert}, key_file: {key}}}\n")
    port = free_port()
    base = f"https://127.0.0.1:{port}"

    def expiry() -> list[float]:
        text = requests.get(f"{base}/metrics", verify=False, timeout=5).text
        checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        return sample_values(text, families.TLS_CERTIFICATE_EXPIRY)

    with serving(config, tmp_path, port, "https") as exporter:
        assert expiry() == [expired_at]
        assert exporter.log().count("expired at") == 1
        renewed = tmp_path / "renewed"
        renewed.mkdir()
        make_cert(renewed, "stepscope")
        for name in ("tls.key", "tls.crt"):  # renewed in place, as cert-manager does
            (tmp_path / name).write_bytes((renewed / name).read_bytes())
        deadline = time.monotonic() + 10
        while expiry() == [expired_at] and time.monotonic() < deadline:
            time.sleep(0.3)
        assert expiry() == [not_after(cert)] and not_after(cert) > time.time()
        assert "is valid until" in exporter.log()
        make_expired_cert(tmp_path)  # and back: the reload says so again
        deadline = time.monotonic() + 10
        while exporter.log().count("expired at") < 2 and time.monotonic() < deadline:
            expiry()
            time.sleep(0.3)
        assert exporter.log().count("expired at") == 2

"""The Prometheus exporter conventions against a real exporter: --web.config.file (TLS, client
certificates, bcrypt basic auth, headers), --web.telemetry-path, --collector.NAME switches, and the
older flags kept as aliases."""

import asyncio
import base64
import ssl
import sys
import time
from pathlib import Path

import bcrypt
import pytest
import requests

from stepscope.exporter.cli import build_parser, enabled_collectors
from stepscope.exporter.web_auth import BcryptUsers, Client
from stepscope.exporter.web_config import WebConfigError, load
from stepscope.exporter.web_tls import TlsContextSource
from stepscope_testkit.processes import exporter_env, free_port, running, running_exporter, sample_values, scrape
from tests.support.certs import make_cert, make_client_cert
from tests.test_cli import assert_clean_failure, run_exporter

PASSWORD = "s3cret"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()  # cost 4: quick, same code path
CLIENT = Client("127.0.0.1")


def _exporter_argv(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "stepscope.exporter", "--web.listen-address", f"127.0.0.1:{port}",
            "--collect-interval", "0.5", *args]


def collectors_in(text: str) -> set[str]:
    return {line.split('collector="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith("stepscope_exporter_collector_duration_seconds{")}


def test_web_config_tls_basic_auth_headers_and_a_moved_telemetry_path(tmp_path: Path) -> None:
    make_cert(tmp_path, "stepscope")
    config = tmp_path / "web.yml"  # relative file names: relative to the file, as exporter-toolkit reads them
    config.write_text(f"""
tls_server_config:
  cert_file: tls.crt
  key_file: tls.key
  min_version: TLS12
http_server_config:
  headers:
    X-Frame-Options: deny
    X-Content-Type-Options: nosniff
basic_auth_users:
  prometheus: {HASH}
""")
    port = free_port()
    base = f"https://127.0.0.1:{port}"
    verify = str(tmp_path / "tls.crt")
    argv = _exporter_argv(port, "--web.config.file", str(config), "--web.telemetry-path", "/stepscope/metrics",
                          "--no-collector.gpu", "--no-collector.process")
    with running(argv, f"{base}/-/ready", tmp_path / "exporter.log", env=exporter_env(), verify=verify):
        denied = requests.get(f"{base}/stepscope/metrics", verify=verify, timeout=5)
        assert denied.status_code == 401 and denied.headers["WWW-Authenticate"].startswith("Basic")
        assert denied.headers["X-Frame-Options"] == "deny"
        auth = ("prometheus", PASSWORD)
        assert requests.get(f"{base}/stepscope/metrics", auth=("prometheus", "wrong"), verify=verify,
                            timeout=5).status_code == 401
        assert requests.get(f"{base}/stepscope/metrics", auth=("nobody", PASSWORD), verify=verify,
                            timeout=5).status_code == 401
        for _ in range(3):  # the cached outcome answers the same way every time
            scraped = requests.get(f"{base}/stepscope/metrics", auth=auth, verify=verify, timeout=5)
            assert scraped.status_code == 200
        assert scraped.headers["X-Content-Type-Options"] == "nosniff" and scraped.headers["X-Frame-Options"] == "deny"
        assert collectors_in(scraped.text) == {"node"}
        assert sample_values(scraped.text, "stepscope_exporter_build_info") == [1.0]
        assert requests.get(f"{base}/metrics", auth=auth, verify=verify, timeout=5).status_code == 404
        assert 'href="stepscope/metrics"' in requests.get(f"{base}/", auth=auth, verify=verify, timeout=5).text
        assert requests.get(f"{base}/-/healthy", verify=verify, timeout=5).status_code == 200  # probes stay open
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/stepscope/metrics", timeout=5)
        # the push API keeps its Pushgateway path wherever the metrics moved
        push = requests.put(f"{base}/metrics/job/stepscope/run/r/rank/0", verify=verify, timeout=5,
                            data="# TYPE stepscope_steps_total counter\nstepscope_steps_total 3\n")
        assert push.status_code == 200, push.text
        scraped = requests.get(f"{base}/stepscope/metrics", auth=auth, verify=verify, timeout=5)
        assert sample_values(scraped.text, "stepscope_steps_total", run="r", rank="0") == [3.0]


def test_client_certificates_are_required_when_configured(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "stepscope")
    ca, client_cert, client_key = make_client_cert(tmp_path)
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                      f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {ca}\n")
    port = free_port()
    base = f"https://127.0.0.1:{port}"
    client = (str(client_cert), str(client_key))
    with running(_exporter_argv(port, "--web.config.file", str(config), "--collectors", ""), f"{base}/-/ready",
                 tmp_path / "exporter.log", env=exporter_env(), verify=str(cert), cert=client):
        assert requests.get(f"{base}/metrics", cert=client, verify=str(cert), timeout=5).status_code == 200
        with pytest.raises(requests.exceptions.ConnectionError):  # TLS 1.3 closes after the handshake
            requests.get(f"{base}/metrics", verify=str(cert), timeout=5)  # no client certificate
        stranger_dir = tmp_path / "stranger"
        stranger_dir.mkdir()
        _, stranger_cert, stranger_key = make_client_cert(stranger_dir)  # signed by another CA
        with pytest.raises(requests.exceptions.ConnectionError):  # TLS 1.3 closes after the handshake
            requests.get(f"{base}/metrics", cert=(str(stranger_cert), str(stranger_key)), verify=str(cert), timeout=5)


def test_wrong_web_config_fails_in_one_line_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text("tls_server_config:\n  cert_file: a.crt\n  key_flie: a.key\n")
    assert_clean_failure(run_exporter("--web.config.file", str(config)),
                         "--web.config.file", "line 3: unknown key 'tls_server_config.key_flie'", "known: cert_file")
    config.write_text(f"basic_auth_users:\n  prometheus: {HASH}\n")
    assert_clean_failure(run_exporter("--web.config.file", str(config), "--basic-auth-user", "u"),
                         "--basic-auth-user and --web.config.file both configure the web server")


@pytest.mark.parametrize(("broken", "expected"), [
    ("cert_file", "certificate file {cert_file!r} is not a PEM certificate ([SSL] PEM lib)"),
    ("key_file", "key file {key_file!r} is not a PEM private key ([SSL] PEM lib)"),
    ("another_key", "key file {key_file!r} is not the key of certificate file {cert_file!r}"),
    ("client_ca_file", "client CA file {client_ca_file!r} holds no PEM certificate"),
], ids=["cert", "key", "another-key", "client-ca"])
def test_a_tls_file_that_does_not_load_is_named_in_one_line(tmp_path: Path, broken: str, expected: str) -> None:
    """Before, each was `cannot load TLS certificate/key: [SSL] PEM lib (_ssl.c:3926)`: no file, no kind."""
    cert, key = make_cert(tmp_path, "served")
    (tmp_path / "other").mkdir()
    files = {"cert_file": cert, "key_file": key, "client_ca_file": cert}
    if broken == "another_key":
        files["key_file"] = make_cert(tmp_path / "other", "other")[1]
    else:
        files[broken] = tmp_path / "garbage.pem"
        files[broken].write_bytes(bytes(range(256)) * 8)
    config = tmp_path / "web.yml"
    config.write_text("tls_server_config:\n  client_auth_type: RequireAndVerifyClientCert\n"
                      + "".join(f"  {name}: {path}\n" for name, path in files.items()))
    line = expected.format(**{name: str(path) for name, path in files.items()})
    assert_clean_failure(run_exporter("--web.config.file", str(config), "--collectors", ""),
                         f"stepscope-exporter: error: cannot load TLS: {line}")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tls_server_config: {cert_file: a}\n", "missing key_file"),
        ("basic_auth_user: {}\n", "line 1: unknown key 'basic_auth_user'"),
        ("http_server_config: {headers: {X-Powered-By: me}}\n", "'X-Powered-By' can not be configured"),
        ("http_server_config: {headers: {X-Frame-Options: allow}}\n", "'allow' is not one of deny, sameorigin"),
        ('http_server_config: {headers: {Content-Security-Policy: "default-src a\\r\\nSet-Cookie: x=1"}}\n',
         "holds characters a response header can not carry"),
        ("http_server_config: {headers: {Content-Security-Policy: default-src \u00e9}}\n",
         "holds characters a response header can not carry"),
        ("basic_auth_users: {prometheus: plaintext}\n", "basic_auth_users.prometheus: not a bcrypt hash"),
        ("tls_server_config: {cert_file: a, key_file: b, min_version: TLS14}\n", "'TLS14' is not one of"),
        ("tls_server_config: {cert_file: a, key_file: b, min_version: TLS13, max_version: TLS12}\n",
         "min_version is above max_version"),
        ("tls_server_config: {cert_file: a, key_file: b, client_auth_type: RequireClientCert}\n",
         "'RequireClientCert' is not one of"),
        ("tls_server_config: {cert_file: a, key_file: b, client_ca_file: ca}\n", "client_auth_type is NoClientCert"),
        ("tls_server_config: {cert_file: a, key_file: b, cipher_suites: [X]}\n", "is not supported"),
        ("rate_limit: {interval: 1s}\n", "'rate_limit' is not supported"),
        ("- a list\n", "the file must be a mapping"),
        ("tls_server_config: [\n", "not YAML"),
        # exporter-toolkit reads strictly: a YAML loader would keep the second and drop user a without a word
        ("basic_auth_users: {a: x}\nhttp_server_config: {}\nbasic_auth_users: {b: y}\n",
         "line 3: key 'basic_auth_users' appears twice (first on line 1)"),
        ("basic_auth_users:\n  a: x\n  a: y\n", "line 3: key 'a' appears twice (first on line 2)"),
        ("http_server_config: {headers: {X-Frame-Options: deny, X-Frame-Options: sameorigin}}\n",
         "line 1: key 'X-Frame-Options' appears twice"),
    ],
)
def test_web_config_checks(tmp_path: Path, text: str, expected: str) -> None:
    config = tmp_path / "web.yml"
    config.write_text(text)
    with pytest.raises(WebConfigError) as caught:
        load(str(config))
    assert expected in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(("versions", "expected"), [
    ("", (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3)),
    ("min_version: TLS13, ", (ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_3)),
    ("min_version: TLS12, max_version: TLS12, ", (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_2)),
])
def test_the_files_tls_names_reach_the_served_context(tmp_path: Path, versions: str, expected: tuple) -> None:
    """web_config keeps exporter-toolkit's names (so that reading it never loads ssl); web_tls turns them into
    the context's versions and client verification."""
    make_cert(tmp_path, "stepscope")
    ca, _, _ = make_client_cert(tmp_path)
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config: {{cert_file: tls.crt, key_file: tls.key, {versions}"
                      f"client_auth_type: VerifyClientCertIfGiven, client_ca_file: {ca}}}\n")
    context = TlsContextSource(load(str(config)).tls).context()
    assert (context.minimum_version, context.maximum_version) == expected
    assert context.verify_mode == ssl.CERT_OPTIONAL


def test_an_empty_web_config_changes_nothing(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text("# nothing configured\n")
    assert load(str(config)).tls is None and not load(str(config)).users


def test_bcrypt_runs_once_per_credential() -> None:
    users = BcryptUsers({"prometheus": HASH})

    def header(user: str, password: str) -> str:
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    async def scrapes() -> list[bool]:
        answers = [await users.allows(header("prometheus", PASSWORD), CLIENT) for _ in range(5)]
        answers += [await users.allows(header("prometheus", "wrong"), CLIENT) for _ in range(3)]
        answers += [await users.allows(header("nobody", PASSWORD), CLIENT), await users.allows("Bearer x", CLIENT),
                    await users.allows("Basic !!!", CLIENT)]
        return answers

    assert asyncio.run(scrapes()) == [True] * 5 + [False] * 6
    assert users.bcrypt_calls == 3  # the right password, the wrong one, the unknown user: once each
    users.replace_users({})  # a reload that removed the user: its cached outcome must not let it in
    assert asyncio.run(users.allows(header("prometheus", PASSWORD), CLIENT)) is False


def test_users_and_headers_follow_the_edited_web_config(tmp_path: Path) -> None:
    """exporter-toolkit re-reads its web config per request: a rotated password, a changed header and
    removed users apply without a restart; a broken edit keeps what was loaded."""
    new_password = "n3w-s3cret"
    new_hash = bcrypt.hashpw(new_password.encode(), bcrypt.gensalt(4)).decode()
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users: {{prometheus: '{HASH}'}}\n"
                      "http_server_config: {headers: {X-Frame-Options: deny}}\n")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = _exporter_argv(port, "--web.config.file", str(config), "--no-collector.gpu", "--no-collector.process")

    def status(auth: tuple[str, str] | None) -> tuple[int, str]:
        answer = requests.get(f"{base}/metrics", auth=auth, timeout=5)
        return answer.status_code, answer.headers.get("X-Frame-Options", "")

    def eventually(auth: tuple[str, str] | None, expected: tuple[int, str]) -> None:
        deadline = time.monotonic() + 10
        while status(auth) != expected and time.monotonic() < deadline:
            time.sleep(0.2)
        assert status(auth) == expected

    with running(argv, f"{base}/-/ready", tmp_path / "exporter.log", env=exporter_env()):
        assert status(("prometheus", PASSWORD)) == (200, "deny") and status(None) == (401, "deny")
        config.write_text(f"basic_auth_users: {{prometheus: '{new_hash}'}}\n"
                          "http_server_config: {headers: {X-Frame-Options: sameorigin}}\n")
        eventually(("prometheus", new_password), (200, "sameorigin"))
        assert status(("prometheus", PASSWORD)) == (401, "sameorigin")
        config.write_text("basic_auth_users: {prometheus: plaintext}\n")  # does not load: nothing changes
        time.sleep(1.5)
        assert status(("prometheus", new_password)) == (200, "sameorigin") and status(None)[0] == 401
        config.unlink()  # a file being replaced: said once, the loaded users stay
        time.sleep(2.5)
        assert status(("prometheus", new_password)) == (200, "sameorigin") and status(None)[0] == 401
        config.write_text("basic_auth_users: {}\nhttp_server_config: {headers: {}}\n")  # explicitly off
        eventually(None, (200, ""))
    log = (tmp_path / "exporter.log").read_text()
    assert "basic_auth_users.prometheus: not a bcrypt hash" in log and "keeping the loaded users" in log
    assert log.count("is gone; keeping the loaded users") == 1


def test_a_collector_switch_on_the_command_line_beats_the_environment(tmp_path: Path) -> None:
    with running_exporter(tmp_path, "--collector.process", env={"STEPSCOPE_COLLECTORS": ""}) as exporter:
        assert collectors_in(scrape(exporter.url)) == {"process"}


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, ["node", "gpu", "process"]),
        (["--no-collector.gpu"], {}, ["node", "process"]),
        (["--collectors", "node", "--collector.node"], {}, ["node"]),  # they agree
        (["--collectors", "node"], {"STEPSCOPE_COLLECTOR_GPU": "1"}, ["node"]),  # the flag's list wins
        ([], {"STEPSCOPE_COLLECTORS": "node", "STEPSCOPE_COLLECTOR_NODE": "true"}, ["node"]),
        (["--collector.gpu"], {"STEPSCOPE_COLLECTORS": "node"}, ["node", "gpu"]),
    ],
)
def test_collector_precedence(argv: list[str], env: dict[str, str], expected: list[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert enabled_collectors(build_parser().parse_args(argv)) == expected


@pytest.mark.parametrize(
    ("argv", "dest", "value"),
    [
        (["--listen-address", "127.0.0.1:9"], "listen_address", ("127.0.0.1", 9)),
        (["--web-max-connections", "7"], "web_max_connections", 7),
        (["--log-level", "debug"], "log_level", "debug"),
        (["--no-gpu-pcie-poll"], "gpu_pcie_poll", False),
        (["--no-collector.gpu.pcie-poll"], "gpu_pcie_poll", False),
        ([], "gpu_pcie_poll", True),
        (["--listen-address", "127.0.0.1:9", "--web.listen-address", "127.0.0.1:9"], "listen_address",
         ("127.0.0.1", 9)),  # a flag and its alias may agree
    ],
)
def test_older_flags_are_aliases(argv: list[str], dest: str, value: object) -> None:
    assert getattr(build_parser().parse_args(argv), dest) == value


@pytest.mark.parametrize(
    ("env", "value"),
    [({"STEPSCOPE_NO_GPU_PCIE_POLL": "1"}, False), ({"STEPSCOPE_NO_GPU_PCIE_POLL": "0"}, True),
     ({"STEPSCOPE_COLLECTOR_GPU_PCIE_POLL": "false"}, False), ({}, True)],
)
def test_the_older_negative_variable_reads_the_other_way_round(env: dict[str, str], value: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for name, text in env.items():
        monkeypatch.setenv(name, text)
    assert build_parser().parse_args([]).gpu_pcie_poll is value

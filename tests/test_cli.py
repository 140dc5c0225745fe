"""Bad configuration ends with one clear line on stderr and exit code 2, never a traceback."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stepscope_testkit.processes import exporter_env, free_port, running_exporter, scrape


def run_exporter(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stepscope.exporter", *args],
        capture_output=True, text=True, timeout=30, env={**exporter_env(), **(env or {})},
    )


def assert_clean_failure(result: subprocess.CompletedProcess, *expected: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in expected:
        assert fragment in lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--collectors", "node,disco"], ["unknown collector 'disco'", "node, gpu, process"]),
        (["--collect-interval", "-1"], ["--collect-interval", "must be a positive number"]),
        (["--collect-interval", "soon"], ["'soon' is not a number"]),
        # 1e-9 spun a core; 1e308 (past threading.TIMEOUT_MAX) killed every collector thread with OverflowError
        # while the exporter served its first reading for ever; the TTL's 1e308 killed the expiry thread
        (["--collect-interval", "1e-9"], ["--collect-interval", "'1e-9' must be from 0.1 to 3600 seconds"]),
        (["--collect-interval", "1e308"], ["--collect-interval", "'1e308' must be from 0.1 to 3600 seconds"]),
        (["--collector.gpu.slow-interval", "1e308"], ["--collector.gpu.slow-interval", "from 0.1 to 3600 seconds"]),
        (["--ingest-ttl", "1e308"], ["--ingest-ttl", "'1e308' must be from 1 to 2592000 seconds"]),
        (["--listen-address", "localhost"], ["HOST:PORT"]),
        (["--listen-address", "127.0.0.1:70000"], ["port from 1 to 65535"]),
        # an IPv6 address without brackets: ::1 on port 9847, or the address ::1:9847 on no port? Before, the first
        (["--web.listen-address", "::1:9847"], ["'::1:9847' is not HOST:PORT: write an IPv6 address in brackets, "
                                                "e.g. [::1]:9847 ([::]:9847 or :9847: every address)"]),
        (["--web.listen-address", "[::1:9847"], ["write an IPv6 address in brackets"]),
        (["--web.listen-address", "[localhost]:9847"], ["'localhost' in brackets is not an IPv6 address"]),
        (["--tls-cert-file", "/nonexistent/cert.pem", "--tls-key-file", "/nonexistent/key.pem"],
         ["cannot read '/nonexistent/cert.pem'"]),
        (["--log-level", "loud"], ["'loud' is not one of debug, info, warning, error"]),
        (["--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
        (["--listen"], ["unrecognized arguments: --listen"]),  # never abbreviated
        (["--web.listen-address", ":1", "--listen-address", ":2"],
         ["--web.listen-address and --listen-address set the same thing to different values"]),
        (["--log.level", "debug", "--log-level", "info"], ["--log.level and --log-level"]),
        (["--collectors", "node", "--collector.gpu"], ["--collectors node and --collector.gpu disagree"]),
        (["--no-gpu-pcie-poll", "--collector.gpu.pcie-poll"], ["--no-gpu-pcie-poll and --collector.gpu.pcie-poll"]),
        (["--web.telemetry-path", "metrics"], ["--web.telemetry-path", "must be a path starting with '/'"]),
        (["--web.telemetry-path", "/metrics/job/x"], ["push and profile APIs"]),
        (["--web.config.file", "/nonexistent/web.yml"], ["cannot read '/nonexistent/web.yml'"]),
        (["--path.rootfs", "/nonexistent/host"], ["--path.rootfs", "'/nonexistent/host' is not a directory"]),
        (["--collector.node.netdev-exclude", "veth("], ["'veth(' is not a regular expression: missing )"]),
        # the socket's directory (the one the chart mounts) or a file: before, accepted, then 'Connection refused'
        # from every pods cycle
        (["--kubelet-pod-resources-socket", "/tmp"], ["'/tmp' is a directory, not a socket: give the socket in it, "
                                                      "e.g. /tmp/kubelet.sock"]),
        (["--kubelet-pod-resources-socket", "/etc/hostname"], ["'/etc/hostname' is not a unix socket"]),
    ],
)
def test_bad_flags(args: list[str], expected: list[str]) -> None:
    assert_clean_failure(run_exporter(*args), *expected)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"STEPSCOPE_COLLECT_INTERVAL": "0"}, ["STEPSCOPE_COLLECT_INTERVAL='0'", "'0' must be a positive number"]),
        ({"STEPSCOPE_LISTEN_ADDRESS": "nowhere"}, ["STEPSCOPE_LISTEN_ADDRESS='nowhere'", "HOST:PORT"]),
        ({"STEPSCOPE_COLLECTOR_GPU": "maybe"}, ["STEPSCOPE_COLLECTOR_GPU='maybe'", "not a boolean"]),
        ({"STEPSCOPE_LOG_LEVEL": "loud"}, ["STEPSCOPE_LOG_LEVEL='loud'"]),
        ({"STEPSCOPE_LISTEN_ADDRESS": ":1", "STEPSCOPE_WEB_LISTEN_ADDRESS": ":2"},
         ["STEPSCOPE_WEB_LISTEN_ADDRESS and STEPSCOPE_LISTEN_ADDRESS"]),
        ({"STEPSCOPE_COLLECTORS": "node", "STEPSCOPE_COLLECTOR_GPU": "on"},
         ["STEPSCOPE_COLLECTORS node and STEPSCOPE_COLLECTOR_GPU disagree"]),
    ],
)
def test_bad_environment_values_name_the_variable(env: dict[str, str], expected: list[str]) -> None:
    result = run_exporter(env=env)
    assert_clean_failure(result, *expected)
    assert "--" not in result.stderr.split("error:", 1)[1].split("=")[0]  # the variable, not a flag


def test_tls_files_must_come_in_pairs_and_parse(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate")
    assert_clean_failure(run_exporter("--tls-cert-file", str(cert)), "must be given together")
    assert_clean_failure(
        run_exporter("--tls-cert-file", str(cert), "--tls-key-file", str(cert)),
        f"cannot load TLS: certificate file {str(cert)!r} is not a PEM certificate",
    )


def test_an_auth_state_file_without_a_web_config_is_refused(tmp_path: Path) -> None:
    """Before, the exporter started and never read or wrote it: a user expecting logins kept across restarts
    had none kept, without a word."""
    state = tmp_path / "auth-state.json"
    assert_clean_failure(run_exporter("--web.auth.state-file", str(state), "--collectors", ""),
                         "--web.auth.state-file", "give --web.config.file too")
    assert not state.exists()


def test_empty_basic_auth_password_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "password"
    empty.write_text("\n")
    assert_clean_failure(
        run_exporter("--basic-auth-user", "u", "--basic-auth-password-file", str(empty)), "is empty"
    )


@pytest.mark.parametrize(("content", "expected"), [
    (b"\xffp\xe4ss\n", "is not UTF-8 text (byte 0xff at offset 0)"),  # Latin-1: a UnicodeDecodeError traceback
    (None, "is longer than 8192 bytes: not a password"),  # /dev/zero: read until memory ran out
], ids=["latin-1", "dev-zero"])
def test_a_password_file_no_client_could_match_is_one_line(tmp_path: Path, content: bytes | None,
                                                            expected: str) -> None:
    password = tmp_path / "password"
    if content is not None:
        password.write_bytes(content)
    path = str(password) if content is not None else "/dev/zero"
    assert_clean_failure(run_exporter("--basic-auth-user", "u", "--basic-auth-password-file", path,
                                      "--collectors", ""), "--basic-auth-password-file", expected)


def test_port_in_use() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_exporter("--listen-address", f"127.0.0.1:{port}", "--collectors", "")
    assert_clean_failure(result, f"cannot listen on 127.0.0.1:{port}", "Address already in use")


def test_help_documents_every_flag_with_its_environment_variable() -> None:
    result = run_exporter("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split()).replace("- ", "-")  # argparse wraps inside hyphenated words
    flags = {word.strip(",;[]()") for word in text.split() if word.strip("[(").startswith("--")} - {"--help"}
    for flag in flags - {"--version", "--collector.NAME"} - {f for f in flags if f.startswith("--no-")}:
        env = "STEPSCOPE_" + flag[2:].replace("-", "_").replace(".", "_").upper()
        assert env in text, f"{flag} does not name {env}"
    for new, old in [("--web.listen-address", "--listen-address"), ("--log.level", "--log-level"),
                     ("--web.max-connections", "--web-max-connections")]:
        assert f"alias {old}" in text and new in text


def test_environment_configures_the_exporter(tmp_path: Path) -> None:
    port = free_port()
    with running_exporter(tmp_path, port=port, env={"STEPSCOPE_COLLECTORS": ""}) as exporter:
        text = scrape(exporter.url)
    assert "stepscope_exporter_collector_duration_seconds" in text
    assert 'collector="' not in text  # no collector ran: the environment was honoured

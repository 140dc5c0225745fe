"""Bad input to the exporter and to stepscope-profile that used to cost a traceback, a wait or a misleading
answer: each is one line and exit status 2 (an HTTP 4xx for a request), tried against real processes.

- Push tokens: stepscope-profile read --token-file as UTF-8 and let UnicodeDecodeError out; a token
  with a character outside Latin-1 (from the file or STEPSCOPE_PUSH_TOKEN) reached http.client, which
  raised UnicodeEncodeError; an empty file was taken as no token. The exporter took an
  --ingest-token-file token no client can send in a header and then refused every push (it already
  refused an empty or non-UTF-8 file in one line).
"""

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepscope_testkit.processes import REPO_ROOT, Running, exporter_env, free_port, running_exporter

NOT_UTF8 = b"tok\xff\xfeen"
NOT_LATIN1 = "tok€en".encode()
START_SECONDS = 15.0  # an exporter that refuses its flags ends well within this; one that serves does not


@pytest.fixture(scope="module")
def exporter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """A real exporter for stepscope-profile to be pointed at, pushes needing the token `good-token`."""
    tmp = tmp_path_factory.mktemp("exporter-inputs")
    token_file = tmp / "token"
    token_file.write_text("good-token\n")
    with running_exporter(tmp, "--collectors", "", "--ingest-token-file", str(token_file)) as running:
        yield running


def run_profile_cli(exporter: Running, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stepscope.exporter.profile_cli", "--exporter", exporter.url, "--run", "r", "--wait",
         "1", *argv], env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
        capture_output=True, text=True, timeout=60)


def assert_one_line_refusal(status: int | None, stderr: str, *words: str) -> None:
    assert status == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, (status, stderr)
    assert all(word in stderr for word in words), stderr


@pytest.mark.parametrize("content, reason", [
    (NOT_UTF8, "cannot read it as UTF-8 text (byte 0xff at offset 3)"),
    (NOT_LATIN1, "the token holds '€' (U+20AC), which an HTTP header cannot carry"),
    (b"tok\x7fen\n", "the token holds '\\x7f'"),
    (b"", "the file is empty"),
    (b" \n", "the file is empty"),
], ids=["not-utf8", "not-latin1", "control-character", "empty", "blank"])
def test_stepscope_profile_refuses_a_token_file_it_cannot_send_in_one_line(
        exporter: Running, tmp_path: Path, content: bytes, reason: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_bytes(content)
    done = run_profile_cli(exporter, "--token-file", str(token_file))
    assert_one_line_refusal(done.returncode, done.stderr, f"--token-file {str(token_file)!r}", reason)


def test_stepscope_profile_refuses_a_token_variable_it_cannot_send_in_one_line(exporter: Running) -> None:
    done = run_profile_cli(exporter, env={"STEPSCOPE_PUSH_TOKEN": NOT_LATIN1.decode()})
    assert_one_line_refusal(done.returncode, done.stderr, "STEPSCOPE_PUSH_TOKEN", "U+20AC")


def test_stepscope_profile_still_sends_a_good_token(exporter: Running, tmp_path: Path) -> None:
    """The check lets a usable token through: the exporter answers the request (no rank pushes here)
    rather than refusing the token."""
    token_file = tmp_path / "token"
    token_file.write_text("good-token\n")
    done = run_profile_cli(exporter, "--token-file", str(token_file))
    assert done.returncode == 2 and "bearer token" not in done.stderr and "Traceback" not in done.stderr
    assert "error:" not in done.stderr, done.stderr


def test_stepscope_profile_reaches_this_machines_exporter_past_the_environments_proxy(exporter: Running) -> None:
    """With HTTP_PROXY set (clusters set it for downloads) it sent its requests to 127.0.0.1 through the proxy:
    'cannot reach the exporter ... (ProxyError)'. It now goes direct, as the hooks' pushes do: the exporter
    answers (no rank of run r pushes here)."""
    done = run_profile_cli(exporter, env={"HTTP_PROXY": "http://127.0.0.1:1", "NO_PROXY": "", "no_proxy": ""})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "cannot reach" not in done.stderr and "ProxyError" not in done.stderr, done.stderr


@pytest.mark.parametrize(("lines", "refused"), [("good-token\nold-token\n", False), ("old-token\ngood-token\n", True)],
                         ids=["newest-first", "newest-second"])
def test_stepscope_profile_sends_the_first_token_of_a_rotating_file(exporter: Running, tmp_path: Path, lines: str,
                                                                    refused: bool) -> None:
    """A token file lists the tokens in use newest first (exporter.ingest.tokens): the client sends the first."""
    token_file = tmp_path / "token"
    token_file.write_text(lines)
    done = run_profile_cli(exporter, "--token-file", str(token_file))
    assert ("bearer token" in done.stderr) is refused and "Traceback" not in done.stderr, done.stderr


def exporter_exit(*argv: str) -> tuple[int | None, str]:
    """A real exporter's exit status and stderr; None where it kept running (it took the flags)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "stepscope.exporter", "--web.listen-address", f"127.0.0.1:{free_port()}",
         "--collectors", "", *argv], env={**os.environ, **exporter_env()}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = process.communicate(timeout=START_SECONDS)
        return process.returncode, stderr
    except subprocess.TimeoutExpired:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
        return None, stderr


@pytest.mark.parametrize("content, reason", [
    (NOT_LATIN1, "the token holds '€' (U+20AC), which an HTTP header cannot carry"),
    (NOT_UTF8, "utf-8"),  # these two were one line already: kept so
    (b"", "empty"),
], ids=["not-latin1", "not-utf8", "empty"])
def test_the_exporter_refuses_an_ingest_token_no_client_could_send_in_one_line(
        tmp_path: Path, content: bytes, reason: str) -> None:
    """Before, a token outside Latin-1 was taken: the exporter served and refused every push (401)."""
    token_file = tmp_path / "token"
    token_file.write_bytes(content)
    status, stderr = exporter_exit("--ingest-token-file", str(token_file))
    assert_one_line_refusal(status, stderr.lower(), f"--ingest-token-file {str(token_file)!r}", reason.lower())

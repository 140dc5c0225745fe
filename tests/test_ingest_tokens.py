"""Rotating the ingest token while exporters and training pods run.

Before, the exporter read --ingest-token-file once: a Secret rotated in place (external-secrets, Vault,
`kubectl apply`) reached the mounted file within a minute, training pods started afterwards pushed the
new token, and every one of their pushes got 401 until the exporter restarted; restarting it refused the
pods started before. Now the file lists the tokens in use, newest first, and is re-read when it changes;
an edit that does not load keeps what was loaded.
"""

import logging
import os
import time
from pathlib import Path

import pytest
import requests

from stepscope.exporter.ingest.tokens import IngestTokens
from stepscope.hooks.config import Config
from stepscope_testkit.ingest_bodies import full_body
from stepscope_testkit.processes import running_exporter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def secret_volume(directory: Path, content: str) -> Path:
    """`directory/token` as the kubelet lays out a Secret volume: a link to ..data/token, ..data a link to a
    timestamped directory that an update replaces by swapping the link (the file itself never changes)."""
    stamp = directory / f"..{time.monotonic_ns()}"
    stamp.mkdir()
    (stamp / "token").write_text(content)
    swap = directory / "..data_tmp"
    swap.symlink_to(stamp.name)
    os.replace(swap, directory / "..data")
    token = directory / "token"
    if not token.is_symlink():
        token.symlink_to("..data/token")
    return token


def test_every_line_of_the_file_is_a_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("  new-token\n\nold-token \n")
    tokens = IngestTokens.from_file(str(token))
    assert tokens.matches("new-token") and tokens.matches("old-token")
    assert not tokens.matches("new-token\nold-token") and not tokens.matches("")


def test_a_secret_swapped_in_place_is_taken_within_a_second(tmp_path: Path) -> None:
    clock = Clock()
    tokens = IngestTokens.from_file(str(secret_volume(tmp_path, "first\n")), clock=clock)
    secret_volume(tmp_path, "second\nfirst\n")
    assert tokens.matches("first") and not tokens.matches("second")  # looked at once a second at most
    clock.now += 1.0
    assert tokens.matches("second") and tokens.matches("first")
    secret_volume(tmp_path, "second\n")
    clock.now += 1.0
    assert tokens.matches("second") and not tokens.matches("first")


@pytest.mark.parametrize("content", ["", "\n \n", "half\x00", "caf\u20ac"], ids=["empty", "blank", "nul", "not-latin1"])
def test_an_edit_that_does_not_load_keeps_the_loaded_tokens(tmp_path: Path, content: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    token = tmp_path / "token"
    token.write_text("kept-token\n")
    tokens = IngestTokens.from_file(str(token), clock=clock)
    token.write_text(content)
    with caplog.at_level(logging.INFO, logger="stepscope.exporter.ingest.tokens"):
        for _ in range(3):
            clock.now += 1.0
            assert tokens.matches("kept-token")
    assert not tokens.matches("")
    assert [record.levelname for record in caplog.records] == ["ERROR"], caplog.text  # once, not every second
    assert "keeping the 1 loaded tokens" in caplog.text


def test_a_deleted_file_keeps_the_tokens_and_its_return_is_read(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    token = tmp_path / "token"
    token.write_text("kept-token\n")
    tokens = IngestTokens.from_file(str(token), clock=clock)
    token.unlink()
    with caplog.at_level(logging.INFO, logger="stepscope.exporter.ingest.tokens"):
        clock.now += 1.0
        assert tokens.matches("kept-token")
        token.write_text("back-token\n")
        clock.now += 1.0
        assert tokens.matches("back-token") and not tokens.matches("kept-token")
    assert "is gone; keeping the 1 loaded tokens" in caplog.text
    assert "reloaded --ingest-token-file" in caplog.text


def test_a_pod_reads_the_newest_token_of_a_rotating_secret() -> None:
    config = Config.resolve(env={"STEPSCOPE_PUSH_TOKEN": "\n new-token \nold-token\n"})
    assert config.push_token == "new-token"


def push_status(url: str, token: str) -> int:
    return requests.put(f"{url}/metrics/job/stepscope/run/rotated/rank/0", data=full_body(), timeout=10,
                        headers={"Authorization": f"Bearer {token}"}).status_code


def wait_for_status(url: str, token: str, wanted: int) -> float:
    """Seconds until a push with `token` gets `wanted`; fails after 10 s."""
    started = time.monotonic()
    while (status := push_status(url, token)) != wanted:
        assert time.monotonic() - started < 10, f"a push with {token!r} still gets {status}"
        time.sleep(0.1)
    return time.monotonic() - started


def test_a_running_exporter_follows_a_rotation_of_its_secret(tmp_path: Path) -> None:
    """The rotation the docs describe, on a real exporter and a Secret volume laid out as the kubelet does."""
    secret = tmp_path / "secret"
    secret.mkdir()
    token = secret_volume(secret, "old-token\n")
    with running_exporter(tmp_path, "--collectors", "", "--ingest-token-file", str(token)) as exporter:
        assert push_status(exporter.url, "old-token") == 200
        assert push_status(exporter.url, "new-token") == 401
        secret_volume(secret, "new-token\nold-token\n")  # pods started from now on send new-token
        wait_for_status(exporter.url, "new-token", 200)
        assert push_status(exporter.url, "old-token") == 200  # pods started before keep pushing
        secret_volume(secret, "new-token\n")  # once they have ended
        wait_for_status(exporter.url, "old-token", 401)
        secret_volume(secret, "")  # a broken update: keeps new-token, neither opens nor locks out
        time.sleep(2.5)
        assert push_status(exporter.url, "new-token") == 200
        assert push_status(exporter.url, "") == 401
    log = exporter.log()
    assert "reloaded --ingest-token-file" in log and "the file is empty; keeping the 1 loaded tokens" in log

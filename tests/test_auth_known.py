"""Issue 20, the flood after a restart: the address groups basic auth let in are kept in
`--web.auth.state-file`, so after a restart the legitimate scraper's first login gets the slot kept for
known groups and goes ahead of the checks of new addresses queued before it, however many new
addresses send wrong passwords. Before, a restarted exporter knew no one: each new address cost a
hash before it was known as a guesser, and the first scrape competed with them for every slot.

Unit tests use real bcrypt, real files and a hand-moved wall clock; the end-to-end test restarts a real
exporter (SIGKILL) under a flood from 100 loopback addresses. Timings: benchmarks/bench_auth_flood.py."""

import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from stepscope.exporter.web_auth import HASH_WAITING, HASH_WORKERS, AuthBusy, BcryptUsers, Client, _BoundedHasher
from stepscope.exporter.web_auth_known import MAX_FILE_BYTES, REFRESH_SECONDS, REMEMBER_SECONDS, KnownGroups
from stepscope_testkit.processes import exporter_env, free_port, running, wait_http_ok
from tests.support.clock import ManualClock
from tests.test_auth_backoff import guessing
from tests.test_web_attacks import HASH, PASSWORD, SLOW_HASH, basic

SLOTS = HASH_WORKERS + HASH_WAITING
SCRAPER = Client("10.0.2.1")


def flood_with(users: BcryptUsers, scraper: Client, user: str, password: str,
               hashed_order: list[str] | None = None) -> list[object]:
    """Every check slot asked for at once by new addresses guessing, then the scraper's login: the
    answers, the scraper's last. `hashed_order` gets each address as its check starts hashing."""

    def client(address: str) -> Client:
        return Client(address, lambda: hashed_order is None or hashed_order.append(address) is None)

    async def at_once() -> list[object]:
        new = [users.allows(basic("prometheus", f"guess-{n}"), client(f"10.0.0.{n}")) for n in range(SLOTS)]
        return await asyncio.gather(*new, users.allows(basic(user, password), client(scraper.address)),
                                    return_exceptions=True)

    return asyncio.run(at_once())


def test_a_restarted_exporter_lets_the_scraper_let_in_before_in_at_its_first_try_under_a_flood(
        tmp_path: Path) -> None:
    state = tmp_path / "auth-state.json"
    before = BcryptUsers({"prometheus": HASH, "scraper": HASH}, known=KnownGroups(state))
    assert asyncio.run(before.allows(basic("scraper", PASSWORD), SCRAPER)) is True
    restarted = BcryptUsers({"prometheus": HASH, "scraper": HASH}, known=KnownGroups(state))
    answers = flood_with(restarted, SCRAPER, "scraper", PASSWORD)
    assert answers[:SLOTS - 1] == [False] * (SLOTS - 1) and isinstance(answers[SLOTS - 1], AuthBusy)
    assert answers[-1] is True
    forgetful = BcryptUsers({"prometheus": HASH, "scraper": HASH})  # a restart without the file: as before
    assert isinstance(flood_with(forgetful, SCRAPER, "scraper", PASSWORD)[-1], AuthBusy)
    saved = state.read_text()
    assert json.loads(saved)["groups"].keys() == {SCRAPER.address}
    assert not any(secret in saved for secret in ("scraper", PASSWORD, HASH, "prometheus"))


def test_a_known_groups_check_goes_ahead_of_the_new_addresses_queued_before_it() -> None:
    """New addresses fill every slot but the kept one, most of them queued for a worker; the known
    scraper asks last and is hashed next, right after the checks already running."""
    users = BcryptUsers({"prometheus": HASH, "scraper": HASH})
    assert asyncio.run(users.allows(basic("scraper", PASSWORD), SCRAPER)) is True
    order: list[str] = []
    answers = flood_with(users, SCRAPER, "prometheus", PASSWORD, order)  # a new password: not cached
    assert answers[-1] is True
    assert order.index(SCRAPER.address) <= HASH_WORKERS, order  # after those running (fewer if one ended first)


def test_a_check_cancelled_while_waiting_or_as_it_is_handed_a_worker_gives_the_worker_on() -> None:
    """A request cancelled while its check waits for a worker leaves no worker held: neither one
    cancelled in the queue nor one cancelled just as a worker was handed to it."""

    async def scenario() -> bool:
        hasher = _BoundedHasher(KnownGroups())
        for _ in range(HASH_WORKERS):
            await hasher._turn(False)  # every worker busy
        handed, gone = asyncio.ensure_future(hasher._turn(False)), asyncio.ensure_future(hasher._turn(False))
        await asyncio.sleep(0)  # both queued
        gone.cancel()
        await asyncio.sleep(0)
        hasher._next()  # a check ends: its worker goes to `handed`, skipping `gone`
        handed.cancel()  # the client leaves before `handed` resumed
        await asyncio.gather(handed, gone, return_exceptions=True)
        later = asyncio.ensure_future(hasher._turn(False))
        await asyncio.sleep(0)
        return later.done()  # the freed worker was passed back, not kept by the cancelled check

    assert asyncio.run(scenario()) is True


def test_a_second_address_with_cached_credentials_is_known_after_a_restart_and_a_denial_forgets_it(
        tmp_path: Path) -> None:
    """The second Prometheus of a pair sends the login the first one's check cached: no hash, but its
    group is known good too. A wrong password from a known group takes it off the file at once."""
    state = tmp_path / "auth-state.json"
    users = BcryptUsers({"scraper": HASH}, known=KnownGroups(state))
    pair = Client("10.0.3.1")
    assert [asyncio.run(users.allows(basic("scraper", PASSWORD), c)) for c in (SCRAPER, pair)] == [True, True]
    assert users.bcrypt_calls == 1 and set(KnownGroups(state).groups()) == {SCRAPER.address, pair.address}
    assert asyncio.run(users.allows(basic("scraper", "a-typo"), pair)) is False
    assert set(KnownGroups(state).groups()) == {SCRAPER.address}


def test_groups_are_bounded_forgotten_after_a_week_and_rewritten_at_most_hourly(tmp_path: Path) -> None:
    state = tmp_path / "auth-state.json"
    clock = ManualClock(1_800_000_000.0)
    known = KnownGroups(state, clock=clock, size=3)
    for n in range(4):
        known.let_in(f"10.0.0.{n}")
        clock.now += 60
    assert KnownGroups(state, clock=clock).groups() == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    saved_at = json.loads(state.read_text())["groups"]["10.0.0.1"]
    known.let_in("10.0.0.1")  # a scrape with cached credentials, every 15 s: no write
    assert json.loads(state.read_text())["groups"]["10.0.0.1"] == saved_at
    clock.now += REFRESH_SECONDS
    known.let_in("10.0.0.1")
    assert json.loads(state.read_text())["groups"]["10.0.0.1"] == clock.now
    clock.now += REMEMBER_SECONDS - 1
    assert KnownGroups(state, clock=clock).groups() == ["10.0.0.1"]


def test_an_empty_state_file_starts_with_no_groups_and_is_rewritten(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Empty is what a file created and not yet written looks like (or one emptied by hand): nothing to lose."""
    state = tmp_path / "auth-state.json"
    state.write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        known = KnownGroups(state)
    assert known.groups() == [] and caplog.records == []
    known.let_in("10.0.2.1")
    assert KnownGroups(state).groups() == ["10.0.2.1"]


@pytest.mark.parametrize("content", [
    b'{"version":1,"groups":{"10.0.2.1":17',  # cut short: never by the exporter, which renames a whole file in
    b"\xff\xfe\x00garbage",
    b'{"version":2,"groups":{}}',
    b'{"version":1,"groups":{"10.0.2.1":"yesterday"}}',
    b'{"version":1,"groups":{"10.0.2.1":true}}',
    b'{"version":1,"groups":{"' + b"x" * 65 + b'":1.0}}',
    b"[" * (MAX_FILE_BYTES + 1),
    b"[" * 5000,  # deeper than the interpreter's stack: a RecursionError traceback at start before
], ids=["half-written", "binary", "other-version", "bad-time", "bool-time", "long-group", "too-large", "nested"])
def test_a_state_file_the_exporter_did_not_write_is_refused_and_left_as_it_was(
        tmp_path: Path, content: bytes) -> None:
    """Before, such a file was ignored with a warning and replaced at the first let-in: whatever it held
    (another program's file, a file named by mistake) was gone."""
    state = tmp_path / "auth-state.json"
    state.write_bytes(content)
    with pytest.raises(ValueError, match="not a state file this exporter wrote") as refused:  # StateFileError
        KnownGroups(state)
    assert "\n" not in str(refused.value)
    assert state.read_bytes() == content


def exporter_with_state_file(config: Path, state_file: Path) -> tuple[int, str]:
    """A real exporter on `config` and `state_file`: its exit status and stderr. Where it serves instead of
    refusing, basic auth lets one scrape in (the let-in that writes the state file) and it is stopped."""
    port = free_port()
    argv = [sys.executable, "-m", "stepscope.exporter", "--web.listen-address", f"127.0.0.1:{port}",
            "--web.config.file", str(config), "--web.auth.state-file", str(state_file), "--collectors", ""]
    process = subprocess.Popen(argv, env={**os.environ, **exporter_env()}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/-/ready", process)
        requests.get(f"http://127.0.0.1:{port}/metrics", auth=("prometheus", PASSWORD), timeout=10)
        process.terminate()
    except RuntimeError:  # it ended before it was ready: the refusal
        pass
    _, stderr = process.communicate(timeout=30)
    return process.returncode, stderr


@pytest.mark.parametrize("config_text", [f"basic_auth_users: {{prometheus: '{HASH}'}}\n", ""],
                         ids=["with-users", "empty"])
def test_a_state_file_that_is_the_web_config_is_refused_at_start_and_the_config_kept(
        tmp_path: Path, config_text: str) -> None:
    """The audit's repro: the web config given as the state file too. Before, the first login (with an
    empty config, the start) replaced it with the state JSON, the users and hashes gone."""
    config = tmp_path / "web.yml"
    config.write_text(config_text)
    status, stderr = exporter_with_state_file(config, config)
    assert config.read_text() == config_text
    assert status == 2 and stderr.count("\n") == 1, stderr
    assert "--web.auth.state-file" in stderr and "--web.config.file" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("content", [random.Random(7).randbytes(2000), b'{"users": ["alice"]}\n'],
                         ids=["random-bytes", "other-json"])
def test_a_real_exporter_refuses_a_state_file_it_did_not_write_and_leaves_it_as_it_was(
        tmp_path: Path, content: bytes) -> None:
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users: {{prometheus: '{HASH}'}}\n")
    state = tmp_path / "precious.bin"
    state.write_bytes(content)
    status, stderr = exporter_with_state_file(config, state)
    assert state.read_bytes() == content
    assert status == 2 and stderr.count("\n") == 1, stderr
    assert "--web.auth.state-file" in stderr and "not a state file this exporter wrote" in stderr


def test_a_state_file_that_can_no_longer_be_written_is_logged_once_and_groups_stay_known(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The directory removed under a running exporter: a scraper scraping on with cached credentials
    stays known, and the failure is one line, not one per scrape."""
    directory = tmp_path / "state"
    directory.mkdir()
    known = KnownGroups(directory / "auth-state.json")
    known.let_in("10.0.2.1")
    (directory / "auth-state.json").unlink()
    directory.rmdir()
    with caplog.at_level(logging.ERROR):
        for _ in range(20):
            known.let_in("10.0.3.1")
    assert known.groups() == ["10.0.2.1", "10.0.3.1"]
    assert len(caplog.records) == 1 and "--web.auth.state-file" in caplog.text


def test_a_state_file_the_exporter_cannot_write_is_one_line_at_start(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users: {{prometheus: '{HASH}'}}\n")
    answer = subprocess.run(
        [sys.executable, "-m", "stepscope.exporter", "--web.config.file", str(config), "--collectors", "",
         "--web.auth.state-file", str(tmp_path / "no-such-dir" / "auth-state.json")],
        env={**exporter_env()}, capture_output=True, text=True, timeout=60)
    assert answer.returncode == 2
    assert answer.stderr.count("\n") == 1 and "--web.auth.state-file" in answer.stderr, answer.stderr


def test_a_real_exporter_killed_and_restarted_lets_its_scraper_in_at_the_first_try_under_a_flood(
        tmp_path: Path) -> None:
    """The scraper logs in once; the exporter is SIGKILLed and started again on the same state file
    (given by its variable, STEPSCOPE_WEB_AUTH_STATE_FILE); 100 new addresses guess a cost-10 password
    as fast as answered, filling every slot they may; the scraper's first scrape is let in. Before, it
    met 429 (every slot held by new addresses)."""
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  scraper: '{HASH}'\n  prometheus: '{SLOW_HASH}'\n")
    env = {**exporter_env(), "STEPSCOPE_WEB_AUTH_STATE_FILE": str(tmp_path / "auth-state.json")}
    port = free_port()
    argv = [sys.executable, "-m", "stepscope.exporter", "--web.listen-address", f"127.0.0.1:{port}",
            "--web.config.file", str(config), "--collectors", "", "--collect-interval", "0.5"]
    base = f"http://127.0.0.1:{port}"
    with running(argv, f"{base}/-/ready", tmp_path / "first.log", env=env) as first:
        assert requests.get(f"{base}/metrics", auth=("scraper", PASSWORD), timeout=10).status_code == 200
        first.process.kill()
        first.process.wait()
    with running(argv, f"{base}/-/ready", tmp_path / "restarted.log", env=env) as restarted, \
            guessing(port, 100, "prometheus") as denied:
        deadline = time.monotonic() + 30
        while len(denied) < 2 * SLOTS and time.monotonic() < deadline:  # the flood holds the slots
            time.sleep(0.05)
        assert len(denied) >= 2 * SLOTS, f"only {len(denied)} guessers were answered 401"
        scrape = requests.get(f"{base}/metrics", auth=("scraper", PASSWORD), timeout=10)
    assert scrape.status_code == 200, scrape.text
    assert "Traceback" not in restarted.log()

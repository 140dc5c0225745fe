"""Issue 20's last security item: a wrong-password flood from many addresses against a login not cached
yet (the first scrape after an exporter restart or a password change).

An address whose checks were denied waits, before its next new check, a time that doubles with its
denials in a row (after two free ones), and is checked only when no other check is running, so
addresses never denied go first. Unit tests
use an injected clock (no sleeps); the end-to-end test floods a real exporter from many loopback
addresses. The flood's timings are in benchmarks/bench_auth_flood.py."""

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import bcrypt
import pytest
import requests

from stepscope.exporter.web_auth import (
    BACKOFF_FIRST_SECONDS,
    BACKOFF_FREE_DENIALS,
    BACKOFF_MAX_SECONDS,
    HASH_WAITING,
    HASH_WORKERS,
    AuthBusy,
    BcryptUsers,
    Client,
    _DenialBackoff,
)
from stepscope_testkit.processes import free_port
from tests.support.clock import ManualClock
from tests.test_web_attacks import HASH, PASSWORD, basic, serving


def test_the_wait_doubles_with_each_denial_in_a_row_up_to_the_cap_and_a_grant_ends_it() -> None:
    clock = ManualClock(1000.0)
    backoff = _DenialBackoff(clock)
    waits = []
    for _ in range(14):
        backoff.denied("10.0.0.1")
        waits.append(backoff.wait("10.0.0.1"))
    assert waits[:BACKOFF_FREE_DENIALS] == [0.0] * BACKOFF_FREE_DENIALS and "10.0.0.1" in backoff
    assert waits[BACKOFF_FREE_DENIALS:][:3] == [BACKOFF_FIRST_SECONDS, 2 * BACKOFF_FIRST_SECONDS,
                                                4 * BACKOFF_FIRST_SECONDS]
    assert max(waits) == waits[-1] == BACKOFF_MAX_SECONDS
    clock.now += 1.0
    assert backoff.wait("10.0.0.1") == BACKOFF_MAX_SECONDS - 1.0
    assert backoff.wait("10.0.0.2") == 0.0 and "10.0.0.2" not in backoff  # never denied: never delayed
    backoff.granted("10.0.0.1")
    assert backoff.wait("10.0.0.1") == 0.0 and "10.0.0.1" not in backoff
    for _ in range(BACKOFF_FREE_DENIALS + 1):  # the count starts again after a grant
        backoff.denied("10.0.0.1")
    assert backoff.wait("10.0.0.1") == BACKOFF_FIRST_SECONDS


def test_memory_is_bounded_and_the_least_recently_denied_address_is_forgotten_first() -> None:
    backoff = _DenialBackoff(ManualClock(1000.0), size=3)
    for address in ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.1", "10.0.0.4"):
        backoff.denied(address)
    assert [a for a in ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4") if a in backoff] == [
        "10.0.0.1", "10.0.0.3", "10.0.0.4"]


def test_a_denied_address_gets_429_with_retry_after_without_hashing_until_its_wait_is_over() -> None:
    clock = ManualClock(1000.0)
    users = BcryptUsers({"prometheus": HASH, "other": HASH}, clock=clock)
    guesser, scraper = Client("10.0.0.1"), Client("10.0.0.9")

    def allows(password: str, client: Client, user: str = "prometheus") -> bool:
        return asyncio.run(users.allows(basic(user, password), client))

    free = [allows(f"typo-{n}", guesser) for n in range(BACKOFF_FREE_DENIALS)]  # no wait between these
    assert allows("guess-1", guesser) is False and free == [False] * BACKOFF_FREE_DENIALS
    assert users.bcrypt_calls == BACKOFF_FREE_DENIALS + 1
    with pytest.raises(AuthBusy, match="wrong passwords") as busy:
        allows("guess-2", guesser)
    assert busy.value.retry_after == 1 and users.bcrypt_calls == BACKOFF_FREE_DENIALS + 1  # nothing hashed
    assert allows("guess-1", guesser) is False  # a repeated wrong password costs a lookup: answered
    assert allows(PASSWORD, scraper, "other") is True  # another address is not delayed
    assert allows(PASSWORD, guesser, "other") is True  # nor a login already cached, from any address
    clock.now += BACKOFF_FIRST_SECONDS
    assert allows("guess-2", guesser) is False
    clock.now += 2 * BACKOFF_FIRST_SECONDS - 0.01
    with pytest.raises(AuthBusy):  # the wait doubled
        allows(PASSWORD, guesser)
    clock.now += 0.01
    assert allows(PASSWORD, guesser) is True  # the right password ends the wait: the next guesses are heard
    assert [allows(f"guess-{n}", guesser) for n in range(3, 3 + BACKOFF_FREE_DENIALS + 1)] == [False] * (
        BACKOFF_FREE_DENIALS + 1)


def test_an_address_with_a_denial_is_checked_only_when_nothing_else_is() -> None:
    clock = ManualClock(1000.0)
    users = BcryptUsers({"prometheus": HASH}, clock=clock)
    slots = HASH_WORKERS + HASH_WAITING
    guessers = [Client(f"10.0.0.{n}") for n in range(slots + 2)]

    async def at_once(clients: list[Client], guess: str) -> list[object]:
        return await asyncio.gather(*(users.allows(basic("prometheus", f"{guess}-{client.address}"), client)
                                      for client in clients), return_exceptions=True)

    for guesser in guessers:  # each denied once
        asyncio.run(at_once([guesser], "first"))
    clock.now += BACKOFF_FIRST_SECONDS
    answers = asyncio.run(at_once([*guessers, *(Client(f"10.0.1.{n}") for n in range(slots))], "second"))
    assert answers[0] is False  # the hasher was idle
    assert all(isinstance(answer, AuthBusy) for answer in answers[1:len(guessers)])
    assert answers[len(guessers):-2] == [False] * (slots - 2)  # new addresses: all but the last slot
    assert all(isinstance(answer, AuthBusy) for answer in answers[-2:])


def test_the_last_slot_is_kept_for_an_address_let_in_before() -> None:
    """After a password change the scraper's address, let in before, is heard however many new
    addresses hold the other slots; once denied it waits behind them like any denied address."""
    users = BcryptUsers({"prometheus": HASH, "other": HASH}, clock=ManualClock(1000.0))
    slots = HASH_WORKERS + HASH_WAITING
    scraper = Client("10.0.2.1")
    assert asyncio.run(users.allows(basic("other", PASSWORD), scraper)) is True

    async def flood_and(user: str, password: str) -> list[object]:
        new = [users.allows(basic("prometheus", f"guess-{n}"), Client(f"10.0.0.{n}")) for n in range(slots)]
        return await asyncio.gather(*new, users.allows(basic(user, password), scraper), return_exceptions=True)

    answers = asyncio.run(flood_and("prometheus", PASSWORD))  # the password it was given now
    assert answers[:slots - 1] == [False] * (slots - 1) and isinstance(answers[slots - 1], AuthBusy)
    assert answers[-1] is True
    assert asyncio.run(users.allows(basic("other", "a-typo"), scraper)) is False
    assert isinstance(asyncio.run(flood_and("other", "another-typo"))[-1], AuthBusy)


@contextmanager
def guessing(port: int, addresses: int, user: str) -> Iterator[set[str]]:
    """Clients from `addresses` loopback addresses (127.0.0.2 and up), each sending a new wrong password
    for `user` as soon as its last one is answered; yields the addresses that have had a 401 so far."""
    denied: set[str] = set()
    stop = threading.Event()

    async def guesser(address: str) -> None:
        for attempt in itertools.count():
            if stop.is_set():
                return
            request = (f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: {basic(user, f'{address}-{attempt}')}"
                       "\r\nConnection: close\r\n\r\n").encode()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(address, 0))
                writer.write(request)
                status = await asyncio.wait_for(reader.readline(), 15)
                writer.close()
            except (OSError, asyncio.TimeoutError):
                await asyncio.sleep(0.05)
                continue
            if status.startswith(b"HTTP/1.1 401"):
                denied.add(address)

    async def flood() -> None:
        await asyncio.gather(*(guesser(f"127.0.0.{2 + n}") for n in range(addresses)))

    thread = threading.Thread(target=asyncio.run, args=(flood(),), daemon=True)
    thread.start()
    try:
        yield denied
    finally:
        stop.set()
        thread.join(timeout=30)


def test_a_flood_from_many_addresses_cannot_keep_a_new_login_out(tmp_path: Path) -> None:
    """40 addresses each guess a new wrong password (a cost-8 bcrypt each) as soon as answered. Once
    each has been denied, three logins never seen before (three users, from 127.0.0.1) are each let in at
    the first try: the guessers get at most one check slot. Before, they held every slot and a new login
    got 429."""
    slow = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(8)).decode()
    logins = [f"scraper-{n}" for n in range(3)]
    config = tmp_path / "web.yml"
    config.write_text("basic_auth_users:\n" + "".join(f"  {user}: '{HASH}'\n" for user in logins)
                      + f"  prometheus: '{slow}'\n")
    port = free_port()
    with serving(config, tmp_path, port) as exporter, guessing(port, 40, "prometheus") as denied:
        deadline = time.monotonic() + 30
        while len(denied) < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(denied) == 40, f"only {len(denied)} of 40 guessers were ever answered 401"
        answers = [requests.get(f"{exporter.url}/metrics", auth=(user, PASSWORD), timeout=10).status_code
                   for user in logins]
    assert answers == [200, 200, 200]
    assert "Traceback" not in exporter.log()

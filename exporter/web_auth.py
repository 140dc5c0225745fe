"""HTTP basic auth for /metrics and the index page: bcrypt users (`--web.config.file`) or one user with
a plain password file (the older `--basic-auth-user`).

bcrypt is deliberately slow (~70 ms of CPU at cost 10), so a client sending a new wrong password per
request could otherwise make the exporter hash for minutes while the legitimate scraper and its
connections wait. What keeps the legitimate scraper in under such a flood:

- outcomes are cached, granted and denied apart: only a right password enters the granted cache, so
  no number of wrong passwords evicts the scraper's entry, and a scrape with known credentials costs a
  lookup, never a hash. Entries are keyed by an HMAC-SHA256 under a random per-process key, never by
  the password;
- at most HASH_WORKERS hashes run at once and HASH_WAITING more wait; a check beyond that, or a second
  one from a client address that already has one waiting or running, is refused at once (AuthBusy, a
  429 with Retry-After) instead of holding its connection. An IPv6 address counts by its /64, what one
  host is usually given, so one host cannot hold every slot by changing its address;
- an address whose checks were denied gets no new one for a while (429 with Retry-After, no hash):
  from its third denial in a row (a mistyped password and user name cost no wait), 0.25 s, doubling
  with each further denial up to 30 s; a grant ends it. And such an address is checked only when
  no other check is waiting or running: addresses never denied go first, so the hashing goes to
  telling new addresses apart, and once every guesser has been denied a login not cached yet (the first
  scrape after a restart) finds a slot at once. An address that never sent a wrong password is never
  delayed;
- the last free slot is kept for an address let in before (and not denied since), and its check goes
  ahead of every queued check of other addresses: after a password change the scraper is heard at once
  however many new addresses flood. These groups are kept across restarts when `--web.auth.state-file`
  is set (web_auth_known), so the first scrape after a restart is heard at once too;
- a waiting check whose connection is lost by the time its turn comes is dropped without hashing. A
  client that only closed its side is not known to be gone (it may be waiting for the answer, as
  `nc -N` does), so its check runs; the bound above is what caps those.

An unknown user is checked against a fixed hash so timing does not reveal which users exist.
"""

import asyncio
import base64
import ipaddress
import os
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import ceil
from typing import Protocol

from stepscope.exporter.web_auth_known import KnownGroups

GRANTED_CACHE_SIZE = 64  # right passwords only: as many as users and their rotations need
DENIED_CACHE_SIZE = 1024  # a repeated wrong password (a stale secret) costs a lookup too
HASH_WORKERS = max(1, min(4, (os.cpu_count() or 1) // 2))  # never more than half the CPUs hashing
HASH_WAITING = 4
BACKOFF_FREE_DENIALS = 2  # denials in a row an address may have with no wait: a person's typos
BACKOFF_FIRST_SECONDS = 0.25  # the wait after the next one, doubling with each further denial in a row
BACKOFF_MAX_SECONDS = 30.0  # at most: two scrapes of a 15 s interval, once its password is put right
BACKOFF_ADDRESSES = 4096  # denied address groups remembered (well under 1 MiB in all); oldest go first
BCRYPT_MAX_PASSWORD_BYTES = 72  # bcrypt reads no further; bcrypt>=5 refuses longer ones
# a cost-10 bcrypt of a password nobody sends: an unknown user costs what a known one does
DECOY_HASH = b"$2b$10$5NGai4efUngPzjijLv27ReZVXW6bHPBHlS4fU2I/4h1OMWqGLSFU2"


class AuthBusy(Exception):
    """New credentials cannot be checked now: too many checks are waiting, or this address was denied
    too recently. Answered with 429 and `Retry-After: retry_after`."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Client:
    """Who asks: its address (one uncached check per address at a time) and whether it is still there."""

    address: str
    connected: Callable[[], bool] = lambda: True


class Authenticator(Protocol):
    async def allows(self, header: str | None, client: Client) -> bool:
        """Whether an `Authorization` header value grants access; AuthBusy when it cannot be told now."""
        ...


def _basic_credentials(header: str | None) -> tuple[str, str] | None:
    """(user, password) of a Basic header; None for anything else, raw non-ASCII bytes included."""
    scheme, _, encoded = (header or "").strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, sep, password = base64.b64decode(encoded.strip(), validate=True).decode("utf-8").partition(":")
    except ValueError:  # binascii.Error, UnicodeDecodeError, and non-ASCII text b64decode refuses
        return None
    return (user, password) if sep else None


class PasswordFileUser:
    """One user whose password is given in clear in a file (`--basic-auth-user`/`--basic-auth-password-file`)."""

    def __init__(self, user: str, password: str) -> None:
        self._expected = f"{user}:{password}".encode()

    async def allows(self, header: str | None, client: Client) -> bool:
        credentials = _basic_credentials(header)
        if credentials is None:
            return False
        import hmac  # here, as in BcryptUsers: an exporter without basic auth never loads hashlib (0.74 MiB)

        return hmac.compare_digest(":".join(credentials).encode(), self._expected)


class _LruSet:
    """Keys most recently used, at most `size` of them."""

    def __init__(self, size: int) -> None:
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self._size = size

    def hit(self, key: Hashable) -> bool:
        if key in self._keys:
            self._keys.move_to_end(key)
            return True
        return False

    def add(self, key: Hashable) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self._size:
            self._keys.popitem(last=False)


def _address_group(address: str) -> str:
    """The unit one check at a time is allowed to: an IPv4 address (also IPv4-mapped), an IPv6 /64."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is None:
        return str(ipaddress.IPv6Network(f"{parsed}/64", strict=False))
    return str(getattr(parsed, "ipv4_mapped", None) or parsed)


class _DenialBackoff:
    """Address groups whose last checks were denied, each with a wait before its next new check that
    doubles with its denials in a row; a grant forgets the group. Beyond `size` groups the least
    recently denied is forgotten, so a flood of new addresses costs bounded memory (a flood from more
    groups than that looks new again, which is what the limit costs)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, size: int = BACKOFF_ADDRESSES) -> None:
        self._clock = clock
        self._size = size
        self._groups: OrderedDict[str, tuple[int, float]] = OrderedDict()  # -> (denials in a row, free at)

    def __contains__(self, group: str) -> bool:
        return group in self._groups

    def wait(self, group: str) -> float:
        """Seconds before this group may have a new check: 0 for one with no denial remembered."""
        return max(0.0, self._groups.get(group, (0, 0.0))[1] - self._clock())

    def denied(self, group: str) -> None:
        denials = self._groups.pop(group, (0, 0.0))[0] + 1
        over = denials - BACKOFF_FREE_DENIALS
        wait = min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2 ** min(over - 1, 16)) if over > 0 else 0.0
        self._groups[group] = (denials, self._clock() + wait)
        if len(self._groups) > self._size:
            self._groups.popitem(last=False)

    def granted(self, group: str) -> None:
        self._groups.pop(group, None)


class _BoundedHasher:
    """bcrypt on worker threads (it releases the GIL), with a bound on checks waiting or running, and
    the checks of groups let in before handed a worker ahead of the others waiting."""

    def __init__(self, known: KnownGroups, clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = ThreadPoolExecutor(max_workers=HASH_WORKERS, thread_name_prefix="bcrypt")
        self._by_address: Counter[str] = Counter()
        self._backoff = _DenialBackoff(clock)
        self._known = known  # groups let in before and not denied since
        self._running = 0  # checks holding a worker
        self._queues: tuple[deque[asyncio.Future[None]], ...] = (deque(), deque())  # known groups', others'
        self.calls = 0  # hashes actually computed

    async def matches(self, password: bytes, hashed: bytes, client: Client) -> bool | None:
        """Whether the password matches; None when the client left before its turn (nothing hashed)."""
        group = _address_group(client.address)
        known = group in self._known
        self._admit(group, known)
        self._by_address[group] += 1
        try:
            await self._turn(known)
            try:
                matched = await asyncio.get_running_loop().run_in_executor(self._pool, self._check, password,
                                                                           hashed, client.connected)
            finally:
                self._next()
        finally:
            self._by_address[group] -= 1
            if not self._by_address[group]:
                del self._by_address[group]
        if matched:
            self._backoff.granted(group)
            self._known.let_in(group)
        elif matched is not None:
            self._backoff.denied(group)
            self._known.denied(group)
        return matched

    def _admit(self, group: str, known: bool) -> None:
        """AuthBusy unless this group may start a check now: not in its wait after a denial, none of its
        own running, and one of its slots free."""
        if wait := self._backoff.wait(group):
            raise AuthBusy(f"too many wrong passwords from this address; retry in {ceil(wait)} s", ceil(wait))
        if self._by_address[group] or sum(self._by_address.values()) >= self._slots(group, known):
            raise AuthBusy("too many new credentials are being checked; retry in a second")

    def _slots(self, group: str, known: bool) -> int:
        """How many checks may be running or waiting for this group to start one: with a denial
        remembered, it waits until none is; a new group may fill all but the last slot, kept for a group
        let in before (and not denied since)."""
        if group in self._backoff:
            return 1
        return HASH_WORKERS + HASH_WAITING - (0 if known else 1)

    async def _turn(self, known: bool) -> None:
        """Returns holding a worker: at once when one is free, else when _next hands one over. A known
        group's check is handed one before any other waiting, so it waits for one hash at most, not for
        the checks of the new addresses queued before it."""
        if self._running < HASH_WORKERS:
            self._running += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._queues[0 if known else 1].append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed a worker as it was cancelled: pass it on
                self._next()
            raise

    def _next(self) -> None:
        """The worker a check just gave up goes to the first waiting known group's check, else to the
        first other waiting one, else back to the pool."""
        for queue in self._queues:
            while queue:
                turn = queue.popleft()
                if not turn.done():  # a cancelled one is skipped
                    turn.set_result(None)
                    return
        self._running -= 1

    def _check(self, password: bytes, hashed: bytes, connected: Callable[[], bool]) -> bool | None:
        if not connected():  # read from this thread: at worst one hash for a client leaving right now
            return None
        self.calls += 1
        import bcrypt  # here: an exporter without basic auth never loads it (0.4 MiB of RSS)

        return bcrypt.checkpw(password, hashed)


class BcryptUsers:
    """`basic_auth_users` of a web config file: user -> bcrypt hash. `known` holds the address groups let
    in (by a hash or a cached login) and not denied since, saved across restarts when it has a file."""

    def __init__(self, users: Mapping[str, str], clock: Callable[[], float] = time.monotonic,
                 known: KnownGroups | None = None) -> None:
        import secrets  # here and in allows: an exporter without basic auth never loads hashlib (0.74 MiB of RSS)

        self._users = {user: hashed.encode() for user, hashed in users.items()}
        self._key = secrets.token_bytes(32)  # cache keys mean nothing outside this process
        self._granted = _LruSet(GRANTED_CACHE_SIZE)
        self._denied = _LruSet(DENIED_CACHE_SIZE)
        self._known = known if known is not None else KnownGroups()
        self._hasher = _BoundedHasher(self._known, clock)
        self._pending: dict[bytes, asyncio.Future[None]] = {}  # credentials being checked now

    @property
    def bcrypt_calls(self) -> int:
        return self._hasher.calls

    def replace_users(self, users: Mapping[str, str]) -> None:
        """The users of a reloaded web config. Cached outcomes stay valid: each is keyed by the hash
        it was checked against, so a changed or removed user's old outcome no longer matches."""
        self._users = {user: hashed.encode() for user, hashed in users.items()}

    async def allows(self, header: str | None, client: Client) -> bool:
        credentials = _basic_credentials(header)
        if credentials is None:
            return False
        user, password = credentials[0], credentials[1].encode()
        if len(password) > BCRYPT_MAX_PASSWORD_BYTES:  # no bcrypt hash was made from it
            return False
        hashed = self._users.get(user, DECOY_HASH)
        import hashlib
        import hmac

        key = hmac.new(self._key, b"\0".join((user.encode(), hashed, password)), hashlib.sha256).digest()
        while (cached := self._cached(key)) is None and key in self._pending:
            await asyncio.shield(self._pending[key])  # the same credentials sent again before the answer
        if cached:  # a second Prometheus of a pair sends what the first did: its group is known good too
            self._known.let_in(_address_group(client.address))
        if cached is not None:
            return cached
        return await self._check(key, user, password, hashed, client)

    def _cached(self, key: bytes) -> bool | None:
        if self._granted.hit(key):
            return True
        return False if self._denied.hit(key) else None

    async def _check(self, key: bytes, user: str, password: bytes, hashed: bytes, client: Client) -> bool:
        """One bcrypt for these credentials; others sending them meanwhile wait for its cached outcome
        (or, where this client left before its turn and nothing was cached, check themselves)."""
        self._pending[key] = done = asyncio.get_running_loop().create_future()
        try:
            matches = await self._hasher.matches(password, hashed, client)
            granted = bool(matches) and user in self._users
            if matches is not None:
                (self._granted if granted else self._denied).add(key)
            return granted
        finally:
            del self._pending[key]
            done.set_result(None)

"""HTTP basic auth for /metrics and the index page: bcrypt users (`--web.config.file`) or one user with
a plain password file (the older `--basic-auth-user`).

bcrypt is deliberately slow (tens of milliseconds at cost 10), so as exporter-toolkit does, the
outcome of each (user, hash, password) is cached and a scrape every 15 s costs a dictionary lookup,
not a bcrypt; only a new or wrong password pays. Hashing runs on one worker thread, off the event
loop, one at a time: a client guessing passwords slows its own answers, never a scrape with cached
credentials. An unknown user is checked against a fixed hash so timing does not reveal which users
exist.
"""

import asyncio
import base64
import binascii
import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import bcrypt

CACHE_SIZE = 100  # exporter-toolkit keeps 100 outcomes too
# a cost-10 bcrypt of a password nobody sends: an unknown user costs what a known one does
DECOY_HASH = b"$2b$10$5NGai4efUngPzjijLv27ReZVXW6bHPBHlS4fU2I/4h1OMWqGLSFU2"


class Authenticator(Protocol):
    async def allows(self, header: str | None) -> bool:
        """Whether an `Authorization` header value grants access."""
        ...


def _basic_credentials(header: str | None) -> tuple[str, str] | None:
    scheme, _, encoded = (header or "").strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, sep, password = base64.b64decode(encoded.strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, password) if sep else None


class PasswordFileUser:
    """One user whose password is given in clear in a file (`--basic-auth-user`/`--basic-auth-password-file`)."""

    def __init__(self, user: str, password: str) -> None:
        self._expected = f"{user}:{password}".encode()

    async def allows(self, header: str | None) -> bool:
        credentials = _basic_credentials(header)
        if credentials is None:
            return False
        return hmac.compare_digest(":".join(credentials).encode(), self._expected)


class BcryptUsers:
    """`basic_auth_users` of a web config file: user -> bcrypt hash."""

    def __init__(self, users: Mapping[str, str]) -> None:
        self._users = {user: hashed.encode() for user, hashed in users.items()}
        self._outcomes: OrderedDict[bytes, bool] = OrderedDict()
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcrypt")
        self.bcrypt_calls = 0

    def replace_users(self, users: Mapping[str, str]) -> None:
        """The users of a reloaded web config. Cached outcomes stay valid: each is keyed by the hash
        it was checked against, so a changed or removed user's old outcome no longer matches."""
        self._users = {user: hashed.encode() for user, hashed in users.items()}

    async def allows(self, header: str | None) -> bool:
        credentials = _basic_credentials(header)
        if credentials is None:
            return False
        user, password = credentials
        hashed = self._users.get(user, DECOY_HASH)
        key = hashlib.sha256(b"\0".join((user.encode(), hashed, password.encode()))).digest()
        outcome = self._outcomes.get(key)
        if outcome is None:
            loop = asyncio.get_running_loop()
            matches = await loop.run_in_executor(self._hasher, bcrypt.checkpw, password.encode(), hashed)
            self.bcrypt_calls += 1
            outcome = matches and user in self._users
            self._outcomes[key] = outcome
            while len(self._outcomes) > CACHE_SIZE:
                self._outcomes.popitem(last=False)
        return outcome

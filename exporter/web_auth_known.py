"""The address groups basic auth let in recently, kept across restarts (`--web.auth.state-file`).

After a restart no login is cached, and every new address costs one bcrypt before it is known as a
guesser, so a flood of new addresses used to compete with the legitimate scraper's first login for
every check slot. The groups it came from (an IPv4 address, an IPv6 /64: the unit the backoff counts)
are what lets web_auth keep a slot and the front of the queue for it. Only groups and the time each was
last let in are kept, never a user, a password or a hash, so the file tells a reader no more than an
access log would.

The file is JSON, replaced atomically (a temporary file beside it, then rename), at most KNOWN_GROUPS
groups, each forgotten REMEMBER_SECONDS after it was last let in. An absent or empty file starts with no
groups. Anything else that is not such a document is refused (StateFileError) rather than replaced: the
exporter never leaves one half-written (it renames a complete file into place), so such content is
another program's, or the path of another flag's file (a web config given twice), and the first let-in
would overwrite it. Let-ins of groups already known rewrite it at most once per REFRESH_SECONDS each,
so a scrape with cached credentials costs no write.
"""

import json
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from stepscope.contract import json_text

log = logging.getLogger(__name__)

KNOWN_GROUPS = 1024  # groups let in and not denied since; the least recently let in go first
REMEMBER_SECONDS = 7 * 86400.0  # a scraper gone a week is forgotten (its address may be someone else's now)
REFRESH_SECONDS = 3600.0  # a known group's let-in time is written again at most this often
MAX_FILE_BYTES = 256 * 1024  # well above KNOWN_GROUPS entries; a larger file is not ours
MAX_GROUP_CHARS = 64  # an IPv6 /64 in full is 43 characters
FORMAT_VERSION = 1


class StateFileError(ValueError):
    """The state file holds what this exporter did not write, or cannot be read: replacing it could destroy
    someone's data, so the exporter stops instead."""


class KnownGroups:
    """Groups let in and not denied since, most recently let in last; saved to `path` when given."""

    def __init__(self, path: str | Path | None = None, clock: Callable[[], float] = time.time,
                 size: int = KNOWN_GROUPS) -> None:
        self._path = Path(path) if path else None
        self._clock = clock
        self._size = size
        self._groups: OrderedDict[str, float] = OrderedDict()  # group -> wall-clock time last let in
        self._saved: dict[str, float] = {}  # what the file holds
        if self._path is not None:
            self._groups = self._load(self._path)
            self._saved = dict(self._groups)

    def __contains__(self, group: str) -> bool:
        return group in self._groups

    def groups(self) -> list[str]:
        """The known groups, least recently let in first."""
        return list(self._groups)

    def let_in(self, group: str) -> None:
        """`group` was let in now; saved at once when it is new, else when its saved time is stale."""
        now = self._clock()
        self._groups[group] = now
        self._groups.move_to_end(group)
        while len(self._groups) > self._size:
            self._groups.popitem(last=False)
        if now - self._saved.get(group, -math.inf) >= REFRESH_SECONDS:
            self._save_logged()

    def denied(self, group: str) -> None:
        """`group` sent a wrong password: it is no longer known good."""
        if self._groups.pop(group, None) is not None and group in self._saved:
            self._save_logged()

    def save(self) -> None:
        """Writes the file atomically; OSError when it cannot (checked at start: a bad path is a flag error)."""
        if self._path is None:
            return
        now = self._clock()
        groups = {group: at for group, at in self._groups.items() if now - at < REMEMBER_SECONDS}
        text = json.dumps({"version": FORMAT_VERSION, "groups": groups}, separators=(",", ":"))
        import tempfile  # here: only with --web.auth.state-file; it brings shutil and random (0.3 MiB of RSS)

        handle, temporary = tempfile.mkstemp(prefix=f".{self._path.name}.", dir=self._path.parent)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self._path)
        except BaseException:
            os.unlink(temporary)
            raise
        self._saved = groups

    def _save_logged(self) -> None:
        """save() from the request path: a full disk or a removed directory costs the file, not the request."""
        try:
            self.save()
        except OSError as exc:
            log.error("cannot write --web.auth.state-file %s: %s; known groups kept in memory only", self._path, exc)
            self._saved = dict(self._groups)  # tried: the next try comes with the next change, not the next scrape

    def _load(self, path: Path) -> "OrderedDict[str, float]":
        """The groups in the file still within REMEMBER_SECONDS, oldest first; empty when the file is absent
        or empty. StateFileError when it cannot be read or holds anything else: save() would replace it."""
        try:
            with path.open("rb") as handle:
                raw = handle.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return OrderedDict()
        except OSError as exc:
            raise StateFileError(f"cannot read it ({exc.strerror or exc})") from None
        if not raw:
            return OrderedDict()
        try:
            groups = _parse(raw)
        except ValueError as exc:
            raise StateFileError(f"not a state file this exporter wrote ({exc}), so it will not overwrite it: "
                                 "remove it or give a path of its own") from None
        now = self._clock()
        fresh = sorted((at, group) for group, at in groups.items() if 0 <= now - at < REMEMBER_SECONDS)
        return OrderedDict((group, at) for at, group in fresh[-self._size:])


def _parse(raw: bytes) -> dict[str, float]:
    """{group: let-in time} of a state file; ValueError saying what is wrong with it."""
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    try:
        document = json_text.loads(raw)
    except ValueError as exc:  # undecodable, not JSON, or nested too deep; said plainly
        raise ValueError(f"not a JSON document ({exc})") from None
    if not isinstance(document, dict) or document.get("version") != FORMAT_VERSION:
        raise ValueError(f"not a version {FORMAT_VERSION} state file")
    groups = document.get("groups")
    if not isinstance(groups, dict) or not all(
            isinstance(group, str) and len(group) <= MAX_GROUP_CHARS and isinstance(at, (int, float))
            and not isinstance(at, bool) and math.isfinite(at) for group, at in groups.items()):
        raise ValueError("its groups are not a map of address groups to times")
    return {group: float(at) for group, at in groups.items()}

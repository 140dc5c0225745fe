"""Whether a file the exporter re-reads while it runs has changed (the web config, the ingest tokens).

Looked at once a second at most (a scrape or a push pays no stat), by modification time, size and inode with
links followed: a Kubernetes Secret volume swaps a link to a new file, and an editor may write the same size
in the same second.
"""

import os
import time
from collections.abc import Callable
from typing import Literal

CHECK_SECONDS = 1.0
Stamp = tuple[float, int, int]


class FileWatch:
    """The file at `path` as it was when last looked at."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._stamp = _stamp(path)
        self._checked_at = clock()

    def poll(self) -> Literal["same", "changed", "gone"]:
        """"changed" when the file can be read and differs from when last looked at; "gone" the first time it
        cannot be read (mid-replace, deleted: said once, not every second until it is back); else "same",
        as between two looks."""
        now = self._clock()
        if now - self._checked_at < CHECK_SECONDS:
            return "same"
        self._checked_at = now
        stamp, before = _stamp(self.path), self._stamp
        self._stamp = stamp
        if stamp is None:
            return "gone" if before is not None else "same"
        return "changed" if stamp != before else "same"


def _stamp(path: str) -> Stamp | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime, stat.st_size, stat.st_ino

"""Pre-rendered exposition text per source, so a scrape only concatenates bytes."""

import gzip
import threading
from collections.abc import Iterable

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric


class _Families:
    """Adapter: generate_latest wants an object with collect()."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def render(families: Iterable[Metric]) -> bytes:
    """Text exposition format 0.0.4 of the given families."""
    return generate_latest(_Families(families))  # type: ignore[arg-type]


class ExpositionStore:
    """Holds the latest rendered body of every source (a collector, self metrics, ingest).

    Writers swap in a new immutable mapping; readers take the current one without locking. The
    concatenated body and its gzip form are cached per version, so repeated scrapes between two
    collection cycles cost a dictionary lookup.
    """

    def __init__(self) -> None:
        self._parts: dict[str, bytes] = {}
        self._version = 0
        self._write_lock = threading.Lock()
        self._cache: tuple[int, bytes, bytes | None] = (0, b"", None)
        self._cache_lock = threading.Lock()

    def publish(self, source: str, body: bytes) -> None:
        with self._write_lock:
            parts = dict(self._parts)
            parts[source] = body
            self._parts = parts
            self._version += 1

    def body(self, compressed: bool = False) -> bytes:
        version, plain, packed = self._cache
        if version != self._version:
            with self._cache_lock:
                version, plain, packed = self._cache
                if version != self._version:
                    version, parts = self._version, self._parts
                    plain = b"".join(parts[name] for name in sorted(parts))
                    packed = None
                    self._cache = (version, plain, packed)
        if not compressed:
            return plain
        if packed is None:
            packed = gzip.compress(plain, compresslevel=5)
            with self._cache_lock:
                if self._cache[0] == version:
                    self._cache = (version, plain, packed)
        return packed

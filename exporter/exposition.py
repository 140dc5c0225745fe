"""Pre-rendered exposition text per source, so a scrape only concatenates bytes."""

import gzip
import threading
from collections.abc import Iterable
from typing import Any

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


class CachedRenderer:
    """Renders one source's families cycle after cycle, re-rendering only the families that changed.

    Most families of an idle node (GPU identity, memory totals, clocks, limits, temperatures) read
    the same from one cycle to the next: comparing a family's samples with the last cycle's costs a
    fraction of rendering them. One caller at a time (each source has its own).
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[str, str, list[Any], bytes]] = {}  # name -> (type, help, samples, text)
        self._body: bytes | None = None

    def render(self, families: Iterable[Metric]) -> tuple[bytes, bool]:
        """The text of `families`, and whether it differs from the last call's (so worth publishing)."""
        last, current, parts = self._last, {}, []
        for family in families:
            cached = last.get(family.name)
            if cached is not None and cached[:3] == (family.type, family.documentation, family.samples):
                text = cached[3]
            else:
                text = render([family])
            current[family.name] = (family.type, family.documentation, family.samples, text)
            parts.append(text)
        self._last = current
        body = b"".join(parts)
        changed = body != self._body
        self._body = body
        return body, changed


class ExpositionStore:
    """Holds the latest rendered body of every source (a collector, self metrics, ingest).

    The concatenated body and its gzip form are built once per change and then served from the
    cache, so repeated scrapes between two collection cycles cost a lock and a comparison.
    """

    def __init__(self) -> None:
        self._parts: dict[str, bytes] = {}
        self._version = 0
        self._lock = threading.Lock()
        self._cached_version = -1
        self._plain = b""
        self._packed: bytes | None = None

    def publish(self, source: str, body: bytes) -> None:
        with self._lock:
            self._parts = {**self._parts, source: body}
            self._version += 1

    def body(self, compressed: bool = False) -> bytes:
        with self._lock:
            if self._cached_version != self._version:
                self._plain = b"".join(self._parts[name] for name in sorted(self._parts))
                self._packed = None
                self._cached_version = self._version
            if not compressed:
                return self._plain
            if self._packed is None:
                self._packed = gzip.compress(self._plain, compresslevel=5)
            return self._packed

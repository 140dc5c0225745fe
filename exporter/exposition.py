"""Pre-rendered exposition text per source, so a scrape only concatenates bytes (plain or gzip)."""

import struct
import threading
import zlib
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

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


class Chunk:
    """A piece of the exposition: its text and the same text as raw-deflate blocks ended by a sync flush.

    Sync-flushed blocks from independent compressors concatenate into one valid deflate stream (none
    refers back before its own start, and each ends on a byte boundary), so a gzip scrape is a header,
    the stored blocks in order, an empty final block and a CRC32 + length trailer: nothing is
    recompressed at scrape time, only the CRC runs over the plain text (GB/s).
    """

    __slots__ = ("packed", "plain")

    def __init__(self, plain: bytes, level: int = 6) -> None:
        self.plain = plain
        compressor = zlib.compressobj(level, zlib.DEFLATED, -15)
        self.packed = compressor.compress(plain) + compressor.flush(zlib.Z_SYNC_FLUSH)


class ChunkSource(Protocol):
    """A source rendered at scrape time, only when `version()` changed since the last scrape."""

    def version(self) -> object:
        ...

    def chunks(self) -> Sequence[Chunk]:
        ...


_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no mtime, unknown OS
_FINAL_BLOCK = b"\x03\x00"  # an empty final block with fixed Huffman codes


def gzip_member(chunks: Sequence[Chunk]) -> bytes:
    """One gzip member of the chunks' text, from their stored deflate blocks."""
    crc = 0
    size = 0
    for chunk in chunks:
        crc = zlib.crc32(chunk.plain, crc)
        size += len(chunk.plain)
    trailer = struct.pack("<II", crc, size & 0xFFFFFFFF)
    return b"".join([_GZIP_HEADER, *(chunk.packed for chunk in chunks), _FINAL_BLOCK, trailer])


class _Published:
    """A source published as one body (collectors: once per cycle), compressed once at publish."""

    def __init__(self, body: bytes, serial: int) -> None:
        self._chunks = (Chunk(body),) if body else ()
        self._serial = serial

    def version(self) -> object:
        return self._serial

    def chunks(self) -> Sequence[Chunk]:
        return self._chunks


class ExpositionStore:
    """Holds every source of /metrics (collectors, self metrics, ingest) and serves their concatenation.

    Collectors publish a rendered body; the ingest side attaches a ChunkSource that assembles its
    per-group chunks when asked. The plain and gzip bodies are built at most once per change of any
    source and served from the cache until the next change.
    """

    def __init__(self) -> None:
        self._sources: dict[str, ChunkSource] = {}
        self._serial = 0
        self._lock = threading.Lock()
        self._cached_key: tuple[object, ...] | None = None
        self._chunks: list[Chunk] = []
        self._plain: bytes | None = None
        self._packed: bytes | None = None

    def publish(self, source: str, body: bytes) -> None:
        with self._lock:
            self._serial += 1
            self._sources = {**self._sources, source: _Published(body, self._serial)}

    def attach(self, source: str, chunks: ChunkSource) -> None:
        with self._lock:
            self._sources = {**self._sources, source: chunks}

    def body(self, compressed: bool = False) -> bytes:
        with self._lock:
            sources = [self._sources[name] for name in sorted(self._sources)]
            key = tuple(source.version() for source in sources)
            if key != self._cached_key:
                self._chunks = [chunk for source in sources for chunk in source.chunks()]
                self._plain = self._packed = None
                self._cached_key = key
            if not compressed:
                if self._plain is None:
                    self._plain = b"".join(chunk.plain for chunk in self._chunks)
                return self._plain
            if self._packed is None:
                self._packed = gzip_member(self._chunks)
            return self._packed

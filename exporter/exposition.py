"""Pre-rendered exposition text per source, so a scrape only concatenates bytes (plain or gzip)."""

import copy
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from stepscope.contract import families
from stepscope.exporter.metric_families import OPENMETRICS_SUFFIXES, Metric, float_to_go_string, render

_MINUS_INF = float("-inf")
_NODE_TIME_HEAD = (f"# HELP {families.NODE_TIME} The node's wall clock (Unix seconds) as the exporter answered "
                   f"this scrape.\n# TYPE {families.NODE_TIME} gauge\n").encode()


def node_time(now: float | None = None) -> bytes:
    """The node's clock at this scrape, read when the scrape is answered (never cached with a snapshot): the
    server stamps the sample with its own clock at the scrape, so the value less its timestamp() is how far the
    node's clock is off (node_exporter's node_time_seconds, for the same reading). The rules take that out of
    every time the node stamps (last push, last step, a phase's entry, an XID, a collector's success), which they
    compare with their own time() and with other nodes' times."""
    value = float_to_go_string(time.time() if now is None else now)
    return _NODE_TIME_HEAD + f"{families.NODE_TIME} {value}\n".encode()


class _Rendered:
    """A family's text as last rendered, with what it was rendered from and the lines' cached prefixes."""

    __slots__ = ("header", "key", "prefixes", "text")

    def __init__(self, key: tuple[str, str, list[Any]], header: bytes, prefixes: dict[Any, str], text: bytes) -> None:
        self.key = key  # (type, help, samples)
        self.header = header
        self.prefixes = prefixes  # (sample name, label items) -> 'name{labels} '
        self.text = text


def _plain(sample: Any, family_name: str) -> bool:
    """A sample that render writes as `name{labels} value` in the family's order (not moved to a family apart)."""
    return (sample.timestamp is None and sample.exemplar is None and getattr(sample, "native_histogram", None) is None
            and not any(sample.name == family_name + suffix for suffix in OPENMETRICS_SUFFIXES))


def _alone(family: Metric, samples: list[Any]) -> Metric:
    """A copy of `family` holding only `samples` (the original stays as the collector made it)."""
    copied = copy.copy(family)
    copied.samples = samples
    return copied


class CachedRenderer:
    """Renders one source's families cycle after cycle, re-rendering only the families that changed.

    Most families of an idle node (GPU identity, memory totals, clocks, limits, temperatures) read
    the same from one cycle to the next: comparing a family's samples with the last cycle's costs a
    fraction of rendering them. A family that changed is written line by line from prefixes kept
    since its last render (the series' name and labels, formatted by render once) and the
    value (its float_to_go_string), so its text stays byte for byte what render writes at a
    fraction of the cost: a busy GPU changes most of its families every cycle. One caller at a time
    (each source has its own).
    """

    def __init__(self) -> None:
        self._last: dict[str, _Rendered] = {}
        self._body: bytes | None = None

    def render(self, families: Iterable[Metric]) -> tuple[bytes, bool]:
        """The text of `families`, and whether it differs from the last call's (so worth publishing)."""
        last, current = self._last, {}
        for family in families:
            key = (family.type, family.documentation, family.samples)
            cached = last.get(family.name)
            if cached is None or cached.key != key:
                cached = self._render_family(family, key, cached)
            current[family.name] = cached
        self._last = current
        body = b"".join(rendered.text for rendered in current.values())
        changed = body != self._body
        self._body = body
        return body, changed

    @staticmethod
    def _render_family(family: Metric, key: tuple[str, str, list[Any]], previous: _Rendered | None) -> _Rendered:
        name = family.name
        if not all(_plain(sample, name) for sample in family.samples):
            return _Rendered(key, b"", {}, render([family]))
        same_head = previous is not None and previous.header and previous.key[:2] == key[:2]
        header = previous.header if same_head else render([_alone(family, [])])
        old = previous.prefixes if previous is not None else {}
        prefixes: dict[Any, str] = {}
        lines = [header.decode()]
        for sample in family.samples:
            series = (sample.name, tuple(sample.labels.items()))
            prefix = prefixes.get(series) or old.get(series)
            if prefix is None:
                line = render([_alone(family, [sample._replace(value=0.0)])])[len(header):].decode()
                prefix = line.removesuffix("0.0\n")
            prefixes[series] = prefix
            value = float(sample.value)
            # float_to_go_string is repr() for these; it differs only for infinities, NaN and 1e6 up
            lines.append(f"{prefix}{repr(value) if _MINUS_INF < value < 1e6 else float_to_go_string(value)}\n")
        return _Rendered(key, header, prefixes, "".join(lines).encode())


class Chunk:
    """A piece of the exposition: its text and the same text as raw-deflate blocks ended by a sync flush.

    Sync-flushed blocks from independent compressors concatenate into one valid deflate stream (none
    refers back before its own start, and each ends on a byte boundary), so a gzip scrape is a header,
    the stored blocks in order, an empty final block and a CRC32 + length trailer: a chunk is compressed
    once, at the first gzip scrape that serves it, then only the CRC runs over the plain text (GB/s).
    """

    __slots__ = ("_level", "_packed", "plain")

    # Level 1: a busy GPU's body changes every cycle, and exposition text compresses 4x cheaper at 1
    # than at 6 for about 9% more bytes (benchmarks/results/exporter_cpu.md): the node's CPU is the
    # scarcer of the two.
    def __init__(self, plain: bytes, level: int = 1) -> None:
        self.plain = plain
        self._level = level
        self._packed: bytes | None = None

    @property
    def packed(self) -> bytes:
        """Deflated at the first gzip scrape that serves it: collectors publish every cycle (1-5 s) and
        Prometheus scrapes every 15 s, so most bodies are replaced before anyone asks for them."""
        if self._packed is None:  # two scrapes at once both compress, to the same bytes
            compressor = zlib.compressobj(self._level, zlib.DEFLATED, -15)
            self._packed = compressor.compress(self.plain) + compressor.flush(zlib.Z_SYNC_FLUSH)
        return self._packed


class ChunkSource(Protocol):
    """A source rendered at scrape time, only when `version()` changed since the last scrape."""

    def version(self) -> object:
        ...

    def chunks(self) -> Sequence[Chunk]:
        ...


_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no mtime, unknown OS
_FINAL_BLOCK = b"\x03\x00"  # an empty final block with fixed Huffman codes


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
        self._packed: _Packed | None = None

    def publish(self, source: str, body: bytes) -> None:
        with self._lock:
            self._serial += 1
            self._sources = {**self._sources, source: _Published(body, self._serial)}

    def attach(self, source: str, chunks: ChunkSource) -> None:
        with self._lock:
            self._sources = {**self._sources, source: chunks}

    def body(self, compressed: bool = False, tail: bytes = b"") -> bytes:
        """Every source's text, then `tail` (rendered for this scrape alone: the node's clock), plain or gzipped.

        The sources' part is built once per change; `tail` goes in as a stored deflate block, and the CRC goes
        on from the cached one over its few bytes, so a scrape still costs a concatenation.
        """
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
                return self._plain + tail
            if self._packed is None:
                self._packed = _Packed(self._chunks)
            return self._packed.member(tail)


class _Packed:
    """The sources' deflate blocks behind a gzip header, with their CRC32 and length: one gzip member is
    these, a stored block of the scrape's own tail, an empty final block and the trailer."""

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        self.head = b"".join([_GZIP_HEADER, *(chunk.packed for chunk in chunks)])
        self.crc = 0
        self.size = 0
        for chunk in chunks:
            self.crc = zlib.crc32(chunk.plain, self.crc)
            self.size += len(chunk.plain)

    def member(self, tail: bytes) -> bytes:
        stored = struct.pack("<BHH", 0, len(tail), len(tail) ^ 0xFFFF) + tail if tail else b""
        trailer = struct.pack("<II", zlib.crc32(tail, self.crc), (self.size + len(tail)) & 0xFFFFFFFF)
        return b"".join([self.head, stored, _FINAL_BLOCK, trailer])

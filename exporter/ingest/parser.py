"""A strict push-body parser for the accepted families, linear in the body size.

It reads the text exposition format 0.0.4 as Prometheus itself does (one sample per line, a family's
`# TYPE` before its samples, each family once, label values with the escapes \\\\, \\n and \\" only)
and checks every sample against `families.FAMILIES` on the way, so a refused push never reaches the
store. Each line is scanned once, left to right, with `str.find` and regular expressions that are a
single character class (no alternation to backtrack into); work per line stops at the first problem
and at the label, series and phase limits. What comes out is canonical: per family, its sample
lines with `run` and `rank` from the URL path, labels sorted, histogram series as buckets (ordered by
`le`, Go-formatted) then `_count`, `_sum` — ready to serve as they are.

prometheus_client's own parser is laxer and quadratic on some inputs (a long comment line of blanks,
runs of escaped quotes); the tests keep it as the oracle for what a valid body means.
"""

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from stepscope.contract.exposition import escape_label_value
from stepscope.exporter.ingest.errors import Rejected, clip
from stepscope.exporter.ingest.families import (
    FAMILIES,
    LABEL_RULES,
    LONG_LABEL_LENGTHS,
    NON_EMPTY_LABELS,
    PATH_LABELS,
    PHASE_FAMILY,
    RESERVED_LABELS,
    STATE_FAMILY,
    FamilySpec,
)
from stepscope.exporter.metric_families import float_to_go_string

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_BLANKS = re.compile(r"[ \t]*")
_PLAIN_VALUE_TEXT = re.compile(r'[^"\\]*')  # label value text up to the next quote or backslash
# The common case in one match: name="value without escapes" then ',' or '}'. Each part is a single
# character class ending at a character it excludes, so a match or a miss costs one pass.
_PLAIN_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*)"([,}])')
_PLAIN_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*)"')
# A whole sample line of the common shape: name{a="x",b="y"} 12.5 (no escapes, no blanks in braces,
# no timestamp). Deterministic: each repetition starts with a character the previous part excludes.
_LABEL_PAIR_TEXT = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"'
_COMMON_SAMPLE = re.compile(
    rf'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{{((?:{_LABEL_PAIR_TEXT}(?:,{_LABEL_PAIR_TEXT})*)?)\}})? ([-+0-9.eE]+)'
)
_NUMBER_CHARS = "0123456789.eE+-"
_SPECIAL_VALUES = {"+inf": math.inf, "inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_ESCAPES = {"\\": "\\", "n": "\n", '"': '"'}
_MAX_NUMBER_LENGTH = 64
_HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")
_CREATED = "_created"
_UNTYPED = "untyped (no '# TYPE' line)"
_TYPES = ("counter", "gauge", "histogram", "summary", "untyped")

SeriesKey = tuple[str, ...]  # values of the family's body labels, required then optional ("" = absent)


@dataclass(frozen=True, slots=True)
class ParsedFamily:
    """One family of one push: canonical sample lines plus what the store's limits need."""

    lines: bytes
    series: int  # exposed series, histogram buckets, _count and _sum included
    keys: tuple[SeriesKey, ...]  # one per sample (counter, gauge) or per histogram series


class _Malformed(Exception):
    """Text that is not the exposition format; becomes a 400 naming the line."""


@dataclass(frozen=True)
class PushLimits:
    max_label_length: int
    max_series: int  # per group: a body holding more is refused before it is fully read
    max_phases: int


def parse_push(body: bytes, run: str, rank: str, limits: PushLimits) -> dict[str, ParsedFamily]:
    """The body's families, checked and canonical; raises Rejected on the first problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Rejected(400, "malformed", f"body is not UTF-8 text: {exc}") from None
    parser = _BodyParser(run, rank, limits)
    for number, line in enumerate(text.split("\n"), start=1):
        if not line:
            continue
        try:
            parser.feed(line)
        except _Malformed as exc:
            raise Rejected(
                400, "malformed",
                f"cannot parse the text exposition (format 0.0.4) at line {number} {clip(line.strip())!r}: {exc}",
            ) from None
    return parser.finish()


def unknown_family(name: str) -> Rejected:
    return Rejected(
        400, "unknown_family", f"unknown family {clip(name)!r}: the push API accepts only {', '.join(FAMILIES)}"
    )


def _companion(name: str) -> tuple[FamilySpec | None, str]:
    """The accepted family a sample or family name belongs to by suffix, and that suffix."""
    for suffix in (*_HISTOGRAM_SUFFIXES, "_total", _CREATED):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            spec = FAMILIES.get(base) or FAMILIES.get(base + "_total")
            if spec is not None:
                return spec, suffix
    return None, ""


def _is_dropped_created(name: str) -> bool:
    """prometheus_client's `_created` timestamps of counters and histograms: accepted, not stored."""
    spec, suffix = _companion(name)
    return suffix == _CREATED and spec is not None and spec.type in ("counter", "histogram")


def _wrong_type(spec: FamilySpec, got: str) -> Rejected:
    return Rejected(400, "wrong_type", f"family {spec.name} must be TYPE {spec.type}, got {got}")


def _needs_type_line(name: str, spec: FamilySpec, got: str) -> Rejected:
    return Rejected(
        400, "wrong_type", f"sample {name} needs the line '# TYPE {spec.name} {spec.type}' before it (got {got})"
    )


def _label_too_long(name: str, value: str, limit: int) -> Rejected:
    which = "for file paths" if name in LONG_LABEL_LENGTHS else "(--ingest-max-label-value-length)"
    return Rejected(
        400, "label_too_long",
        f"value of label {name!r} has more than {limit} characters, the limit {which}: {clip(value)!r}",
    )


def _split_le(label_text: str) -> tuple[str, str] | None:
    """(the other labels' text, le) of a bucket's plain label text with le first or last, else None."""
    if label_text.startswith('le="'):
        end = label_text.find('"', 4)
        return label_text[end + 2:], label_text[4:end]
    at = label_text.rfind(',le="')
    if at < 0 or '"' in label_text[at + 5:-1]:
        return None
    return label_text[:at], label_text[at + 5:-1]


def _parse_number(token: str) -> float:
    if len(token) > _MAX_NUMBER_LENGTH:
        raise _Malformed(f"number {clip(token, 20)!r} is longer than {_MAX_NUMBER_LENGTH} characters")
    special = _SPECIAL_VALUES.get(token.lower())
    if special is not None:
        return special
    if token.strip(_NUMBER_CHARS):
        raise _Malformed(f"{clip(token, 40)!r} is not a number")
    try:
        return float(token)
    except ValueError:
        raise _Malformed(f"{clip(token, 40)!r} is not a number") from None


def _format_value(value: float) -> str:
    if math.isfinite(value):
        return repr(value)
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")


def _show(name: str, labels: Iterable[tuple[str, str]]) -> str:
    """The sample as the body wrote it, escapes kept: the refusal is one line in the 400 and the exporter's log."""
    shown = ",".join(f'{k}="{clip(escape_label_value(v), 60)}"' for k, v in labels)
    return clip(f"{name}{{{shown}}}" if shown else name, 200)


class _FamilyBuilder:
    """Collects the checked samples of one family and renders its canonical lines."""

    def __init__(
        self, spec: FamilySpec, path_fragments: dict[str, str], le_cache: dict[str, tuple[float, str]]
    ) -> None:
        self.spec = spec
        self.sample_names = frozenset(
            [spec.name + suffix for suffix in _HISTOGRAM_SUFFIXES] if spec.type == "histogram" else [spec.name]
        )
        self.series = 0  # exposed series so far, histogram buckets, _count and _sum included
        self.bucket_name = spec.name + "_bucket" if spec.type == "histogram" else ""
        self.series_by_text: dict[str, _Histogram] = {}  # label text without le -> its checked series
        self._path = path_fragments  # label name -> 'name="escaped value"' for run and rank
        self._le_cache = le_cache
        self._lines: list[str] = []
        self._seen: dict[SeriesKey, _Histogram | None] = {}  # insertion-ordered series keys

    def add(self, name: str, key: SeriesKey, values: dict[str, str], value: float,
            labels: list[tuple[str, str]], le: str | None) -> None:
        spec = self.spec
        if spec.type != "histogram":
            if key in self._seen:
                raise Rejected(400, "malformed", f"duplicate sample {_show(name, labels)}")
            self._seen[key] = None
            self.series += 1
            self._lines.append(f"{name}{{{self._label_text(values)}}} {_format_value(value)}\n")
            return
        hist = self._seen.get(key)
        if hist is None:
            hist = self._seen[key] = _Histogram(spec.name, self._label_text(values))
            self.series += 2  # _count and _sum
        suffix = name[len(spec.name):]
        if suffix == "_bucket":
            assert le is not None
            self.series += hist.add_bucket(self._bound(le, name, labels), value, name, labels)
        else:
            hist.add_total(suffix, value, name, labels)

    def remember(self, text_without_le: str, key: SeriesKey) -> None:
        """Notes that buckets with these other labels belong to the series `key`, whose labels are checked."""
        hist = self._seen.get(key)
        if hist is not None:
            self.series_by_text[text_without_le] = hist

    def add_known_bucket(self, hist: "_Histogram", le: str, value: float) -> bool:
        """Adds a bucket of a series read before, when nothing about it needs a refusal; else False."""
        bound = self._le_cache.get(le)
        if bound is None or bound[0] in hist.buckets or not (math.isfinite(value) and value >= 0):
            return False
        hist.buckets[bound[0]] = (bound[1], value)
        self.series += 1
        return True

    def finish(self) -> ParsedFamily:
        lines = self._lines
        for hist in self._seen.values():
            if hist is not None:
                hist.render(lines)
        return ParsedFamily("".join(lines).encode(), self.series, tuple(self._seen))

    def _bound(self, le: str, name: str, labels: list[tuple[str, str]]) -> tuple[float, str]:
        """(bound, Go-formatted le) of a bucket; a body repeats a few bounds many times."""
        cached = self._le_cache.get(le)
        if cached is None:
            try:
                bound = _parse_number(le)
            except _Malformed:
                raise Rejected(400, "malformed", f"{_show(name, labels)}: le is not a number") from None
            if math.isnan(bound):
                raise Rejected(400, "malformed", f"{_show(name, labels)}: NaN or duplicate le")
            cached = self._le_cache[le] = (bound, float_to_go_string(bound))
        return cached

    def _label_text(self, values: dict[str, str]) -> str:
        """Sorted 'name="value"' pairs: run and rank from the path, body labels that are set."""
        fragments = {label: f'{label}="{escape_label_value(value)}"' for label, value in values.items() if value}
        fragments.update(self._path)
        return ",".join(fragments[label] for label in sorted(fragments))


class _Histogram:
    """One histogram series (one label set without `le`): buckets, count and sum, checked at the end."""

    __slots__ = ("buckets", "count", "family", "label_text", "sum")

    def __init__(self, family: str, label_text: str) -> None:
        self.family = family
        self.label_text = label_text  # sorted label pairs without le
        self.buckets: dict[float, tuple[str, float]] = {}  # bound -> (Go-formatted le, cumulative count)
        self.count: float | None = None
        self.sum: float | None = None

    def add_bucket(self, bound: tuple[float, str], value: float, name: str, labels: list[tuple[str, str]]) -> int:
        """Stores one bucket; returns 1 (the series it adds)."""
        if not (math.isfinite(value) and value >= 0):
            raise Rejected(400, "bad_value", f"{_show(name, labels)}: counts must be finite and >= 0, got {value}")
        if bound[0] in self.buckets:
            raise Rejected(400, "malformed", f"{_show(name, labels)}: NaN or duplicate le")
        self.buckets[bound[0]] = (bound[1], value)
        return 1

    def add_total(self, suffix: str, value: float, name: str, labels: list[tuple[str, str]]) -> None:
        if suffix == "_sum":
            if not math.isfinite(value):
                raise Rejected(400, "bad_value", f"{_show(name, labels)}: _sum must be finite, got {value}")
        elif not (math.isfinite(value) and value >= 0):
            raise Rejected(400, "bad_value", f"{_show(name, labels)}: counts must be finite and >= 0, got {value}")
        if (self.count if suffix == "_count" else self.sum) is not None:
            raise Rejected(400, "malformed", f"duplicate sample {_show(name, labels)}")
        if suffix == "_count":
            self.count = value
        else:
            self.sum = value

    def render(self, lines: list[str]) -> None:
        where = f"{self.family}{{{self.label_text}}}"
        if math.inf not in self.buckets:
            raise Rejected(400, "non_cumulative_buckets", f'{where}: no le="+Inf" bucket')
        if self.count is None or self.sum is None:
            raise Rejected(400, "malformed", f"{where}: histogram needs both _count and _sum")
        previous_le, previous = "-Inf", 0.0
        prefix = f'{self.family}_bucket{{le="'  # le sorts first among the label names: le < phase < rank < run
        rest = f'",{self.label_text}}} '
        for bound in sorted(self.buckets):
            le, value = self.buckets[bound]
            if value < previous:
                raise Rejected(
                    400, "non_cumulative_buckets",
                    f'{where}: buckets are not cumulative: le="{le}" holds {value:g}, less than {previous:g} in '
                    f'le="{previous_le}"',
                )
            previous_le, previous = le, value
            lines.append(f"{prefix}{le}{rest}{_format_value(value)}\n")
        if self.count != previous:
            raise Rejected(
                400, "non_cumulative_buckets",
                f'{where}: _count {self.count:g} differs from {previous:g} in the le="+Inf" bucket',
            )
        lines.append(f"{self.family}_count{{{self.label_text}}} {_format_value(self.count)}\n")
        lines.append(f"{self.family}_sum{{{self.label_text}}} {_format_value(self.sum)}\n")


class _BodyParser:
    """Line-by-line state: the family being read, the families done, the limits so far."""

    def __init__(self, run: str, rank: str, limits: PushLimits) -> None:
        self._path = {"run": run, "rank": rank}
        self._path_fragments = {name: f'{name}="{escape_label_value(value)}"' for name, value in self._path.items()}
        self._limits = limits
        self._done: dict[str, ParsedFamily] = {}
        self._seen: set[str] = set()  # every family name that had a HELP, TYPE or sample line
        self._name = ""  # family announced by the last HELP or TYPE line
        self._type = ""  # its TYPE ("" until the TYPE line)
        self._samples_seen = False
        self._builder: _FamilyBuilder | None = None
        self._dropping = False  # inside a `_created` family: parse lines, keep nothing
        self._series = 0  # series of the families done
        self._phases: set[str] = set()
        self._states_on: list[str] = []  # the states whose stepscope_training_state sample is 1
        self._le_cache: dict[str, tuple[float, str]] = {}

    # --- lines ------------------------------------------------------------------------------------

    def feed(self, line: str) -> None:
        text = line.strip(" \t")
        if not text:
            return
        if text[0] == "#":
            self._comment(text)
        else:
            self._sample(text)

    def finish(self) -> dict[str, ParsedFamily]:
        self._close()
        return self._done

    def _comment(self, text: str) -> None:
        parts = text[1:].split(None, 3)
        if not parts or parts[0] not in ("HELP", "TYPE"):
            if len(parts) > 1 and parts[1] in ("HELP", "TYPE"):  # '#x TYPE ...': a TYPE line to some parsers
                raise _Malformed(f"write '# {parts[1]}' with a blank after '#'")
            return  # a plain comment
        keyword = parts[0]
        if keyword == "TYPE" and (len(parts) != 3 or parts[2] not in _TYPES):
            raise _Malformed(f"a TYPE line is '# TYPE <name> <type>' with a type from {', '.join(_TYPES)}")
        if len(parts) < 2 or not _METRIC_NAME.fullmatch(parts[1]):
            raise _Malformed(f"a {keyword} line names a metric")
        name = parts[1]
        if name != self._name:
            self._start(name)
        if keyword == "TYPE":
            if self._type or self._samples_seen:
                raise _Malformed(f"second TYPE line for {name}, or TYPE after its samples")
            self._typed(name, parts[2])

    def _start(self, name: str) -> None:
        """A HELP or TYPE line for a family other than the current one."""
        self._close()
        if name in self._seen:
            raise Rejected(400, "malformed", f"family {name} appears more than once in the body")
        self._seen.add(name)
        self._name, self._type, self._samples_seen = name, "", False
        if FAMILIES.get(name) is None and not _is_dropped_created(name):
            spec, _ = _companion(name)
            if spec is None or spec.type != "histogram" or name.endswith(_CREATED):
                raise unknown_family(name)
            # e.g. '# TYPE stepscope_step_seconds_count counter': answered at the TYPE line

    def _typed(self, name: str, typ: str) -> None:
        self._type = typ
        spec = FAMILIES.get(name)
        if spec is None:
            if _is_dropped_created(name):
                self._dropping = True
                return
            companion, _ = _companion(name)
            assert companion is not None  # _start refused every other name
            raise _needs_type_line(name, companion, typ)
        if spec.type != typ:
            raise _wrong_type(spec, typ)
        self._builder = _FamilyBuilder(spec, self._path_fragments, self._le_cache)

    def _close(self) -> None:
        builder = self._builder
        if builder is None:
            if self._name and not self._type and not self._dropping:  # HELP without TYPE: untyped
                spec = FAMILIES.get(self._name)
                if spec is not None:
                    raise _wrong_type(spec, _UNTYPED)
                companion, _ = _companion(self._name)
                if companion is not None:
                    raise _needs_type_line(self._name, companion, _UNTYPED)
            self._name, self._type, self._dropping = "", "", False
            return
        if builder.spec.name == STATE_FAMILY and len(self._states_on) != 1:
            raise Rejected(400, "bad_value", f"{STATE_FAMILY}: exactly one state must be 1, got "
                                             f"{len(self._states_on)} ({', '.join(self._states_on) or 'none'})")
        family = builder.finish()
        self._done[builder.spec.name] = family
        self._series += family.series
        self._builder, self._name, self._type = None, "", ""

    # --- samples ----------------------------------------------------------------------------------

    def _sample(self, text: str) -> None:
        """A sample line: the common shape (plain label values, one blank, a number) in two C-level
        matches; anything else, and every problem, through the general reader below."""
        fast = _COMMON_SAMPLE.fullmatch(text)
        builder = self._builder
        if fast is None or builder is None or fast.group(1) not in builder.sample_names:
            self._sample_in_general(text)
            return
        name, label_text, value_text = fast.groups()
        try:
            value = float(value_text)
        except ValueError:
            self._sample_in_general(text)  # refuses it with the general reader's message
            return
        split = _split_le(label_text) if name == builder.bucket_name and label_text else None
        if split is not None:
            hist = builder.series_by_text.get(split[0])
            if hist is not None and len(split[1]) <= self._limits.max_label_length and builder.add_known_bucket(
                hist, split[1], value
            ):
                self._check_series_limit(builder)
                return
        labels = _PLAIN_LABEL_PAIR.findall(label_text) if label_text else []
        self._samples_seen = True
        key = self._record(builder, name, labels, value)
        if split is not None:
            builder.remember(split[0], key)

    def _sample_in_general(self, text: str) -> None:
        match = _METRIC_NAME.match(text)
        if match is None:
            raise _Malformed("a sample line starts with a metric name")
        name = match.group()
        builder = self._builder
        if builder is None or name not in builder.sample_names:
            if self._dropping and name == self._name:
                self._samples_seen = True
                self._split_sample(text, match.end())  # syntax only
                return
            self._stray_sample(name)
            self._split_sample(text, match.end())
            return
        self._samples_seen = True
        labels, value = self._split_sample(text, match.end())
        self._record(builder, name, labels, value)

    def _record(
        self, builder: _FamilyBuilder, name: str, labels: list[tuple[str, str]], value: float
    ) -> SeriesKey:
        """Checks one sample of the current family and adds it; returns its series key."""
        spec = builder.spec
        key, values, le = self._check_labels(spec, name, labels)
        if spec.type != "histogram":
            self._check_value(spec, name, labels, value)
        builder.add(name, key, values, value, labels, le)
        self._check_series_limit(builder)
        if spec.name == STATE_FAMILY and value == 1:
            self._states_on.append(key[0])
        if spec.name == PHASE_FAMILY and key[0] not in self._phases:
            self._phases.add(key[0])
            if len(self._phases) > self._limits.max_phases:
                shown = ", ".join(sorted(self._phases)[:8]) + ", ..."
                raise Rejected(
                    400, "too_many_phases",
                    f"the body holds more than {self._limits.max_phases} distinct phases, the limit per group "
                    f"(--ingest-max-phases): {shown}",
                )
        return key

    def _check_series_limit(self, builder: _FamilyBuilder) -> None:
        if self._series + builder.series > self._limits.max_series:
            raise Rejected(
                400, "too_many_series",
                f"the body holds more than {self._limits.max_series} series, the limit per group "
                "(--ingest-max-series-per-group)",
            )

    def _stray_sample(self, name: str) -> None:
        """A sample outside the family announced last: untyped to Prometheus."""
        if name == self._name and not self._type:
            spec = FAMILIES.get(name)
            if spec is not None:
                raise _wrong_type(spec, _UNTYPED)
        self._close()
        if _is_dropped_created(name):
            self._name, self._dropping = name, True
            if name in self._seen:
                raise Rejected(400, "malformed", f"family {name} appears more than once in the body")
            self._seen.add(name)
            return
        spec = FAMILIES.get(name)
        if spec is not None:
            raise _wrong_type(spec, _UNTYPED)
        companion, _ = _companion(name)
        if companion is not None and companion.type == "histogram":
            raise _needs_type_line(name, companion, _UNTYPED)
        raise unknown_family(name)

    def _split_sample(self, text: str, at: int) -> tuple[list[tuple[str, str]], float]:
        """(labels, value) of a sample line whose metric name ends at `at`."""
        labels: list[tuple[str, str]] = []
        if at < len(text) and text[at] == "{":
            at = self._labels(text, at + 1, labels)
        elif at < len(text) and text[at] not in " \t":
            raise _Malformed(f"unexpected {text[at]!r} after the metric name")
        rest = text[at:].strip(" \t")
        if "\t" in rest:
            rest = rest.replace("\t", " ")
        value_text, _, timestamp = rest.partition(" ")
        if not value_text:
            raise _Malformed("the sample has no value")
        value = _parse_number(value_text)
        timestamp = timestamp.strip(" ")
        if timestamp:
            if " " in timestamp:
                raise _Malformed("unexpected text after the timestamp")
            _parse_number(timestamp)
            name = _METRIC_NAME.match(text).group()  # type: ignore[union-attr]
            raise Rejected(400, "bad_value", f"{_show(name, labels)}: pushed samples must not carry a timestamp")
        return labels, value

    def _labels(self, text: str, at: int, labels: list[tuple[str, str]]) -> int:
        """Reads `name="value",...}` from `at`; returns the index after the closing brace."""
        limit = self._limits.max_label_length
        seen: set[str] = set()
        while True:
            plain = _PLAIN_LABEL.match(text, at)
            if plain is not None:
                name, value, end = plain.groups()
                if len(value) > limit and len(value) > self._limit_of(name):
                    raise _label_too_long(name, value, self._limit_of(name))
                if name in seen:
                    raise _Malformed(f"label {name!r} appears twice")
                seen.add(name)
                labels.append((name, value))
                at = plain.end()
                if end == "}":
                    return at
                continue
            at = _BLANKS.match(text, at).end()  # type: ignore[union-attr]
            if at < len(text) and text[at] == "}":
                return at + 1
            match = _LABEL_NAME.match(text, at)
            if match is None:
                raise _Malformed("expected a label name or '}'")
            name = match.group()
            at = _BLANKS.match(text, match.end()).end()  # type: ignore[union-attr]
            if text[at: at + 1] != "=":
                raise _Malformed(f"expected '=' after label name {clip(name, 40)!r}")
            at = _BLANKS.match(text, at + 1).end()  # type: ignore[union-attr]
            if text[at: at + 1] != '"':
                raise _Malformed(f"the value of label {clip(name, 40)!r} must be in double quotes")
            value, at = self._label_value(text, at + 1, name, self._limit_of(name))
            if name in seen:
                raise _Malformed(f"label {name!r} appears twice")
            seen.add(name)
            labels.append((name, value))
            at = _BLANKS.match(text, at).end()  # type: ignore[union-attr]
            if text[at: at + 1] == ",":
                at += 1
            elif text[at: at + 1] != "}":
                raise _Malformed("expected ',' or '}' after a label value")

    def _limit_of(self, label: str) -> int:
        """The longest value `label` may have: the flag's limit, or more for file paths."""
        return max(self._limits.max_label_length, LONG_LABEL_LENGTHS.get(label, 0))

    @staticmethod
    def _label_value(text: str, at: int, name: str, limit: int) -> tuple[str, int]:
        """The unescaped value starting after its opening quote, and the index after its closing one.

        Stops as soon as the value is longer than `limit`, so a huge value costs no more than a short one.
        """
        parts: list[str] = []
        length = 0
        while True:
            end = _PLAIN_VALUE_TEXT.match(text, at).end()  # type: ignore[union-attr]
            parts.append(text[at:end])
            length += end - at
            if length > limit:
                raise _label_too_long(name, "".join(parts), limit)
            if end >= len(text):
                raise _Malformed(f"the value of label {clip(name, 40)!r} has no closing quote")
            if text[end] == '"':
                return "".join(parts), end + 1
            escaped = _ESCAPES.get(text[end + 1: end + 2])
            if escaped is None:
                raise _Malformed(f"invalid escape {text[end: end + 2]!r} in a label value (use \\\\, \\n or \\\")")
            parts.append(escaped)
            length += 1
            at = end + 2

    def _check_labels(
        self, spec: FamilySpec, name: str, labels: list[tuple[str, str]]
    ) -> tuple[SeriesKey, dict[str, str], str | None]:
        """(series key, body label values, le) of one sample."""
        bucket = spec.type == "histogram" and name.endswith("_bucket")
        values: dict[str, str] = {}
        le = None
        limit = self._limits.max_label_length
        path_labels = 0
        for label, value in labels:
            if len(value) > limit and len(value) > self._limit_of(label):
                raise _label_too_long(label, value, self._limit_of(label))
            if label in RESERVED_LABELS:
                raise Rejected(
                    400, "bad_label",
                    f"{_show(name, labels)}: label {label!r} is not accepted in the body (the scraping "
                    "Prometheus sets job and instance; run and rank come from the URL path)",
                )
            if label in PATH_LABELS:
                path_labels += 1
                if value != self._path[label]:
                    raise Rejected(
                        400, "bad_label",
                        f"{_show(name, labels)}: label {label}={value!r} differs from "
                        f"{label}={self._path[label]!r} in the URL path",
                    )
            elif bucket and label == "le":
                le = value
            elif label in spec.body_labels:
                values[label] = value
                rule = LABEL_RULES.get(label)
                if value and rule is not None and not rule[0](value):
                    raise Rejected(400, "bad_label", f"{_show(name, labels)}: label {label!r} must be {rule[1]}")
            else:
                allowed = ", ".join(spec.body_labels) or "none besides run and rank"
                raise Rejected(
                    400, "bad_label", f"{_show(name, labels)}: unexpected label {label!r} (allowed: {allowed})"
                )
        if len(values) + path_labels + (le is not None) != len(labels):
            raise _Malformed("a label appears twice")
        if bucket and le is None:
            raise Rejected(400, "bad_label", f"{_show(name, labels)}: missing label 'le'")
        for label in spec.labels:
            value = values.get(label)
            if value is None:
                raise Rejected(400, "bad_label", f"{_show(name, labels)}: missing label {label!r}")
            if not value and label in NON_EMPTY_LABELS:
                raise Rejected(400, "bad_label", f"{_show(name, labels)}: label {label!r} must not be empty")
        return tuple([values.get(label, "") for label in spec.body_labels]), values, le

    @staticmethod
    def _check_value(spec: FamilySpec, name: str, labels: list[tuple[str, str]], value: float) -> None:
        rule = spec.values
        if rule == "non_negative" and not (math.isfinite(value) and value >= 0):
            raise Rejected(400, "bad_value", f"{_show(name, labels)}: a counter must be >= 0, got {value}")
        if rule == "one" and value != 1:
            raise Rejected(400, "bad_value", f"{_show(name, labels)}: an info metric must be 1, got {value}")
        if rule == "zero_or_one" and value not in (0, 1):
            raise Rejected(
                400, "bad_value", f"{_show(name, labels)}: state set values must be 0 or 1, got {value}"
            )

"""Parses a pushed text exposition and checks it against the training families' contract.

Everything a body can get wrong is found here, before the group store is touched, so a refused
push never changes what /metrics shows. Accepted samples come out canonical: `run` and `rank` set
from the URL path, histogram series ordered buckets (by `le`, Go-formatted) then `_count`, `_sum`.
"""

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_fd_to_metric_families
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from exporter.ingest.errors import Rejected, clip


@dataclass(frozen=True)
class FamilySpec:
    """One accepted family: its exposed name (counters with `_total`), type and body labels."""

    name: str
    type: str
    labels: tuple[str, ...]
    help: str
    optional: tuple[str, ...] = ()  # body labels a client may leave out (older clients do)


FAMILIES: Mapping[str, FamilySpec] = {
    spec.name: spec
    for spec in (
        FamilySpec("stepscope_step_phase_seconds", "histogram", ("phase",),
                   "Time of one phase of a training step (CUDA event time for GPU phases).", optional=("timing",)),
        FamilySpec("stepscope_step_seconds", "histogram", (), "Time of one whole training step."),
        FamilySpec("stepscope_steps_total", "counter", (), "Training steps completed."),
        FamilySpec("stepscope_samples_total", "counter", (), "Training samples processed."),
        FamilySpec("stepscope_training_info", "gauge", ("local_rank", "world_size", "pid", "framework"),
                   "Identity of a training process; always 1.", optional=("start_time",)),
        FamilySpec("stepscope_training_state", "gauge", ("state",),
                   "State set: 1 for the process's current training state, 0 for the others."),
    )
}
RESERVED_LABELS = ("job", "instance")
NON_EMPTY_LABELS = frozenset({"phase", "state", "pid"})
PHASE_FAMILY = "stepscope_step_phase_seconds"
INFO_FAMILY = "stepscope_training_info"
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")
_PID = re.compile(r"[1-9][0-9]{0,9}")
_START_TIME = re.compile(r"[0-9]{1,12}(\.[0-9]{1,9})?")  # Unix seconds, as psutil's create_time()

Families = dict[str, tuple[Sample, ...]]
"""Exposed family name -> its samples for one group, `run` and `rank` included."""


class _Lines:
    """Feeds the parser line by line and remembers where it was, so errors can name the line."""

    def __init__(self, text: str) -> None:
        self._lines = text.split("\n")
        self.number = 0
        self.line = ""

    def __iter__(self) -> Iterator[str]:
        for number, line in enumerate(self._lines, start=1):
            self.number, self.line = number, line
            yield line


def parse_push(body: bytes, run: str, rank: str, max_label_length: int) -> Families:
    """The body's families, checked and canonical; raises Rejected on the first problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Rejected(400, "malformed", f"body is not UTF-8 text: {exc}") from None
    lines = _Lines(text)
    try:
        parsed = list(text_fd_to_metric_families(lines))  # type: ignore[arg-type]
    except Exception as exc:  # the parser raises ValueError, IndexError, ... with or without a message
        detail = str(exc) or type(exc).__name__
        raise Rejected(
            400, "malformed",
            f"cannot parse the text exposition (format 0.0.4) at line {lines.number} "
            f"{clip(lines.line)!r}: {detail}",
        ) from None
    families: Families = {}
    for family in parsed:
        spec = _spec_for(family.name, family.type)
        if spec is None:
            continue
        if spec.name in families:
            raise Rejected(400, "malformed", f"family {spec.name} appears more than once in the body")
        families[spec.name] = _check_family(spec, family.samples, run, rank, max_label_length)
    return families


def _spec_for(name: str, typ: str) -> FamilySpec | None:
    """The accepted family a parsed one is, None for `_created` companions (dropped), else Rejected."""
    typ = "untyped (no '# TYPE' line)" if typ == "unknown" else typ  # the parser says unknown
    exposed = name + "_total" if typ == "counter" else name
    spec = FAMILIES.get(exposed)
    if spec is not None:
        if spec.type != typ:
            raise Rejected(400, "wrong_type", f"family {spec.name} must be TYPE {spec.type}, got {typ}")
        return spec
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            known = FAMILIES.get(base) or FAMILIES.get(base + "_total")
            if suffix == "_created" and known is not None and known.type in ("counter", "histogram"):
                return None  # prometheus_client's creation timestamps: harmless, not stored
            if known is None or suffix == "_created":
                continue
            raise Rejected(
                400, "wrong_type",
                f"sample {name} needs the line '# TYPE {known.name} {known.type}' before it (got {typ})",
            )
    raise Rejected(
        400, "unknown_family",
        f"unknown family {clip(exposed)!r}: the push API accepts only {', '.join(FAMILIES)}",
    )


def _check_family(
    spec: FamilySpec, samples: list[Sample], run: str, rank: str, max_label_length: int
) -> tuple[Sample, ...]:
    for sample in samples:
        if sample.timestamp is not None:
            raise Rejected(400, "bad_value", f"{_show(sample)}: pushed samples must not carry a timestamp")
        _check_labels(spec, sample, run, rank, max_label_length)
    if spec.type == "histogram":
        return _check_histogram(spec, samples, run, rank)
    checked: list[Sample] = []
    seen: set[tuple[tuple[str, str], ...]] = set()
    for sample in samples:
        value = float(sample.value)
        if spec.type == "counter" and not (math.isfinite(value) and value >= 0):
            raise Rejected(400, "bad_value", f"{_show(sample)}: a counter must be >= 0, got {value}")
        if spec.name == INFO_FAMILY and value != 1:
            raise Rejected(400, "bad_value", f"{_show(sample)}: an info metric must be 1, got {value}")
        if spec.name == "stepscope_training_state" and value not in (0, 1):
            raise Rejected(400, "bad_value", f"{_show(sample)}: state set values must be 0 or 1, got {value}")
        labels = _canonical_labels(spec, sample.labels, run, rank)
        key = tuple(sorted(labels.items()))
        if key in seen:
            raise Rejected(400, "malformed", f"duplicate sample {_show(sample)}")
        seen.add(key)
        checked.append(Sample(sample.name, labels, value))
    return tuple(checked)


def _check_labels(spec: FamilySpec, sample: Sample, run: str, rank: str, max_label_length: int) -> None:
    path = {"run": run, "rank": rank}
    bucket = sample.name.endswith("_bucket")
    for name, value in sample.labels.items():
        if name in RESERVED_LABELS:
            raise Rejected(
                400, "bad_label",
                f"{_show(sample)}: label {name!r} is not accepted in the body (the scraping Prometheus "
                "sets job and instance; run and rank come from the URL path)",
            )
        if name in path:
            if value != path[name]:
                raise Rejected(
                    400, "bad_label",
                    f"{_show(sample)}: label {name}={value!r} differs from {name}={path[name]!r} "
                    "in the URL path",
                )
            continue
        if name not in spec.labels and name not in spec.optional and not (bucket and name == "le"):
            allowed = ", ".join((*spec.labels, *spec.optional)) or "none besides run and rank"
            raise Rejected(
                400, "bad_label", f"{_show(sample)}: unexpected label {name!r} (allowed: {allowed})"
            )
        if len(value) > max_label_length:
            raise Rejected(
                400, "label_too_long",
                f"{spec.name}: value of label {name!r} has {len(value)} characters, over the limit of "
                f"{max_label_length} (--ingest-max-label-value-length): {clip(value)!r}",
            )
    for name in (*spec.labels, *(("le",) if bucket else ())):
        if name not in sample.labels:
            raise Rejected(400, "bad_label", f"{_show(sample)}: missing label {name!r}")
        if name in NON_EMPTY_LABELS and not sample.labels[name]:
            raise Rejected(400, "bad_label", f"{_show(sample)}: label {name!r} must not be empty")
    if spec.name == INFO_FAMILY and not _PID.fullmatch(sample.labels["pid"]):
        raise Rejected(400, "bad_label", f"{_show(sample)}: label 'pid' must be a positive process id")
    if spec.name == INFO_FAMILY and sample.labels.get("start_time") and not _START_TIME.fullmatch(
        sample.labels["start_time"]
    ):
        raise Rejected(
            400, "bad_label",
            f"{_show(sample)}: label 'start_time' must be the process start time in Unix seconds "
            "(a non-negative decimal number like 1712345678.25)",
        )


@dataclass
class _Histogram:
    labels: dict[str, str]
    buckets: dict[float, float] = field(default_factory=dict)
    count: float | None = None
    sum: float | None = None


def _check_histogram(spec: FamilySpec, samples: list[Sample], run: str, rank: str) -> tuple[Sample, ...]:
    series: dict[tuple[tuple[str, str], ...], _Histogram] = {}
    for sample in samples:
        labels = _canonical_labels(spec, sample.labels, run, rank)
        hist = series.setdefault(tuple(sorted(labels.items())), _Histogram(labels))
        value = float(sample.value)
        suffix = sample.name[len(spec.name):]
        if suffix == "_sum":
            if not math.isfinite(value):
                raise Rejected(400, "bad_value", f"{_show(sample)}: _sum must be finite, got {value}")
        elif not (math.isfinite(value) and value >= 0):
            raise Rejected(400, "bad_value", f"{_show(sample)}: counts must be finite and >= 0, got {value}")
        if suffix == "_bucket":
            try:
                bound = float(sample.labels["le"])
            except ValueError:
                raise Rejected(400, "malformed", f"{_show(sample)}: le is not a number") from None
            if math.isnan(bound) or bound in hist.buckets:
                raise Rejected(400, "malformed", f"{_show(sample)}: NaN or duplicate le")
            hist.buckets[bound] = value
        elif (hist.count if suffix == "_count" else hist.sum) is not None:
            raise Rejected(400, "malformed", f"duplicate sample {_show(sample)}")
        elif suffix == "_count":
            hist.count = value
        else:
            hist.sum = value
    checked: list[Sample] = []
    for hist in series.values():
        where = f"{spec.name}{_show_labels(hist.labels)}"
        if math.inf not in hist.buckets:
            raise Rejected(400, "non_cumulative_buckets", f"{where}: no le=\"+Inf\" bucket")
        previous_bound, previous = -math.inf, 0.0
        for bound in sorted(hist.buckets):
            if hist.buckets[bound] < previous:
                raise Rejected(
                    400, "non_cumulative_buckets",
                    f"{where}: buckets are not cumulative: le=\"{floatToGoString(bound)}\" holds "
                    f"{hist.buckets[bound]:g}, less than {previous:g} in "
                    f"le=\"{floatToGoString(previous_bound)}\"",
                )
            previous_bound, previous = bound, hist.buckets[bound]
            le = floatToGoString(bound)
            checked.append(Sample(spec.name + "_bucket", {**hist.labels, "le": le}, previous))
        if hist.count is None or hist.sum is None:
            raise Rejected(400, "malformed", f"{where}: histogram needs both _count and _sum")
        if hist.count != hist.buckets[math.inf]:
            raise Rejected(
                400, "non_cumulative_buckets",
                f"{where}: _count {hist.count:g} differs from {hist.buckets[math.inf]:g} "
                "in the le=\"+Inf\" bucket",
            )
        checked.append(Sample(spec.name + "_count", hist.labels, hist.count))
        checked.append(Sample(spec.name + "_sum", hist.labels, hist.sum))
    return tuple(checked)


def _canonical_labels(spec: FamilySpec, labels: Mapping[str, str], run: str, rank: str) -> dict[str, str]:
    """run and rank from the path, the spec's labels, and optional ones that are set (empty = absent)."""
    optional = {name: labels[name] for name in spec.optional if labels.get(name)}
    return {"run": run, "rank": rank, **{name: labels[name] for name in spec.labels}, **optional}


def _show(sample: Sample) -> str:
    return clip(sample.name + _show_labels(sample.labels), 200)


def _show_labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{clip(v, 60)}"' for k, v in labels.items()) + "}"

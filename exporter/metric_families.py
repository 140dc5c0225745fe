"""Metric families, as collectors build them, and their text exposition (format 0.0.4), byte for byte
what prometheus_client's generate_latest writes.

The exporter used two things of prometheus_client: these family classes and generate_latest. Importing
it brings http.server, wsgiref, urllib.request and email besides: 2.7 MiB of the exporter's RSS (issue
20: no more RSS than nvitop-exporter). The classes keep prometheus_client's interface (`add_metric`,
`samples` of (name, labels, value, timestamp, exemplar, native_histogram)), so collectors read as
before; tests/test_metric_families.py holds the text to generate_latest's for every family type and value
the exporter writes. The training hooks, which run in the user's process, still use prometheus_client.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from stepscope.contract.exposition import escape_label_value


class Sample(NamedTuple):
    name: str
    labels: Mapping[str, str]
    value: float
    timestamp: float | None = None
    exemplar: None = None  # the exporter writes none; kept for prometheus_client's shape
    native_histogram: None = None


class Metric:
    """A family: name (a counter's without `_total`), help, type and samples."""

    def __init__(self, name: str, documentation: str, typ: str) -> None:
        self.name = name
        self.documentation = documentation
        self.type = "unknown" if typ == "untyped" else typ
        self.samples: list[Sample] = []

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Metric) and (self.name, self.documentation, self.type, self.samples) == (
            other.name, other.documentation, other.type, other.samples)

    def __repr__(self) -> str:
        return f"Metric({self.name}, {self.documentation}, {self.type}, {self.samples})"


class _Family(Metric):
    def __init__(self, name: str, documentation: str, typ: str, labels: Sequence[str] | None) -> None:
        super().__init__(name, documentation, typ)
        self._labelnames = tuple(labels or ())

    def _labels(self, values: Sequence[str]) -> dict[str, str]:
        return dict(zip(self._labelnames, values, strict=False))  # as lax as prometheus_client


class GaugeMetricFamily(_Family):
    def __init__(self, name: str, documentation: str, value: float | None = None,
                 labels: Sequence[str] | None = None) -> None:
        super().__init__(name, documentation, "gauge", labels)
        if value is not None:
            self.add_metric([], value)

    def add_metric(self, labels: Sequence[str], value: float, timestamp: float | None = None) -> None:
        self.samples.append(Sample(self.name, self._labels(labels), value, timestamp))


class CounterMetricFamily(_Family):
    def __init__(self, name: str, documentation: str, value: float | None = None,
                 labels: Sequence[str] | None = None) -> None:
        super().__init__(name.removesuffix("_total"), documentation, "counter", labels)
        if value is not None:
            self.add_metric([], value)

    def add_metric(self, labels: Sequence[str], value: float, timestamp: float | None = None) -> None:
        self.samples.append(Sample(self.name + "_total", self._labels(labels), value, timestamp))


class InfoMetricFamily(_Family):
    def __init__(self, name: str, documentation: str, labels: Sequence[str] | None = None) -> None:
        super().__init__(name, documentation, "info", labels)

    def add_metric(self, labels: Sequence[str], value: Mapping[str, str], timestamp: float | None = None) -> None:
        self.samples.append(Sample(self.name + "_info", {**self._labels(labels), **value}, 1, timestamp))


def float_to_go_string(value: float) -> str:
    """A sample value as Go's Prometheus writes it (and prometheus_client's floatToGoString): +Inf, -Inf,
    NaN, and an exponent from 1e+06 up where Python's repr still writes digits."""
    value = float(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


# the OpenMetrics type each becomes in format 0.0.4, and the name suffix it takes
_TEXT_TYPE = {"info": ("gauge", "_info"), "stateset": ("gauge", ""), "gaugehistogram": ("histogram", ""),
              "unknown": ("untyped", ""), "counter": ("counter", "_total")}
OPENMETRICS_SUFFIXES = ("_created", "_gsum", "_gcount")  # written as gauge families of their own, after


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def sample_line(sample: Sample) -> str:
    labels = ",".join(f'{name}="{escape_label_value(value)}"' for name, value in sorted(sample.labels.items()))
    series = f"{sample.name}{{{labels}}}" if labels else sample.name
    timestamp = "" if sample.timestamp is None else f" {int(float(sample.timestamp) * 1000):d}"
    return f"{series} {float_to_go_string(sample.value)}{timestamp}\n"


def render(families: Iterable[Metric]) -> bytes:
    """Text exposition format 0.0.4 of the families (what generate_latest writes for them)."""
    out: list[str] = []
    for family in families:
        text_type, suffix = _TEXT_TYPE.get(family.type, (family.type, ""))
        name = family.name + suffix
        out += [f"# HELP {name} {_escape_help(family.documentation)}\n", f"# TYPE {name} {text_type}\n"]
        apart: dict[str, list[str]] = {}
        for sample in family.samples:
            kept = next((s for s in OPENMETRICS_SUFFIXES if sample.name == family.name + s), None)
            if kept is None:
                out.append(sample_line(sample))
            else:
                apart.setdefault(kept, []).append(sample_line(sample))
        for kept, lines in sorted(apart.items()):
            out += [f"# HELP {family.name}{kept} {_escape_help(family.documentation)}\n",
                    f"# TYPE {family.name}{kept} gauge\n", *lines]
    return "".join(out).encode()

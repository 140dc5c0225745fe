"""exporter.metric_families against prometheus_client, which it replaces in the exporter: the same
families give the same text, byte for byte, for every type and kind of value the exporter writes."""

import math
import random

import prometheus_client.metrics_core as reference
import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.utils import floatToGoString

from stepscope.exporter import metric_families as ours

LABEL_VALUES = ["", "plain", 'quo"te', "back\\slash", "new\nline", "ünï©ødé", "a,b=c{d}"]
HELP_TEXTS = ["Plain help.", "back\\slash and new\nline", "ünï©ødé \"quoted\""]


def values(rng: random.Random) -> list[float]:
    edge = [0.0, -0.0, 1.0, -1.0, 0.5, 1e6, 999999.0, 1234567.0, 1e21, 1e-7, 123456789.123, -1e6, -1234567.0,
            math.inf, -math.inf, math.nan, 2**53, 3.0e-310, 17, True]
    return edge + [rng.uniform(-1e9, 1e9) for _ in range(200)] + [rng.lognormvariate(0, 12) for _ in range(200)]


def text(families: list[object]) -> bytes:
    class Registry:
        def collect(self) -> list[object]:
            return families
    return generate_latest(Registry())  # type: ignore[arg-type]


def test_values_are_written_as_floattogostring_writes_them() -> None:
    for value in values(random.Random(1)):
        assert ours.float_to_go_string(value) == floatToGoString(value), value


@pytest.mark.parametrize("kind", ["gauge", "counter"])
def test_labelled_families_render_as_generate_latest(kind: str) -> None:
    rng = random.Random(kind)
    for documentation in HELP_TEXTS:
        mine = getattr(ours, f"{kind.title()}MetricFamily")(f"stepscope_x_{kind}_total", documentation,
                                                             labels=["gpu", "mode"])
        theirs = getattr(reference, f"{kind.title()}MetricFamily")(f"stepscope_x_{kind}_total", documentation,
                                                                    labels=["gpu", "mode"])
        for value in values(rng)[:60]:
            labels = [rng.choice(LABEL_VALUES), rng.choice(LABEL_VALUES)]
            mine.add_metric(labels, value)
            theirs.add_metric(labels, value)
        assert ours.render([mine]) == text([theirs])
        assert mine.samples == theirs.samples  # what the cached renderer compares cycle to cycle


def test_unlabelled_info_bare_and_timestamped_families_render_as_generate_latest() -> None:
    mine = [ours.GaugeMetricFamily("stepscope_g", "A gauge.", value=3.5),
            ours.CounterMetricFamily("stepscope_c", "A counter.", value=7),
            ours.Metric("stepscope_h_seconds", "A histogram's header.", "histogram"),
            ours.Metric("stepscope_u", "Untyped.", "untyped"),
            ours.Metric("stepscope_s", "A summary's header.", "summary")]
    theirs = [reference.GaugeMetricFamily("stepscope_g", "A gauge.", value=3.5),
              reference.CounterMetricFamily("stepscope_c", "A counter.", value=7),
              reference.Metric("stepscope_h_seconds", "A histogram's header.", "histogram"),
              reference.Metric("stepscope_u", "Untyped.", "untyped"),
              reference.Metric("stepscope_s", "A summary's header.", "summary")]
    info = ours.InfoMetricFamily("stepscope_build", "Build.")
    their_info = reference.InfoMetricFamily("stepscope_build", "Build.")
    info.add_metric([], {"version": "0.1.0", "python": "3.11.7"})
    their_info.add_metric([], {"version": "0.1.0", "python": "3.11.7"})
    stamped, their_stamped = (ours.GaugeMetricFamily("stepscope_t", "Stamped.", labels=["a"]),
                              reference.GaugeMetricFamily("stepscope_t", "Stamped.", labels=["a"]))
    stamped.add_metric(["x"], 1.5, timestamp=1795699686.8076468)
    their_stamped.add_metric(["x"], 1.5, timestamp=1795699686.8076468)
    assert ours.render([*mine, info, stamped]) == text([*theirs, their_info, their_stamped])

"""The collectors' renderer writes changed families from kept line prefixes: the text must stay byte for byte
what prometheus_client's generate_latest writes, cycle after cycle, whatever the values and labels."""

import random

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    StateSetMetricFamily,
)
from prometheus_client.metrics_core import Metric

from stepscope.exporter import exposition
from stepscope.exporter.exposition import CachedRenderer, render

VALUES = (0, 1, -1, 0.5, -0.0, 1e-7, 999_999.9, 1e6, 1_000_001, 123_456_789, 2**53 + 1, 1e21, -1e21,
          float("inf"), float("-inf"), float("nan"), 1.7956664652969725e9, 61 * 2**30, True)
LABEL_VALUES = ("0", "", 'say "hi"', "back\\slash", "new\nline", "ünïcödé", "GPU-00000000-5eed", "a,b=c}")


def families(rng: random.Random, cycle: int) -> list[Metric]:
    """A mix of every family kind the collectors and self metrics publish, values drawn anew each cycle;
    label sets come and go between cycles, and one help text changes."""
    gauge = GaugeMetricFamily("stepscope_test_gauge", "A gauge.\nWith a second line and a \\.", labels=["gpu", "x"])
    for gpu in range(rng.randint(1, 6)):
        gauge.add_metric([str(gpu), rng.choice(LABEL_VALUES)], rng.choice(VALUES))
    counter = CounterMetricFamily("stepscope_test_events", "Events.", labels=["reason"])
    for reason in rng.sample(LABEL_VALUES, 3):
        counter.add_metric([reason], abs(rng.choice(VALUES[:13])))
    created = CounterMetricFamily("stepscope_test_created", "Has a _created sample.", labels=["a"])
    created.add_metric(["1"], rng.random(), created=1_700_000_000.5)
    stamped = GaugeMetricFamily("stepscope_test_stamped", "With a timestamp.")
    stamped.add_metric([], rng.random(), timestamp=1_700_000_000.25)
    info = InfoMetricFamily("stepscope_test_build", "Identity.")
    info.add_metric([], {"version": rng.choice(LABEL_VALUES), "python_version": "3.11.7"})
    states = StateSetMetricFamily("stepscope_test_state", "States.", labels=["run"])
    states.add_metric(["r"], {"setup": cycle % 2 == 0, "train": cycle % 2 == 1})
    histogram = HistogramMetricFamily("stepscope_test_seconds", "A histogram.", labels=["phase"])
    histogram.add_metric(["forward"], [("0.1", cycle), ("+Inf", 2 * cycle)], sum_value=0.3 * cycle)
    help_changes = GaugeMetricFamily("stepscope_test_help", f"Help of cycle {cycle // 3}.", value=cycle)
    unlabelled = GaugeMetricFamily("stepscope_test_plain", "One number.", value=rng.choice(VALUES))
    kept = [gauge, counter, created, stamped, info, states, histogram, help_changes, unlabelled]
    return [family for family in kept if family is not gauge or cycle % 4 != 2]  # a family that leaves


def test_text_is_generate_latests_byte_for_byte_cycle_after_cycle() -> None:
    rng = random.Random(35)
    renderer = CachedRenderer()
    last = None
    for cycle in range(60):
        current = families(rng, cycle)
        body, changed = renderer.render(current)
        assert body == render(current), f"cycle {cycle}"
        assert changed == (body != last)
        last = body


def test_a_changed_value_is_written_without_generate_latest(monkeypatch) -> None:
    """Only a series seen for the first time (or a family the fast path leaves alone) costs a render;
    a new value of a known series shows at the next render from its kept prefix."""
    calls: list[str] = []
    real_render = exposition.render
    monkeypatch.setattr(exposition, "render", lambda fams: (calls.extend(f.name for f in fams), real_render(fams))[1])
    renderer = CachedRenderer()

    def gpu_power(watts: float, gpus: int = 8) -> list[Metric]:
        family = GaugeMetricFamily("stepscope_gpu_power_watts", "Power draw.", labels=["gpu", "uuid"])
        for gpu in range(gpus):
            family.add_metric([str(gpu), f"GPU-{gpu}"], watts + gpu)
        return [family]

    renderer.render(gpu_power(600.0))
    assert calls
    calls.clear()
    body, changed = renderer.render(gpu_power(650.5))
    assert changed and calls == []
    assert b'stepscope_gpu_power_watts{gpu="7",uuid="GPU-7"} 657.5\n' in body
    assert body == real_render(gpu_power(650.5))
    body, _ = renderer.render(gpu_power(650.5, gpus=9))  # a new series: only its prefix is rendered
    assert calls == ["stepscope_gpu_power_watts"]
    assert body == real_render(gpu_power(650.5, gpus=9))

"""Renders the stored groups as one family per name (samples of every group merged) plus self metrics.

Called after a change, never at scrape time: /metrics only concatenates the published bytes.
"""

from collections.abc import Mapping, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter.exposition import render
from exporter.ingest.store import Group
from exporter.ingest.validation import FAMILIES


def render_training(groups: Sequence[Group]) -> bytes:
    families: list[Metric] = []
    for spec in FAMILIES.values():
        samples = [s for group in groups for s in group.families.get(spec.name, ())]
        if not samples:
            continue
        # prometheus_client keeps counter names without `_total` and adds it when rendering
        name = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
        family = Metric(name, spec.help, spec.type)
        family.samples = samples
        families.append(family)
    if groups:
        last_push = GaugeMetricFamily(
            "stepscope_training_last_push_timestamp_seconds",
            "Unix time of the last accepted push of this run and rank (pushes without steps = stalled).",
            labels=["run", "rank"],
        )
        for group in groups:
            last_push.add_metric([group.run, group.rank], group.pushed_at)
        families.append(last_push)
    return render(families)


def render_self(accepted: int, rejected: Mapping[str, int], groups: int) -> bytes:
    accepted_family = CounterMetricFamily(
        "stepscope_exporter_ingest_accepted", "Pushes (PUT, POST, DELETE) the push API accepted."
    )
    accepted_family.add_metric([], accepted)
    rejected_family = CounterMetricFamily(
        "stepscope_exporter_ingest_rejected", "Pushes the push API refused, by reason.", labels=["reason"]
    )
    for reason in sorted(rejected):
        rejected_family.add_metric([reason], rejected[reason])
    groups_family = GaugeMetricFamily(
        "stepscope_exporter_ingest_groups", "Pushed groups (run and rank) currently stored."
    )
    groups_family.add_metric([], groups)
    return render([accepted_family, rejected_family, groups_family])

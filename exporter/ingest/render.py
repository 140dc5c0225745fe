"""Renders the stored groups as one family per name (samples of every group merged) plus self metrics.

Called after a change, never at scrape time: /metrics only concatenates the published bytes. Each
group's sample lines are rendered once when it is pushed; re-rendering after any push then joins
bytes, so its cost grows with the bytes stored, not with groups times series formatting.
"""

from collections.abc import Mapping, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from exporter.exposition import render
from exporter.ingest.store import Group
from exporter.ingest.validation import FAMILIES, Families, FamilySpec


def _family(spec: FamilySpec, samples: Sequence[Sample] = ()) -> Metric:
    # prometheus_client keeps counter names without `_total` and adds it when rendering
    name = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
    family = Metric(name, spec.help, spec.type)
    family.samples = list(samples)
    return family


# "# HELP" and "# TYPE" of every family, rendered by prometheus_client (which escapes the help)
_HEADERS = {name: render([_family(spec)]) for name, spec in FAMILIES.items()}


def render_group_lines(families: Families) -> dict[str, bytes]:
    """The sample lines of one group's families, without the two header lines."""
    return {
        name: render([_family(FAMILIES[name], samples)])[len(_HEADERS[name]):]
        for name, samples in families.items()
    }


def render_training(groups: Sequence[Group]) -> bytes:
    parts: list[bytes] = []
    for name in FAMILIES:
        lines = [group.rendered[name] for group in groups if group.rendered.get(name)]
        if lines:
            parts += [_HEADERS[name], *lines]
    if groups:
        last_push = GaugeMetricFamily(
            "stepscope_training_last_push_timestamp_seconds",
            "Unix time of the last accepted push of this run and rank (pushes without steps = stalled).",
            labels=["run", "rank"],
        )
        for group in groups:
            last_push.add_metric([group.run, group.rank], group.pushed_at)
        parts.append(render([last_push]))
    return b"".join(parts)


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

"""The stored groups as /metrics text: one family per name (samples of every group merged) plus self metrics.

Nothing is formatted at scrape time: each group's lines were rendered and compressed once when it was
pushed, and a family's HELP/TYPE lines once at import, so assembling the training part of a scrape
is a list of chunks in order: header, then every group's chunk of that family.

With pod attribution on (Kubernetes), every line of a group also carries the namespace, pod and container
of the process that pushes it: the group's chunks are relabelled and compressed once per push or change of
its pod, and reused scrape after scrape.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from stepscope.contract import families, family
from stepscope.contract.exposition import escape_label_value
from stepscope.exporter.exposition import Chunk, render
from stepscope.exporter.ingest.families import FAMILIES, LAST_PUSH_FAMILY, FamilySpec
from stepscope.exporter.ingest.store import Group, GroupStore
from stepscope.exporter.metric_families import CounterMetricFamily, GaugeMetricFamily, Metric


def _header(spec: FamilySpec) -> Chunk:
    # prometheus_client keeps counter names without `_total` and adds it when rendering; it escapes the help
    name = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
    return Chunk(render([Metric(name, spec.help, spec.type)]))


_HEADERS = {name: _header(spec) for name, spec in FAMILIES.items()}
_LAST_PUSH_HEADER = Chunk(render([GaugeMetricFamily(LAST_PUSH_FAMILY, family(LAST_PUSH_FAMILY).help)]))


def last_push_line(run: str, rank: str) -> Callable[[float], Chunk]:
    """The group's last-push sample for a push at the given Unix time."""
    prefix = f'{LAST_PUSH_FAMILY}{{rank="{escape_label_value(rank)}",run="{escape_label_value(run)}"}} '
    return lambda pushed_at: Chunk(f"{prefix}{pushed_at!r}\n".encode(), level=1)


def training_chunks(groups: Sequence[Group]) -> list[Chunk]:
    chunks: list[Chunk] = []
    for name, header in _HEADERS.items():
        parts = [group.families[name].chunk for group in groups if name in group.families]
        if parts:
            chunks += [header, *parts]
    if groups:
        chunks += [_LAST_PUSH_HEADER, *(group.last_push for group in groups)]
    return chunks


class RankPods(Protocol):
    """What the ingest side needs of pod attribution (`collectors.pods.PodAttribution`)."""

    def version(self) -> int:
        ...

    def rank(self, run: str, rank: str) -> tuple[str, str, str]:
        ...


def pod_labelled(chunk: Chunk, pod: tuple[str, str, str]) -> Chunk:
    """The chunk's sample lines with namespace, pod and container put first in each label set (every line of
    a group has labels: run and rank at least)."""
    labels = "".join(f'{name}="{escape_label_value(value)}",' for name, value in zip(families.POD, pod, strict=True))
    prefix = ("{" + labels).encode()
    return Chunk(b"".join(line.replace(b"{", prefix, 1) for line in chunk.plain.splitlines(keepends=True)))


class _Relabelled:
    """Each group's chunks with its pod labels, kept while the chunk and the pod stay the same."""

    def __init__(self, pods: RankPods) -> None:
        self._pods = pods
        self._cache: dict[tuple[int, tuple[str, str, str]], tuple[Chunk, Chunk]] = {}  # (id, pod) -> (chunk, new)

    def groups(self, groups: Sequence[Group]) -> list[Group]:
        """The groups with every chunk relabelled; chunks no longer stored leave the cache."""
        cache, self._cache = self._cache, {}
        return [self._group(group, cache) for group in groups]

    def _group(self, group: Group, cache: dict) -> Group:
        pod = self._pods.rank(group.run, group.rank)

        def relabel(chunk: Chunk) -> Chunk:
            key = (id(chunk), pod)
            kept = cache.get(key)
            new = kept[1] if kept is not None and kept[0] is chunk else pod_labelled(chunk, pod)
            self._cache[key] = (chunk, new)
            return new

        stored = {name: replace(f, chunk=relabel(f.chunk)) for name, f in group.families.items()}
        return replace(group, families=stored, last_push=relabel(group.last_push))


class TrainingSource:
    """The ChunkSource of the training families: rebuilt only when the stored groups (or, with pod
    attribution, the ranks' pods) changed."""

    def __init__(self, groups: GroupStore, pods: RankPods | None = None) -> None:
        self._groups = groups
        self._pods = pods
        self._relabelled = _Relabelled(pods) if pods is not None else None

    def version(self) -> object:
        if self._pods is None:
            return self._groups.version()
        return self._groups.version(), self._pods.version()

    def chunks(self) -> Sequence[Chunk]:
        groups = self._groups.snapshot()[1]
        return training_chunks(self._relabelled.groups(groups) if self._relabelled is not None else groups)


class SelfSource:
    """The ingest self metrics, rendered at scrape time when a count changed since the last scrape."""

    def __init__(self, version: Callable[[], object], counts: Callable[[], tuple[int, Mapping[str, int], int]]) -> None:
        self.version = version
        self._counts = counts

    def chunks(self) -> Sequence[Chunk]:
        return [Chunk(render_self(*self._counts()))]


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

"""The pushed groups (one per run and rank): Pushgateway replace/merge semantics, limits and TTL.

The mapping of groups is copy-on-write under one lock (pushes are rare: one per rank every few
seconds), so renderers and the process collector read a consistent snapshot without holding it.
"""

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prometheus_client.samples import Sample

from exporter.ingest.errors import Rejected
from exporter.ingest.validation import INFO_FAMILY, PHASE_FAMILY, Families
from exporter.registered import RegisteredProcess

GroupKey = tuple[str, str]


@dataclass(frozen=True)
class Group:
    run: str
    rank: str
    families: Mapping[str, tuple[Sample, ...]]
    rendered: Mapping[str, bytes]  # per family: its sample lines, so a re-render only joins bytes
    pushed_at: float  # Unix time of the last push, published for "pushes but no steps" alerts
    expires_at: float  # monotonic deadline


@dataclass(frozen=True)
class StoreLimits:
    max_groups: int
    max_series_per_group: int
    max_phases: int
    ttl_seconds: float


class GroupStore:
    def __init__(
        self, limits: StoreLimits, clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._limits = limits
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._groups: Mapping[GroupKey, Group] = MappingProxyType({})
        self._version = 0

    def push(
        self, run: str, rank: str, families: Families, rendered: Mapping[str, bytes], replace: bool
    ) -> Group:
        """PUT (replace=True) replaces the group; POST replaces only the families it carries."""
        limits = self._limits
        with self._lock:
            now = self._clock()
            self._expire_locked(now)
            old = self._groups.get((run, rank))
            if old is None and len(self._groups) >= limits.max_groups:
                raise Rejected(
                    429, "too_many_groups",
                    f"cannot add group run={run!r} rank={rank}: {len(self._groups)} groups are stored, the "
                    f"limit (--ingest-max-groups {limits.max_groups}); a group expires "
                    f"{limits.ttl_seconds:g}s after its last push (--ingest-ttl) or on DELETE",
                )
            if replace or old is None:
                merged, merged_rendered = dict(families), dict(rendered)
            else:
                merged, merged_rendered = {**old.families, **families}, {**old.rendered, **rendered}
            phases = sorted({s.labels["phase"] for s in merged.get(PHASE_FAMILY, ())})
            if len(phases) > limits.max_phases:
                shown = ", ".join(phases[:8]) + (", ..." if len(phases) > 8 else "")
                raise Rejected(
                    400, "too_many_phases",
                    f"group run={run!r} rank={rank} would hold {len(phases)} distinct phases, over the limit "
                    f"of {limits.max_phases} (--ingest-max-phases): {shown}",
                )
            series = sum(len(samples) for samples in merged.values())
            if series > limits.max_series_per_group:
                raise Rejected(
                    400, "too_many_series",
                    f"group run={run!r} rank={rank} would hold {series} series, over the limit of "
                    f"{limits.max_series_per_group} (--ingest-max-series-per-group)",
                )
            group = Group(run, rank, MappingProxyType(merged), MappingProxyType(merged_rendered),
                          self._wall_clock(), now + limits.ttl_seconds)
            self._replace_locked({**self._groups, (run, rank): group})
            return group

    def delete(self, run: str, rank: str) -> bool:
        with self._lock:
            if (run, rank) not in self._groups:
                return False
            self._replace_locked({k: g for k, g in self._groups.items() if k != (run, rank)})
            return True

    def expire(self) -> bool:
        """Drops groups past their TTL; True when any went."""
        with self._lock:
            return self._expire_locked(self._clock())

    def snapshot(self) -> tuple[int, tuple[Group, ...]]:
        """(version, live groups ordered by run then numeric rank); the version grows on every change."""
        with self._lock:
            version, groups = self._version, self._groups
        now = self._clock()
        live = (g for g in groups.values() if g.expires_at > now)
        return version, tuple(sorted(live, key=lambda g: (g.run, int(g.rank))))

    def registered_processes(self) -> list[RegisteredProcess]:
        """The `pid` and `start_time` labels of live groups' stepscope_training_info, by run and rank.

        A list, not a mapping by pid: processes in different pid namespaces may report the same pid.
        """
        processes: list[RegisteredProcess] = []
        for group in self.snapshot()[1]:
            for sample in group.families.get(INFO_FAMILY, ()):
                start_time = sample.labels.get("start_time")
                processes.append(RegisteredProcess(int(sample.labels["pid"]), group.run, group.rank,
                                                   float(start_time) if start_time else None))
        return processes

    def next_expiry(self) -> float | None:
        """Monotonic time at which the next group expires, None when there are none."""
        with self._lock:
            return min((g.expires_at for g in self._groups.values()), default=None)

    def _expire_locked(self, now: float) -> bool:
        live = {k: g for k, g in self._groups.items() if g.expires_at > now}
        if len(live) == len(self._groups):
            return False
        self._replace_locked(live)
        return True

    def _replace_locked(self, groups: dict[GroupKey, Group]) -> None:
        self._groups = MappingProxyType(groups)
        self._version += 1

"""The pushed groups (one per run and rank): Pushgateway replace/merge semantics, limits, TTL and owner.

A group keeps, per family, only its canonical sample lines as a Chunk (text plus its deflate blocks)
and the series keys the limits and the process collector need: no sample objects. The mapping of
groups is copy-on-write under one lock, so renderers and the process collector read a consistent
snapshot without holding it.

A group belongs to one process at a time, the one named by the `pid`, `start_time` and `pid_namespace` of its
stepscope_training_info: two processes pushing one run and rank (two users' `train.py`, both
defaulting to run "train") would otherwise replace each other's counters at every push, and every
rate, share and alert of the group would be garbage. Another process's push is refused (409
run_conflict) while the owner is live; it takes the group over once the owner closed (its last state
was idle), stopped pushing for `hold_seconds` (crashed, killed, restarted by torchrun), or its group
expired or was deleted.
"""

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from types import MappingProxyType

from stepscope.contract import THRESHOLDS, TRAINING_PHASE_ENTERED, TRAINING_STATE
from stepscope.contract.training import IDLE_STATE
from stepscope.exporter.exposition import Chunk
from stepscope.exporter.ingest import LOST_GIVES_WAY_SECONDS
from stepscope.exporter.ingest.errors import Rejected
from stepscope.exporter.ingest.families import FAMILIES, INFO_FAMILY, PHASE_FAMILY
from stepscope.exporter.ingest.parser import SeriesKey
from stepscope.exporter.registered import RegisteredProcess

GroupKey = tuple[str, str]
_INFO_PID = FAMILIES[INFO_FAMILY].body_labels.index("pid")
_INFO_START_TIME = FAMILIES[INFO_FAMILY].body_labels.index("start_time")
_INFO_PID_NAMESPACE = FAMILIES[INFO_FAMILY].body_labels.index("pid_namespace")

INTERVALS_KEPT = 8  # a group's push interval is the median of its last intervals: a final push right after
                    # a periodic one (what close() does) must not read as the rank's pace
# How long an owner that stopped pushing keeps its group from another process: a few of its push intervals,
# so a slow push is not taken for a dead process, and a rank restarted after a crash (torchrun, a requeued
# job: a new pid) is taken over well before StepscopeRankLost would call it lost.
HOLD_INTERVALS = 2.5
HOLD_MIN_SECONDS = 3.0  # a push that a busy node or a GIL-bound training thread delays by a second or two
HOLD_UNKNOWN_SECONDS = 12.5  # one push so far: 2.5 x the hooks' default interval (5 s)
HOLD_MAX_SECONDS = THRESHOLDS["rank_lost_seconds"].value * 2 / 3  # 30 s: under the 45 s of StepscopeRankLost


@dataclass(frozen=True, slots=True, order=True)
class Owner:
    """The process that pushes a group: its stepscope_training_info's pid, start_time and pid_namespace ("" when
    not sent). Two pods' ranks are both pid 1 and may start in one clock tick: without the namespace, the second
    pod's pushes to the same run and rank replaced the first's group at each push (steps 40, 3, 41)."""

    pid: str
    start_time: str
    pid_namespace: str = ""

    def is_same_process(self, other: "Owner") -> bool:
        """Whether `other` names this process: a namespace on one side only does not tell them apart. Hooks newer
        than an older exporter push without theirs, and with it again once that exporter is upgraded under them:
        the same process was refused (409) as another one for its hold, 10 s of its pushes lost."""
        namespaces = {self.pid_namespace, other.pid_namespace} - {""}
        return (self.pid, self.start_time) == (other.pid, other.start_time) and len(namespaces) <= 1

    def describe(self) -> str:
        namespace = f", pid namespace {self.pid_namespace}" if self.pid_namespace else ""
        if not self.start_time:
            return f"pid {self.pid}{namespace}"
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(self.start_time)))
        return f"pid {self.pid}, started {started}{namespace}"


@dataclass(frozen=True, slots=True)
class StoredFamily:
    chunk: Chunk  # canonical sample lines, compressed once at push time
    series: int
    keys: tuple[SeriesKey, ...]


@dataclass(frozen=True, slots=True)
class Group:
    run: str
    rank: str
    families: Mapping[str, StoredFamily]
    last_push: Chunk  # the group's stepscope_training_last_push_timestamp_seconds line
    pushed_at: float  # Unix time of the last push, published for "pushes but no steps" alerts
    expires_at: float  # monotonic deadline
    series: int
    owner: Owner | None  # the process that pushes it; None: no stepscope_training_info stored (a Pushgateway client)
    state: str | None  # the training state its families hold (None: none, "": none of them is 1)
    pushed_clock: float  # the store clock's time of the last push
    intervals: tuple[float, ...]  # between its last pushes, oldest first, at most INTERVALS_KEPT

    def push_interval(self) -> float | None:
        """The median of the last intervals between pushes; None after a single push.

        Computed here rather than with `statistics`, which with fractions and decimal is 0.6 MiB of the
        exporter's RSS."""
        if not self.intervals:
            return None
        ordered = sorted(self.intervals)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    def hold_seconds(self) -> float:
        """How long after its last push the owner keeps the group from another process."""
        interval = self.push_interval()
        if interval is None:
            return HOLD_UNKNOWN_SECONDS
        return min(max(HOLD_INTERVALS * interval, HOLD_MIN_SECONDS), HOLD_MAX_SECONDS)


@dataclass(frozen=True)
class StoreLimits:
    max_groups: int
    max_series_per_group: int
    max_phases: int
    ttl_seconds: float
    max_series: int = 150_000  # over all groups: what bounds the exporter's memory


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
        self._series = 0
        self._version = 0
        self._dropped = 0

    def push(
        self, run: str, rank: str, families: Mapping[str, StoredFamily], last_push: Callable[[float], Chunk],
        replace: bool,
    ) -> Group:
        """PUT (replace=True) replaces the group; POST replaces only the families it carries. Either is
        refused (409) while another process holds the group.

        `last_push` renders the group's last-push line for the push's Unix time.
        """
        limits = self._limits
        with self._lock:
            now = self._clock()
            self._expire_locked(now)
            old = self._groups.get((run, rank))
            owner = _owner(families)
            if old is not None and owner is not None:
                self._check_owner(old, owner, now)
            merged = _in_no_phase_once_closed(
                dict(families) if replace or _starts_afresh(old, owner) else {**old.families, **families})
            self._check_phases(run, rank, merged)
            series = sum(family.series for family in merged.values())
            if series > limits.max_series_per_group:
                raise Rejected(
                    400, "too_many_series",
                    f"group run={run!r} rank={rank} would hold {series} series, over the limit of "
                    f"{limits.max_series_per_group} (--ingest-max-series-per-group)",
                )
            kept = self._room_for(run, rank, old, series, now)
            pushed_at = self._wall_clock()
            group = Group(run, rank, MappingProxyType(merged), last_push(pushed_at), pushed_at,
                          now + limits.ttl_seconds, series, _owner(merged), current_state(merged), now,
                          _intervals(old, now))
            self._dropped += len(self._groups) - len(kept)
            self._replace_locked({**kept, (run, rank): group})
            return group

    def delete(self, run: str, rank: str) -> bool:
        with self._lock:
            if (run, rank) not in self._groups:
                return False
            self._replace_locked({k: g for k, g in self._groups.items() if k != (run, rank)})
            self._dropped += 1
            return True

    def expire(self) -> bool:
        """Drops groups past their TTL; True when any went."""
        with self._lock:
            return self._expire_locked(self._clock())

    def dropped(self) -> int:
        """How many groups have gone (expired or deleted) since start. A push expires groups as well as the expiry
        thread: what their ranks reported beside them (profile status, wanted bounds) is forgotten when this grows,
        whichever of the two dropped them."""
        return self._dropped

    def version(self) -> int:
        """Grows on every change of the stored groups."""
        return self._version

    def snapshot(self) -> tuple[int, tuple[Group, ...]]:
        """(version, live groups ordered by run then numeric rank)."""
        with self._lock:
            version, groups = self._version, self._groups
        now = self._clock()
        live = (g for g in groups.values() if g.expires_at > now)
        return version, tuple(sorted(live, key=lambda g: (g.run, int(g.rank))))

    def registered_processes(self) -> list[RegisteredProcess]:
        """The `pid`, `start_time` and `pid_namespace` of live groups' stepscope_training_info, by run and rank.

        A list, not a mapping by pid: processes in different pid namespaces may report the same pid, and
        one process may sit in several groups (one run closed, the next opened); each entry carries its
        group's last push time so the process collector can tell which run the process works for now.
        """
        processes: list[RegisteredProcess] = []
        for group in self.snapshot()[1]:
            info = group.families.get(INFO_FAMILY)
            for key in info.keys if info else ():
                start_time, namespace = key[_INFO_START_TIME], key[_INFO_PID_NAMESPACE]
                processes.append(RegisteredProcess(int(key[_INFO_PID]), group.run, group.rank,
                                                   float(start_time) if start_time else None, group.pushed_at,
                                                   int(namespace) if namespace else None))
        return processes

    def next_expiry(self) -> float:
        """The earliest (store clock) time a group can expire: the first stored group's deadline, or one TTL
        from now with none stored. Every group has the same TTL, so no push can bring that time closer."""
        with self._lock:
            return min((g.expires_at for g in self._groups.values()), default=self._clock() + self._limits.ttl_seconds)

    def _room_for(self, run: str, rank: str, old: Group | None, series: int, now: float) -> dict[GroupKey, Group]:
        """The stored groups, less those that must give way for this push to fit --ingest-max-groups and
        --ingest-max-series (closed ones first, then lost ones, each the earliest pushed first); 429 when the live
        ones leave no room.

        A closed group is kept until its TTL only to show how its run ended: a node running a sweep of short
        trials filled its 512 slots with closed runs within the TTL, and a training rank was then refused (429)
        until one expired, its series lost meanwhile. A lost group (no push for LOST_GIVES_WAY_SECONDS, not closed)
        is kept for the same reason once StepscopeRankLost has paged it: a sweep of trials killed at their first
        step held every slot for the whole TTL. A live group never gives way."""
        limits = self._limits
        kept = dict(self._groups)
        total = self._series - (old.series if old else 0) + series

        def over() -> bool:
            return (old is None and len(kept) >= limits.max_groups) or total > limits.max_series

        if over():  # only then: a push within the limits (nearly every one) sorts nothing
            for gone in _giving_way(kept.values(), (run, rank), now):
                if not over():
                    break
                del kept[(gone.run, gone.rank)]
                total -= gone.series
        ends = (f"none of a rank that closed or that has not pushed for {LOST_GIVES_WAY_SECONDS:g}s (those give way); "
                f"a group expires {limits.ttl_seconds:g}s after its last push (--ingest-ttl) or on DELETE")
        if old is None and len(kept) >= limits.max_groups:
            raise Rejected(
                429, "too_many_groups",
                f"cannot add group run={run!r} rank={rank}: {len(kept)} groups are stored, the limit "
                f"(--ingest-max-groups {limits.max_groups}), {ends}",
            )
        if total > limits.max_series:
            raise Rejected(
                429, "too_many_series",
                f"storing group run={run!r} rank={rank} would make {total} series on this exporter, over "
                f"the limit of {limits.max_series} (--ingest-max-series), {ends}",
            )
        return kept

    @staticmethod
    def _check_owner(old: Group, pusher: Owner, now: float) -> None:
        """Refuses a push of another process while the group's owner is live: pushing, and not closed."""
        if old.owner is None or old.owner.is_same_process(pusher) or old.state == IDLE_STATE:
            return
        hold, since = old.hold_seconds(), now - old.pushed_clock
        if since >= hold:
            return
        raise Rejected(
            409, "run_conflict",
            f"run {old.run!r} rank {old.rank} is pushed by another process on this node ({old.owner.describe()}, "
            f"last push {since:.1f}s ago): two processes cannot share a run and rank; give each its own run "
            "(STEPSCOPE_RUN or init(run=...); the default is the script's name). This process's pushes are "
            f"taken once the other one closes or stops pushing for {hold:.1f}s",
            subject=f"{old.run}\0{old.rank}\0{pusher.pid}\0{pusher.start_time}\0{pusher.pid_namespace}",
        )

    def _check_phases(self, run: str, rank: str, merged: Mapping[str, StoredFamily]) -> None:
        phase_family = merged.get(PHASE_FAMILY)
        phases = sorted({key[0] for key in phase_family.keys}) if phase_family else []
        if len(phases) > self._limits.max_phases:
            shown = ", ".join(phases[:8]) + (", ..." if len(phases) > 8 else "")
            raise Rejected(
                400, "too_many_phases",
                f"group run={run!r} rank={rank} would hold {len(phases)} distinct phases, over the limit "
                f"of {self._limits.max_phases} (--ingest-max-phases): {shown}",
            )

    def _expire_locked(self, now: float) -> bool:
        live = {k: g for k, g in self._groups.items() if g.expires_at > now}
        if len(live) == len(self._groups):
            return False
        self._dropped += len(self._groups) - len(live)
        self._replace_locked(live)
        return True

    def _replace_locked(self, groups: dict[GroupKey, Group]) -> None:
        self._groups = MappingProxyType(groups)
        self._series = sum(group.series for group in groups.values())
        self._version += 1


def current_state(families: Mapping[str, StoredFamily]) -> str | None:
    """The state whose stepscope_training_state sample is 1 ("" for none); None when `families` hold no
    state (a POST may leave it out: the last one stands)."""
    family = families.get(TRAINING_STATE)
    if family is None:
        return None
    for key, line in zip(family.keys, family.chunk.plain.splitlines(), strict=True):  # one line per key, in order
        if float(line.rsplit(b" ", 1)[1]) == 1:
            return key[0]
    return ""


def _in_no_phase_once_closed(families: dict[str, StoredFamily]) -> dict[str, StoredFamily]:
    """`families` less the phase the rank entered where its state is idle: a closed rank is in no phase. Hooks from
    before 2026-11-27 pushed the dataloader_next their loader's last next() entered with their final idle state, and
    the Training dashboard's "Where each rank is" read the finished rank as waiting on its loader, longer at each
    refresh, for the group's whole --ingest-ttl."""
    if TRAINING_PHASE_ENTERED in families and current_state(families) == IDLE_STATE:
        del families[TRAINING_PHASE_ENTERED]
    return families


def _giving_way(groups: Iterable[Group], pushed: GroupKey, now: float) -> list[Group]:
    """The groups that may give way to `pushed`, in order: the closed ones, then the lost ones (silent for
    LOST_GIVES_WAY_SECONDS without closing), each the earliest pushed first."""
    closed, lost = [], []
    for group in groups:
        if (group.run, group.rank) == pushed:
            continue
        if group.state == IDLE_STATE:
            closed.append(group)
        elif now - group.pushed_clock >= LOST_GIVES_WAY_SECONDS:
            lost.append(group)
    by_push = attrgetter("pushed_clock")
    return sorted(closed, key=by_push) + sorted(lost, key=by_push)


def _owner(families: Mapping[str, StoredFamily]) -> Owner | None:
    """The process named by the families' stepscope_training_info; None without one (no identity)."""
    info = families.get(INFO_FAMILY)
    keys = info.keys if info else ()
    return min((Owner(key[_INFO_PID], key[_INFO_START_TIME], key[_INFO_PID_NAMESPACE]) for key in keys), default=None)


def _starts_afresh(old: Group | None, pusher: Owner | None) -> bool:
    """Whether a push replaces the whole group even as a POST: there is none yet, or another process takes it
    over. A POST merges into its own process's families; merged into the previous owner's, it kept that process's
    families it does not push (tokens, loader limits, a profiler trace, seconds per state) under the new one."""
    return old is None or (pusher is not None and old.owner is not None and not old.owner.is_same_process(pusher))


def _intervals(old: Group | None, now: float) -> tuple[float, ...]:
    """The group's intervals with this push's. Kept across a takeover: the group's pace is its run's (a
    restarted rank pushes as often as before), and a newcomer that started afresh would be held only
    HOLD_UNKNOWN_SECONDS, so two clashing processes that push less often than that would take the group
    from each other at every push."""
    if old is None:
        return ()
    return (*old.intervals, now - old.pushed_clock)[-INTERVALS_KEPT:]

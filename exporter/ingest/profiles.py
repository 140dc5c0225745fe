"""Profile requests: which rank should take a PyTorch profiler trace, and what came of it.

The exporter never connects to a training process. A request waits here until the rank's next push,
whose answer carries it (`Stepscope-Profile-Request`); every push of current hooks reports the rank's
tracing state and its last outcome (`Stepscope-Profile`, see stepscope.hooks.profiling), which moves
the request from pending to running to done or failed. Both sides repeat themselves on every push, so
a lost push or answer only delays things. Refused at once, with the reason: a rank that is not
pushing here, one whose hooks cannot take traces (no torch, a stock Pushgateway client), and a second
request for a rank that is taking one, and one for a rank whose last push said it is idle (what the
hooks push when training ends: no step would ever take it). A running request is cancelled the same way
(`Stepscope-Profile-Cancel` on the rank's push answers until it reports the end) where the rank's hooks
understand that (protocol version 2); older hooks' traces run their steps.
"""

import json
import shlex
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stepscope.contract import json_text
from stepscope.contract.training import IDLE_STATE
from stepscope.exporter.ingest.errors import clip
from stepscope.exporter.ingest.store import Group, GroupKey, GroupStore

STATUS_HEADER = "Stepscope-Profile"  # stepscope.hooks.profiling.STATUS_HEADER
REQUEST_HEADER = "Stepscope-Profile-Request"  # stepscope.hooks.profiling.REQUEST_HEADER
CANCEL_HEADER = "Stepscope-Profile-Cancel"  # stepscope.hooks.profiling.CANCEL_HEADER
CANCEL_VERSION = 2  # the hooks' protocol version (`v`) from which they take CANCEL_HEADER
MAX_STEPS = 1000  # stepscope.hooks.profiling.MAX_TRACE_STEPS
PENDING_TIMEOUT_SECONDS = 600.0  # a request no push took within this long fails
KEEP_FINISHED = 256  # finished requests kept for stepscope-profile to read, the oldest dropped first
ACTIVE = ("pending", "running")
MAX_REASON = 300  # characters of a rank's reason kept


class ProfileError(Exception):
    """A request the exporter refuses: an HTTP status and a message that says what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class RankStatus:
    """A rank's `Stepscope-Profile` header as of its last push."""

    state: str  # ready, running, unavailable
    reason: str
    running_id: str
    done_steps: int
    last: Mapping[str, Any]  # the outcome of its last request ({} before the first)
    version: int = 1  # the hooks' protocol version: 1 for hooks that did not say


def parse_status(raw: str) -> RankStatus | None:
    """The header's content; None when it is not what current hooks send (treated as no header)."""
    try:
        data = json_text.loads(raw)
    except ValueError:  # a header of nested brackets is not what hooks send either
        return None
    if not isinstance(data, dict) or data.get("state") not in ("ready", "running", "unavailable"):
        return None
    done, version = data.get("done_steps"), data.get("v")
    return RankStatus(
        state=data["state"], reason=_one_line(data.get("reason")), running_id=str(data.get("id") or ""),
        done_steps=done if _count(done) else 0, last=_outcome(data.get("last")),
        version=version if _count(version) else 1,
    )


def _outcome(last: object) -> Mapping[str, Any]:
    """The last request's outcome with the types the registry relies on; {} when it is anything else."""
    if not isinstance(last, dict) or not isinstance(last.get("id"), str) or not isinstance(last.get("ok"), bool):
        return {}
    if last["ok"] and not (isinstance(last.get("path"), str) and _count(last.get("size"))
                           and _count(last.get("steps"))):
        return {}
    return {"id": last["id"], "ok": last["ok"], "path": last.get("path", ""), "size": last.get("size", 0),
            "steps": last.get("steps", 0), "reason": _one_line(last.get("reason")),
            "cancelled": last.get("cancelled") is True and not last["ok"]}


def _one_line(reason: object) -> str:
    """A rank's reason as stepscope-profile and the listing show it: one line of at most MAX_REASON characters.
    Reasons quote exceptions, and torch's span lines (C++ frames under "Exception raised from"): stepscope-profile,
    which ends with one line saying why, printed each of them, and a terminal acted on any escape in them."""
    words = "".join(char if char.isprintable() else " " for char in str(reason or "")).split()
    return clip(" ".join(words), MAX_REASON)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class ProfileRequest:
    """One request; mutated only under the registry's lock."""

    id: str
    run: str
    rank: str
    steps: int
    requested_at: float  # Unix time
    state: str = "pending"  # pending, running, done, failed, cancelled
    reason: str = ""
    started_at: float | None = None  # when a push showed the rank took it
    finished_at: float | None = None
    done_steps: int = 0
    path: str = ""
    size: int = 0
    trace_steps: int = 0
    cancelling: bool = False  # running, and the rank is told to stop it at its next step

    def answer_headers(self) -> dict[str, str]:
        """What the rank's push answers carry while this request is active."""
        if self.cancelling:
            return {CANCEL_HEADER: self.id}
        if self.state == "pending":
            return {REQUEST_HEADER: json.dumps({"id": self.id, "steps": self.steps}, separators=(",", ":"))}
        return {}

    def as_json(self, last_push_age: float | None, push_interval: float | None = None,
                training_state: str | None = None) -> dict[str, Any]:
        """`last_push_age_seconds` and `push_interval_seconds` (the median of the rank's last intervals)
        let a waiting client tell a rank that pushes rarely from one that stopped; `training_state` is
        what the rank's last push said it does (train, idle, ...; None when it did not say)."""
        return {
            "id": self.id, "run": self.run, "rank": self.rank, "steps": self.steps, "state": self.state,
            "reason": self.reason, "requested_at": self.requested_at, "started_at": self.started_at,
            "finished_at": self.finished_at, "done_steps": self.done_steps, "path": self.path, "bytes": self.size,
            "trace_steps": self.trace_steps, "cancelling": self.cancelling,
            "last_push_age_seconds": None if last_push_age is None else round(last_push_age, 3),
            "push_interval_seconds": None if push_interval is None else round(push_interval, 3),
            "training_state": training_state,
        }


class ProfileRequests:
    """Open and finished requests, and what each rank's last push said about tracing."""

    def __init__(self, groups: GroupStore, clock: Callable[[], float] = time.time,
                 pending_timeout: float = PENDING_TIMEOUT_SECONDS, keep_finished: int = KEEP_FINISHED) -> None:
        self._groups = groups
        self._clock = clock
        self._pending_timeout = pending_timeout
        self._keep_finished = keep_finished
        self._lock = threading.Lock()
        self._status: dict[GroupKey, RankStatus | None] = {}  # None: pushes without the header
        self._states: dict[GroupKey, str] = {}  # the training state the rank's last push reported
        self._active: dict[GroupKey, ProfileRequest] = {}
        self._finished: OrderedDict[str, ProfileRequest] = OrderedDict()

    def create(self, run: str, ranks: Sequence[str] | None, steps: int) -> list[ProfileRequest]:
        """New pending requests for `ranks` of `run` (None: every rank pushing here); all or none.

        Raises ProfileError: 400 bad steps, 404 not pushing here, 409 already tracing, 422 cannot trace.
        """
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_STEPS:
            raise ProfileError(400, f"steps must be an integer from 1 to {MAX_STEPS}, got {steps!r}")
        live = self._live_groups()
        here = {rank: group.pushed_at for (group_run, rank), group in live.items() if group_run == run}
        targets = sorted(here, key=int) if ranks is None else list(dict.fromkeys(ranks))
        missing = [rank for rank in targets if rank not in here]
        if missing or not here:
            raise ProfileError(404, _not_pushing(run, missing, here, sorted({r for r, _ in live})))
        with self._lock:
            self._expire_locked(live)
            problems = [problem for rank in targets if (problem := self._refusal_locked(run, rank, here[rank]))]
            if problems:
                raise ProfileError(problems[0][0], "; ".join(message for _, message in problems))
            now = self._clock()
            import secrets  # here: secrets loads hashlib (0.74 MiB of RSS), needed once a trace is asked for

            created = [ProfileRequest(secrets.token_hex(8), run, rank, steps, now) for rank in targets]
            for request in created:
                self._active[(run, request.rank)] = request
            return created

    def on_push(self, run: str, rank: str, header: str | None, training_state: str | None = None) -> dict[str, str]:
        """Records what an accepted push said (`training_state`: None when it carried no state); the headers
        to answer it with: the request that waits, or the cancellation of the one the rank is taking."""
        status = parse_status(header) if header else None
        with self._lock:
            self._status[(run, rank)] = status
            if training_state is not None:
                self._states[(run, rank)] = training_state
            request = self._active.get((run, rank))
            if request is None:
                return self._cancelled_but_running_locked(status)
            self._follow_locked(request, status)
            return request.answer_headers() if request.state in ACTIVE else {}

    def get(self, request_id: str) -> dict[str, Any]:
        here = self._live_groups()
        with self._lock:
            self._expire_locked(here)
            return self._json_locked(here, self._find_locked(request_id))

    def cancel(self, request_id: str) -> dict[str, Any]:
        """Cancels a request: a pending one at once; a running one at the rank's next step, the next push
        answer telling it (`cancelling` until the rank reports it ended), where its hooks can (409 otherwise)."""
        here = self._live_groups()
        with self._lock:
            self._expire_locked(here)
            request = self._find_locked(request_id)
            if request.state == "running":
                status = self._status.get((request.run, request.rank))
                if status is None or status.version < CANCEL_VERSION:
                    raise ProfileError(409, f"request {request_id} is running on rank {request.rank}, whose hooks "
                                            "are older than this exporter and cannot stop a trace: it ends by itself "
                                            f"after {request.steps} steps")
                request.cancelling = True
            if request.state == "pending":
                self._end_locked(request, "cancelled", "cancelled before the rank took it")
            return self._json_locked(here, request)

    def listing(self, run: str | None) -> dict[str, Any]:
        """Requests and the tracing state of every rank pushing here (of `run`, when given)."""
        here = self._live_groups()
        with self._lock:
            self._expire_locked(here)
            requests = [r for r in (*self._active.values(), *self._finished.values()) if run in (None, r.run)]
            ranks = [
                {"run": key[0], "rank": key[1], "tracing": _describe(self._status.get(key)),
                 "last_push_age_seconds": round(self._clock() - group.pushed_at, 3)}
                for key, group in sorted(here.items(), key=lambda item: (item[0][0], int(item[0][1])))
                if run in (None, key[0])
            ]
            return {"requests": [self._json_locked(here, r) for r in requests], "ranks": ranks}

    def forget_except(self, live: Iterable[GroupKey]) -> None:
        """Drops what ranks whose groups are gone reported (called when groups expire or are deleted)."""
        keep = set(live)
        with self._lock:
            for key in [key for key in self._status if key not in keep]:
                del self._status[key]
                self._states.pop(key, None)

    # -- under the lock ---------------------------------------------------------------------------

    def _refusal_locked(self, run: str, rank: str, pushed_at: float) -> tuple[int, str] | None:
        active = self._active.get((run, rank))
        status = self._status.get((run, rank))
        if active is not None:
            return 409, (f"rank {rank} of run {run!r} is already taking a trace (request {active.id}, "
                         f"{active.state}, {active.steps} steps): one trace at a time per rank; wait for it")
        if self._states.get((run, rank)) == IDLE_STATE:
            ago = self._clock() - pushed_at
            return 409, (f"rank {rank} of run {run!r} is idle (its last push, {ago:.1f} s ago, said so: its training "
                         "ended or has not started): a trace records training steps; ask while it trains")
        if status is None:
            return 422, (f"rank {rank} of run {run!r} pushes without the {STATUS_HEADER} header, so its hooks "
                         "cannot take traces (a Pushgateway client, or stepscope hooks older than this exporter)")
        if status.state == "unavailable":
            return 422, f"profiler not available on rank {rank} of run {run!r}: {status.reason}"
        if status.state == "running":
            return 409, (f"rank {rank} of run {run!r} is already taking a trace (request {status.running_id}): one "
                         "trace at a time per rank; wait for it")
        return None

    def _cancelled_but_running_locked(self, status: RankStatus | None) -> dict[str, str]:
        """The cancellation of a trace the rank runs for a request cancelled here while pending: the answer
        that carried it to the rank had gone out before the DELETE came."""
        if status is None or status.state != "running" or status.version < CANCEL_VERSION:
            return {}
        ended = self._finished.get(status.running_id)
        return {CANCEL_HEADER: ended.id} if ended is not None and ended.state == "cancelled" else {}

    def _follow_locked(self, request: ProfileRequest, status: RankStatus | None) -> None:
        """Moves a request along with what its rank's latest push said."""
        if status is None:
            return
        last = status.last
        if last.get("id") == request.id:
            if last["cancelled"]:
                request.done_steps = last["steps"]
                self._end_locked(request, "cancelled", last["reason"] or "cancelled while the rank traced")
            elif last["ok"]:
                request.path, request.size, request.trace_steps = last["path"], last["size"], last["steps"]
                self._end_locked(request, "done", last["reason"])
            else:
                self._end_locked(request, "failed", last["reason"] or "the rank gave no reason")
        elif status.state == "running" and status.running_id == request.id:
            request.state = "running"
            request.started_at = request.started_at or self._clock()
            request.done_steps = status.done_steps
        elif request.state == "running":
            self._end_locked(request, "failed", f"rank {request.rank} no longer reports request {request.id}: its "
                                                "process restarted or its hooks were closed")

    def _expire_locked(self, here: Mapping[GroupKey, Group]) -> None:
        now = self._clock()
        for key, request in list(self._active.items()):
            if key not in here:
                self._end_locked(request, "failed", f"rank {request.rank} of run {request.run!r} stopped pushing "
                                                    "(its group expired or was deleted)")
            elif request.state == "pending" and now - request.requested_at > self._pending_timeout:
                self._end_locked(request, "failed", f"no push of rank {request.rank} took the request within "
                                                    f"{self._pending_timeout:g} s")

    def _end_locked(self, request: ProfileRequest, state: str, reason: str) -> None:
        request.state, request.reason, request.finished_at = state, reason, self._clock()
        self._active.pop((request.run, request.rank), None)
        self._finished[request.id] = request
        while len(self._finished) > self._keep_finished:
            self._finished.popitem(last=False)

    def _find_locked(self, request_id: str) -> ProfileRequest:
        for request in self._active.values():
            if request.id == request_id:
                return request
        found = self._finished.get(request_id)
        if found is None:
            raise ProfileError(404, f"no profile request {clip(request_id, 40)!r} here: finished requests are kept "
                                    f"for the last {self._keep_finished}, and an exporter restart forgets them")
        return found

    # -- groups -----------------------------------------------------------------------------------

    def _live_groups(self) -> dict[GroupKey, Group]:
        """(run, rank) -> its group (last push time, push interval), for every live group."""
        return {(group.run, group.rank): group for group in self._groups.snapshot()[1]}

    def _json_locked(self, here: Mapping[GroupKey, Group], request: ProfileRequest) -> dict[str, Any]:
        key = (request.run, request.rank)
        group = here.get(key)
        return request.as_json(None if group is None else self._clock() - group.pushed_at,
                               None if group is None else group.push_interval(), self._states.get(key))


def _describe(status: RankStatus | None) -> str:
    if status is None:
        return "cannot take traces (no Stepscope-Profile header on its pushes)"
    if status.state == "unavailable":
        return f"unavailable: {status.reason}"
    return status.state


def _not_pushing(run: str, missing: Sequence[str], here: Mapping[str, float], runs: Sequence[str]) -> str:
    if not here:
        # each as a shell writes it for --run: a trailing space, a comma in a name, were read as other runs
        listed = ", ".join(shlex.quote(clip(r, 40)) for r in runs[:10])
        others = f" (runs pushing here: {listed})" if runs else " (no run is)"
        return (f"run {run!r} has no rank pushing to this exporter{others}: a rank pushes to the exporter on its own "
                "node (STEPSCOPE_PUSH_URL)")
    ranks = ", ".join(sorted(here, key=int)[:20])
    noun = "rank" if len(missing) == 1 else "ranks"
    return (f"{noun} {', '.join(missing)} of run {run!r} not pushing to this exporter (ranks here: {ranks}); a rank "
            "pushes to the exporter on its own node")

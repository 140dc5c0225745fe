"""The Pushgateway API subset: access check, path routing, then validate-and-swap into the store.

Order matters: a client that may not push learns nothing about paths or bodies and sends no body
byte the exporter reads (`check` runs on the request head alone), and a body is checked completely
before the store changes, so a refused push leaves /metrics as it was.
"""

import base64
import binascii
import logging
import os
import re
import threading
import time
from urllib.parse import unquote

from stepscope.contract.families import EXPORTER_INSTANCE_HEADER
from stepscope.contract.training import RUN_NAME_RULE, is_run_name
from stepscope.exporter.exposition import Chunk, ExpositionStore
from stepscope.exporter.ingest.access import AccessPolicy
from stepscope.exporter.ingest.errors import REASONS, Rejected, clip
from stepscope.exporter.ingest.node_bounds import BOUNDS_HEADER, NodeBounds, parse_wanted
from stepscope.exporter.ingest.parser import PushLimits, parse_push
from stepscope.exporter.ingest.profiles import STATUS_HEADER, ProfileRequests
from stepscope.exporter.ingest.render import RankPods, SelfSource, TrainingSource, last_push_line
from stepscope.exporter.ingest.store import GroupStore, StoredFamily, current_state
from stepscope.exporter.registered import RegisteredProcess
from stepscope.exporter.server import PushRequest, PushResponse

log = logging.getLogger(__name__)

TRAINING_SOURCE = "training"
SELF_SOURCE = "ingest"
PATH_FORMAT = "/metrics/job/stepscope/run/<run>/rank/<rank>"
_RANK = re.compile(r"0|[1-9][0-9]{0,8}")
LOGGED_KEPT = 1024  # refusals (reason, subject) remembered as logged: bounds the memory a stream of new subjects takes


def parse_group_path(path: str, max_label_length: int) -> tuple[str, str]:
    """(run, rank) from PATH_FORMAT; any value may be base64url-encoded as `name@base64/<b64>`."""
    raw = path.split("?", 1)[0]
    segments = raw.removeprefix("/metrics/").removesuffix("/").split("/")
    if not raw.startswith("/metrics/") or len(segments) != 6:
        raise Rejected(404, "bad_path", f"no push endpoint at {clip(raw)!r}: push to {PATH_FORMAT}")
    labels: dict[str, str] = {}
    for name, value in zip(segments[::2], segments[1::2], strict=True):
        name, value = _percent_decoded(name), _percent_decoded(value)
        if name.endswith("@base64"):
            name = name.removesuffix("@base64")
            value = _b64decode(name, value)
        if name in labels:
            raise Rejected(400, "bad_path", f"label {name!r} appears twice; push to {PATH_FORMAT}")
        labels[name] = value
    if list(labels) != ["job", "run", "rank"] and list(labels) != ["job", "rank", "run"]:
        raise Rejected(404, "bad_path", f"no push endpoint at {clip(raw)!r}: push to {PATH_FORMAT}")
    if labels["job"] != "stepscope":
        raise Rejected(
            404, "bad_path", f"job {clip(labels['job'])!r} is not served here: push to {PATH_FORMAT}"
        )
    run, rank = labels["run"], labels["rank"]
    if not _RANK.fullmatch(rank):
        raise Rejected(400, "bad_path", f"rank {clip(rank)!r} in the path is not a non-negative integer "
                                        "(at most 9 digits, no leading zero)")
    if not is_run_name(run):
        raise Rejected(400, "bad_path", f"run {clip(run)!r} in the path must be {RUN_NAME_RULE}")
    if len(run) > max_label_length:
        raise Rejected(
            400, "label_too_long",
            f"run in the path has {len(run)} characters, over the limit of {max_label_length} "
            f"(--ingest-max-label-value-length): {clip(run)!r}",
        )
    return run, rank


def _percent_decoded(segment: str) -> str:
    """A path segment's text; percent-escapes that do not spell UTF-8 are refused, as the Pushgateway does,
    rather than stored as U+FFFD (a run name other than the one the client meant, and equal to others)."""
    try:
        return unquote(segment, errors="strict")
    except UnicodeDecodeError:
        raise Rejected(400, "bad_path", f"path segment {clip(segment)!r} is not percent-encoded UTF-8") from None


def _b64decode(name: str, value: str) -> str:
    try:
        padded = value.rstrip("=") + "=" * (-len(value.rstrip("=")) % 4)
        return base64.b64decode(padded, altchars=b"-_", validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise Rejected(
            400, "bad_path", f"value of {name}@base64 is not base64url-encoded UTF-8: {clip(value)!r}"
        ) from None


def _too_large(length: int, limit: int) -> Rejected:
    return Rejected(
        413, "body_too_large",
        f"body of {length} bytes exceeds the limit of {limit} bytes (--ingest-max-body-bytes)",
    )


class PushApi:
    """Implements exporter.server.PushHandler; serves the training families and self metrics."""

    def __init__(
        self, store: ExpositionStore, groups: GroupStore, access: AccessPolicy, *,
        max_body_bytes: int, limits: PushLimits, profiles: ProfileRequests | None = None,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self._groups = groups
        self.profiles = profiles if profiles is not None else ProfileRequests(groups)
        self._bounds = NodeBounds()
        # EXPORTER_INSTANCE_HEADER: another after a restart, so hooks re-offer. os.urandom, not secrets: secrets
        # loads hashlib (through hmac), which the exporter loads only where a token, password or trace needs it.
        self._instance = os.urandom(8).hex()
        self._forgotten_drops = 0  # the store's dropped() when what gone ranks reported was last forgotten
        self._access = access
        self._limits = limits
        self._stats_lock = threading.Lock()
        self._accepted = 0
        self._rejected = dict.fromkeys(REASONS, 0)
        self._logged: dict[tuple[str, str], None] = {}  # (reason, subject) already warned of, oldest first
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = store
        store.attach(TRAINING_SOURCE, TrainingSource(groups))
        store.attach(SELF_SOURCE, SelfSource(self._stats_version, self._counts))

    def check(self, request: PushRequest) -> PushResponse | None:
        """Everything decided from the request line and headers, before one body byte is read."""
        try:
            response = self._check(request)
        except Rejected as rejected:
            return self._refuse(rejected, request)
        if response is not None:
            self._count_accepted()
        return response

    def handle(self, request: PushRequest, body: bytes) -> PushResponse:
        """Parses and stores a body `check` admitted."""
        try:
            run, rank = parse_group_path(request.path, self._limits.max_label_length)
            if len(body) > self.max_body_bytes:
                raise _too_large(len(body), self.max_body_bytes)
            parsed = parse_push(body, run, rank, self._limits)
            wanted = parse_wanted(request.headers.get(BOUNDS_HEADER.lower()), self._limits.max_phases + 1,
                                  self._limits.max_label_length)
            if not any(family.series for family in parsed.values()):  # a PUT of it would wipe the rank's series
                raise Rejected(400, "empty_body", f"the {request.method} holds no samples; nothing stored: send the "
                                                  "rank's families in the text format (DELETE removes a group)")
            families = {name: StoredFamily(Chunk(f.lines), f.series, f.keys) for name, f in parsed.items()}
            group = self._groups.push(run, rank, families, last_push_line(run, rank),
                                      replace=request.method == "PUT")
        except Rejected as rejected:
            return self._refuse(rejected, request)
        self._count_accepted()
        self._forget_gone()
        answer = self.profiles.on_push(run, rank, request.headers.get(STATUS_HEADER.lower()), current_state(families))
        answer = {**answer, **self._bounds.on_push(run, rank, wanted), EXPORTER_INSTANCE_HEADER: self._instance}
        return PushResponse(200, f"stored group run={run!r} rank={rank}: {group.series} series",
                            headers=answer)

    def refuse(self, request: PushRequest, status: int, reason: str, message: str) -> PushResponse:
        """Counts and logs a refusal the HTTP layer decided (too many bodies in flight, a body cut short)."""
        return self._refuse(Rejected(status, reason, message), request)

    def label_pods(self, pods: RankPods) -> None:
        """Pod attribution (Kubernetes): every pushed series carries its process's namespace, pod and container."""
        self._store.attach(TRAINING_SOURCE, TrainingSource(self._groups, pods))

    def registered_processes(self) -> list[RegisteredProcess]:
        """The training processes whose groups are live, as their hooks reported them."""
        return self._groups.registered_processes()

    def start(self) -> None:
        """Starts the thread that drops groups when their TTL runs out."""
        self._thread = threading.Thread(target=self._expire_loop, name="ingest-expiry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _check(self, request: PushRequest) -> PushResponse | None:
        self._access.check(request.client_ip, request.headers.get("authorization"))
        method = request.method
        if method not in ("PUT", "POST", "DELETE"):
            raise Rejected(405, "bad_method", f"method {clip(method)} is not supported: use PUT, POST or DELETE")
        run, rank = parse_group_path(request.path, self._limits.max_label_length)
        if method == "DELETE":
            existed = self._groups.delete(run, rank)
            self._forget_gone()
            return PushResponse(202, f"deleted group run={run!r} rank={rank}" if existed
                                else f"no group run={run!r} rank={rank}; nothing deleted")
        headers = request.headers
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raise Rejected(411, "length_required", "send the body with a Content-Length header "
                                                   "(chunked transfer encoding is not supported)")
        if not request.length:  # PUT would replace the rank's series with nothing: a client's mistake, not a delete
            raise Rejected(400, "empty_body", f"the {method} has an empty body; nothing stored: send the rank's "
                                              "families in the text format (DELETE removes a group)")
        if request.length > self.max_body_bytes:
            raise _too_large(request.length, self.max_body_bytes)
        if "protobuf" in headers.get("content-type", ""):
            raise Rejected(415, "unsupported_media_type", "only the text exposition format 0.0.4 is accepted")
        encoding = headers.get("content-encoding", "identity")
        if encoding.lower() != "identity":
            raise Rejected(415, "unsupported_media_type",
                           f"Content-Encoding {clip(encoding)!r} is not supported: send the body uncompressed")
        return None

    def _count_accepted(self) -> None:
        with self._stats_lock:
            self._accepted += 1

    def _refuse(self, rejected: Rejected, request: PushRequest) -> PushResponse:
        with self._stats_lock:
            self._rejected[rejected.reason] += 1
            first = self._first_of(rejected)
        # The first refusal per reason (and subject) is a warning; repeats (a client pushing every few
        # seconds) go to debug, and the counter keeps the tally.
        log.log(logging.WARNING if first else logging.DEBUG, "refused %s %s from %s (%d %s): %s",
                clip(request.method), clip(request.path), request.client_ip, rejected.status, rejected.reason,
                rejected.message)
        return PushResponse(rejected.status, rejected.message)

    def _first_of(self, rejected: Rejected) -> bool:
        """Whether the refusal's reason and subject are new to the log; the oldest of LOGGED_KEPT is forgotten."""
        key = (rejected.reason, rejected.subject)
        if key in self._logged:
            return False
        self._logged[key] = None
        if len(self._logged) > LOGGED_KEPT:
            del self._logged[next(iter(self._logged))]
        return True

    def _stats_version(self) -> object:
        return self._accepted, sum(self._rejected.values()), self._groups.version()

    def _counts(self) -> tuple[int, dict[str, int], int]:
        with self._stats_lock:
            accepted, rejected = self._accepted, dict(self._rejected)
        return accepted, rejected, len(self._groups.snapshot()[1])

    def _expire_loop(self) -> None:
        """Sleeps until a group can expire (a TTL while none is stored), not a second at a time: each wake-up
        of an idle exporter is a thread switch, which a VM pays for."""
        while True:
            delay = max(0.0, self._groups.next_expiry() - time.monotonic()) + 0.01
            if self._stop.wait(delay):
                return
            self._groups.expire()
            self._forget_gone()

    def _forget_gone(self) -> None:
        """Drops what ranks whose groups expired or were deleted reported (profiles, wanted bounds), once any went.

        Called after every push too: a push expires the groups past their TTL, and on a busy node pushes dropped
        nearly all of them before the expiry thread woke, which then found none to drop and forgot nothing. A
        killed rank's wanted bounds then counted in its run's answer for good (10 of 10 runs on a node pushing
        steadily), and every run's gone ranks stayed in memory."""
        dropped = self._groups.dropped()
        if dropped == self._forgotten_drops:
            return
        self._forgotten_drops = dropped
        live = [(group.run, group.rank) for group in self._groups.snapshot()[1]]
        self.profiles.forget_except(live)
        self._bounds.forget_except(live)

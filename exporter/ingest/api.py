"""The Pushgateway API subset: access check, path routing, then validate-and-swap into the store.

Order matters: a client that may not push learns nothing about paths or bodies, and a body is
checked completely before the store changes, so a refused push leaves /metrics as it was.
"""

import base64
import binascii
import logging
import re
import threading
import time
from urllib.parse import unquote

from exporter.exposition import ExpositionStore
from exporter.ingest.access import AccessPolicy
from exporter.ingest.errors import REASONS, Rejected, clip
from exporter.ingest.render import render_group_lines, render_self, render_training
from exporter.ingest.store import GroupStore
from exporter.ingest.validation import parse_push
from exporter.registered import RegisteredProcess
from exporter.server import PushResponse

log = logging.getLogger(__name__)

TRAINING_SOURCE = "training"
SELF_SOURCE = "ingest"
PATH_FORMAT = "/metrics/job/stepscope/run/<run>/rank/<rank>"
_RANK = re.compile(r"0|[1-9][0-9]{0,8}")


def parse_group_path(path: str, max_label_length: int) -> tuple[str, str]:
    """(run, rank) from PATH_FORMAT; any value may be base64url-encoded as `name@base64/<b64>`."""
    raw = path.split("?", 1)[0]
    segments = raw.removeprefix("/metrics/").removesuffix("/").split("/")
    if not raw.startswith("/metrics/") or len(segments) != 6:
        raise Rejected(404, "bad_path", f"no push endpoint at {clip(raw)!r}: push to {PATH_FORMAT}")
    labels: dict[str, str] = {}
    for name, value in zip(segments[::2], segments[1::2], strict=True):
        name, value = unquote(name), unquote(value)
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
        raise Rejected(400, "bad_path", f"rank {clip(rank)!r} in the path is not a non-negative integer")
    if not run or not run.isprintable():
        raise Rejected(400, "bad_path", f"run {clip(run)!r} in the path must be non-empty printable text")
    if len(run) > max_label_length:
        raise Rejected(
            400, "label_too_long",
            f"run in the path has {len(run)} characters, over the limit of {max_label_length} "
            f"(--ingest-max-label-value-length): {clip(run)!r}",
        )
    return run, rank


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
    """Implements exporter.server.PushHandler; publishes the training families and self metrics."""

    def __init__(
        self, store: ExpositionStore, groups: GroupStore, access: AccessPolicy, *,
        max_body_bytes: int, max_label_length: int,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self._store = store
        self._groups = groups
        self._access = access
        self._max_label_length = max_label_length
        self._stats_lock = threading.Lock()
        self._accepted = 0
        self._rejected = dict.fromkeys(REASONS, 0)
        self._logged_reasons: set[str] = set()
        self._publish_lock = threading.Lock()
        self._published_version = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._publish()

    def handle(
        self, method: str, path: str, headers: dict[str, str], body: bytes, client_ip: str
    ) -> PushResponse:
        try:
            response = self._handle(method, path, headers, body, client_ip)
        except Rejected as rejected:
            return self._refuse(rejected, method, path, client_ip)
        with self._stats_lock:
            self._accepted += 1
        self._publish()
        return response

    def reject_oversized(self, method: str, path: str, length: int, client_ip: str) -> PushResponse:
        """The 413 for the HTTP layer, which refuses a too-large Content-Length without reading the body."""
        return self._refuse(_too_large(length, self.max_body_bytes), method, path, client_ip)

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

    def _handle(
        self, method: str, path: str, headers: dict[str, str], body: bytes, client_ip: str
    ) -> PushResponse:
        self._access.check(client_ip, headers.get("authorization"))
        if method not in ("PUT", "POST", "DELETE"):
            raise Rejected(405, "bad_method", f"method {method} is not supported: use PUT, POST or DELETE")
        run, rank = parse_group_path(path, self._max_label_length)
        if method == "DELETE":
            existed = self._groups.delete(run, rank)
            return PushResponse(202, f"deleted group run={run!r} rank={rank}" if existed
                                else f"no group run={run!r} rank={rank}; nothing deleted")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            # the HTTP layer reads Content-Length bytes only: a chunked body would arrive empty and
            # a PUT would wipe the group
            raise Rejected(411, "length_required", "send the body with a Content-Length header "
                                                   "(chunked transfer encoding is not supported)")
        if len(body) > self.max_body_bytes:
            raise _too_large(len(body), self.max_body_bytes)
        if "protobuf" in headers.get("content-type", ""):
            raise Rejected(415, "unsupported_media_type", "only the text exposition format 0.0.4 is accepted")
        encoding = headers.get("content-encoding", "identity")
        if encoding.lower() != "identity":
            raise Rejected(415, "unsupported_media_type",
                           f"Content-Encoding {encoding!r} is not supported: send the body uncompressed")
        families = parse_push(body, run, rank, self._max_label_length)
        rendered = render_group_lines(families)  # outside the store's lock
        group = self._groups.push(run, rank, families, rendered, replace=method == "PUT")
        series = sum(len(samples) for samples in group.families.values())
        return PushResponse(200, f"stored group run={run!r} rank={rank}: {series} series")

    def _refuse(self, rejected: Rejected, method: str, path: str, client_ip: str) -> PushResponse:
        with self._stats_lock:
            self._rejected[rejected.reason] += 1
            first = rejected.reason not in self._logged_reasons
            self._logged_reasons.add(rejected.reason)
        # The first refusal per reason is a warning; repeats (a client pushing every few seconds) go
        # to debug, and the counter keeps the tally.
        log.log(logging.WARNING if first else logging.DEBUG, "refused %s %s from %s (%d %s): %s",
                method, clip(path), client_ip, rejected.status, rejected.reason, rejected.message)
        self._publish()
        return PushResponse(rejected.status, rejected.message)

    def _publish(self) -> None:
        """Renders the current state; a caller that finds its change already published skips the work."""
        with self._publish_lock:
            version, groups = self._groups.snapshot()
            if version != self._published_version:
                self._store.publish(TRAINING_SOURCE, render_training(groups))
                self._published_version = version
            with self._stats_lock:
                accepted, rejected = self._accepted, dict(self._rejected)
            self._store.publish(SELF_SOURCE, render_self(accepted, rejected, len(groups)))

    def _expire_loop(self) -> None:
        while True:
            next_expiry = self._groups.next_expiry()
            delay = 1.0 if next_expiry is None else max(0.0, next_expiry - time.monotonic()) + 0.01
            if self._stop.wait(min(delay, 1.0)):
                return
            if self._groups.expire():
                self._publish()

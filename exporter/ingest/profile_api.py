"""The profile-request API: what `stepscope-profile` talks to, behind the push API's access rules.

    POST   /api/v1/profiles        {"run": "r", "ranks": [0, 1] | "all", "steps": 20}  -> 201 {"requests": [...]}
    GET    /api/v1/profiles[?run=r]                 requests and each rank's tracing state
    GET    /api/v1/profiles/<id>                    one request: pending, running, done (path, bytes,
                                                    trace_steps) or failed/cancelled (reason)
    DELETE /api/v1/profiles/<id>                    cancels a request: at once where no rank took it; a
                                                    running one at the rank's next step (`cancelling` until
                                                    its push says so), where its hooks can (409 otherwise)

Answers are JSON; refusals are `{"error": "<what to do>"}` with 400 (bad request), 401/403 (the push
API's token and allow-list: loopback only without them), 404 (no such run, rank or request), 405,
409 (the rank is taking a trace, or its hooks cannot stop the running one), 411/413 (body without length,
or over 4 KiB), 422 (the rank cannot take traces: no torch, or hooks that do not speak the protocol).
"""

import json
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, unquote

from stepscope.contract import json_text
from stepscope.exporter.ingest import PROFILE_PREFIX
from stepscope.exporter.ingest.access import AccessPolicy
from stepscope.exporter.ingest.errors import Rejected, clip
from stepscope.exporter.ingest.profiles import ProfileError, ProfileRequests
from stepscope.exporter.server import PushRequest, PushResponse

log = logging.getLogger(__name__)

PREFIX = PROFILE_PREFIX
MAX_BODY_BYTES = 4096
JSON = "application/json"
DEFAULT_STEPS = 20


def _answer(status: int, payload: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> PushResponse:
    return PushResponse(status, json.dumps(payload, indent=1), headers=dict(headers or {}), content_type=JSON)


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> PushResponse:
    return _answer(status, {"error": message}, headers)


class ProfileApi:
    """Implements exporter.server.PushHandler for PREFIX."""

    def __init__(self, requests: ProfileRequests, access: AccessPolicy) -> None:
        self._requests = requests
        self._access = access

    def check(self, request: PushRequest) -> PushResponse | None:
        """Everything but a POST's body; None when the body is to be read and handed to `handle`."""
        try:
            self._access.check(request.client_ip, request.headers.get("authorization"))
        except Rejected as rejected:
            return _error(rejected.status, rejected.message)
        path, _, query = request.path.partition("?")
        method = request.method
        try:
            if path == PREFIX:
                if method == "POST":
                    return self._admit_body(request)
                if method in ("GET", "HEAD"):
                    runs = parse_qs(query).get("run")
                    return _answer(200, self._requests.listing(runs[0] if runs else None))
                return _error(405, f"method {clip(method)} is not allowed on {PREFIX}: use POST or GET",
                              {"Allow": "GET, HEAD, POST"})
            request_id = unquote(path[len(PREFIX) + 1:])
            if not request_id or "/" in request_id:
                return _error(404, f"no such endpoint {clip(path)!r}: use {PREFIX} or {PREFIX}/<id>")
            if method in ("GET", "HEAD"):
                return _answer(200, self._requests.get(request_id))
            if method == "DELETE":
                return _answer(200, self._requests.cancel(request_id))
            return _error(405, f"method {clip(method)} is not allowed on {PREFIX}/<id>: use GET or DELETE",
                          {"Allow": "GET, HEAD, DELETE"})
        except ProfileError as refused:
            return _error(refused.status, refused.message)

    def handle(self, request: PushRequest, body: bytes) -> PushResponse:
        """Creates the requests a POST body asks for."""
        try:
            run, ranks, steps = _parse_body(body)
            created = self._requests.create(run, ranks, steps)
        except ProfileError as refused:
            log.info("profile request from %s refused (%d): %s", request.client_ip, refused.status, refused.message)
            return _error(refused.status, refused.message)
        log.info("profile requests from %s: run %r ranks %s, %d steps (%s)", request.client_ip, run,
                 ", ".join(r.rank for r in created), steps, ", ".join(r.id for r in created))
        return _answer(201, {"requests": [r.as_json(None) for r in created]})

    def refuse(self, request: PushRequest, status: int, reason: str, message: str) -> PushResponse:
        return _error(status, message)

    @staticmethod
    def _admit_body(request: PushRequest) -> PushResponse | None:
        if "chunked" in request.headers.get("transfer-encoding", "").lower() or request.length is None:
            return _error(411, "send the JSON body with a Content-Length header")
        if request.length > MAX_BODY_BYTES:
            return _error(413, f"body of {request.length} bytes is over the limit of {MAX_BODY_BYTES}")
        return None


def _parse_body(body: bytes) -> tuple[str, list[str] | None, int]:
    """(run, ranks as strings or None for all, steps) of a POST body; ProfileError 400 otherwise."""
    usage = 'send {"run": "<run>", "ranks": [0, 1] or "all", "steps": 20}'
    try:
        data = json_text.loads(body)
    except ValueError:
        raise ProfileError(400, f"the body is not JSON: {usage}") from None
    if not isinstance(data, dict):
        raise ProfileError(400, f"the body is not a JSON object: {usage}")
    unknown = sorted(set(data) - {"run", "ranks", "steps"})
    if unknown:
        raise ProfileError(400, f"unknown field {clip(unknown[0], 40)!r}: {usage}")
    run, ranks, steps = data.get("run"), data.get("ranks", [0]), data.get("steps", DEFAULT_STEPS)
    if not isinstance(run, str) or not run:
        raise ProfileError(400, f"run must be a non-empty string: {usage}")
    if ranks == "all":
        return run, None, steps
    if (not isinstance(ranks, list) or not ranks
            or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)):
        raise ProfileError(400, f"ranks must be a non-empty list of ranks (integers >= 0) or \"all\": {usage}")
    return run, [str(rank) for rank in ranks], steps

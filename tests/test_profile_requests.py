"""The exporter's side of profile requests in-process: the registry on a fake clock (refusals, the
states a rank's pushes move a request through, expiry, cancelling) and the HTTP API's checks."""

import json

import pytest

from stepscope.contract import EXPORTER_INSTANCE_HEADER
from stepscope.exporter.exposition import ExpositionStore
from stepscope.exporter.ingest.access import AccessPolicy
from stepscope.exporter.ingest.api import PushApi
from stepscope.exporter.ingest.parser import PushLimits
from stepscope.exporter.ingest.profile_api import ProfileApi
from stepscope.exporter.ingest.profiles import CANCEL_HEADER, REQUEST_HEADER, ProfileError, ProfileRequests
from stepscope.exporter.ingest.render import last_push_line
from stepscope.exporter.ingest.store import GroupStore, StoreLimits
from stepscope.exporter.ingest.tokens import IngestTokens
from stepscope.exporter.server import PushRequest
from stepscope_testkit.ingest_bodies import full_body

READY = json.dumps({"v": 1, "state": "ready"})


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def groups(clock: Clock) -> GroupStore:
    limits = StoreLimits(max_groups=16, max_series_per_group=100, max_phases=4, ttl_seconds=60)
    return GroupStore(limits, clock=clock, wall_clock=clock)


def push_answer(groups: GroupStore, registry: ProfileRequests, rank: str, header: str | None,
                run: str = "r") -> dict[str, str]:
    """The headers the exporter answers a push of rank `rank` with."""
    groups.push(run, rank, {}, last_push_line(run, rank), replace=True)
    return registry.on_push(run, rank, header)


def push(groups: GroupStore, registry: ProfileRequests, rank: str, header: str | None, run: str = "r") -> str | None:
    """The request header the exporter answers a push with (None: none)."""
    answer = push_answer(groups, registry, rank, header, run)
    assert CANCEL_HEADER not in answer, answer
    return answer.get(REQUEST_HEADER)


def running(request_id: str, done: int = 0, version: int = 1) -> str:
    return json.dumps({"v": version, "state": "running", "id": request_id, "steps": 5, "done_steps": done})


def ready_after(request_id: str, ok: bool, **outcome: object) -> str:
    return json.dumps({"v": 1, "state": "ready", "last": {"id": request_id, "ok": ok, **outcome}})


def refusal(call, *args) -> ProfileError:  # type: ignore[no-untyped-def]
    with pytest.raises(ProfileError) as info:
        call(*args)
    return info.value


def test_a_request_moves_with_the_ranks_pushes(groups: GroupStore, clock: Clock) -> None:
    registry = ProfileRequests(groups, clock=clock)
    assert push(groups, registry, "0", READY) is None
    [request] = registry.create("r", ["0"], 5)
    assert registry.get(request.id)["state"] == "pending"
    answer = push(groups, registry, "0", READY)  # the answer carries the request until the rank takes it
    assert answer is not None and json.loads(answer) == {"id": request.id, "steps": 5}
    assert push(groups, registry, "0", READY) == answer  # a lost answer is repeated
    clock.now += 1
    assert push(groups, registry, "0", running(request.id, done=2)) is None
    state = registry.get(request.id)
    assert (state["state"], state["done_steps"], state["started_at"]) == ("running", 2, clock.now)
    push(groups, registry, "0", ready_after(request.id, True, path="/t/a.pt.trace.json.gz", size=123, steps=5))
    state = registry.get(request.id)
    assert (state["state"], state["path"], state["bytes"], state["trace_steps"]) == \
        ("done", "/t/a.pt.trace.json.gz", 123, 5)
    [request] = registry.create("r", ["0"], 5)  # the rank is free again
    push(groups, registry, "0", ready_after(request.id, False, reason="torch.profiler could not start: x"))
    assert registry.get(request.id)["reason"] == "torch.profiler could not start: x"


def test_a_rank_s_reason_is_kept_as_one_line(groups: GroupStore, clock: Clock) -> None:
    """torch's exceptions span lines (its C++ frames): a reason quoting one made stepscope-profile's one-line end
    three lines, and an escape in it reached the terminal."""
    registry = ProfileRequests(groups, clock=clock)
    push(groups, registry, "0", READY)
    [request] = registry.create("r", ["0"], 5)
    reason = "torch.profiler could not start: boom\nException raised from start at kineto.cpp:42\n\x1b[31mframe #0"
    push(groups, registry, "0", ready_after(request.id, False, reason=reason))
    assert registry.get(request.id)["reason"] == ("torch.profiler could not start: boom Exception raised from start "
                                                  "at kineto.cpp:42 [31mframe #0")
    push(groups, registry, "0", json.dumps({"v": 1, "state": "unavailable", "reason": "no\r\ntorch"}))
    assert registry.listing("r")["ranks"][0]["tracing"] == "unavailable: no torch"


def test_a_refusal_lists_the_runs_here_as_a_shell_writes_them(groups: GroupStore, clock: Clock) -> None:
    """Before: `(runs pushing here: exp1 , lr=1e-3, bs=64)`: the trailing space that made --run exp1 miss was
    invisible, and one run read as two."""
    registry = ProfileRequests(groups, clock=clock)
    for run in ("exp1 ", "lr=1e-3, bs=64", "train"):
        push(groups, registry, "0", READY, run=run)
    error = refusal(registry.create, "exp1", None, 5)
    assert error.status == 404 and "(runs pushing here: 'exp1 ', 'lr=1e-3, bs=64', train)" in error.message


def test_refusals_name_the_reason_and_create_nothing(groups: GroupStore, clock: Clock) -> None:
    registry = ProfileRequests(groups, clock=clock)
    assert refusal(registry.create, "r", ["0"], 5).status == 404
    push(groups, registry, "0", READY)
    push(groups, registry, "1", json.dumps({"v": 1, "state": "unavailable", "reason": "torch is not imported"}))
    push(groups, registry, "2", None)  # a client without the header
    push(groups, registry, "3", "{not json")
    push(groups, registry, "4", running("from-before-a-restart"))
    push(groups, registry, "0", READY, run="other")
    error = refusal(registry.create, "r", ["7"], 5)
    assert error.status == 404 and "rank 7 of run 'r' not pushing to this exporter (ranks here: 0, 1, 2, 3, 4)" in \
        error.message
    error = refusal(registry.create, "nope", None, 5)
    assert error.status == 404 and "(runs pushing here: other, r)" in error.message
    for steps in (0, 1001, "5", True):
        assert refusal(registry.create, "r", ["0"], steps).status == 400
    error = refusal(registry.create, "r", None, 5)  # all ranks: rank 0 could, the others cannot
    assert error.status == 422
    assert "profiler not available on rank 1 of run 'r': torch is not imported" in error.message
    assert error.message.count("pushes without the Stepscope-Profile header") == 2  # ranks 2 and 3
    assert "rank 4 of run 'r' is already taking a trace (request from-before-a-restart)" in error.message
    assert registry.listing("r")["requests"] == []  # all or none
    [request] = registry.create("r", ["0"], 5)
    error = refusal(registry.create, "r", ["0"], 5)
    assert error.status == 409 and f"(request {request.id}, pending, 5 steps)" in error.message


def test_requests_fail_when_the_rank_stops_pushing_or_forgets_them(groups: GroupStore, clock: Clock) -> None:
    registry = ProfileRequests(groups, clock=clock, pending_timeout=30)
    for rank in "012":
        push(groups, registry, rank, READY)
    first, second, third = registry.create("r", None, 5)
    push(groups, registry, "1", running(second.id))
    push(groups, registry, "1", READY)  # restarted: no longer knows the request
    assert "no longer reports request" in registry.get(second.id)["reason"]
    clock.now += 31
    push(groups, registry, "2", running(third.id))  # taken: no longer pending
    assert registry.get(first.id)["reason"] == "no push of rank 0 took the request within 30 s"
    clock.now += 61  # rank 2's group expires (ttl 60 s)
    groups.expire()
    assert registry.get(third.id)["reason"] == "rank 2 of run 'r' stopped pushing (its group expired or was deleted)"
    assert registry.get(third.id)["last_push_age_seconds"] is None


def test_cancel_and_lookups(groups: GroupStore, clock: Clock) -> None:
    registry = ProfileRequests(groups, clock=clock, keep_finished=2)
    push(groups, registry, "0", READY)
    clock.now += 2
    push(groups, registry, "0", READY)
    [request] = registry.create("r", ["0"], 5)
    state = registry.get(request.id)
    assert (state["last_push_age_seconds"], state["push_interval_seconds"]) == (0, 2)
    cancelled = registry.cancel(request.id)
    assert cancelled["state"] == "cancelled"
    assert push(groups, registry, "0", READY) is None  # a cancelled request is not delivered
    [request] = registry.create("r", ["0"], 5)
    push(groups, registry, "0", running(request.id))
    assert refusal(registry.cancel, request.id).status == 409
    assert refusal(registry.get, "no-such-id").status == 404
    for _ in range(3):
        push(groups, registry, "0", ready_after(request.id, True, path="/p", size=1, steps=5))
        [request] = registry.create("r", ["0"], 5)
    assert len(registry.listing(None)["requests"]) == 3  # 2 finished kept, plus the open one


def test_a_running_request_is_cancelled_through_the_ranks_push_answers(groups: GroupStore, clock: Clock) -> None:
    """stepscope-profile's Ctrl-C: DELETE of a running request. Hooks of protocol version 2 are told on every
    push answer until they report the end; the request is then `cancelled` with their reason. Before, DELETE
    answered 409 "it cannot be cancelled" and the rank traced all its steps."""
    registry = ProfileRequests(groups, clock=clock)
    push(groups, registry, "0", READY)
    [request] = registry.create("r", ["0"], 5)
    push(groups, registry, "0", running(request.id, done=2, version=2))
    cancelling = registry.cancel(request.id)
    assert (cancelling["state"], cancelling["cancelling"]) == ("running", True)
    for _ in range(2):  # repeated until the rank says it stopped: a lost answer only delays it
        assert push_answer(groups, registry, "0", running(request.id, done=3, version=2)) == {CANCEL_HEADER: request.id}
    reason = "cancelled after 3 of 5 steps; no trace written"
    ended = json.dumps({"v": 2, "state": "ready", "last": {"id": request.id, "ok": False, "steps": 3,
                                                             "reason": reason, "cancelled": True}})
    assert push_answer(groups, registry, "0", ended) == {}
    state = registry.get(request.id)
    assert (state["state"], state["reason"], state["done_steps"], state["path"]) == ("cancelled", reason, 3, "")
    assert registry.create("r", ["0"], 5)  # the rank is free again


def test_older_hooks_keep_their_running_trace_and_a_late_taken_cancel_reaches_newer_ones(
        groups: GroupStore, clock: Clock) -> None:
    """Hooks of version 1 (or without a version) cannot stop a trace: DELETE is refused as before, and their
    push answers never carry the new header. A pending request cancelled after its answer went out, which the
    rank took anyway, is cancelled on the rank too."""
    registry = ProfileRequests(groups, clock=clock)
    push(groups, registry, "0", READY)
    [request] = registry.create("r", ["0"], 5)
    push(groups, registry, "0", running(request.id))
    error = refusal(registry.cancel, request.id)
    assert error.status == 409 and "hooks are older than this exporter and cannot stop a trace" in error.message
    assert push_answer(groups, registry, "0", running(request.id)) == {}
    push(groups, registry, "0", ready_after(request.id, True, path="/p", size=1, steps=5))
    [late] = registry.create("r", ["0"], 5)
    assert REQUEST_HEADER in push_answer(groups, registry, "0", READY)  # the answer goes out ...
    registry.cancel(late.id)  # ... the DELETE comes before the rank's next push
    assert push_answer(groups, registry, "0", running(late.id, version=2)) == {CANCEL_HEADER: late.id}
    assert push_answer(groups, registry, "0", running(late.id, version=1)) == {}
    assert registry.get(late.id)["state"] == "cancelled"


@pytest.mark.parametrize("header", [
    '{"v": 1, "state": "ready", "last": {"id": "X", "ok": true, "path": "/p", "size": "big", "steps": 1}}',
    '{"v": 1, "state": "ready", "last": {"id": "X", "ok": "yes"}}',
    '{"v": 1, "state": "ready", "last": {"id": 7, "ok": false}}',
    '{"v": 1, "state": "ready", "last": [1, 2]}',
    '{"v": 1, "state": "running", "id": "X", "done_steps": "3"}',
])
def test_a_malformed_status_changes_nothing_and_fails_no_push(groups: GroupStore, clock: Clock, header: str) -> None:
    registry = ProfileRequests(groups, clock=clock)
    push(groups, registry, "0", READY)
    [request] = registry.create("r", ["0"], 5)
    header = header.replace('"X"', json.dumps(request.id))
    assert push(groups, registry, "0", header) in (None, request.answer_headers().get(REQUEST_HEADER))
    assert registry.get(request.id)["state"] in ("pending", "running")
    assert registry.get(request.id)["done_steps"] == 0


def test_pushes_answer_with_the_request_header(groups: GroupStore) -> None:
    limits = PushLimits(max_label_length=128, max_series=100, max_phases=4)
    api = PushApi(ExpositionStore(), groups, AccessPolicy(), max_body_bytes=100_000, limits=limits)
    body = full_body().encode()
    request = PushRequest("PUT", "/metrics/job/stepscope/run/r/rank/0", {"stepscope-profile": READY}, "127.0.0.1",
                          len(body))
    assert set(api.handle(request, body).headers) == {EXPORTER_INSTANCE_HEADER}  # no profile request header yet
    [created] = api.profiles.create("r", ["0"], 3)
    answer = api.handle(request, body)
    assert answer.status == 200 and json.loads(answer.headers[REQUEST_HEADER]) == {"id": created.id, "steps": 3}


def api_request(method: str, path: str, body: bytes = b"", client: str = "127.0.0.1",
                **headers: str) -> PushRequest:
    return PushRequest(method, path, {k.replace("_", "-"): v for k, v in headers.items()}, client,
                       len(body) if method == "POST" else None)


def answer_of(api: ProfileApi, request: PushRequest, body: bytes = b"") -> tuple[int, dict]:
    answer = api.check(request) or api.handle(request, body)
    assert answer.content_type == "application/json"
    return answer.status, json.loads(answer.message)


def test_the_api_checks_access_methods_and_bodies(groups: GroupStore, clock: Clock) -> None:
    registry = ProfileRequests(groups, clock=clock)
    push(groups, registry, "0", READY)
    api = ProfileApi(registry, AccessPolicy(token=IngestTokens(("s3cret",))))
    good = json.dumps({"run": "r", "ranks": [0], "steps": 2}).encode()
    status, payload = answer_of(api, api_request("POST", "/api/v1/profiles", good))
    assert status == 401 and "Authorization: Bearer" in payload["error"]
    auth = {"authorization": "Bearer s3cret"}
    status, payload = answer_of(api, api_request("POST", "/api/v1/profiles", good, **auth), good)
    assert status == 201 and payload["requests"][0]["rank"] == "0"
    request_id = payload["requests"][0]["id"]
    assert answer_of(api, api_request("GET", f"/api/v1/profiles/{request_id}", **auth))[1]["state"] == "pending"
    assert answer_of(api, api_request("DELETE", f"/api/v1/profiles/{request_id}", **auth))[1]["state"] == "cancelled"
    listing = answer_of(api, api_request("GET", "/api/v1/profiles?run=r", **auth))[1]
    assert listing["ranks"] == [{"run": "r", "rank": "0", "tracing": "ready", "last_push_age_seconds": 0}]
    for body, needle in (
        (b"{", "not JSON"), (b"[]", "not a JSON object"), (b'{"run": ""}', "run must be"),
        (b'{"run": "r", "ranks": [-1]}', "ranks must be"), (b'{"run": "r", "ranks": []}', "ranks must be"),
        (b'{"run": "r", "rank": 0}', "unknown field 'rank'"), (b'{"run": "r", "steps": 0}', "steps must be"),
    ):
        status, payload = answer_of(api, api_request("POST", "/api/v1/profiles", body, **auth), body)
        assert status == 400 and needle in payload["error"], body
    assert answer_of(api, api_request("PUT", "/api/v1/profiles", **auth))[0] == 405
    assert answer_of(api, api_request("POST", "/api/v1/profiles/x", **auth))[0] == 405
    assert answer_of(api, api_request("GET", "/api/v1/profiles/a/b", **auth))[0] == 404
    big = api_request("POST", "/api/v1/profiles", b"x" * 5000, **auth)
    assert answer_of(api, big)[0] == 413
    chunked = PushRequest("POST", "/api/v1/profiles", {**auth, "transfer-encoding": "chunked"}, "127.0.0.1", None)
    assert answer_of(api, chunked)[0] == 411
    status, payload = answer_of(ProfileApi(registry, AccessPolicy()), api_request("GET", "/api/v1/profiles",
                                                                                 client="192.0.2.9"))
    assert status == 403 and "pushes from 192.0.2.9 are not allowed" in payload["error"]


def test_a_rank_whose_last_push_said_idle_is_refused_and_a_final_push_does_not_set_the_pace(
        groups: GroupStore, clock: Clock) -> None:
    """What close() pushes (state idle, a moment after the last periodic push) ends the rank's tracing:
    a request is refused at once, and the pace a waiting client judges by stays the periodic one."""
    registry = ProfileRequests(groups, clock=clock)
    for _ in range(4):
        groups.push("r", "0", {}, last_push_line("r", "0"), replace=True)
        registry.on_push("r", "0", READY, "train")
        clock.now += 5
    [request] = registry.create("r", ["0"], 5)
    clock.now -= 4.9
    groups.push("r", "0", {}, last_push_line("r", "0"), replace=True)
    registry.on_push("r", "0", READY, "idle")  # the final push, 0.1 s after the last periodic one
    state = registry.get(request.id)
    assert (state["push_interval_seconds"], state["training_state"]) == (5.0, "idle")
    registry.cancel(request.id)
    error = refusal(registry.create, "r", ["0"], 5)
    assert error.status == 409
    assert error.message == ("rank 0 of run 'r' is idle (its last push, 0.0 s ago, said so: its training ended or "
                             "has not started): a trace records training steps; ask while it trains")
    registry.on_push("r", "0", READY, None)  # a POST without the state family: the last state stands
    assert refusal(registry.create, "r", ["0"], 5).status == 409
    registry.on_push("r", "0", READY, "train")
    assert registry.create("r", ["0"], 5)


@pytest.mark.parametrize(("age", "interval", "gone"), [(4.5, 1.1, False), (9.9, 0.2, False), (10.5, 0.2, True),
                                                       (16.5, 5.0, True), (15.5, 5.0, False)])
def test_a_rank_is_called_gone_after_three_intervals_and_a_second_and_never_within_ten_seconds(
        age: float, interval: float, gone: bool) -> None:
    """Starting the profiler holds a rank's interpreter, its pusher thread too: in a clean-clone CI run a rank
    pushing every 1.1 s went 4.3 s without a push as it took a trace, and stepscope-profile called it killed,
    hung or gone (3 intervals and a second) before it recorded a step."""
    from stepscope.exporter.profile_cli import stopped_pushing

    request = {"state": "running", "last_push_age_seconds": age, "push_interval_seconds": interval}
    assert stopped_pushing(request) is gone

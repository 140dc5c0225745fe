"""Ingest pieces in-process: access rules by address, path parsing, body checks, the group store."""

import base64
import ipaddress
import logging
import os
import time

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from stepscope.contract import EXPORTER_INSTANCE_HEADER
from stepscope.contract.training import STATES
from stepscope.exporter.exposition import Chunk, ExpositionStore, render
from stepscope.exporter.ingest import LOST_GIVES_WAY_SECONDS, RANK_LOST_PAGED_SECONDS
from stepscope.exporter.ingest.access import AccessPolicy
from stepscope.exporter.ingest.api import PushApi, parse_group_path
from stepscope.exporter.ingest.errors import Rejected
from stepscope.exporter.ingest.families import FAMILIES
from stepscope.exporter.ingest.parser import PushLimits
from stepscope.exporter.ingest.parser import parse_push as parse_body
from stepscope.exporter.ingest.render import last_push_line, training_chunks
from stepscope.exporter.ingest.store import GroupStore, StoredFamily, StoreLimits
from stepscope.exporter.ingest.tokens import IngestTokens
from stepscope.exporter.registered import RegisteredProcess
from stepscope.exporter.server import PushRequest, PushResponse
from stepscope_testkit.ingest_bodies import counter, full_body, info_family, phase_family, state_family

LIMITS = StoreLimits(max_groups=3, max_series_per_group=40, max_phases=4, ttl_seconds=10)


def parse_push(body: bytes, run: str, rank: str, max_label_length: int):  # type: ignore[no-untyped-def]
    return parse_body(body, run, rank, PushLimits(max_label_length, max_series=2000, max_phases=32))


def sample_lines(parsed) -> list[str]:  # type: ignore[no-untyped-def]
    return [line for family in parsed.values() for line in family.lines.decode().splitlines()]


def training_text(store: GroupStore) -> str:
    return b"".join(chunk.plain for chunk in training_chunks(store.snapshot()[1])).decode()


def rejected(call, *args):  # type: ignore[no-untyped-def]
    with pytest.raises(Rejected) as info:
        call(*args)
    return info.value


# --- access -------------------------------------------------------------------------------------

@pytest.mark.parametrize("ip", ["127.0.0.1", "127.3.4.5", "::1", "::ffff:127.0.0.1"])
def test_default_policy_admits_loopback(ip: str) -> None:
    AccessPolicy().check(ip, None)


@pytest.mark.parametrize("ip", ["192.0.2.7", "10.0.0.1", "::ffff:10.0.0.1", "fd00::2", "not-an-ip"])
def test_default_policy_refuses_other_addresses_and_says_how_to_allow(ip: str) -> None:
    error = rejected(AccessPolicy().check, ip, None)
    assert (error.status, error.reason) == (403, "forbidden")
    assert "--ingest-token-file" in error.message and "--ingest-allow" in error.message
    assert ip.removeprefix("::ffff:") in error.message


def test_refusal_suggests_an_allow_entry_for_the_client() -> None:
    message = rejected(AccessPolicy().check, "::ffff:10.0.0.1", None).message
    assert "only loopback clients may push without a token" in message
    assert "add this client to --ingest-allow (e.g. 10.0.0.1/32)" in message
    assert "(e.g. fd00::2/128)" in rejected(AccessPolicy().check, "fd00::2", None).message


def test_allow_list_admits_its_networks_and_loopback_only() -> None:
    policy = AccessPolicy(allow=(ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8")))
    for ip in ("10.1.2.3", "::ffff:10.9.9.9", "fd00::2", "127.0.0.1"):
        policy.check(ip, None)
    error = rejected(policy.check, "11.0.0.1", None)
    assert error.status == 403
    assert "only loopback clients and --ingest-allow networks may push without a token" in error.message


def test_token_is_required_from_everyone_once_configured() -> None:
    policy = AccessPolicy(token=IngestTokens(("s3cret",)))
    for header in (None, "", "Bearer wrong", "Basic s3cret", "Bearer", "s3cret"):
        error = rejected(policy.check, "127.0.0.1", header)
        assert (error.status, error.reason) == (401, "unauthorized")
        assert "Authorization: Bearer" in error.message
    policy.check("127.0.0.1", "Bearer s3cret")
    policy.check("192.0.2.7", "bearer  s3cret ")


def test_token_with_allow_list_needs_both() -> None:
    policy = AccessPolicy(token=IngestTokens(("s3cret",)), allow=(ipaddress.ip_network("10.0.0.0/8"),))
    policy.check("10.0.0.5", "Bearer s3cret")
    assert rejected(policy.check, "192.0.2.7", "Bearer s3cret").status == 403
    assert rejected(policy.check, "10.0.0.5", "Bearer nope").status == 401


# --- path ---------------------------------------------------------------------------------------

def b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


@pytest.mark.parametrize(("path", "expected"), [
    ("/metrics/job/stepscope/run/r1/rank/0", ("r1", "0")),
    ("/metrics/job/stepscope/rank/12/run/r1/", ("r1", "12")),
    ("/metrics/job/stepscope/run/my%20run/rank/3", ("my run", "3")),
    (f"/metrics/job/stepscope/run@base64/{b64('a/b ü?')}/rank/1", ("a/b ü?", "1")),
    (f"/metrics/job@base64/{b64('stepscope')}/run/r/rank@base64/{b64('7')}", ("r", "7")),
    ("/metrics/job/stepscope/run@base64/cnVu=/rank/0", ("run", "0")),  # padded form accepted too
])
def test_group_paths(path: str, expected: tuple[str, str]) -> None:
    assert parse_group_path(path, 128) == expected


@pytest.mark.parametrize(("path", "status", "text"), [
    ("/metrics/job/stepscope", 404, "push to /metrics/job/stepscope/run/<run>/rank/<rank>"),
    ("/metrics/job/stepscope/run/r/rank/0/extra/x", 404, "push to"),
    ("/metrics/job/stepscope/run/r/gpu/0", 404, "push to"),
    ("/metrics/job/other/run/r/rank/0", 404, "job 'other' is not served here"),
    ("/metrics/job/stepscope/run/r/run/s", 400, "'run' appears twice"),
    ("/metrics/job/stepscope/run/r/rank/-1", 400, "rank '-1' in the path is not a non-negative integer"),
    ("/metrics/job/stepscope/run/r/rank/01", 400, "not a non-negative integer"),
    ("/metrics/job/stepscope/run/r/rank/1234567890", 400, "integer (at most 9 digits, no leading zero)"),
    ("/metrics/job/stepscope/run//rank/0", 400, "must be non-empty printable text"),
    ("/metrics/job/stepscope/run/a%0Ab/rank/0", 400, "must be non-empty printable text"),
    ("/metrics/job/stepscope/run/a%22b/rank/0", 400, "without quotes"),  # Grafana could not select it
    ("/metrics/job/stepscope/run/it%27s/rank/0", 400, "without quotes"),
    ("/metrics/job/stepscope/run@base64/!!/rank/0", 400, "run@base64 is not base64url-encoded"),
    # bytes that are not UTF-8: refused as the Pushgateway does, never stored as run 'a\ufffdb'
    ("/metrics/job/stepscope/run/a%FFb/rank/0", 400, "path segment 'a%FFb' is not percent-encoded UTF-8"),
    ("/metrics/job/stepscope/run/r/rank/0%C3", 400, "path segment '0%C3' is not percent-encoded UTF-8"),
    ("/metrics/job/stepscope/run/" + "r" * 40 + "/rank/0", 400, "over the limit of 32"),
])
def test_bad_group_paths(path: str, status: int, text: str) -> None:
    error = rejected(parse_group_path, path, 32)
    assert error.status == status
    assert text in error.message


# --- body ---------------------------------------------------------------------------------------

def test_parse_push_canonicalises_histograms_and_drops_created() -> None:
    body = (
        "# TYPE stepscope_step_seconds histogram\n"
        'stepscope_step_seconds_count 3\nstepscope_step_seconds_bucket{le="+Inf"} 3\n'
        'stepscope_step_seconds_bucket{le="1"} 2\nstepscope_step_seconds_sum 1.5\n'
        "# TYPE stepscope_step_seconds_created gauge\nstepscope_step_seconds_created 1.7e9\n"
    )
    families = parse_push(body.encode(), "r", "0", 128)
    assert list(families) == ["stepscope_step_seconds"]
    assert sample_lines(families) == [
        'stepscope_step_seconds_bucket{le="1.0",rank="0",run="r"} 2.0',
        'stepscope_step_seconds_bucket{le="+Inf",rank="0",run="r"} 3.0',
        'stepscope_step_seconds_count{rank="0",run="r"} 3.0',
        'stepscope_step_seconds_sum{rank="0",run="r"} 1.5',
    ]
    assert families["stepscope_step_seconds"].series == 4


@pytest.mark.parametrize(("body", "reason", "text"), [
    ("# TYPE stepscope_steps_created gauge\nstepscope_steps_created 1.7e9\n", None, ""),
    ("# TYPE stepscope_training_info_created gauge\nstepscope_training_info_created 1\n", "unknown_family",
     "unknown family 'stepscope_training_info_created'"),
    ("# TYPE stepscope_step_seconds_count counter\nstepscope_step_seconds_count 1\n", "wrong_type",
     "needs the line '# TYPE stepscope_step_seconds histogram' before it (got counter)"),
])
def test_created_companions_dropped_near_names_refused(body: str, reason: str | None, text: str) -> None:
    if reason is None:
        assert parse_push(body.encode(), "r", "0", 128) == {}
        return
    error = rejected(parse_push, body.encode(), "r", "0", 128)
    assert (error.reason, error.status) == (reason, 400) and text in error.message


def test_parse_error_names_the_line() -> None:
    body = b"# TYPE stepscope_steps_total counter\nstepscope_steps_total{x 1\n"
    error = rejected(parse_push, body, "r", "0", 128)
    assert (error.status, error.reason) == (400, "malformed")
    assert "line 2" in error.message and "stepscope_steps_total{x 1" in error.message


def test_body_must_be_utf8() -> None:
    assert rejected(parse_push, b"\xff\xfe", "r", "0", 128).reason == "malformed"


# --- store --------------------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def families(body: str, run: str = "r", rank: str = "0"):  # type: ignore[no-untyped-def]
    return parse_push(body.encode(), run, rank, 128)


def stored(parsed: dict) -> dict[str, StoredFamily]:
    return {name: StoredFamily(Chunk(f.lines), f.series, f.keys) for name, f in parsed.items()}


def push(store: GroupStore, rank: str, parsed: dict, replace: bool = True, run: str = "r"):  # type: ignore[no-untyped-def]
    return store.push(run, rank, stored(parsed), last_push_line(run, rank), replace)


def test_post_merges_put_replaces() -> None:
    store = GroupStore(LIMITS)
    push(store, "0", families(full_body(steps=4)), True)
    push(store, "0", families(counter("stepscope_steps_total", 9)), False)
    group = store.snapshot()[1][0]
    assert group.families["stepscope_steps_total"].chunk.plain == b'stepscope_steps_total{rank="0",run="r"} 9.0\n'
    assert "stepscope_step_phase_seconds" in group.families
    text = training_text(store)
    assert 'stepscope_steps_total{rank="0",run="r"} 9.0' in text
    assert 'stepscope_step_phase_seconds_count{phase="forward",rank="0",run="r"} 4.0' in text
    push(store, "0", families(counter("stepscope_steps_total", 10)), True)
    assert list(store.snapshot()[1][0].families) == ["stepscope_steps_total"]


def test_limits_apply_to_the_merged_group_and_leave_it_unchanged() -> None:
    store = GroupStore(StoreLimits(max_groups=3, max_series_per_group=25, max_phases=3, ttl_seconds=10))
    push(store, "0", families(full_body()), True)  # 2 phases: 21 series
    before = store.snapshot()
    error = rejected(push, store, "0", families(phase_family(("a", "b", "c", "d"))), False)
    assert (error.status, error.reason) == (400, "too_many_phases")
    assert "4 distinct phases, over the limit of 3 (--ingest-max-phases): a, b, c, d" in error.message
    # POST replaces the 10 phase series with 15: 26 series in the merged group
    error = rejected(push, store, "0", families(phase_family(("a", "b", "c"))), False)
    assert (error.status, error.reason) == (400, "too_many_series")
    assert "would hold 26 series, over the limit of 25 (--ingest-max-series-per-group)" in error.message
    assert store.snapshot() == before


def test_group_limit_counts_only_new_groups_and_expired_ones_free_room() -> None:
    clock = FakeClock()
    store = GroupStore(LIMITS, clock=clock)
    for rank in "012":
        push(store, rank, {}, True)
    push(store, "2", {}, True)  # existing group: never counts as new
    error = rejected(push, store, "3", {}, True)
    assert (error.status, error.reason) == (429, "too_many_groups")
    assert "--ingest-max-groups 3" in error.message
    clock.now += 11
    push(store, "3", {}, True)
    assert [g.rank for g in store.snapshot()[1]] == ["3"]


def test_a_closed_group_gives_its_slot_to_a_new_one_the_longest_closed_first() -> None:
    """A sweep's short trials closed within the TTL filled every slot (16 of 16 on a real exporter), and a training
    rank was refused 429 until one expired. Closed groups give way, the earliest pushed first; live ones never,
    and a refused push still changes nothing."""
    clock = FakeClock()
    store = GroupStore(LIMITS, clock=clock, wall_clock=clock)
    for rank, pid in (("0", 100), ("1", 101)):
        push(store, rank, process_push(pid, state="idle"))
        clock.now += 1
    push(store, "2", process_push(102))
    push(store, "3", process_push(103))
    assert [g.rank for g in store.snapshot()[1]] == ["1", "2", "3"]  # rank 0 closed first: it gave way
    push(store, "4", process_push(104))
    assert [g.rank for g in store.snapshot()[1]] == ["2", "3", "4"]
    before = store.snapshot()
    error = rejected(push, store, "5", process_push(105))
    assert (error.status, error.reason) == (429, "too_many_groups") and store.snapshot() == before
    assert "none of a rank that closed or that has not pushed for 120s (those give way)" in error.message
    assert store.dropped() == 2


def test_ttl_expiry_and_registered_processes() -> None:
    clock = FakeClock()
    store = GroupStore(LIMITS, clock=clock, wall_clock=clock)
    push(store, "0", families(info_family(pid=111)), True)
    clock.now += 5
    push(store, "1", families(info_family(pid=222, start_time="1712345678.25"), rank="1"), True)
    assert store.registered_processes() == [RegisteredProcess(111, "r", "0", None, 1000.0),
                                            RegisteredProcess(222, "r", "1", 1712345678.25, 1005.0)]
    clock.now += 6  # rank 0 is now 11 s old, rank 1 is 6 s old
    assert store.registered_processes() == [RegisteredProcess(222, "r", "1", 1712345678.25, 1005.0)]
    assert store.expire() is True
    assert [g.rank for g in store.snapshot()[1]] == ["1"]
    assert store.expire() is False
    assert store.delete("r", "1") is True and store.registered_processes() == []


def test_the_same_pid_from_two_pid_namespaces_registers_twice() -> None:
    store = GroupStore(LIMITS, wall_clock=lambda: 1000.0)
    push(store, "0", families(info_family(pid=1, start_time="100.5")), True)
    push(store, "1", families(info_family(pid=1, start_time="200.5"), rank="1"), True)
    assert store.registered_processes() == [RegisteredProcess(1, "r", "0", 100.5, 1000.0),
                                            RegisteredProcess(1, "r", "1", 200.5, 1000.0)]


def test_a_process_in_two_runs_registers_each_with_its_last_push_time() -> None:
    """A notebook closed run "b" and opened run "a": both groups live, the later push tells them apart."""
    clock = FakeClock()
    store = GroupStore(LIMITS, clock=clock, wall_clock=clock)
    push(store, "0", families(info_family(pid=7, start_time="100.5"), run="b"), run="b")
    clock.now += 2
    push(store, "0", families(info_family(pid=7, start_time="100.5"), run="a"), run="a")
    assert store.registered_processes() == [RegisteredProcess(7, "a", "0", 100.5, 1002.0),
                                            RegisteredProcess(7, "b", "0", 100.5, 1000.0)]


def test_two_pods_pid_1_started_in_one_tick_register_with_their_pid_namespaces() -> None:
    """Their pid and start time are the same: only the namespace tells the exporter which process is which."""
    store = GroupStore(LIMITS, wall_clock=lambda: 1000.0)
    push(store, "0", families(info_family(pid=1, start_time="100.5", pid_namespace="4026532178"), run="a"), run="a")
    push(store, "0", families(info_family(pid=1, start_time="100.5", pid_namespace="4026532180"), run="b"), run="b")
    assert store.registered_processes() == [RegisteredProcess(1, "a", "0", 100.5, 1000.0, 4026532178),
                                            RegisteredProcess(1, "b", "0", 100.5, 1000.0, 4026532180)]


@pytest.mark.parametrize("pid_namespace", ["0", "-4026532178", "4026532178.5", "pid:[4026532178]", "1" * 21])
def test_training_info_refuses_a_malformed_pid_namespace(pid_namespace: str) -> None:
    error = rejected(families, info_family(pid_namespace=pid_namespace))
    assert (error.status, error.reason) == (400, "bad_label")
    assert "label 'pid_namespace' must be the inode number of the process's pid namespace" in error.message


@pytest.mark.parametrize(("start_time", "stored"), [
    ("1712345678.250", "1712345678.250"), ("0", "0"), ("", None),  # empty = absent, as in Prometheus
])
def test_training_info_takes_an_optional_start_time(start_time: str, stored: str | None) -> None:
    lines = families(info_family(pid=7, start_time=start_time))["stepscope_training_info"].lines.decode()
    (sample,) = [s for f in text_string_to_metric_families(lines) for s in f.samples]
    assert sample.labels.get("start_time") == stored
    assert set(sample.labels) - {"start_time"} == {"run", "rank", "local_rank", "world_size", "pid", "framework"}


@pytest.mark.parametrize("start_time", ["-1", "1e9", "12.", ".5", "nan", "1712345678,25", "1" * 13, "1.0000000001"])
def test_training_info_refuses_a_malformed_start_time(start_time: str) -> None:
    error = rejected(families, info_family(start_time=start_time))
    assert (error.status, error.reason) == (400, "bad_label")
    assert "label 'start_time' must be the process start time in Unix seconds" in error.message


def test_render_merges_groups_into_one_family_each() -> None:
    store = GroupStore(LIMITS)
    push(store, "10", families(full_body(), rank="10"), True)
    push(store, "2", families(full_body(), rank="2"), True)
    text = training_text(store)
    parsed = list(text_string_to_metric_families(text))
    names = [f.name for f in parsed]
    assert len(names) == len(set(names)) == 7
    ranks = [s.labels["rank"] for s in parsed[2].samples]
    assert ranks == ["2", "10"]  # numeric rank order within a family
    # the joined per-group lines equal prometheus_client rendering all samples of a family at once
    whole = []
    for family in parsed[:6]:
        spec = FAMILIES[family.name + "_total" if family.type == "counter" else family.name]
        metric = Metric(family.name, spec.help, spec.type)
        metric.samples = family.samples
        whole.append(metric)
    assert text.startswith(render(whole).decode())
    assert text.count("# TYPE") == 7


# --- one process per group ----------------------------------------------------------------------

def process_push(pid: int, steps: int = 1, state: str = "train", start_time: str = "1795000000.25",
                 run: str = "r") -> dict:
    """What one process's hooks push: its identity, its state and its counters."""
    return families(info_family(pid=pid, start_time=start_time) + state_family(state, STATES)
                    + counter("stepscope_steps_total", steps), run=run)


def owner_pid(store: GroupStore) -> int:
    (process,) = store.registered_processes()
    return process.pid


def test_another_process_is_refused_while_the_owner_pushes() -> None:
    """Two users' train.py, both run "train" rank 0: the second's pushes replaced the first's at every push
    (its pid flipping, its steps_total going back). Now the second gets a 409 that says what to do, and the
    group stays the first's."""
    clock = FakeClock()
    store = GroupStore(LIMITS, clock=clock, wall_clock=clock)
    push(store, "0", process_push(111, steps=500, run="train"), run="train")
    clock.now += 2.1
    before = store.snapshot()
    for replace in (True, False):  # a PUT and a POST alike
        error = rejected(push, store, "0", process_push(222, steps=3, run="train"), replace, "train")
        assert (error.status, error.reason) == (409, "run_conflict")
        assert error.message == (
            "run 'train' rank 0 is pushed by another process on this node (pid 111, started 2026-11-18 "
            "11:06:40 UTC, last push 2.1s ago): two processes cannot share a run and rank; give each its own "
            "run (STEPSCOPE_RUN or init(run=...); the default is the script's name). This process's pushes "
            "are taken once the other one closes or stops pushing for 12.5s")
    assert store.snapshot() == before and owner_pid(store) == 111
    push(store, "0", process_push(111, steps=510, run="train"), run="train")  # the owner goes on
    assert 'stepscope_steps_total{rank="0",run="train"} 510.0' in training_text(store)


def test_the_same_pid_with_another_start_time_is_another_process() -> None:
    """A pid reused after a reboot, or the same pid in two containers' pid namespaces."""
    store = GroupStore(LIMITS)
    push(store, "0", process_push(7, start_time="100.5"))
    assert rejected(push, store, "0", process_push(7, start_time="200.5")).reason == "run_conflict"
    push(store, "0", process_push(7, start_time="100.5"))


def test_two_pods_pid_1_started_in_one_tick_are_two_processes() -> None:
    """Two pods of a Job, each rank pid 1 and started in the same clock tick, both run "train" rank 0 (the
    script's name): pod B's pushes replaced pod A's group at each push (steps 40, 3, 41). The namespace tells
    them apart: pod B gets the 409."""
    store = GroupStore(LIMITS)
    pod_a, pod_b = (info_family(pid=1, start_time="100.5", pid_namespace=namespace)
                    for namespace in ("4026532178", "4026532180"))
    push(store, "0", families(pod_a + counter("stepscope_steps_total", 40)))
    error = rejected(push, store, "0", families(pod_b + counter("stepscope_steps_total", 3)))
    assert error.reason == "run_conflict" and "pid 1, started 1970-01-01 00:01:40 UTC, pid namespace 4026532178" \
        in error.message
    assert 'stepscope_steps_total{rank="0",run="r"} 40.0' in training_text(store)


def test_a_push_without_training_info_names_no_process_and_is_not_checked() -> None:
    """A Pushgateway-style client sends what it has: nothing to tell its process by."""
    store = GroupStore(LIMITS)
    push(store, "0", process_push(111))
    push(store, "0", families(counter("stepscope_steps_total", 9)), replace=False)
    assert owner_pid(store) == 111  # merged into the owner's group: still its process
    push(store, "0", families(counter("stepscope_steps_total", 10)), replace=True)
    assert store.registered_processes() == [] and store.snapshot()[1][0].owner is None
    push(store, "0", process_push(222))  # nobody to refuse for


def test_a_closed_owner_is_taken_over_at_once() -> None:
    """The same script run twice in a row: close() pushes state idle, and the next run's first push lands."""
    clock = FakeClock()
    store = GroupStore(LIMITS, clock=clock, wall_clock=clock)
    push(store, "0", process_push(111, steps=500))
    push(store, "0", process_push(111, steps=500, state="idle"))
    clock.now += 0.1
    push(store, "0", process_push(222, steps=1))
    assert owner_pid(store) == 222
    assert 'stepscope_steps_total{rank="0",run="r"} 1.0' in training_text(store)  # its state replaced the old
    assert rejected(push, store, "0", process_push(111, state="train")).reason == "run_conflict"


def test_a_post_that_takes_a_group_over_keeps_nothing_of_the_previous_process() -> None:
    """A run name reused by a Pushgateway-style client that POSTs: the closed run's tokens (9e9) and loader limit
    stayed under the new process, a counter the new run never pushed, and one that would go back once it does."""
    clock = FakeClock()
    store = GroupStore(LIMITS, clock=clock, wall_clock=clock)
    previous = (info_family(pid=111, start_time="1795000000.25") + state_family("idle", STATES)
                + counter("stepscope_tokens_total", 9e9)
                + "# TYPE stepscope_loader_limit_samples_per_second gauge\n"
                + "stepscope_loader_limit_samples_per_second 1234\n")
    push(store, "0", families(previous))
    push(store, "0", process_push(222, steps=3), replace=False)
    assert sorted(store.snapshot()[1][0].families) == sorted(process_push(222))
    assert "tokens" not in training_text(store) and "loader_limit" not in training_text(store)
    push(store, "0", families(counter("stepscope_tokens_total", 50)), replace=False)  # its own POSTs still merge
    assert owner_pid(store) == 222 and 'stepscope_steps_total{rank="0",run="r"} 3.0' in training_text(store)


@pytest.mark.parametrize(("interval", "hold"), [
    (None, 12.5),  # one push so far: 2.5 x the hooks' default 5 s
    (2.0, 5.0),    # 2.5 x the interval
    (0.2, 3.0),    # at least 3 s
    (20.0, 30.0),  # at most 30 s: two thirds of rank_lost_seconds (45 s)
])
def test_an_owner_that_stopped_pushing_is_taken_over_after_its_hold(interval: float | None, hold: float) -> None:
    """SIGKILL, the OOM killer, a crash: the rank restarted by torchrun (a new pid) is refused while the dead
    one could still be pushing, then takes the group over well before StepscopeRankLost (45 s) would fire."""
    clock = FakeClock()
    store = GroupStore(StoreLimits(max_groups=3, max_series_per_group=40, max_phases=4, ttl_seconds=600),
                       clock=clock, wall_clock=clock)
    for _ in range(1 if interval is None else 5):
        push(store, "0", process_push(111))
        clock.now += interval or 0
    clock.now += hold - (interval or 0) - 0.01
    error = rejected(push, store, "0", process_push(222))
    assert error.message.endswith(f"closes or stops pushing for {hold:.1f}s")
    clock.now += 0.01
    push(store, "0", process_push(222))
    assert owner_pid(store) == 222


def test_a_pace_survives_a_takeover_so_clashing_slow_pushers_do_not_take_turns() -> None:
    """Two processes pushing every 30 s, 15 s apart: the second takes the group at its first push (the owner's
    single push gives no pace: held 12.5 s). The group's pace, kept across the takeover, then holds the first
    off; started afresh it would be 12.5 s again, and the two would take the group from each other at every
    push."""
    clock = FakeClock()
    store = GroupStore(StoreLimits(max_groups=3, max_series_per_group=40, max_phases=4, ttl_seconds=600),
                       clock=clock, wall_clock=clock)
    push(store, "0", process_push(111))
    clock.now += 15
    push(store, "0", process_push(222))
    for _ in range(3):
        clock.now += 15
        assert rejected(push, store, "0", process_push(111)).reason == "run_conflict"
        clock.now += 15
        push(store, "0", process_push(222))
    assert owner_pid(store) == 222


def test_an_expired_or_deleted_group_belongs_to_nobody() -> None:
    clock = FakeClock()
    store = GroupStore(LIMITS, clock=clock, wall_clock=clock)
    push(store, "0", process_push(111))
    assert rejected(push, store, "0", process_push(222)).reason == "run_conflict"
    assert store.delete("r", "0")
    push(store, "0", process_push(222))
    assert rejected(push, store, "0", process_push(333)).reason == "run_conflict"
    clock.now += 10  # the TTL here (10 s) ends the group before its owner's hold (12.5 s)
    push(store, "0", process_push(333))
    assert owner_pid(store) == 333


def test_push_api_answers_a_conflict_with_409_counts_it_and_logs_each_new_one(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="stepscope.exporter.ingest.api")
    exposition = ExpositionStore()
    api = PushApi(exposition, GroupStore(LIMITS), AccessPolicy(), max_body_bytes=10_000,
                  limits=PushLimits(128, max_series=40, max_phases=4))

    def put(run: str, pid: int) -> PushResponse:
        body = full_body(pid=pid).encode()
        return api.handle(push_request("PUT", f"/metrics/job/stepscope/run/{run}/rank/0", len(body)), body)

    assert put("a", 111).status == put("b", 111).status == 200
    for run in ("a", "a", "b"):
        response = put(run, 222)
        assert response.status == 409
        assert response.message.startswith(f"run '{run}' rank 0 is pushed by another process on this node (pid 111")
    assert 'stepscope_exporter_ingest_rejected_total{reason="run_conflict"} 3.0' in exposition.body().decode()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # a and b: each clash once, its repeats at debug
    assert warnings[0].startswith("refused PUT /metrics/job/stepscope/run/a/rank/0 from 127.0.0.1 (409 run_conflict): "
                                  "run 'a' rank 0 is pushed by another process")


def test_a_rank_expired_by_another_push_takes_its_wanted_bounds_with_it() -> None:
    """A killed rank's group expires inside whichever push comes next on a busy node, before the expiry thread
    wakes: its wanted step block (5) stayed counted in its run's answer for good (10 of 10 runs on a real
    exporter pushed to steadily)."""
    clock = FakeClock()
    api = PushApi(ExpositionStore(), GroupStore(LIMITS, clock=clock, wall_clock=clock), AccessPolicy(),
                  max_body_bytes=10_000, limits=PushLimits(128, max_series=40, max_phases=4))

    def put(run: str, rank: str, wanted: str) -> str | None:
        body, path = full_body().encode(), f"/metrics/job/stepscope/run/{run}/rank/{rank}"
        request = push_request("PUT", path, len(body), **{"stepscope-bounds": wanted})
        return api.handle(request, body).headers.get("Stepscope-Run-Bounds")

    assert put("r", "1", '{"step":[5]}') == '{"step":{"5":1}}'  # then killed: it never pushes again
    clock.now += LIMITS.ttl_seconds
    put("busy", "0", '{"step":[9]}')  # another run's push drops rank 1's group
    assert put("r", "0", '{"step":[7]}') == '{"step":{"7":1}}'


def push_request(method: str, path: str, length: int | None = None, **headers: str) -> PushRequest:
    return PushRequest(method, path, headers, "127.0.0.1", length)


def test_push_api_publishes_nothing_for_a_refused_push() -> None:
    exposition = ExpositionStore()
    api = PushApi(exposition, GroupStore(LIMITS, wall_clock=lambda: 1000.0), AccessPolicy(), max_body_bytes=10_000,
                  limits=PushLimits(128, max_series=40, max_phases=4))
    path = "/metrics/job/stepscope/run/r/rank/0"
    body = full_body().encode()
    assert api.check(push_request("PUT", path, len(body))) is None
    assert api.handle(push_request("PUT", path, len(body)), body).status == 200
    before = exposition.body()
    response = api.handle(push_request("PUT", path, 24), b"stepscope_steps_total 1\n")
    assert response.status == 400
    training = [line for line in exposition.body().decode().splitlines() if "stepscope_step" in line]
    assert training == [line for line in before.decode().splitlines() if "stepscope_step" in line]
    assert api.check(push_request("PATCH", path)).status == 405  # type: ignore[union-attr]
    assert api.handle(push_request("PUT", path, 10_001), b"x" * 10_001).status == 413
    response = api.check(push_request("PUT", path, 20_000))
    assert response == PushResponse(
        413, "body of 20000 bytes exceeds the limit of 10000 bytes (--ingest-max-body-bytes)")
    counted = 'stepscope_exporter_ingest_rejected_total{reason="body_too_large"} 2.0'
    assert counted in exposition.body().decode()
    assert api.registered_processes() == [RegisteredProcess(os.getpid(), "r", "0", None, 1000.0)]


@pytest.mark.parametrize("body", ["\n", "# TYPE stepscope_steps_total counter\n", "# EOF\n",
                                  "# HELP stepscope_steps_total Steps.\n# TYPE stepscope_steps_total counter\n"])
@pytest.mark.parametrize("method", ["PUT", "POST"])
def test_a_body_without_samples_is_refused_and_wipes_nothing(method: str, body: str) -> None:
    """A PUT replaces the group with the body's families: one holding no sample would wipe the rank's series."""
    exposition = ExpositionStore()
    api = PushApi(exposition, GroupStore(LIMITS, wall_clock=lambda: 1000.0), AccessPolicy(), max_body_bytes=10_000,
                  limits=PushLimits(128, max_series=40, max_phases=4))
    path = "/metrics/job/stepscope/run/r/rank/0"
    stored = full_body().encode()
    assert api.handle(push_request("PUT", path, len(stored)), stored).status == 200
    before = exposition.body()
    response = api.handle(push_request(method, path, len(body)), body.encode())
    assert (response.status, response.message) == (
        400, f"the {method} holds no samples; nothing stored: send the rank's families in the text format "
             "(DELETE removes a group)")
    assert [line for line in exposition.body().decode().splitlines() if "stepscope_step" in line] == [
        line for line in before.decode().splitlines() if "stepscope_step" in line]
    assert 'stepscope_exporter_ingest_rejected_total{reason="empty_body"} 1.0' in exposition.body().decode()


@pytest.mark.parametrize(("states", "text"), [
    ({"train": 1, "training": 0}, "label 'state' must be one of setup, train, eval, checkpoint, idle"),
    ({"train": 1, "idle": 1}, "exactly one state must be 1, got 2 (train, idle)"),
    ({"train": 0, "idle": 0}, "exactly one state must be 1, got 0 (none)"),
])
def test_the_state_set_holds_one_state_of_the_contract(states: dict[str, int], text: str) -> None:
    """The rules count a rank as training by state="train" == 1: a state outside the set, or two at once, would
    hide the rank from the verdict and alerts or count it twice."""
    body = "# TYPE stepscope_training_state gauge\n" + "".join(
        f'stepscope_training_state{{state="{state}"}} {value}\n' for state, value in states.items())
    error = rejected(parse_push, body.encode(), "r", "0", 128)
    assert error.status == 400
    assert text in error.message


def test_the_state_seconds_take_only_states_of_the_contract() -> None:
    body = counter("stepscope_state_seconds_total", 1.5).replace("total 1.5", 'total{state="warmup"} 1.5')
    assert "label 'state' must be one of setup" in rejected(parse_push, body.encode(), "r", "0", 128).message
    ok = counter("stepscope_state_seconds_total", 1.5).replace("total 1.5", 'total{state="eval"} 1.5')
    assert sample_lines(parse_push(ok.encode(), "r", "0", 128)) == [
        'stepscope_state_seconds_total{rank="0",run="r",state="eval"} 1.5']


def test_expiry_sleeps_until_a_group_can_expire_not_a_second_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TTL is every group's, so no push brings the next deadline closer: with no group stored none can
    expire within one TTL, and the expiry thread of an idle exporter has no reason to wake every second (each
    wake-up is a thread switch, which a VM pays for)."""
    now = [100.0]
    store = GroupStore(LIMITS, clock=lambda: now[0], wall_clock=lambda: 1000.0)
    assert store.next_expiry() == 110.0  # none stored: one TTL from now
    body = stored(parse_push(full_body().encode(), "r", "0", 128))
    store.push("r", "0", body, last_push_line("r", "0"), replace=True)
    now[0] = 103.0
    store.push("r", "1", body, last_push_line("r", "1"), replace=True)
    assert store.next_expiry() == 110.0  # the first group's deadline, not the later one's
    store.push("r", "0", body, last_push_line("r", "0"), replace=True)  # pushed again: its deadline moves later
    assert store.next_expiry() == 113.0

    idle = GroupStore(StoreLimits(max_groups=3, max_series_per_group=40, max_phases=4, ttl_seconds=600))
    asked: list[float] = []
    real_next_expiry = idle.next_expiry
    monkeypatch.setattr(idle, "next_expiry", lambda: (asked.append(1.0), real_next_expiry())[1])
    api = PushApi(ExpositionStore(), idle, AccessPolicy(), max_body_bytes=10_000,
                  limits=PushLimits(128, max_series=40, max_phases=4))
    api.start()
    try:
        time.sleep(2.5)
    finally:
        api.stop()
    assert len(asked) == 1  # one sleep of a TTL (a wake a second: 3)


def test_an_accepted_push_names_the_exporter_process_that_stored_it() -> None:
    """Hooks that left out what an older exporter refused offer it again once another exporter process answers
    (tests/test_hooks_push.py): one exporter names itself alike in every accepted answer, a restarted one
    (a new PushApi) otherwise, and a refusal names none."""
    first, restarted = (PushApi(ExpositionStore(), GroupStore(LIMITS), AccessPolicy(), max_body_bytes=10_000,
                                limits=PushLimits(128, max_series=40, max_phases=4)) for _ in range(2))
    body = full_body(pid=111).encode()
    request = push_request("PUT", "/metrics/job/stepscope/run/a/rank/0", len(body))
    names = [api.handle(request, body).headers.get(EXPORTER_INSTANCE_HEADER) for api in (first, first, restarted)]
    assert names[0] and names[0] == names[1] and names[2] and names[2] != names[0]
    assert EXPORTER_INSTANCE_HEADER not in first.handle(request, b"not exposition\n").headers


def test_the_owner_that_adds_its_pid_namespace_is_the_same_process() -> None:
    """Hooks newer than their exporter push without `pid_namespace` until that exporter is upgraded under them, then
    with it: measured with 97d12fc's exporter swapped for this one, the same process's next push got 409 run_conflict
    (its 10 s hold) as another process. A namespace on one side only now tells no process apart; two differ."""
    clock = FakeClock()
    store = GroupStore(LIMITS, clock=clock, wall_clock=clock)
    push(store, "0", families(info_family(pid=1, start_time="100.5") + counter("stepscope_steps_total", 5)))
    clock.now += 5
    push(store, "0", families(info_family(pid=1, start_time="100.5", pid_namespace="4026532178")
                              + counter("stepscope_steps_total", 6)), replace=False)
    assert 'stepscope_steps_total{rank="0",run="r"} 6.0' in training_text(store)
    clock.now += 5
    other = families(info_family(pid=1, start_time="100.5", pid_namespace="4026532180"))
    assert (rejected(push, store, "0", other).status, owner_pid(store)) == (409, 1)


def test_a_closed_rank_is_in_no_phase_whatever_its_hooks_pushed() -> None:
    """Hooks before 2026-11-27 (48fb572) closed with stepscope_training_phase_entered{phase="dataloader_next"} in
    their final idle push (measured: 16.4 s after close the exporter still published it, the finished rank read as
    waiting on its loader). A closed rank is in no phase: the exporter stores none; a training rank keeps its own."""
    entered = ("# TYPE stepscope_training_phase_entered_timestamp_seconds gauge\n"
               'stepscope_training_phase_entered_timestamp_seconds{phase="dataloader_next"} 1795973231.5\n')
    store = GroupStore(LIMITS)
    push(store, "0", families(entered + state_family("train", STATES)))
    assert "stepscope_training_phase_entered_timestamp_seconds{" in training_text(store)
    push(store, "0", families(entered + state_family("idle", STATES)))
    assert "phase_entered" not in training_text(store)
    assert 'stepscope_training_state{rank="0",run="r",state="idle"} 1.0' in training_text(store)


def test_a_lost_group_gives_way_once_its_rank_was_paged_but_not_before() -> None:
    """A sweep whose trials were SIGKILLed (OOM at the first step) left their groups in `train` until --ingest-ttl
    (600 s): with every slot held by them, a new run's rank was refused 429 for up to 10 minutes, though
    StepscopeRankLost had paged each dead rank long before. A rank silent past LOST_GIVES_WAY_SECONDS gives way
    after the closed ones, the longest silent first; one the rules may not have paged yet does not."""
    clock = FakeClock()
    store = GroupStore(StoreLimits(max_groups=3, max_series_per_group=40, max_phases=4, ttl_seconds=600),
                       clock=clock, wall_clock=clock)
    for rank, pid in (("0", 100), ("1", 101), ("2", 102)):
        push(store, rank, process_push(pid))
        clock.now += 1
    clock.now += LOST_GIVES_WAY_SECONDS - 4  # rank 0, the longest silent, for 1 s less than that
    error = rejected(push, store, "0", process_push(200, run="next"), True, "next")
    assert (error.status, error.reason) == (429, "too_many_groups")
    assert f"a rank that closed or that has not pushed for {LOST_GIVES_WAY_SECONDS:g}s" in error.message
    clock.now += 1  # rank 0 is silent for LOST_GIVES_WAY_SECONDS, ranks 1 and 2 for less
    push(store, "0", process_push(200, run="next"), run="next")
    assert [(g.run, g.rank) for g in store.snapshot()[1]] == [("next", "0"), ("r", "1"), ("r", "2")]
    assert LOST_GIVES_WAY_SECONDS > RANK_LOST_PAGED_SECONDS

"""The push API through a real exporter process: hand-written bodies over HTTP, then /metrics."""

import gzip
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests

from stepscope.contract.training import STATES
from stepscope_testkit.ingest_bodies import counter, full_body, histogram, info_family, phase_family, state_family
from stepscope_testkit.processes import Running, exporter_env, free_port, running_exporter, samples, scrape

LIMIT_FLAGS = (
    "--collectors", "", "--ingest-max-body-bytes", "8192", "--ingest-max-series-per-group", "30",
    "--ingest-max-phases", "4", "--ingest-max-label-value-length", "32",
)
TRAINING_PREFIXES = ("stepscope_step", "stepscope_samples", "stepscope_training")


def group_url(base: str, run: str, rank: str = "0") -> str:
    return f"{base}/metrics/job/stepscope/run/{run}/rank/{rank}"


def training(text: str) -> dict[tuple[str, frozenset], float]:
    """The pushed families' samples (last-push timestamps included) of one scrape."""
    return {key: value for key, value in samples(text).items() if key[0].startswith(TRAINING_PREFIXES)}


def key(name: str, **labels: str) -> tuple[str, frozenset]:
    return name, frozenset(labels.items())


def of_run(text: str, run: str) -> dict[tuple[str, frozenset], float]:
    return {k: v for k, v in training(text).items() if ("run", run) in k[1]}


def rejected_count(text: str, reason: str) -> float:
    return samples(text)[key("stepscope_exporter_ingest_rejected_total", reason=reason)]


def wait_for(condition, timeout: float = 15.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def exporter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with running_exporter(tmp_path_factory.mktemp("ingest"), *LIMIT_FLAGS) as proc:
        yield proc


# --- accepted pushes ----------------------------------------------------------------------------

def test_every_family_appears_with_run_and_rank_and_no_job(exporter: Running) -> None:
    response = requests.put(group_url(exporter.url, "all"), data=full_body(steps=4), timeout=10)
    assert (response.status_code, response.text) == (200, "stored group run='all' rank=0: 21 series\n")
    text = scrape(exporter.url)
    pushed = of_run(text, "all")
    names = {name for name, _ in pushed}
    assert names == {
        "stepscope_step_phase_seconds_bucket", "stepscope_step_phase_seconds_count",
        "stepscope_step_phase_seconds_sum", "stepscope_step_seconds_bucket", "stepscope_step_seconds_count",
        "stepscope_step_seconds_sum", "stepscope_steps_total", "stepscope_samples_total",
        "stepscope_training_info", "stepscope_training_state",
        "stepscope_training_last_push_timestamp_seconds",
    }
    assert all(("rank", "0") in labels for _, labels in pushed)
    assert not any(label in ("job", "instance") for _, labels in training(text) for label, _ in labels)
    assert pushed[key("stepscope_steps_total", run="all", rank="0")] == 4
    bucket = key("stepscope_step_phase_seconds_bucket", run="all", rank="0", phase="forward", le="0.1")
    assert pushed[bucket] == 3
    assert pushed[key("stepscope_training_info", run="all", rank="0", local_rank="0", world_size="2",
                      pid=str(os.getpid()), framework="torch")] == 1
    last_push = pushed[key("stepscope_training_last_push_timestamp_seconds", run="all", rank="0")]
    assert abs(last_push - time.time()) < 300
    # each family is rendered once even with several groups stored
    requests.put(group_url(exporter.url, "all", "1"), data=full_body(), timeout=10).raise_for_status()
    type_lines = [line for line in scrape(exporter.url).splitlines() if line.startswith("# TYPE")]
    assert len(type_lines) == len(set(type_lines))


def test_repushing_the_same_body_is_idempotent(exporter: Running) -> None:
    timestamp = "stepscope_training_last_push_timestamp_seconds"
    seen = []
    for _ in range(2):
        requests.put(group_url(exporter.url, "same"), data=full_body(steps=7), timeout=10).raise_for_status()
        seen.append({k: v for k, v in of_run(scrape(exporter.url), "same").items() if k[0] != timestamp})
    assert seen[0] == seen[1]
    assert len(seen[0]) == 21


def test_post_merges_families_and_put_replaces_the_group(exporter: Running) -> None:
    url = group_url(exporter.url, "merge")
    requests.put(url, data=full_body(steps=4), timeout=10).raise_for_status()
    body = counter("stepscope_steps_total", 10) + state_family("eval")
    assert requests.post(url, data=body, timeout=10).status_code == 200
    text = scrape(exporter.url)
    assert of_run(text, "merge")[key("stepscope_steps_total", run="merge", rank="0")] == 10
    assert of_run(text, "merge")[key("stepscope_training_state", run="merge", rank="0", state="eval")] == 1
    assert any(name == "stepscope_step_phase_seconds_count" for name, _ in of_run(text, "merge"))
    requests.put(url, data=counter("stepscope_steps_total", 11), timeout=10).raise_for_status()
    assert {name for name, _ in of_run(scrape(exporter.url), "merge")} == {
        "stepscope_steps_total", "stepscope_training_last_push_timestamp_seconds"}


def test_delete_removes_the_group(exporter: Running) -> None:
    url = group_url(exporter.url, "gone")
    requests.put(url, data=full_body(), timeout=10).raise_for_status()
    assert of_run(scrape(exporter.url), "gone")
    response = requests.delete(url, timeout=10)
    assert (response.status_code, response.text) == (202, "deleted group run='gone' rank=0\n")
    assert of_run(scrape(exporter.url), "gone") == {}
    response = requests.delete(url, timeout=10)
    assert (response.status_code, response.text) == (202, "no group run='gone' rank=0; nothing deleted\n")


def test_base64_path_values_and_matching_body_labels(exporter: Running) -> None:
    # "lr=3e-4/bs 64" base64url-encoded, as Pushgateway clients do for values with a slash
    url = f"{exporter.url}/metrics/job/stepscope/run@base64/bHI9M2UtNC9icyA2NA/rank@base64/Mw"
    body = '# TYPE stepscope_steps_total counter\nstepscope_steps_total{run="lr=3e-4/bs 64",rank="3"} 5\n'
    assert requests.put(url, data=body, timeout=10).status_code == 200
    assert samples(scrape(exporter.url))[key("stepscope_steps_total", run="lr=3e-4/bs 64", rank="3")] == 5


def test_concurrent_pushes_all_land(exporter: Running) -> None:
    def push_rank(rank: int) -> list[int]:
        url = group_url(exporter.url, "busy", str(rank))
        return [requests.put(url, data=full_body(steps=steps), timeout=10).status_code for steps in (1, 2, 5)]

    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = [status for result in pool.map(push_rank, range(8)) for status in result]
    assert statuses == [200] * 24
    pushed = of_run(scrape(exporter.url), "busy").items()
    steps = {dict(labels)["rank"]: v for (name, labels), v in pushed if name == "stepscope_steps_total"}
    assert steps == {str(rank): 5 for rank in range(8)}


def test_scrape_with_pushed_data_passes_promtool(exporter: Running, tmp_path: Path) -> None:
    for rank in ("0", "1"):
        requests.put(group_url(exporter.url, "lint", rank), data=full_body(), timeout=10).raise_for_status()
    text = scrape(exporter.url)
    assert "stepscope_step_phase_seconds_bucket" in text
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=30)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


# --- refused pushes: status, message, and nothing stored changes -------------------------------

def bucket_body(buckets: list[tuple[str, float]], count: float) -> str:
    lines = histogram("stepscope_step_seconds", buckets, count, 1.0)
    return "# TYPE stepscope_step_seconds histogram\n" + lines


STEPS = "# TYPE stepscope_steps_total counter\n"
REFUSALS = {
    "unknown_family": (counter("node_load_total", 1), 400,
                       "unknown family 'node_load_total': the push API accepts only "
                       "stepscope_step_phase_seconds"),
    "untyped": ("stepscope_steps_total 5\n", 400,
                "family stepscope_steps_total must be TYPE counter, got untyped (no '# TYPE' line)"),
    "wrong_type": ("# TYPE stepscope_steps_total gauge\nstepscope_steps_total 5\n", 400,
                   "family stepscope_steps_total must be TYPE counter, got gauge"),
    "unparsable": (STEPS + "stepscope_steps_total{ 1\n", 400,
                   "cannot parse the text exposition (format 0.0.4) at line 2 'stepscope_steps_total{ 1'"),
    "duplicate": (STEPS + "stepscope_steps_total 1\nstepscope_steps_total 2\n", 400,
                  "duplicate sample stepscope_steps_total"),
    "job_label": (STEPS + 'stepscope_steps_total{job="x"} 1\n', 400,
                  "label 'job' is not accepted in the body"),
    "instance_label": (STEPS + 'stepscope_steps_total{instance="x"} 1\n', 400,
                       "label 'instance' is not accepted in the body"),
    "run_mismatch": (STEPS + 'stepscope_steps_total{run="other"} 1\n', 400,
                     "label run='other' differs from run='refuse' in the URL path"),
    "unexpected_label": (STEPS + 'stepscope_steps_total{gpu="0"} 1\n', 400,
                         "unexpected label 'gpu' (allowed: none besides run and rank)"),
    "missing_label": ('# TYPE stepscope_training_state gauge\nstepscope_training_state 1\n', 400,
                      "stepscope_training_state: missing label 'state'"),
    "bad_pid": (info_family(pid=0), 400, "label 'pid' must be a positive process id"),
    "bad_start_time": (info_family(start_time="-3"), 400,
                       "label 'start_time' must be the process start time in Unix seconds"),
    "label_too_long": (phase_family(("p" * 33,)), 400,
                       "value of label 'phase' has more than 32 characters, the limit "
                       "(--ingest-max-label-value-length)"),
    "negative_counter": (STEPS + "stepscope_steps_total -1\n", 400, "a counter must be >= 0, got -1.0"),
    "info_not_one": (info_family().replace("} 1", "} 2"), 400, "an info metric must be 1, got 2.0"),
    "timestamp": (STEPS + "stepscope_steps_total 1 1700000000000\n", 400, "must not carry a timestamp"),
    "non_cumulative": (bucket_body([("0.1", 5), ("1", 3), ("+Inf", 5)], 5), 400,
                       'buckets are not cumulative: le="1.0" holds 3, less than 5 in le="0.1"'),
    "no_inf_bucket": (bucket_body([("0.1", 5), ("1", 5)], 5), 400, 'stepscope_step_seconds{rank="0",'
                      'run="refuse"}: no le="+Inf" bucket'),
    "count_mismatch": (bucket_body([("0.1", 1), ("+Inf", 5)], 4), 400,
                       '_count 4 differs from 5 in the le="+Inf" bucket'),
    "too_many_phases": (phase_family(("a", "b", "c", "d", "e")), 400,
                        "the body holds more than 4 distinct phases, the limit per group (--ingest-max-phases): "
                        "a, b, c, d, e"),
    "too_many_series": (full_body(phases=("a", "b", "c", "d")), 400,
                        "the body holds more than 30 series, the limit per group (--ingest-max-series-per-group)"),
    "run_conflict": (full_body(pid=1), 409,  # another process than this one, which pushed the group
                     f"run 'refuse' rank 0 is pushed by another process on this node (pid {os.getpid()}, last "
                     "push "),
}
REASON = {
    "untyped": "wrong_type", "unparsable": "malformed", "duplicate": "malformed", "job_label": "bad_label",
    "instance_label": "bad_label", "run_mismatch": "bad_label", "unexpected_label": "bad_label",
    "missing_label": "bad_label", "bad_pid": "bad_label", "bad_start_time": "bad_label",
    "negative_counter": "bad_value",
    "info_not_one": "bad_value", "timestamp": "bad_value", "non_cumulative": "non_cumulative_buckets",
    "no_inf_bucket": "non_cumulative_buckets", "count_mismatch": "non_cumulative_buckets",
}


def assert_refused(exporter: Running, method: str, url: str, status: int, message: str, reason: str | None,
                   **kwargs) -> None:  # type: ignore[no-untyped-def]
    """The request gets `status` and a message containing `message`; stored data stays as it was."""
    requests.put(group_url(exporter.url, "refuse"), data=full_body(steps=3), timeout=10).raise_for_status()
    before = scrape(exporter.url)
    response = requests.request(method, url, timeout=10, **kwargs)
    assert response.status_code == status, response.text
    assert message in response.text
    after = scrape(exporter.url)
    assert training(after) == training(before)
    if reason is not None:
        assert rejected_count(after, reason) == rejected_count(before, reason) + 1


@pytest.mark.parametrize("case", list(REFUSALS))
@pytest.mark.parametrize("method", ["PUT", "POST"])
def test_refused_bodies_change_nothing(exporter: Running, case: str, method: str) -> None:
    body, status, message = REFUSALS[case]
    assert_refused(exporter, method, group_url(exporter.url, "refuse"), status, message,
                   REASON.get(case, case), data=body)


@pytest.mark.parametrize(("path", "status", "message"), [
    ("/metrics/job/stepscope/run/refuse", 404, "push to /metrics/job/stepscope/run/<run>/rank/<rank>"),
    ("/metrics/job/other/run/refuse/rank/0", 404, "job 'other' is not served here"),
    ("/metrics/job/stepscope/run/refuse/rank/x", 400, "rank 'x' in the path is not a non-negative integer"),
    ("/metrics/job/stepscope/run@base64/%%%/rank/0", 400, "value of run@base64 is not base64url-encoded"),
])
def test_bad_paths_are_refused(exporter: Running, path: str, status: int, message: str) -> None:
    assert_refused(exporter, "PUT", exporter.url + path, status, message, "bad_path", data=full_body())


def test_long_run_in_path_is_refused(exporter: Running) -> None:
    assert_refused(exporter, "PUT", group_url(exporter.url, "r" * 33), 400,
                   "run in the path has 33 characters, over the limit of 32", "label_too_long",
                   data=full_body())


def test_delete_of_a_bad_path_deletes_nothing(exporter: Running) -> None:
    assert_refused(exporter, "DELETE", f"{exporter.url}/metrics/job/stepscope/run/refuse", 404, "push to",
                   "bad_path")


def test_oversized_body_gets_413(exporter: Running) -> None:
    body = full_body() + "#" * 8192
    assert_refused(exporter, "PUT", group_url(exporter.url, "refuse"), 413,
                   f"body of {len(body)} bytes exceeds the limit of 8192 bytes", None, data=body)


def test_protobuf_bodies_get_415(exporter: Running) -> None:
    headers = {"Content-Type": "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily"}
    assert_refused(exporter, "PUT", group_url(exporter.url, "refuse"), 415, "only the text exposition format",
                   "unsupported_media_type", data=b"\x00\x01", headers=headers)


def test_chunked_bodies_get_411(exporter: Running) -> None:
    assert_refused(exporter, "PUT", group_url(exporter.url, "refuse"), 411,
                   "send the body with a Content-Length", "length_required",
                   data=iter([full_body().encode()]))


def test_compressed_bodies_get_415(exporter: Running) -> None:
    assert_refused(exporter, "PUT", group_url(exporter.url, "refuse"), 415,
                   "Content-Encoding 'gzip' is not supported", "unsupported_media_type",
                   data=gzip.compress(full_body().encode()), headers={"Content-Encoding": "gzip"})


@pytest.mark.parametrize("method", ["PUT", "POST"])
def test_an_empty_push_is_refused_at_once_and_keeps_the_group(exporter: Running, method: str) -> None:
    """Content-Length: 0 is a 400 empty_body within a second, and the rank's series stay: a PUT of nothing
    would replace them with nothing, and DELETE is how a group goes (the Pushgateway subset of DESIGN.md).
    Before, the exporter waited 10 s for a body that had already ended, then answered 408 incomplete_body."""
    url = group_url(exporter.url, "refuse")
    requests.put(url, data=full_body(steps=3), timeout=10).raise_for_status()
    before = scrape(exporter.url)
    started = time.monotonic()
    response = requests.request(method, url, data=b"", timeout=5)  # requests sends Content-Length: 0
    assert time.monotonic() - started < 2
    assert (response.status_code, response.text) == (
        400, f"the {method} has an empty body; nothing stored: send the rank's families in the text format "
             "(DELETE removes a group)\n")
    after = scrape(exporter.url)
    assert training(after) == training(before)
    assert rejected_count(after, "empty_body") == rejected_count(before, "empty_body") + 1


def test_a_group_is_one_process_s_until_it_closes(exporter: Running) -> None:
    """Two processes pushing run "train" rank 0 replaced each other's series at every push, unseen. The second
    gets 409 (counted, logged once, the first's series untouched) until the first pushes state idle."""
    url = group_url(exporter.url, "clash")
    requests.put(url, data=full_body(steps=500, pid=111), timeout=10).raise_for_status()
    before = scrape(exporter.url)
    for method in ("PUT", "POST", "PUT"):
        response = requests.request(method, url, data=full_body(steps=3, pid=222), timeout=10)
        assert response.status_code == 409
        assert response.text.startswith("run 'clash' rank 0 is pushed by another process on this node (pid 111, ")
        assert response.text.rstrip().endswith("taken once the other one closes or stops pushing for 12.5s")
    after = scrape(exporter.url)
    assert of_run(after, "clash") == of_run(before, "clash")
    assert rejected_count(after, "run_conflict") == rejected_count(before, "run_conflict") + 3
    logged = [line for line in exporter.log().splitlines() if "run 'clash' rank 0 is pushed by another" in line]
    assert len(logged) == 1 and "WARNING" in logged[0] and "(409 run_conflict)" in logged[0]

    closed = info_family(pid=111) + state_family("idle", STATES) + counter("stepscope_steps_total", 500)
    requests.put(url, data=closed, timeout=10).raise_for_status()
    requests.put(url, data=full_body(steps=3, pid=222), timeout=10).raise_for_status()
    pushed = of_run(scrape(exporter.url), "clash")
    assert pushed[key("stepscope_steps_total", run="clash", rank="0")] == 3
    assert {dict(labels)["pid"] for name, labels in pushed if name == "stepscope_training_info"} == {"222"}


def test_a_delete_without_a_body_is_answered_at_once(exporter: Running) -> None:
    url = group_url(exporter.url, "gone-at-once")
    requests.put(url, data=full_body(), timeout=10).raise_for_status()
    started = time.monotonic()
    response = requests.delete(url, timeout=5)
    assert response.status_code == 202 and time.monotonic() - started < 2
    assert not of_run(scrape(exporter.url), "gone-at-once")


# --- the bounds of ranks without a store (exporter.ingest.node_bounds) ---------------------------

def _put_wanted(exporter: Running, run: str, rank: str, wanted: str | None) -> requests.Response:
    headers = {"Stepscope-Bounds": wanted} if wanted is not None else {}
    response = requests.put(group_url(exporter.url, run, rank), data=full_body(), headers=headers, timeout=10)
    response.raise_for_status()
    return response


def _run_counts(response: requests.Response) -> dict | None:
    raw = response.headers.get("Stepscope-Run-Bounds")
    return json.loads(raw) if raw is not None else None


def test_a_push_is_answered_what_the_runs_ranks_here_want(exporter: Running) -> None:
    """Each rank's push says which fine blocks it wants; the answer counts the run's ranks on this node, its own
    push included, and no other run's. A push without the header withdraws its rank; a delete forgets it."""
    _put_wanted(exporter, "wants", "0", '{"step":[40,41],"phase:forward":[9]}')
    _put_wanted(exporter, "other-wants", "0", '{"step":[70]}')
    answer = _put_wanted(exporter, "wants", "1", '{"step":[41,42]}')
    assert _run_counts(answer) == {"step": {"40": 1, "41": 2, "42": 1}, "phase:forward": {"9": 1}}
    assert _run_counts(_put_wanted(exporter, "wants", "0", None)) is None
    assert _run_counts(_put_wanted(exporter, "wants", "1", '{"step":[41]}')) == {"step": {"41": 1}}
    _put_wanted(exporter, "wants", "0", '{"step":[40]}')
    requests.delete(group_url(exporter.url, "wants", "0"), timeout=10).raise_for_status()
    assert _run_counts(_put_wanted(exporter, "wants", "1", '{"step":[41]}')) == {"step": {"41": 1}}


@pytest.mark.parametrize(("wanted", "message"), [
    ("[40]", "header Stepscope-Bounds must be an object of at most 5 histograms"),
    ("{nope", "header Stepscope-Bounds is not JSON"),
    pytest.param("[" * 5000, "header Stepscope-Bounds is not JSON", id="nested-past-the-stack"),  # was 500
    ('{"step":[40,"41"]}', "header Stepscope-Bounds gives 'step' blocks [40, '41']: a list of integers from 0 to 215"),
    ('{"step":[-1]}', "a list of integers from 0 to 215 expected"),
    ('{"forward":[3]}', 'header Stepscope-Bounds names histogram \'forward\': "step" or "phase:<phase>" expected'),
])
def test_a_bad_bounds_header_is_refused(exporter: Running, wanted: str, message: str) -> None:
    """A hook's bug shows as a refused push naming the header, not as bounds that read off."""
    assert_refused(exporter, "PUT", group_url(exporter.url, "refuse"), 400, message, "malformed",
                   data=full_body(), headers={"Stepscope-Bounds": wanted})


# --- TTL, group limit, access -------------------------------------------------------------------

def test_groups_expire_after_the_ttl_and_a_ttl_too_short_for_rank_lost_is_said(tmp_path: Path) -> None:
    """A TTL under StepscopeRankLost's 45 s + 15 s drops a killed rank before the alert can page it: said at start
    (2 SIGKILLed ranks went unpaged under --ingest-ttl 20 with nothing logged)."""
    with running_exporter(tmp_path, "--collectors", "", "--ingest-ttl", "3") as exp:
        requests.put(group_url(exp.url, "short"), data=full_body(), timeout=10).raise_for_status()
        assert of_run(scrape(exp.url), "short")
        assert wait_for(lambda: of_run(scrape(exp.url), "short") == {})
        assert samples(scrape(exp.url))[key("stepscope_exporter_ingest_groups")] == 0
        assert ("WARNING exporter: --ingest-ttl 3 drops a rank that stops pushing without closing "
                "(SIGKILL, the OOM killer) before StepscopeRankLost can page it (no push for 45 s, for 15 s): killed "
                "ranks go unalerted; use more than 60 s (the default is 600)") in exp.log()


def test_group_limit(tmp_path: Path) -> None:
    with running_exporter(tmp_path, "--collectors", "", "--ingest-max-groups", "2") as exp:
        for rank in ("0", "1", "1"):
            response = requests.put(group_url(exp.url, "lim", rank), data=full_body(), timeout=10)
            assert response.status_code == 200
        response = requests.put(group_url(exp.url, "lim", "2"), data=full_body(), timeout=10)
        assert response.status_code == 429
        assert "cannot add group run='lim' rank=2: 2 groups are stored, the limit (--ingest-max-groups 2)" \
            in response.text
        assert requests.delete(group_url(exp.url, "lim", "0"), timeout=10).status_code == 202
        assert requests.put(group_url(exp.url, "lim", "2"), data=full_body(), timeout=10).status_code == 200
        text = scrape(exp.url)
        assert {dict(labels)["rank"] for name, labels in training(text)} == {"1", "2"}
        assert rejected_count(text, "too_many_groups") == 1


def test_token_is_required_once_configured(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret-token\n")
    with running_exporter(tmp_path, "--collectors", "", "--ingest-token-file", str(token_file)) as exp:
        url = group_url(exp.url, "tok")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-token"}):
            response = requests.put(url, data=full_body(), headers=headers, timeout=10)
            assert response.status_code == 401
            assert "missing or wrong bearer token" in response.text
        assert requests.delete(url, timeout=10).status_code == 401
        headers = {"Authorization": "Bearer s3cret-token"}
        response = requests.put(url, data=full_body(), headers=headers, timeout=10)
        assert response.status_code == 200
        text = scrape(exp.url)
        assert of_run(text, "tok")
        assert rejected_count(text, "unauthorized") == 4


@pytest.mark.parametrize(("content", "message"), [("\n  \n", "is empty"), (b"\xff\xfe", "cannot read")])
def test_unusable_token_file_fails_cleanly(tmp_path: Path, content: str | bytes, message: str) -> None:
    token_file = tmp_path / "token"
    if isinstance(content, bytes):
        token_file.write_bytes(content)
    else:
        token_file.write_text(content)
    result = subprocess.run(
        [sys.executable, "-m", "stepscope.exporter", "--collectors", "", "--listen-address", f"127.0.0.1:{free_port()}",
         "--ingest-token-file", str(token_file)],
        capture_output=True, text=True, timeout=30, env={**os.environ, **exporter_env()},
    )
    assert result.returncode == 2
    assert result.stderr.startswith("stepscope-exporter: error: ")
    assert message in result.stderr and "--ingest-token-file" in result.stderr
    assert "Traceback" not in result.stderr


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine that is not loopback (pushing to it stays on this machine)."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


@pytest.fixture
def own_address() -> str:
    address = non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to push from")
    return address


@pytest.mark.parametrize("allow", [False, True])
def test_non_loopback_clients_need_configuration(tmp_path: Path, own_address: str, allow: bool) -> None:
    port = free_port()
    flags = ["--collectors", "", "--listen-address", f"0.0.0.0:{port}"]
    if allow:
        flags += ["--ingest-allow", f"{own_address}/32"]
    with running_exporter(tmp_path, *flags, port=port) as exp:
        session = requests.Session()
        session.trust_env = False  # no proxy: the request must come from own_address, not loopback
        response = session.put(group_url(f"http://{own_address}:{port}", "net"), data=full_body(), timeout=10)
        if allow:
            assert response.status_code == 200
            assert of_run(scrape(exp.url), "net")
        else:
            assert response.status_code == 403
            assert f"pushes from {own_address} are not allowed" in response.text
            assert "--ingest-token-file" in response.text and "--ingest-allow" in response.text
            assert of_run(scrape(exp.url), "net") == {}


def test_an_ipv4_client_of_the_dual_stack_socket_is_named_by_its_ipv4_address(tmp_path: Path, own_address: str) -> None:
    """`[::]:PORT` (and the default `:PORT`) is one IPv6 socket that IPv4 clients reach too, as ::ffff:a.b.c.d.
    The access check maps such an address to its IPv4 one; the log named the mapped form, so a grep for the
    client's address (or a reader) found nothing."""
    port = free_port()
    with running_exporter(tmp_path, "--collectors", "", "--listen-address", f"[::]:{port}", port=port) as exp:
        session = requests.Session()
        session.trust_env = False
        response = session.put(group_url(f"http://{own_address}:{port}", "net"), data=full_body(), timeout=10)
        assert response.status_code == 403 and f"pushes from {own_address} are not allowed" in response.text
    assert f"refused PUT /metrics/job/stepscope/run/net/rank/0 from {own_address} (403 forbidden)" in exp.log()
    assert "::ffff:" not in exp.log()


def test_registered_pid_gets_process_series(tmp_path: Path) -> None:
    with running_exporter(tmp_path, "--collectors", "process") as exp:
        body = info_family(pid=os.getpid()) + counter("stepscope_steps_total", 1)
        requests.put(group_url(exp.url, "proc", "5"), data=body, timeout=10).raise_for_status()
        labels = {"pid": str(os.getpid()), "run": "proc", "rank": "5"}

        def published() -> bool:
            return any(name == "stepscope_process_cpu_seconds_total" and labels.items() <= dict(lbls).items()
                       for name, lbls in samples(scrape(exp.url)))

        assert wait_for(published)

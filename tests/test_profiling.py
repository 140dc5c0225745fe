"""The hooks' trace taker on its own: requests from push answers, torch.profiler at step boundaries,
the writer's cap and pruning, and the status the pushes carry. Real torch.profiler on the CPU."""

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import stepscope.hooks as th
from stepscope.hooks import config as config_module
from stepscope.hooks import tracker as tracker_module
from stepscope.hooks.cuda import CudaTimer
from stepscope.hooks.profiling import (
    CANCEL_HEADER,
    MAX_RUN_CHARS,
    REQUEST_HEADER,
    STATUS_HEADER,
    TraceSettings,
    TraceTaker,
    TraceTooLarge,
    gzip_capped,
    parse_request,
    prune,
    trace_file_name,
    trace_file_prefix,
)
from stepscope_testkit.fake_cuda import FakeCuda
from stepscope_testkit.traces import step_annotations


class Armed:
    """Stands in for the tracker: holds the boundary callback the taker arms."""

    def __init__(self) -> None:
        self.boundary: Callable[[], None] | None = None

    def __call__(self, boundary: Callable[[], None] | None) -> None:
        self.boundary = boundary

    def steps(self, count: int) -> None:
        model = torch.nn.Linear(8, 1)
        for _ in range(count):
            model(torch.randn(4, 8)).sum().backward()
            if self.boundary is not None:
                self.boundary()


def taker(tmp_path: Path, armed: Armed, **settings: int) -> TraceTaker:
    return TraceTaker("unit/run", 3, TraceSettings(str(tmp_path / "traces"), settings.get("max_bytes", 10**8),
                                                   settings.get("keep", 5)), armed)


def ask(traces: TraceTaker, request_id: str, steps: int) -> None:
    traces.on_answer({REQUEST_HEADER: json.dumps({"id": request_id, "steps": steps})})


def status(traces: TraceTaker) -> dict:
    return json.loads(traces.headers()[STATUS_HEADER])


def finish(traces: TraceTaker) -> dict:
    traces.close()  # joins the writer
    return status(traces)["last"]


def test_a_request_records_exactly_its_steps_from_the_next_boundary(tmp_path: Path) -> None:
    armed = Armed()
    traces = taker(tmp_path, armed)
    assert status(traces) == {"v": 2, "state": "ready"} and armed.boundary is None
    ask(traces, "r1", 4)
    assert armed.boundary is not None and status(traces)["state"] == "running"
    armed.steps(3)
    assert status(traces)["done_steps"] == 1  # boundary 1 started it, 2 ended the warm-up step, 3 one step
    armed.steps(10)
    assert armed.boundary is None  # disarmed once the schedule ended: nothing on the hot path again
    last = finish(traces)
    assert last["ok"] and last["steps"] == 4 and last["requested_steps"] == 4 and last["reason"] == ""
    path = Path(last["path"])
    assert path.parent == tmp_path / "traces" and path.name.startswith(trace_file_prefix("unit/run", 3))
    assert last["size"] == path.stat().st_size
    assert step_annotations(path) == [f"ProfilerStep#{n}" for n in range(1, 5)]
    assert traces.published() is not None and traces.published().path == str(path)
    assert status(traces)["state"] == "ready"


def test_a_repeated_answer_and_a_second_request_while_tracing_are_ignored(tmp_path: Path) -> None:
    armed = Armed()
    traces = taker(tmp_path, armed)
    ask(traces, "r1", 2)
    ask(traces, "r2", 2)  # one at a time
    armed.steps(5)
    assert finish(traces)["id"] == "r1"
    ask(traces, "r1", 2)  # the exporter repeats an answer the rank already took: no second trace
    assert armed.boundary is None


def test_close_mid_trace_writes_the_steps_it_has(tmp_path: Path) -> None:
    armed = Armed()
    traces = taker(tmp_path, armed)
    ask(traces, "r1", 50)
    armed.steps(4)
    last = finish(traces)
    assert last["ok"] and last["steps"] == 3 and last["reason"] == "training ended after 3 of 50 steps"
    assert len(step_annotations(last["path"])) == 3


def test_a_cancelled_trace_stops_at_the_next_step_and_writes_nothing(tmp_path: Path) -> None:
    """The exporter's cancel header mid-trace: the training thread stops the profiler at its next boundary,
    nothing is written, the trace directory stays empty and the next push says `cancelled` with the steps it
    had. Before, the header did not exist: the trace ran all its steps and wrote its file."""
    armed = Armed()
    traces = taker(tmp_path, armed)
    ask(traces, "r1", 1000)
    armed.steps(5)
    traces.on_answer({CANCEL_HEADER: "other"})  # not this request's: nothing happens
    traces.on_answer({CANCEL_HEADER: "r1"})
    assert status(traces)["state"] == "running"  # until the training thread's next step boundary
    armed.steps(1)
    assert armed.boundary is None and status(traces)["state"] == "ready"
    last = status(traces)["last"]  # nothing to wait for: no writer
    assert (last["ok"], last["cancelled"], last["steps"]) == (False, True, 3)
    assert last["reason"] == "cancelled after 3 of 1000 steps; no trace written"
    assert not any((tmp_path / "traces").iterdir())
    ask(traces, "r2", 2)  # free for the next request
    armed.steps(4)
    assert finish(traces)["ok"]


def test_a_cancel_before_the_first_step_and_at_close_writes_nothing(tmp_path: Path) -> None:
    armed = Armed()
    traces = taker(tmp_path, armed)
    ask(traces, "r1", 10)
    traces.on_answer({CANCEL_HEADER: "r1"})  # taken, not started: ends at once
    assert armed.boundary is None and status(traces)["last"]["reason"] == "cancelled after 0 of 10 steps; no trace " \
                                                                          "written"
    ask(traces, "r2", 10)
    armed.steps(3)
    traces.on_answer({CANCEL_HEADER: "r2"})
    last = finish(traces)  # training ends before its next step: still no file, not the steps it had
    assert (last["id"], last["cancelled"]) == ("r2", True)
    assert not any((tmp_path / "traces").iterdir())


def test_a_profiler_session_of_the_user_is_left_alone(tmp_path: Path) -> None:
    armed = Armed()
    traces = taker(tmp_path, armed)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as users:
        assert status(traces)["state"] == "unavailable"  # the exporter refuses requests meanwhile
        ask(traces, "r1", 2)  # one that arrived anyway is not started
        assert armed.boundary is None
        armed.steps(2)
    last = status(traces)["last"]
    assert not last["ok"] and last["reason"].startswith("another torch.profiler session is recording")
    assert any(event.name == "aten::linear" for event in users.events())  # the user's trace is whole
    ask(traces, "r2", 1)  # armed before the user's session starts, started while it runs: not started
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as users:
        armed.steps(2)
    assert status(traces)["last"]["reason"] == "another torch.profiler session is recording in this process"
    assert any(event.name == "aten::linear" for event in users.events())
    assert armed.boundary is None and status(traces)["state"] == "ready"


def test_an_unwritable_trace_directory_fails_at_once(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    armed = Armed()
    traces = TraceTaker("r", 0, TraceSettings(str(tmp_path / "file" / "traces"), 10**8, 5), armed)
    ask(traces, "r1", 2)
    last = status(traces)["last"]
    assert armed.boundary is None and not last["ok"]
    assert last["reason"].startswith(f"cannot create the trace directory {tmp_path / 'file' / 'traces'} "
                                     "(STEPSCOPE_TRACE_DIR)")


def test_a_trace_over_the_cap_is_deleted_and_fails(tmp_path: Path) -> None:
    armed = Armed()
    traces = taker(tmp_path, armed, max_bytes=2048)
    ask(traces, "r1", 3)
    armed.steps(6)
    last = finish(traces)
    assert not last["ok"] and "over 2048 bytes gzipped" in last["reason"] and "ask for fewer steps" in last["reason"]
    assert list((tmp_path / "traces").iterdir()) == []  # neither the trace nor its raw JSON is left


FULL_DIRECTORY_SCRIPT = """
import json, os, resource, signal, sys
import torch
from stepscope.hooks.profiling import REQUEST_HEADER, TraceSettings, TraceTaker
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
armed = []
traces = TraceTaker("r", 0, TraceSettings(sys.argv[1], 10**8, 5), armed.append)
traces.on_answer({REQUEST_HEADER: json.dumps({"id": "full1", "steps": 3})})
model = torch.nn.Linear(8, 1)
for _ in range(8):
    model(torch.randn(4, 8)).sum().backward()
    if armed and armed[-1] is not None:
        armed[-1]()
traces.close()
print(json.dumps({"last": traces.status()["last"], "files": os.listdir(sys.argv[1])}))
"""


def test_a_trace_the_disk_cannot_hold_fails_with_the_reason_and_leaves_no_file(tmp_path: Path) -> None:
    """A write that fails for want of room (EFBIG under RLIMIT_FSIZE stands in for ENOSPC: Kineto sees a
    failed write either way) is reported as such, not as 'No such file', and leaves no temporary file."""
    directory = tmp_path / "traces"
    run = subprocess.run([sys.executable, "-c", FULL_DIRECTORY_SCRIPT, str(directory)], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    assert not outcome["last"]["ok"]
    reason = outcome["last"]["reason"]
    assert reason.startswith(f"could not write the trace to {directory}: torch.profiler could not write the trace "
                             "file ("), reason
    assert "is the disk full?" in reason and "No such file" not in reason
    assert outcome["files"] == []


@pytest.mark.parametrize("raw", ["not json", '{"id": "a b", "steps": 2}', '{"id": "a", "steps": 0}',
                                 '{"id": "a", "steps": 1001}', '{"id": "a", "steps": true}', '["a", 2]',
                                 "[" * 60_000],  # nested past the stack, within http.client's 64 KiB header line
                         ids=lambda raw: raw[:30])
def test_bad_requests_are_ignored(tmp_path: Path, raw: str) -> None:
    with pytest.raises(ValueError):
        parse_request(raw)
    armed = Armed()
    traces = taker(tmp_path, armed)
    traces.on_answer({REQUEST_HEADER: raw})
    assert armed.boundary is None and status(traces) == {"v": 2, "state": "ready"}


def test_gzip_capped_writes_whole_or_nothing(tmp_path: Path) -> None:
    source = tmp_path / "raw.json"
    source.write_bytes(os.urandom(200_000))  # incompressible
    target = tmp_path / "t.gz"
    assert gzip_capped(source, target, 10**6) == target.stat().st_size
    assert gzip.decompress(target.read_bytes()) == source.read_bytes()
    with pytest.raises(TraceTooLarge):
        gzip_capped(source, tmp_path / "u.gz", 100_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw.json", "t.gz"]


def _traces(directory: Path, prefix: str, count: int) -> list[Path]:
    """`count` trace files of `prefix` as the writer names them, the first the oldest."""
    paths = []
    for index in range(count):
        path = directory / trace_file_name(prefix, f"req{index}")
        path.write_text("")
        os.utime(path, ns=(index * 10**9, index * 10**9))
        paths.append(path)
    return paths


def test_prune_keeps_the_newest_traces_of_one_run_and_rank(tmp_path: Path) -> None:
    mine, other = trace_file_prefix("run", 0), trace_file_prefix("run", 1)
    kept, others = _traces(tmp_path, mine, 4), _traces(tmp_path, other, 4)
    assert prune(tmp_path, mine, keep=2) == kept[:2]
    assert all(path.exists() for path in kept[2:] + others)


def test_each_user_of_a_node_has_a_default_trace_directory_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default was one /tmp/stepscope-traces, made (mode 0755) by the first user's process that traced: on a
    node shared by users (Slurm) every other user's trace request then failed, permission denied. Named by the
    uid's passwd entry, not $USER (which su keeps), and by the uid where it has none (a container's)."""
    monkeypatch.setenv("USER", "root")
    names = {}
    for uid in (0, 65534, 4_242_424):
        monkeypatch.setattr(os, "getuid", lambda uid=uid: uid)
        names[uid] = os.path.basename(config_module._user_trace_dir())
    assert names == {0: "stepscope-traces-root", 65534: "stepscope-traces-nobody",
                     4_242_424: "stepscope-traces-4242424"}


SWEEP = "sweep-2026-11-29-llama-7b-cosine-warmup2000-bs1024-lr3e-4-dropout0.1-seed"  # 73 characters


@pytest.mark.parametrize(("run", "neighbour", "rank"), [
    (f"{SWEEP}1", f"{SWEEP}2", 0),  # both were 'sweep-...-dropou-rank0-': a prune took the other run's traces
    ("llama/7b", "llama_7b", 0),  # both were 'llama_7b-rank0-'
    ("a", "a-rank1", 1),  # 'a-rank1-*' took in 'a-rank1-rank0-*'
], ids=["long-names", "unsafe-characters", "prefix-of-another"])
def test_a_runs_pruning_never_deletes_another_runs_traces(tmp_path: Path, run: str, neighbour: str,
                                                          rank: int) -> None:
    """Runs sharing a node's trace directory (a user's default, or one set) each keep their newest
    STEPSCOPE_TRACE_KEEP; before, two runs of a sweep named alike had one file name prefix, and tracing one
    with keep 1 deleted the other's trace."""
    mine, theirs = trace_file_prefix(run, rank), trace_file_prefix(neighbour, 0)
    neighbours = _traces(tmp_path, theirs, 2)
    kept = _traces(tmp_path, mine, 2)
    assert prune(tmp_path, mine, keep=1) == kept[:1]
    assert all(path.exists() for path in neighbours)


def test_a_long_run_name_is_cut_to_its_limit_in_file_names() -> None:
    assert len(trace_file_prefix(SWEEP * 3, 0)) == MAX_RUN_CHARS + len("-rank0-")
    assert trace_file_prefix("quickstart", 2) == "quickstart-rank2-"  # a safe, short name as it is


def test_the_step_boundary_hook_joins_gpu_timing_and_an_armed_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """step() makes one test, as before traces existed: a single hook serves CUDA timing, an armed
    trace, or both, whichever thread set its part first."""
    cuda = FakeCuda()
    monkeypatch.setattr(tracker_module, "_cuda_module", lambda: cuda)
    calls: list[str] = []
    monkeypatch.setattr(CudaTimer, "step_done", lambda timer, duration: calls.append("gpu"))
    tracker = th.init(run="hook", push_url="", handle_sigterm=False)
    assert tracker._at_boundary is None
    tracker._arm_tracing(lambda duration: calls.append("trace"))  # armed before any GPU phase
    tracker.step()
    with tracker.phase("forward", cuda=True):  # the CUDA timer joins the armed trace
        pass
    tracker.step()
    tracker._arm_tracing(None)  # the trace ended
    tracker.step()
    assert calls == ["trace", "gpu", "trace", "gpu"]
    tracker.close()

"""stepscope-profile end to end: a real exporter, a real CPU training process (the demo) with the
hooks, a process with the hooks but no torch, the console script, the traces on disk, the Lightning and
transformers callbacks, and (marked gpu) a CUDA training loop.

The demo pushes every 0.2 s, so a request reaches it within a push; the profiler records a few steps.
"""

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import stepscope.hooks as th
from stepscope.exporter import profile_cli
from stepscope_testkit.processes import REPO_ROOT, free_port, running_exporter, sample_values, scrape
from stepscope_testkit.traces import (
    API,
    kernel_names,
    rank_tracing,
    request_state,
    request_trace,
    step_annotations,
    wait_until,
)
from tests.support.demos import start_demo, stop
from tests.support.tiny_models import LinearRegressor

RUN = "prof"
PUSH_INTERVAL = "0.2"
CONSOLE_SCRIPT = Path(sys.executable).parent / "stepscope-profile"
# rank 1: the hooks in a process that never imports torch (no profiler there)
NO_TORCH_RANK = f"""
import time, stepscope.hooks as th
tracker = th.init(run={RUN!r}, rank=1, world_size=2, push_interval={PUSH_INTERVAL})
while True:
    tracker.step(samples=1)
    time.sleep(0.01)
"""


@dataclass
class Node:
    exporter: str
    traces: Path
    demo: subprocess.Popen


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("profile-e2e")
    traces = tmp / "traces"
    with running_exporter(tmp) as exporter:
        # steps of 5+ ms (~150 a second): a few to trace within a push, without the demo taking a whole core
        demo = start_demo(RUN, 0, 2, exporter.url, tmp / "demo.log", "--push-interval", PUSH_INTERVAL,
                          "--extra-step-seconds", "0.005", env={"STEPSCOPE_TRACE_DIR": str(traces)})
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "STEPSCOPE_PUSH_URL": exporter.url}
        no_torch = subprocess.Popen([sys.executable, "-c", NO_TORCH_RANK], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env=env)
        try:
            wait_until(lambda: rank_tracing(exporter.url, RUN, 0) == "ready"
                       and rank_tracing(exporter.url, RUN, 1).startswith("unavailable"),
                       60, f"both ranks pushing (demo log: {tmp / 'demo.log'})")
            yield Node(exporter.url, traces, demo)
        finally:
            stop([demo, no_torch])


def profile(node: Node, *argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """stepscope-profile in this process (the console script runs once, in the first test)."""
    capsys.readouterr()
    code = profile_cli.main(["--exporter", node.exporter, "--run", RUN, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_console_script_writes_a_trace_holding_the_requested_steps(node: Node) -> None:
    done = subprocess.run([str(CONSOLE_SCRIPT), "--exporter", node.exporter, "--run", RUN, "--rank", "0",
                           "--steps", "3", "--wait", "60"], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    [path] = done.stdout.split()
    trace = Path(path)
    assert trace.parent == node.traces and trace.name.startswith(f"{RUN}-rank0-")
    assert trace.name.endswith(".pt.trace.json.gz")
    assert step_annotations(trace) == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    assert "rank 0: 3 steps" in done.stderr
    # published for Prometheus: the latest trace of the rank, its real size and steps
    text = scrape(node.exporter)
    labels = {"run": RUN, "rank": "0", "path": path}
    assert sample_values(text, "stepscope_profile_trace_bytes", **labels) == [trace.stat().st_size]
    assert sample_values(text, "stepscope_profile_trace_steps", **labels) == [3]
    [written] = sample_values(text, "stepscope_profile_trace_timestamp_seconds", **labels)
    assert abs(written - trace.stat().st_mtime) < 5


def test_a_second_request_while_one_runs_is_refused(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    first = request_trace(node.exporter, RUN, 0, steps=100)
    code, out, err = profile(node, "--rank", "0", "--steps", "2", "--wait", "30", capsys=capsys)
    assert code == 2 and out == ""
    assert f"rank 0 of run '{RUN}' is already taking a trace (request {first}" in err
    assert "one trace at a time per rank" in err
    wait_until(lambda: request_state(node.exporter, first)["state"] in ("done", "failed"), 60, "the first trace")
    finished = request_state(node.exporter, first)
    assert finished["state"] == "done" and finished["trace_steps"] == 100, finished
    assert len(step_annotations(finished["path"])) == 100


def test_all_ranks_is_refused_whole_when_one_rank_has_no_profiler(node: Node,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = profile(node, "--all-ranks", "--wait", "5", capsys=capsys)
    assert code == 2 and out == ""
    assert f"profiler not available on rank 1 of run '{RUN}': torch is not imported in this process" in err
    listing = requests.get(f"{node.exporter}{API}", params={"run": RUN}, timeout=10).json()
    assert all(r["state"] in ("done", "failed") for r in listing["requests"])  # nothing asked of rank 0


def test_a_rank_that_never_pushed_here_is_refused_at_once(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    code, _, err = profile(node, "--rank", "5", "--wait", "60", capsys=capsys)
    assert code == 2 and time.monotonic() - started < 30
    assert f"rank 5 of run '{RUN}' not pushing to this exporter (ranks here: 0, 1)" in err
    code, _, err = profile(node, "--run", "nope", capsys=capsys)
    assert code == 2 and f"run 'nope' has no rank pushing to this exporter (runs pushing here: {RUN})" in err


def _ctrl_c_as_at_a_terminal() -> None:
    """SIGINT's default in the command, whose Python then raises KeyboardInterrupt: CI runs the suite in the
    background, where SIGINT is ignored and its children inherit that (the command then traced to the end)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_mid_trace_stops_the_trace_and_leaves_no_file(node: Node) -> None:
    """Ctrl-C while the rank traces: the command exits 130 with one line, the rank stops the profiler at its
    next step and writes nothing, the request ends `cancelled`, and training goes on. Before, the command
    exited 130 ("interrupted") but the rank traced all its steps (here 1000 steps, some 10 s of a slower
    training), wrote the file and the request read `done` with nobody waiting for it."""
    command = subprocess.Popen([sys.executable, "-m", "stepscope.exporter.profile_cli", "--exporter", node.exporter,
                                "--run", RUN, "--rank", "0", "--steps", "1000", "--wait", "120"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, preexec_fn=_ctrl_c_as_at_a_terminal)
    try:
        wait_until(lambda: rank_tracing(node.exporter, RUN, 0) == "running", 60, "the rank taking the request")
    finally:
        command.send_signal(signal.SIGINT)
        out, err = command.communicate(timeout=60)
    assert (command.returncode, out) == (130, ""), err
    assert err.splitlines()[1:] == ["stepscope-profile: interrupted: rank 0 stops its trace at its next step, "
                                    "writing no file"], err
    listing = requests.get(f"{node.exporter}{API}", params={"run": RUN}, timeout=10).json()
    (request_id,) = [r["id"] for r in listing["requests"] if r["steps"] == 1000]
    wait_until(lambda: request_state(node.exporter, request_id)["state"] != "running", 60, "the rank to stop")
    ended = request_state(node.exporter, request_id)
    assert ended["state"] == "cancelled" and ended["path"] == "", ended
    assert ended["reason"] == f"cancelled after {ended['done_steps']} of 1000 steps; no trace written"
    assert ended["done_steps"] < 1000
    assert not list(node.traces.glob(f"*{request_id[:8]}*")) and not list(node.traces.glob(".*"))
    assert node.demo.poll() is None  # training goes on
    steps = sample_values(scrape(node.exporter), "stepscope_steps_total", run=RUN, rank="0")[0]
    wait_until(lambda: sample_values(scrape(node.exporter), "stepscope_steps_total", run=RUN, rank="0")[0] > steps,
               30, "training to step on")
    assert rank_tracing(node.exporter, RUN, 0) == "ready"


def test_a_rank_that_stopped_pushing_times_out_and_its_request_is_cancelled(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    os.kill(node.demo.pid, signal.SIGSTOP)  # hung: its group stays, no more pushes
    started = time.monotonic()
    try:
        code, out, err = profile(node, "--rank", "0", "--wait", "60", capsys=capsys)
    finally:
        os.kill(node.demo.pid, signal.SIGCONT)
    assert code == 2 and out == ""
    assert time.monotonic() - started < 30  # 3 push intervals and a second without a push, not --wait
    assert f"rank 0 of run '{RUN}' stopped pushing before it took the request (its last push was " in err
    # the interval the exporter saw: the demo's 0.2 s, or a little more when the pushes came late on a busy machine
    # (0.3 s in a clean-clone CI run); never the --wait
    every = re.search(r", pushes came every (\d+\.\d) s\): the process is not pushing \(hung, stopped or gone\)", err)
    assert every and float(PUSH_INTERVAL) <= float(every[1]) < 1, err
    listing = requests.get(f"{node.exporter}{API}", params={"run": RUN}, timeout=10).json()
    assert listing["requests"][-1]["state"] == "cancelled"  # a later push does not start a trace nobody waits for


def test_a_rank_that_stops_pushing_mid_trace_is_named_at_once_and_its_trace_cancelled(node: Node) -> None:
    """The rank took the request, then hung (SIGSTOP: its group stays, no more pushes). Before, the command
    waited out --wait (80 s) and said "training is slow, stalled or not stepping ...; raise --wait" while the
    exporter showed its last push 75 s old at a 1 s interval; and the trace went on once the rank came back."""
    command = subprocess.Popen([sys.executable, "-m", "stepscope.exporter.profile_cli", "--exporter", node.exporter,
                                "--run", RUN, "--rank", "0", "--steps", "1000", "--wait", "120"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        wait_until(lambda: rank_tracing(node.exporter, RUN, 0) == "running", 60, "the rank taking the request")
        os.kill(node.demo.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            out, err = command.communicate(timeout=60)
        finally:
            os.kill(node.demo.pid, signal.SIGCONT)
    finally:
        command.kill()
    assert time.monotonic() - stopped < 30  # 3 push intervals and a second without a push, not --wait
    assert (command.returncode, out) == (2, ""), err
    line = err.splitlines()[-1]
    assert re.fullmatch(rf"stepscope-profile: rank 0 of run '{RUN}' took the request, recorded \d+ of 1000 steps, "
                        r"then stopped pushing \(its last push was \d+\.\d s ago, pushes came every \d\.\d s\): the "
                        r"process is not pushing \(killed, hung or gone\) and wrote no trace", line), err
    listing = requests.get(f"{node.exporter}{API}", params={"run": RUN}, timeout=10).json()
    request_id = listing["requests"][-1]["id"]
    wait_until(lambda: request_state(node.exporter, request_id)["state"] == "cancelled", 60,
               "the rank, back, to stop the trace nobody waits for")
    assert not list(node.traces.glob(f"*{request_id[:8]}*"))
    wait_until(lambda: rank_tracing(node.exporter, RUN, 0) == "ready", 60, "the rank ready for the next request")


def test_a_rank_that_ended_its_training_is_refused_at_once(node: Node, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """close() pushes state idle one last time; the group lives on until its TTL, but no step will take a
    request: stepscope-profile says so at once instead of waiting out --wait."""
    run = "ended"
    tracker = th.init(run=run, push_url=node.exporter, push_interval=0.2, trace_dir=str(tmp_path),
                      handle_sigterm=False)
    for _ in range(5):
        tracker.step(samples=1)
    wait_until(lambda: rank_tracing(node.exporter, run, 0) == "ready", 30, "the first push")
    tracker.close()
    started = time.monotonic()
    capsys.readouterr()
    code = profile_cli.main(["--exporter", node.exporter, "--run", run, "--wait", "60"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - started < 30
    assert f"rank 0 of run '{run}' is idle (its last push, " in err
    assert "a trace records training steps; ask while it trains" in err


def test_unreachable_exporter_and_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert profile_cli.main(["--exporter", url, "--run", RUN]) == 2
    assert f"cannot reach the exporter at {url}" in capsys.readouterr().err
    for argv in (["--run", RUN, "--steps", "0"], ["--run", RUN, "--rank", "0", "--all-ranks"],
                 ["--run", RUN, "--wait", "-1"], ["--run", RUN, "--exporter", "localhost:9847"], []):
        with pytest.raises(SystemExit) as exit_:
            profile_cli.main(argv)
        assert exit_.value.code == 2, argv


def test_a_bad_push_url_in_the_environment_is_named_as_such(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--exporter defaults to STEPSCOPE_PUSH_URL: the message names what the user set (it said --exporter)."""
    monkeypatch.setenv("STEPSCOPE_PUSH_URL", "garbage")
    for argv, named in ((["--run", RUN], "STEPSCOPE_PUSH_URL (the default of --exporter)"),
                        (["--run", RUN, "--exporter=bad"], "--exporter")):
        with pytest.raises(SystemExit) as exit_:
            profile_cli.main(argv)
        assert exit_.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].startswith(
            f"stepscope-profile: error: {named} must be an http:// or https:// URL, got "), argv


def test_help_says_each_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    """--help states each default once, as the flag's help says it (a defaults formatter printed each a
    second time, and "(default: None)" for the defaults that come from the environment)."""
    with pytest.raises(SystemExit) as exit_:
        profile_cli.main(["--help"])
    assert exit_.value.code == 0
    options = " ".join(capsys.readouterr().out.split()).split("options:", 1)[1]
    for flag in ("--exporter URL", "--rank K", "--steps STEPS", "--wait SECONDS", "--token-file FILE"):
        help_text = options.split(flag, 1)[1].split(" --", 1)[0]
        assert help_text.count("(default:") == 1, help_text
    assert "(default: None)" not in options and "(default: False)" not in options


class Regression(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = torch.full((8,), index / 64)
        return {"x": x, "labels": x.sum(dim=0, keepdim=True)}


def lightning_fit(tracker: th.Tracker, steps: int, tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from stepscope.hooks.lightning import StepscopeCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch["x"]), batch["labels"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[StepscopeCallback(tracker=tracker)])
    trainer.fit(Module(), DataLoader(Regression(), batch_size=4))


def transformers_train(tracker: th.Tracker, steps: int, tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from stepscope.hooks.huggingface import StepscopeCallback

    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=steps, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, logging_strategy="no", save_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0)
    callback = StepscopeCallback(tracker=tracker)
    Trainer(model=LinearRegressor(), args=args, train_dataset=Regression(), callbacks=[callback]).train()


@pytest.mark.parametrize("fit", [lightning_fit, transformers_train], ids=["lightning", "transformers"])
def test_the_framework_callbacks_take_traces(node: Node, tmp_path: Path, fit: Callable) -> None:
    run = f"{RUN}-{fit.__name__}"
    tracker = th.init(run=run, push_url=node.exporter, push_interval=0.2, trace_dir=str(tmp_path),
                      handle_sigterm=False)
    try:
        wait_until(lambda: rank_tracing(node.exporter, run, 0) == "ready", 30, "the first push")
        request_id = request_trace(node.exporter, run, 0, steps=3)
        wait_until(lambda: request_state(node.exporter, request_id)["state"] == "running", 30, "the rank armed")
        fit(tracker, 8, tmp_path)  # the callback's tracker.step() at each batch end starts and ends the trace
        wait_until(lambda: request_state(node.exporter, request_id)["state"] == "done", 30, "the trace written")
        assert step_annotations(request_state(node.exporter, request_id)["path"]) == \
            ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    finally:
        tracker.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU visible to torch")
def test_a_cuda_training_loop_traces_its_kernels(node: Node, tmp_path: Path) -> None:
    run = f"{RUN}-cuda"
    tracker = th.init(run=run, push_url=node.exporter, push_interval=0.2, trace_dir=str(tmp_path),
                      handle_sigterm=False)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        wait_until(lambda: rank_tracing(node.exporter, run, 0) == "ready", 30, "the first push")
        request_id = request_trace(node.exporter, run, 0, steps=5)
        deadline = time.monotonic() + 60
        while request_state(node.exporter, request_id)["state"] not in ("done", "failed"):
            assert time.monotonic() < deadline, "no trace within 60 s"
            x = torch.randn(256, 1024, device="cuda")
            with tracker.phase("forward", cuda=True):
                loss = model(x).square().mean()
            with tracker.phase("backward", cuda=True):
                optimizer.zero_grad()
                loss.backward()
            with tracker.phase("optimizer_step", cuda=True):
                optimizer.step()
            tracker.step(samples=256)
        state = request_state(node.exporter, request_id)
        assert state["state"] == "done", state
        kernels = kernel_names(state["path"])
        print(f"\nCUDA trace: {state['bytes']} bytes gzipped, {len(kernels)} kernels, e.g. {sorted(set(kernels))[:5]}")
        # the 5 steps after the warm-up step (#0) that followed the request, each once: on the CPU timeline
        assert step_annotations(state["path"]) == [f"ProfilerStep#{n}" for n in range(1, 6)]
        assert state["trace_steps"] == 5, state
        assert any("gemm" in name.lower() or "sgemm" in name.lower() for name in kernels), sorted(set(kernels))[:20]
    finally:
        tracker.close()

"""`python -m stepscope.hooks.demo`'s flags and identity, checked before torch is imported. Training
and pushing (to the exporter and to a real Pushgateway) are test_readme_commands.py's: it runs every
demo command docs/hooks.md shows and reads their pushed steps, samples and phase sums."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import stepscope.hooks as th
from stepscope.hooks.demo import look_command
from stepscope_testkit.processes import REPO_ROOT, running_exporter, samples


def demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "stepscope.hooks.demo", *args]
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
                          env={**os.environ, **env} if env else None)


def without_torch(tmp_path: Path, failure: str) -> dict[str, str]:
    """An environment whose `import torch` runs `failure` instead: proves what happens before it."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(f"{failure}\n")
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "-1"], "--steps: must be >= 0"),
        (["--slow-loader", "fast"], "--slow-loader: expected a number of seconds"),
        (["--eval-every", "-5"], "--eval-every: must be >= 0"),
        (["--eval-seconds", "-1"], "--eval-seconds: must be >= 0"),
        (["--warm-up-seconds", "-1"], "--warm-up-seconds: must be >= 0"),
        (["--rank", "2", "--world-size", "2"], "rank 2 must be smaller than world_size 2"),
        (["--push-url", "127.0.0.1:9847"], "must start with http://"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--slow-rank", "1"], "--slow-rank 1 must be smaller than world_size 1"),
        (["--push-interval", "0"], "push_interval must be a number > 0.01 and at most 600 seconds"),
        (["--progress-every", "0"], "--progress-every: must be > 0"),
        # Before: time.sleep(inf) raised OverflowError (a traceback, exit 1), an eval of inf seconds never ended,
        # and the pusher thread died at a wait of 1e10 s.
        (["--slow-loader", "inf"], "--slow-loader: must be at most 3600 seconds, got 'inf'"),
        (["--extra-step-seconds", "inf"], "--extra-step-seconds: must be at most 3600 seconds, got 'inf'"),
        (["--eval-every", "1", "--eval-seconds", "inf"], "--eval-seconds: must be at most 3600 seconds, got 'inf'"),
        (["--slow-loader", "1e10"], "--slow-loader: must be at most 3600 seconds, got '1e10'"),
        (["--push-interval", "1e10"], "push_interval must be a number > 0.01 and at most 600 seconds"),
    ],
)
def test_demo_rejects_bad_flags(args: list[str], message: str, tmp_path: Path) -> None:
    """One line, exit 2, and before torch is imported (a stand-in torch that fails on import proves it)."""
    result = demo(*args, env=without_torch(tmp_path, "raise SystemExit('torch was imported')"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "env", "identity"),
    [
        (["--rank", "1"], {"WORLD_SIZE": "4"}, "rank=1/4"),  # WORLD_SIZE first, as --help says
        (["--rank", "1"], {"WORLD_SIZE": ""}, "rank=1/2"),  # then rank + 1
    ],
)
def test_demo_identity_defaults(args: list[str], env: dict[str, str], identity: str, tmp_path: Path) -> None:
    """The identity is settled and said before torch is imported: a torch that fails on import ends the
    demo right after the line (the training itself is test_demo_trains_and_pushes_a_slow_rank's)."""
    result = demo("--steps", "1", "--push-url", "", *args,
                  env={**env, **without_torch(tmp_path, "raise ImportError('no torch in this test')")})
    assert result.stdout.startswith(f"stepscope demo: run=demo {identity} pushing nowhere"), result.stderr
    assert result.returncode == 2 and "the demo needs torch" in result.stderr


def test_ctrl_c_while_torch_loads_ends_as_ctrl_c_while_training(tmp_path: Path) -> None:
    """Ctrl-C after the 'pushing' line, while torch is imported (seconds): before, a KeyboardInterrupt
    traceback (the import was outside the demo's try); now what Ctrl-C while training does, the steps so far
    and exit 0. A stand-in torch interrupts its own import, with Python's Ctrl-C handler in place as in a
    terminal: a suite started in the background of a shell (`cmd &`, as CI) runs with SIGINT ignored, which
    the demo inherits, and the signal did nothing there (the import slept its 30 s and the demo said it
    needs torch)."""
    env = without_torch(tmp_path, "import os, signal, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
                                  "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)")
    result = demo("--push-url", "", env=env)
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr
    assert result.stdout.splitlines()[1:] == ["stepscope demo: 0 steps done"], result.stdout
    assert result.returncode == 0


def test_demo_says_what_it_does_while_it_trains() -> None:
    """Every --progress-every seconds (10 by default) a line: the steps, their rate, the share of the step
    spent waiting for data, and where to look at what it pushes."""
    result = demo("--steps", "60", "--slow-loader", "0.02", "--progress-every", "0.3",
                  "--push-url", "http://127.0.0.1:9")  # nothing listens: pushing fails quietly, training goes on
    assert result.returncode == 0, result.stderr
    progress = [line for line in result.stdout.splitlines() if " steps/s" in line]
    assert len(progress) >= 2, result.stdout
    pattern = (r"stepscope demo: ([\d,]+) steps, [\d.]+ steps/s, waiting for data (\d+)% of the step time; "
               r"look: curl -s http://127\.0\.0\.1:9/metrics \| grep -F 'run=\"demo\"'")
    matches = [re.fullmatch(pattern, line) for line in progress]
    assert all(matches), progress
    assert [int(m.group(1)) for m in matches] == sorted(int(m.group(1)) for m in matches)
    assert 0 < int(matches[-1].group(2)) <= 100, progress  # the loader sleeps 20 ms of each step



# Names whose label /metrics escapes (a quote, a backslash), that a shell would read (a quote, $, a backtick, a
# glob) or grep (a bracket, a dot), and one that is the start of another.
LOOKED_UP = ["we ird/ x", "back\\slash", "semi;colon|pipe", "$HOME `id`", "a[b*", "a.c", "ab", "a"]


def test_the_command_the_progress_line_prints_shows_the_runs_series_whatever_its_name(tmp_path: Path) -> None:
    """The printed `curl ... | grep ...` run as is against a real exporter shows every series of the run and
    none of another, for names with a backslash (/metrics writes `\\\\`) and the shell's own characters. (A quote,
    which broke both before, is no run name any more: Grafana cannot select it.)"""
    with running_exporter(tmp_path) as exporter:
        for run in LOOKED_UP:
            tracker = th.init(run=run, push_url=exporter.url, push_interval=60, handle_sigterm=False)
            tracker.step(samples=1)
            tracker.close()
        for run in LOOKED_UP:
            shown = subprocess.run(["bash", "-c", look_command(exporter.url, run)], capture_output=True, text=True,
                                   timeout=30)
            series = samples(shown.stdout)
            assert ("stepscope_steps_total", frozenset({("run", run), ("rank", "0")})) in series, (run, shown)
            assert {dict(labels).get("run") for _, labels in series} == {run}, run


def test_a_stopped_process_group_with_loader_workers_ends_in_one_line(tmp_path: Path) -> None:
    """SIGTERM to the demo's whole process group (a shell's job control, `timeout`, Ctrl-C) can reach the
    loader workers before the trainer: the trainer then says so in one line, no traceback."""
    log = tmp_path / "demo.log"
    with log.open("w") as out:
        demo = subprocess.Popen(
            [sys.executable, "-m", "stepscope.hooks.demo", "--run", "stop", "--push-url", "", "--loader-workers",
             "2", "--progress-every", "0.5"],
            cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        deadline = time.monotonic() + 90
        while " steps, " not in log.read_text() and demo.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = subprocess.run(["pgrep", "-P", str(demo.pid)], capture_output=True, text=True).stdout.split()
        signalled = []
        for worker in workers:  # the workers first, as a group signal may deliver it
            # the trainer may read the first worker's end and shut the other down before it is signalled
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(worker), signal.SIGTERM)
                signalled.append(worker)
        demo.wait(timeout=60)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    text = log.read_text()
    assert workers and signalled[:1] == workers[:1], text  # the first worker was alive when it was stopped
    assert "Traceback" not in text, text
    assert "stepscope demo: stopped after" in text, text


@pytest.mark.parametrize("error", [EOFError(), ConnectionRefusedError(111, "Connection refused"),
                                   ConnectionResetError(104, "Connection reset by peer")])
def test_a_worker_dying_in_a_batch_hand_over_ends_in_one_line(
        error: Exception, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The race the process-group test meets now and then: a worker stopped while the trainer fetches its
    batch's shared memory, which multiprocessing's resource sharer reads as EOF or a refused connection.
    Forced here with a loader whose third batch fails so; the demo says so in one line, exit 143."""
    torch_data = pytest.importorskip("torch.utils.data")
    from stepscope.hooks import demo as demo_module

    class HandOverFails(torch_data.DataLoader):
        def __iter__(self) -> Iterator[object]:
            batches = super().__iter__()
            yield next(batches)
            yield next(batches)
            raise error

    monkeypatch.setattr(torch_data, "DataLoader", HandOverFails)
    code = demo_module.main(["--run", "handover", "--push-url", "", "--loader-workers", "2", "--steps", "0"])
    err = capsys.readouterr().err
    assert code == 143, err
    assert err.strip().splitlines() == [f"stepscope demo: stopped after 2 steps: {str(error) or type(error).__name__}"]

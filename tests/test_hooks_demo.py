"""`python -m training_hooks.demo` as a user runs it: a subprocess pushing to a real Pushgateway."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stepscope_testkit.processes import REPO_ROOT, sample_values, scrape
from stepscope_testkit.pushgateway import running_pushgateway


def demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "training_hooks.demo", *args]
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
                          env={**os.environ, **env} if env else None)


def test_demo_trains_and_pushes_a_slow_rank(tmp_path: Path) -> None:
    with running_pushgateway(tmp_path) as gateway:
        result = demo("--run", "demo-test", "--steps", "8", "--batch-size", "16", "--slow-loader", "0.01",
                      "--rank", "1", "--world-size", "2", "--extra-step-seconds", "0.02",
                      "--push-url", gateway.url, "--push-interval", "0.2")
        assert result.returncode == 0, result.stderr
        text = scrape(gateway.url)
    first_line = result.stdout.splitlines()[0]
    assert first_line.startswith("stepscope demo: run=demo-test rank=1/2 pushing to ")
    assert gateway.url in first_line
    group = {"job": "stepscope", "run": "demo-test", "rank": "1"}
    assert sample_values(text, "stepscope_steps_total", **group) == [8]
    assert sample_values(text, "stepscope_samples_total", **group) == [8 * 16]
    [loading] = sample_values(text, "stepscope_step_phase_seconds_sum", phase="dataloader_next", **group)
    assert loading >= 8 * 0.01
    [forward] = sample_values(text, "stepscope_step_phase_seconds_sum", phase="forward", **group)
    assert forward >= 8 * 0.02


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "-1"], "--steps: must be >= 0"),
        (["--slow-loader", "fast"], "--slow-loader: expected a number of seconds"),
        (["--eval-every", "-5"], "--eval-every: must be >= 0"),
        (["--eval-seconds", "-1"], "--eval-seconds: must be >= 0"),
        (["--rank", "2", "--world-size", "2"], "rank 2 must be smaller than world_size 2"),
        (["--push-url", "127.0.0.1:9847"], "must start with http://"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_demo_rejects_bad_flags(args: list[str], message: str) -> None:
    result = demo(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "env", "identity"),
    [
        (["--rank", "1"], {"WORLD_SIZE": "4"}, "rank=1/4"),  # WORLD_SIZE first, as --help says
        (["--rank", "1"], {"WORLD_SIZE": ""}, "rank=1/2"),  # then rank + 1
    ],
)
def test_demo_identity_defaults(args: list[str], env: dict[str, str], identity: str) -> None:
    result = demo("--steps", "1", "--push-url", "", *args, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"stepscope demo: run=demo {identity} pushing nowhere")

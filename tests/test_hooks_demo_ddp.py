"""`python -m stepscope.hooks.demo --ddp`: two real DistributedDataParallel ranks (gloo, CPU), wired up the
way torchrun does it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), pushing to a real Pushgateway."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepscope.hooks.demo import ddp_env
from stepscope_testkit.processes import REPO_ROOT, free_port, sample_values, scrape
from stepscope_testkit.pushgateway import running_pushgateway
from tests.support.readme import documented_commands

STEPS = 10
EXTRA_SECONDS = 0.02
BASE_ENV = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
NO_DDP_ENV = {name: value for name, value in os.environ.items()
              if name not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def demo(*args: str, env: dict[str, str]) -> subprocess.Popen:
    argv = [sys.executable, "-m", "stepscope.hooks.demo", *args]
    return subprocess.Popen(argv, cwd=REPO_ROOT, env={**NO_DDP_ENV, **BASE_ENV, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_ddp_ranks_step_together_and_the_fast_rank_waits_in_backward(tmp_path: Path) -> None:
    rendezvous = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with running_pushgateway(tmp_path) as gateway:
        ranks = [
            demo("--ddp", "--run", "ddp-test", "--steps", str(STEPS), "--batch-size", "16", "--slow-rank", "1",
                 "--extra-step-seconds", str(EXTRA_SECONDS), "--push-url", gateway.url, "--push-interval", "0.2",
                 env={**rendezvous, "RANK": str(rank)})
            for rank in (0, 1)
        ]
        outputs = [proc.communicate(timeout=120) for proc in ranks]
        text = scrape(gateway.url)
    for rank, (proc, (stdout, stderr)) in enumerate(zip(ranks, outputs, strict=True)):
        assert proc.returncode == 0, stderr
        assert stdout.startswith(f"stepscope demo: run=ddp-test rank={rank}/2 ddp (gloo) pushing to ")
        assert f"{STEPS} steps done" in stdout

    def phase(rank: int, name: str) -> float:
        [value] = sample_values(text, "stepscope_step_phase_seconds_sum", job="stepscope", run="ddp-test",
                                rank=str(rank), phase=name)
        return value

    for rank in (0, 1):
        assert sample_values(text, "stepscope_steps_total", run="ddp-test", rank=str(rank)) == [STEPS]
    # --slow-rank 1: only rank 1 sleeps in forward; rank 0 waits for it in the backward all-reduce
    assert phase(1, "forward") >= STEPS * EXTRA_SECONDS
    assert phase(0, "forward") < STEPS * EXTRA_SECONDS
    assert phase(0, "backward") > phase(1, "backward") + STEPS * EXTRA_SECONDS / 2


def steps_pushed(text: str, rank: int) -> bool:
    return any(value > 0 for value in sample_values(text, "stepscope_steps_total", run="lost-peer", rank=str(rank)))


def test_a_lost_peer_ends_the_other_rank_with_exit_1_and_one_message(tmp_path: Path) -> None:
    rendezvous = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with running_pushgateway(tmp_path) as gateway:
        ranks = [demo("--ddp", "--run", "lost-peer", "--steps", "0", "--push-url", gateway.url,
                      "--push-interval", "0.2", env={**rendezvous, "RANK": str(rank)}) for rank in (0, 1)]
        try:
            deadline = time.monotonic() + 60
            while not all(steps_pushed(scrape(gateway.url), rank) for rank in (0, 1)):
                assert time.monotonic() < deadline, "the two ranks never trained together"
                time.sleep(0.1)
            ranks[1].kill()  # rank 1 dies mid-training, as an OOM-killed worker would
            _, stderr = ranks[0].communicate(timeout=120)
        finally:
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
                proc.communicate()
    assert ranks[0].returncode == 1, stderr  # a clean-clone CI run once saw -6 (SIGABRT) here, stderr unseen
    assert stderr.startswith("stepscope demo: lost the process group after "), stderr
    assert len(stderr.strip().splitlines()) == 1
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--ddp"], {}, "--ddp needs RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment"),
        (["--ddp"], {"RANK": "0", "WORLD_SIZE": "2"}, "--ddp needs MASTER_ADDR, MASTER_PORT in the environment"),
        (["--ddp", "--rank", "1"], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
         "--rank 1 disagrees with torchrun's environment (0)"),
        (["--ddp"], {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
         "RANK 2 must be in 0..WORLD_SIZE-1"),
        (["--slow-rank", "2", "--rank", "0", "--world-size", "2", "--push-url", ""], {},
         "--slow-rank 2 must be smaller than world_size 2"),
    ],
)
def test_ddp_flags_without_a_usable_environment_exit_2(args: list[str], env: dict[str, str], message: str) -> None:
    proc = demo(*args, env=env)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert message in stderr
    assert "Traceback" not in stderr


def test_the_torchrun_command_the_ddp_error_gives_is_the_documented_one() -> None:
    """The hint, with a demo flag added as a user would, is how docs/hooks.md starts the DDP demo (a command
    tests/test_readme_commands.py runs): before, it left out the `--`, and `--run ddp` added to it ended in
    torchrun's "ambiguous option: --run could match --run-path, --run_path"."""
    with pytest.raises(ValueError, match="start it with") as refused:
        ddp_env({})
    hinted = str(refused.value).split("start it with ", 1)[1].replace(" N ", " 2 ")
    assert hinted.endswith(" -- --ddp")
    (documented,) = [c for c in documented_commands() if c.startswith("torchrun")]
    assert documented.startswith(hinted.removesuffix("--ddp") + "--run ddp --ddp")

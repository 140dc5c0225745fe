"""A hung and a dying data-parallel run, end to end: two real DistributedDataParallel runs (gloo, CPU, 2
ranks each, the collective timeout raised so nothing dies by itself) push to a real exporter; a real
Prometheus evaluates the shipped rules (their own thresholds and `for`, not shortened).

- `hung`: after 15 steps rank 1 blocks forever fetching its next batch; rank 0 goes on into its next
  step and waits in backward's all-reduce. StepscopeTrainingStalled must fire for the run within two
  minutes of its last step, naming rank 1 and dataloader_next, and rank 0 in backward.
- `killed`: rank 1 is SIGKILLed mid-run. StepscopeRankLost must fire within two minutes, naming rank
  1 and its node; the run's surviving rank (gloo ends it when its peer's socket closes) closes, so
  nothing else is said about it.
- `checkpointing`: after 15 steps rank 0 checkpoints (state checkpoint) for the rest of the module, longer
  than the stall floor, while rank 1 waits in its next all-reduce; `slow`: steps of 20 s, steady. Neither
  may raise StepscopeTrainingStalled, checked once the hung run's alert fired and the checkpoint has lasted
  past the floor.
The other cases that must not fire (80 s steps, 10 minutes of checkpoint, eval, a closed run) are promtool
cases in grafana/rules/tests/training.yml.
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from stepscope_testkit.processes import REPO_ROOT, free_port, running_exporter
from tests.support.prometheus import running_prometheus, shipped_groups, wait_for

pytestmark = pytest.mark.timeout(300)

BOUND_SECONDS = 120  # the issue's: named within two minutes
STALL_FLOOR_SECONDS = 60  # StepscopeTrainingStalled's floor (docs/alerts.md): no step for max(60 s, 5 x the pace)
SLOW_STEP_SECONDS = 20.0
# The shipped groups StepscopeTrainingStalled and StepscopeRankLost read, with their recordings and the node clock
# offset the stall's description names: nothing else is asked of Prometheus here, and every shipped group took 7 s
# of the module's 32 s of CPU (the 8 training processes the rest). The hung run's alert firing in the same
# Prometheus shows the chain the runs that must not fire are judged by is whole.
STALL_GROUPS = ("stepscope-node", "stepscope-rank", "stepscope-training-stall-alerts")
NODE = "node-1"
TRAINER = """
import datetime, os, sys, time
import torch, torch.distributed as dist
import stepscope.hooks as th
run, hang_after, checkpoint_after, step_seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(hours=1))
tracker = th.init(run=run, rank=rank, world_size=2, push_url=os.environ["PUSH_URL"], push_interval=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
def batches():
    step = 0
    while True:
        if rank == 1 and step == hang_after:
            time.sleep(3600)  # a deadlocked worker, a stuck read
        step += 1
        time.sleep(0.05)
        yield torch.randn(32, 64)
for batch in tracker.loader(batches()):
    if rank == 0 and tracker.steps == checkpoint_after:
        with tracker.state("checkpoint"):
            time.sleep(3600)  # a checkpoint write far longer than the stall floor; rank 1 waits in backward
    with tracker.phase("forward"):
        time.sleep(step_seconds)
        loss = model(batch).square().mean()
    with tracker.phase("backward"):
        loss.backward()
    with tracker.phase("optimizer_step"):
        optimizer.step()
        optimizer.zero_grad()
    tracker.step(samples=32)
    print("step", tracker.steps, flush=True)
"""


@dataclass
class Run:
    name: str
    ranks: list[subprocess.Popen]


NEVER = 10**9


def start_run(name: str, push_url: str, tmp: Path, hang_after: int = NEVER, checkpoint_after: int = NEVER,
              step_seconds: float = 0.0) -> Run:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PUSH_URL": push_url,
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = []
    for rank in (0, 1):
        log = open(tmp / f"{name}-{rank}.log", "w")  # noqa: SIM115 (the process writes to it)
        ranks.append(subprocess.Popen([sys.executable, "-c", TRAINER, name, str(hang_after), str(checkpoint_after),
                                       str(step_seconds)],
                                      env={**env, "RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT))
    return Run(name, ranks)


def firing(prometheus: str, alertname: str, run: str) -> list[dict]:
    alerts = requests.get(f"{prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == alertname and a["labels"].get("run") == run
            and a["state"] == "firing"]


def steps_of(log: Path) -> int:
    lines = [line for line in log.read_text().splitlines() if line.startswith("step ")]
    return int(lines[-1].split()[1]) if lines else 0


@dataclass
class Observed:
    prometheus: str
    hung_last_step: float  # wall time the hung run last stepped (its rank 0's last printed step)
    killed_at: float
    checkpoint_began: float  # wall time the checkpointing run's rank 0 entered checkpoint (after its last step)


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("stall")
    with running_exporter(tmp, "--collectors", "node") as exporter, \
            running_prometheus(tmp, {NODE: exporter.url.removeprefix("http://")},
                               [shipped_groups(tmp, *STALL_GROUPS)]) as prometheus:
        hung = start_run("hung", exporter.url, tmp, hang_after=15)
        killed = start_run("killed", exporter.url, tmp)
        checkpointing = start_run("checkpointing", exporter.url, tmp, checkpoint_after=15)
        slow = start_run("slow", exporter.url, tmp, step_seconds=SLOW_STEP_SECONDS)
        runs = [hung, killed, checkpointing, slow]
        try:
            log = tmp / "hung-0.log"
            assert wait_for(lambda: steps_of(log) >= 15, 120), log.read_text()
            assert wait_for(lambda: steps_of(tmp / "killed-1.log") >= 15, 60), (tmp / "killed-1.log").read_text()
            killed.ranks[1].send_signal(signal.SIGKILL)
            killed_at = time.time()
            steps = steps_of(log)
            assert not wait_for(lambda: steps_of(log) > steps, 5), "the hung run went on stepping"
            last_step = (tmp / "hung-0.log").stat().st_mtime
            checkpoint_log = tmp / "checkpointing-0.log"
            assert wait_for(lambda: steps_of(checkpoint_log) >= 15, 60), checkpoint_log.read_text()
            yield Observed(prometheus.url, last_step, killed_at, checkpoint_log.stat().st_mtime)
        finally:
            for proc in [rank for run in runs for rank in run.ranks]:
                proc.kill()
                proc.wait()


def test_a_hung_run_is_named_within_two_minutes_with_the_rank_that_holds_it_up(observed: Observed) -> None:
    alerts = wait_for(lambda: firing(observed.prometheus, "StepscopeTrainingStalled", "hung"), BOUND_SECONDS + 10)
    seen = time.time()
    assert alerts, "StepscopeTrainingStalled did not fire"
    print(f"\nstalled alert firing {seen - observed.hung_last_step:.0f} s after the last step")
    assert seen - observed.hung_last_step <= BOUND_SECONDS
    description = alerts[0]["annotations"]["description"]
    assert "Likely cause: rank 1 on node-1, in dataloader_next" in description, description
    assert "Rank 0 on node-1 has been in backward" in description, description


def test_a_killed_rank_is_lost_within_two_minutes_with_its_node(observed: Observed) -> None:
    alerts = wait_for(lambda: firing(observed.prometheus, "StepscopeRankLost", "killed"), BOUND_SECONDS + 10)
    seen = time.time()
    assert [(a["labels"]["rank"], a["labels"]["instance"]) for a in alerts] == [("1", NODE)]
    print(f"\nlost alert firing {seen - observed.killed_at:.0f} s after SIGKILL")
    assert seen - observed.killed_at <= BOUND_SECONDS
    assert not firing(observed.prometheus, "StepscopeTrainingStalled", "killed"), "the survivor closed: no stall"


def test_a_long_checkpoint_and_slow_steady_steps_are_not_a_stall(observed: Observed) -> None:
    """Checked after the hung run's alert fired (the rules had the same time to judge) and once the checkpoint
    has lasted 20 s past the floor, with two evaluations' margin."""
    assert wait_for(lambda: firing(observed.prometheus, "StepscopeTrainingStalled", "hung"), BOUND_SECONDS + 10)
    past_floor = observed.checkpoint_began + STALL_FLOOR_SECONDS + 20
    time.sleep(max(0.0, past_floor - time.time()))
    print(f"\ncheckpoint held {time.time() - observed.checkpoint_began:.0f} s; slow run steps every"
          f" {SLOW_STEP_SECONDS:g} s")
    for run in ("checkpointing", "slow"):
        assert not firing(observed.prometheus, "StepscopeTrainingStalled", run), run

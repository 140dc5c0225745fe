"""A run that hangs in its very first step, end to end: a real DistributedDataParallel run (gloo, CPU, 2 ranks,
the collective timeout raised so nothing dies by itself) pushes to a real exporter, and a real Prometheus
evaluates the shipped rules, rendered from their sources with first_step_stall_seconds lowered to
FIRST_STEP_SECONDS_HERE (the shipped 20 minutes would hold the test that long; nothing else changes).

- `firsthang`: rank 1's DataLoader worker blocks on an Event while loading the first batch, so its main process
  waits in dataloader_next; rank 0 gets its batch and waits in backward's all-reduce. No rank ever pushes a last
  step. StepscopeFirstStepStalled must fire for the run once its ranks have been in train for the threshold
  (not before), naming rank 1 in dataloader_next and its pid, and StepscopeTrainingStalled must not.
- `stepping`: the same script without the hang: its first step lands, so it gets neither alert.
On the rules before, nothing fired for `firsthang`: StepscopeTrainingStalled measures from the last step.
The other cases that must not fire (setup, eval, checkpoint, a closed or lost rank, a run that already stepped)
are promtool cases in grafana/rules/tests/first_step.yml.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from grafana.rules import SOURCES_DIR
from grafana.rules import render as rules_render
from stepscope.contract import THRESHOLDS
from stepscope.contract.thresholds import Threshold
from stepscope_testkit.processes import REPO_ROOT, free_port, running_exporter
from tests.support.prometheus import running_prometheus, wait_for
from tests.test_stall_e2e import NODE, firing

pytestmark = pytest.mark.timeout(300)

FIRST_STEP_SECONDS_HERE = 15  # well past this script's real first step (a worker's start and one batch: < 1 s)
FIRED_WITHIN_SECONDS = 30  # after the threshold: a push (1 s), a scrape and an evaluation (1 s each), a busy CPU
TRAINER = """
import datetime, os, sys, threading, time
import torch, torch.distributed as dist
import stepscope.hooks as th
run, hang_rank = sys.argv[1], int(sys.argv[2])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", timeout=datetime.timedelta(hours=1))
tracker = th.init(run=run, rank=rank, world_size=world, push_url=os.environ["PUSH_URL"], push_interval=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
never = threading.Event()
class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 10**6
    def __getitem__(self, index):
        if rank == hang_rank:
            never.wait()  # the worker deadlocks on the first batch
        return torch.randn(64)
loader = torch.utils.data.DataLoader(Samples(), batch_size=32, num_workers=1)
print("train", time.time(), flush=True)
for batch in tracker.loader(loader):
    with tracker.phase("forward"):
        loss = model(batch).square().mean()
    with tracker.phase("backward"):
        loss.backward()
    with tracker.phase("optimizer_step"):
        optimizer.step()
        optimizer.zero_grad()
    tracker.step(samples=32)
    print("step", tracker.steps, flush=True)
    time.sleep(0.1)
"""


def rules_with_first_step_threshold(tmp: Path, seconds: float) -> list[Path]:
    """The rule files as `python -m grafana generate` renders them, with first_step_stall_seconds at `seconds`."""
    lowered = {**THRESHOLDS, "first_step_stall_seconds": Threshold(seconds, "lowered for the end-to-end test", ())}
    paths = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rules_render, "THRESHOLDS", lowered)
        for source in sorted(SOURCES_DIR.glob("*.rules.yml")):  # node, then run: RULE_FILES' order
            paths.append(tmp / source.name)
            paths[-1].write_text(rules_render.render(source.read_text(), source.name))
    return paths


def start_ranks(name: str, world: int, hang_rank: int, push_url: str, tmp: Path) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PUSH_URL": push_url,
           "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = []
    for rank in range(world):
        log = open(tmp / f"{name}-{rank}.log", "w")  # noqa: SIM115 (the process writes to it)
        ranks.append(subprocess.Popen([sys.executable, "-c", TRAINER, name, str(hang_rank)], start_new_session=True,
                                      env={**env, "RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT))
    return ranks


def stop_ranks(ranks: list[subprocess.Popen]) -> None:
    """Kills each rank with its DataLoader worker (its process group). A worker blocked in __getitem__ never
    looks for its parent: killed alone, the ranks left 1-3 such processes running for good, ~240 MB each."""
    for proc in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert wait_for(lambda: not any(map(_group_alive, ranks)), 10), "a rank's process group outlived SIGKILL"


def _group_alive(rank: subprocess.Popen) -> bool:
    try:
        os.killpg(rank.pid, 0)
    except ProcessLookupError:
        return False
    return True


def printed(log: Path, word: str) -> list[str]:
    return [line.split()[1] for line in log.read_text().splitlines() if line.startswith(f"{word} ")]


@dataclass
class Observed:
    prometheus: str
    tmp: Path
    hung_pids: list[int]
    train_began: float  # wall time the hanging rank began its loop (entered train), as it printed it


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("first-step")
    rule_files = rules_with_first_step_threshold(tmp, FIRST_STEP_SECONDS_HERE)
    with running_exporter(tmp, "--collectors", "node") as exporter, \
            running_prometheus(tmp, {NODE: exporter.url.removeprefix("http://")}, rule_files) as prometheus:
        hung = start_ranks("firsthang", 2, 1, exporter.url, tmp)
        stepping = start_ranks("stepping", 1, -1, exporter.url, tmp)
        try:
            log = tmp / "firsthang-1.log"
            assert wait_for(lambda: printed(log, "train"), 120), log.read_text()
            stepping_log = tmp / "stepping-0.log"
            assert wait_for(lambda: len(printed(stepping_log, "step")) >= 3, 120), stepping_log.read_text()
            yield Observed(prometheus.url, tmp, [proc.pid for proc in hung], float(printed(log, "train")[0]))
        finally:
            stop_ranks(hung + stepping)


def test_a_hang_in_the_first_step_pages_once_past_the_threshold(observed: Observed) -> None:
    alerts = wait_for(lambda: firing(observed.prometheus, "StepscopeFirstStepStalled", "firsthang"),
                      FIRST_STEP_SECONDS_HERE + FIRED_WITHIN_SECONDS + 10, 0.5)
    seen = time.time()
    assert alerts, "StepscopeFirstStepStalled did not fire"
    print(f"\nfirst-step alert firing {seen - observed.train_began:.1f} s after the ranks entered train")
    assert FIRST_STEP_SECONDS_HERE <= seen - observed.train_began <= FIRST_STEP_SECONDS_HERE + FIRED_WITHIN_SECONDS
    assert float(alerts[0]["value"]) > FIRST_STEP_SECONDS_HERE
    assert not any(printed(observed.tmp / f"firsthang-{rank}.log", "step") for rank in (0, 1)), "firsthang stepped"
    description = alerts[0]["annotations"]["description"]
    assert "Likely cause: rank 1 on node-1, in dataloader_next" in description, description
    assert "Rank 0 on node-1 has been in backward" in description, description
    assert f"py-spy dump --pid {observed.hung_pids[1]} on node-1 shows rank 1's stack" in description, description
    assert not firing(observed.prometheus, "StepscopeTrainingStalled", "firsthang"), "two alerts for one hang"


def test_a_run_whose_first_step_landed_gets_neither_alert(observed: Observed) -> None:
    """Checked once the hung run's alert fired: the stepping run has trained past the threshold as long."""
    assert wait_for(lambda: firing(observed.prometheus, "StepscopeFirstStepStalled", "firsthang"),
                    FIRST_STEP_SECONDS_HERE + FIRED_WITHIN_SECONDS + 10, 0.5)
    for alert in ("StepscopeFirstStepStalled", "StepscopeTrainingStalled"):
        assert not firing(observed.prometheus, alert, "stepping"), alert

"""Two real training processes pushing run "train" rank 0 to one real exporter: two users' `train.py` on one
node, both with the default run (the script's name). The exporter's group used to take whichever pushed
last: its pid flipped at every push, steps_total went back, the rules read garbage, and nobody was told.
Now the second process is refused (409, one clear line in its log) while the first lives, and takes the
group over once the first closes (within a push interval) or dies (after the documented hold)."""

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from stepscope.exporter.ingest.store import HOLD_MIN_SECONDS
from stepscope_testkit.processes import REPO_ROOT, running_exporter, samples, scrape

pytestmark = pytest.mark.timeout(60)  # a process that never says "ready" or "closed" must not hang the suite
INTERVAL = 0.3  # the ranks' push interval: 2.5 of it is under HOLD_MIN_SECONDS, so a dead rank is held 3 s
SCRIPT = REPO_ROOT / "tests" / "support" / "clashing_rank.py"


@dataclass
class Rank:
    process: subprocess.Popen
    log_path: Path

    def conflicts(self) -> list[str]:
        """The lines its hooks logged about a 409."""
        return [line for line in self.log_path.read_text().splitlines() if "(409)" in line]

    def close(self) -> None:
        """close() in the process (state idle, a final push), then its exit."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("close\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline() == "closed\n", self.log_path.read_text()
        assert self.process.wait(timeout=10) == 0


@contextmanager
def rank(url: str, log_path: Path) -> Iterator[Rank]:
    process = subprocess.Popen([sys.executable, str(SCRIPT), url, str(INTERVAL)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=log_path.open("w"), text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n", log_path.read_text()
        yield Rank(process, log_path)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def group_pids(url: str) -> set[str]:
    """The pid(s) stepscope_training_info of run "train" rank 0 shows now."""
    return {dict(labels)["pid"] for (name, labels) in samples(scrape(url))
            if name == "stepscope_training_info" and ("run", "train") in labels}


def conflicts_counted(url: str) -> float:
    return samples(scrape(url))[("stepscope_exporter_ingest_rejected_total", frozenset({("reason", "run_conflict")}))]


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> float:
    """The monotonic time at which `condition` was first seen true (polled every 20 ms)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic()


def clash(url: str, first: Rank, second: Rank) -> None:
    """The second is refused, says so once, and the group stays the first's."""
    wait_until(lambda: bool(second.conflicts()),
               f"a 409 for the second process (the group showed pids {group_pids(url)})")
    seen: set[str] = set()
    watch_until = time.monotonic() + 8 * INTERVAL
    while time.monotonic() < watch_until:
        seen |= group_pids(url)
        time.sleep(0.05)
    assert seen == {str(first.process.pid)}
    assert conflicts_counted(url) >= 5
    [line] = second.conflicts()
    assert line.startswith(f"stepscope: push to {url}/metrics/job/stepscope/run/train/rank/0 rejected (409): run "
                           f"'train' rank 0 is pushed by another process on this node (pid {first.process.pid}, "
                           "started "), line
    assert "give each its own run (STEPSCOPE_RUN or init(run=...); the default is the script's name)" in line
    # the hold its first refusal named: 12.5 s when the first process had pushed once (no pace yet), else 3 s
    assert re.search(r"This process's pushes are taken once the other one closes or stops pushing for "
                     r"(12\.5|3\.0)s; training continues$", line), line


def test_the_second_process_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    with running_exporter(tmp_path, "--collectors", "") as exporter, rank(exporter.url, tmp_path / "a.log") as first:
        wait_until(lambda: group_pids(exporter.url) == {str(first.process.pid)}, "the first process's push")
        with rank(exporter.url, tmp_path / "b.log") as second:
            clash(exporter.url, first, second)
            first.close()
            closed = time.monotonic()
            taken = wait_until(lambda: group_pids(exporter.url) == {str(second.process.pid)},
                               "the second process's push after the first closed")
            assert taken - closed < INTERVAL + 1.0  # its next push, plus the latency of a busy machine
            assert len(second.conflicts()) == 1
            second.close()


def test_a_killed_process_is_taken_over_after_the_hold(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer, a crash): nothing says the first is gone but its silence."""
    with running_exporter(tmp_path, "--collectors", "") as exporter, rank(exporter.url, tmp_path / "a.log") as first:
        wait_until(lambda: group_pids(exporter.url) == {str(first.process.pid)}, "the first process's push")
        with rank(exporter.url, tmp_path / "b.log") as second:
            clash(exporter.url, first, second)
            first.process.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            taken = wait_until(lambda: group_pids(exporter.url) == {str(second.process.pid)},
                               "the second process's push after the first was killed")
            # held HOLD_MIN_SECONDS from the first's last push (at most an interval before the kill), then
            # taken at the second's next push
            assert HOLD_MIN_SECONDS - INTERVAL - 0.1 < taken - killed < HOLD_MIN_SECONDS + INTERVAL + 1.0
            second.close()

"""SIGTERM: the hooks push a final state, then the signal goes where it went before (real processes).

Each case runs a small script in its own Python process and signals it for real: the default action
of SIGTERM kills the process, which no in-process test could survive.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stepscope_testkit.processes import REPO_ROOT, free_port, running_exporter, sample_values, scrape
from tests.support.prometheus import wait_for

pytestmark = pytest.mark.timeout(120)

PRELUDE = '''
import os, signal, sys, threading
from http.server import BaseHTTPRequestHandler, HTTPServer
import stepscope.hooks as th

class Receiver(BaseHTTPRequestHandler):
    """A push endpoint that says on stdout when a body with state idle arrives."""
    def do_PUT(self):
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        self.send_response(200)
        self.end_headers()
        if 'state="idle"} 1' in body:
            print("pushed idle", flush=True)
    def log_message(self, *args):
        pass

def receiver_url():
    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}"
'''


def run_script(body: str, **env: str) -> subprocess.CompletedProcess:
    """Runs the PRELUDE then `body` in a Python process of its own session: a script may signal its process group
    as Kubernetes and `docker stop` do, without reaching pytest."""
    script = PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "STEPSCOPE_PUSH_URL": "", **env},
    )


# A loop over a DataLoader with persistent workers, whose final push is slow to go out (a slow network): the
# workers, signalled with the main process, die first, and torch's SIGCHLD handler raises in the main thread.
WORKERS_AND_A_SLOW_FINAL_PUSH = """
    import subprocess
    import time
    import requests
    import torch
    from torch.utils.data import DataLoader, Dataset

    send = requests.adapters.HTTPAdapter.send
    def slow_from_main(self, *args, **kwargs):  # the final push is the main thread's; the periodic ones are not
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.5)
        return send(self, *args, **kwargs)
    requests.adapters.HTTPAdapter.send = slow_from_main

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 10**6
        def __getitem__(self, index):
            return torch.ones(4)

    loader = DataLoader(Items(), batch_size=4, num_workers=2, persistent_workers=True)

    def terminate_group():  # from another process: a worker signalled by its parent exits quietly (torch's handler)
        subprocess.Popen(["kill", "-s", "TERM", "--", f"-{os.getpgid(0)}"])
"""


def test_default_action_still_ends_the_process_by_sigterm_after_the_final_push() -> None:
    result = run_script("""
        tracker = th.init(run="r", push_url=receiver_url(), push_interval=60)
        tracker.step()
        os.kill(os.getpid(), signal.SIGTERM)
        print("survived", flush=True)
    """)
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert "pushed idle" in result.stdout.splitlines()
    assert "survived" not in result.stdout


def test_a_previous_python_handler_is_called_after_the_final_push() -> None:
    result = run_script("""
        calls = []
        signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
        tracker = th.init(run="r")
        os.kill(os.getpid(), signal.SIGTERM)
        print(calls == [signal.SIGTERM], tracker.current_state)
        # close() put the script's handler back
        print(signal.getsignal(signal.SIGTERM).__name__)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "idle", "<lambda>"]


def test_a_handler_installed_later_that_chains_to_ours_decides_what_happens() -> None:
    """Lightning's way: it composes the handlers it finds and stops training itself, later."""
    result = run_script("""
        tracker = th.init(run="r")
        ours = signal.getsignal(signal.SIGTERM)
        received = []
        def lightning_like(signum, frame):
            received.append(signum)
            ours(signum, frame)
        signal.signal(signal.SIGTERM, lightning_like)
        os.kill(os.getpid(), signal.SIGTERM)
        print("continued", received == [signal.SIGTERM], tracker.current_state)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["continued", "True", "idle"]


def test_sigterm_to_the_process_group_pushes_idle_though_the_loaders_workers_die_first() -> None:
    """Kubernetes and `docker stop` signal every process of the container: torch's SIGCHLD handler raised "DataLoader
    worker ... is killed by signal" inside the final push, which was lost (2 of 8 tries without the slow push;
    every try with it). The process still dies of SIGTERM."""
    result = run_script(WORKERS_AND_A_SLOW_FINAL_PUSH + """
    tracker = th.init(run="r", push_url=receiver_url(), push_interval=60)
    for index, batch in enumerate(tracker.loader(loader)):
        tracker.step(samples=len(batch))
        if index == 5:
            terminate_group()
    """)
    assert result.returncode == -signal.SIGTERM, result.stdout + result.stderr
    assert "pushed idle" in result.stdout.splitlines(), result.stderr
    assert "killed by signal" not in result.stderr


def test_a_sigchld_held_back_during_the_final_push_reaches_its_handler_after_a_handler_that_returns() -> None:
    """Where the process lives on after the final push (a handler before ours that returns), a SIGCHLD that came
    during the push reaches the Python handler it was held back from (torch's, which says the workers were killed),
    once, after the signal went on; and that handler is the installed one again. A child that exits during the push
    stands for the workers: which of torch's two messages a dying worker gives is torch's race, not ours."""
    result = run_script("""
    import subprocess, time
    import requests

    send = requests.adapters.HTTPAdapter.send
    def child_exits_during_the_final_push(self, *args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            subprocess.run(["true"])  # its SIGCHLD is sent before the wait for it returns
        return send(self, *args, **kwargs)
    requests.adapters.HTTPAdapter.send = child_exits_during_the_final_push

    def on_child(signum, frame):
        print("SIGCHLD", flush=True)
    signal.signal(signal.SIGCHLD, on_child)
    signal.signal(signal.SIGTERM, lambda signum, frame: print("the script's handler", flush=True))
    tracker = th.init(run="r", push_url=receiver_url(), push_interval=60)
    while tracker.pusher.stats.successes < 1:  # the pusher thread's first push, of state setup
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)
    print("after", flush=True)
    print(signal.getsignal(signal.SIGCHLD) is on_child, flush=True)
    """)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["pushed idle", "the script's handler", "SIGCHLD", "after", "True"], (
        result.stdout + result.stderr)


def test_ignored_sigterm_stays_ignored_and_threads_install_nothing() -> None:
    result = run_script("""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        tracker = th.init(run="r")
        print(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)
        os.kill(os.getpid(), signal.SIGTERM)
        print(tracker.current_state)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        made = []
        thread = threading.Thread(target=lambda: made.append(th.init(run="t")))
        thread.start(); thread.join()
        print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
        print(th.init(run="off", handle_sigterm=False) and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "setup", "True", "True"]


def test_two_trackers_chain_and_the_signal_still_kills() -> None:
    """The first tracker closed early: its handler stays in the second's chain and must not swallow."""
    result = run_script("""
        first = th.init(run="a")
        second = th.init(run="b")
        first.close()
        os.kill(os.getpid(), signal.SIGTERM)
        print("survived", flush=True)
    """)
    assert result.returncode == -signal.SIGTERM, result.stdout + result.stderr
    assert "survived" not in result.stdout


def test_forked_child_dies_of_sigterm_without_pushing_for_the_parent() -> None:
    result = run_script("""
        tracker = th.init(run="r")
        pid = os.fork()
        if pid == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, tracker.current_state)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "setup"]


def test_sigterm_to_a_training_process_shows_its_final_state_on_metrics_within_two_seconds(
    tmp_path: Path,
) -> None:
    """The demo trains on torch (CPU) and pushes every second; state idle is only ever set by close(),
    which the SIGTERM handler runs before the signal ends the process. Kubernetes and `docker stop`
    end pods this way."""
    with running_exporter(tmp_path, "--collectors", "node", port=free_port()) as exporter:
        log = tmp_path / "demo.log"
        with open(log, "wb") as out:
            demo = subprocess.Popen(
                [sys.executable, "-m", "stepscope.hooks.demo", "--run", "sigterm", "--push-url", exporter.url,
                 "--push-interval", "1"],
                stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
            )
        try:
            def pushed(name: str, **labels: str) -> list[float]:
                return sample_values(scrape(exporter.url), name, run="sigterm", **labels)

            def training() -> bool:
                assert demo.poll() is None, log.read_text()
                steps = pushed("stepscope_steps_total")
                return pushed("stepscope_training_state", state="train") == [1] and bool(steps) and steps[0] > 0

            assert wait_for(training, 90, interval=0.2), f"the demo did not train:\n{log.read_text()}"
            demo.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            while pushed("stepscope_training_state", state="idle") != [1] and time.monotonic() - sent < 2.0:
                time.sleep(0.05)
            assert pushed("stepscope_training_state", state="idle") == [1], (
                f"no final state 2 s after SIGTERM:\n{log.read_text()}"
            )
            assert demo.wait(timeout=30) == -signal.SIGTERM, log.read_text()  # not swallowed
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait()


def test_lightning_keeps_its_graceful_sigterm_stop_and_the_final_state_is_pushed() -> None:
    """Lightning installs its SIGTERM handler after our callback's tracker exists, chains to ours, and
    stops fitting at the end of the batch (SIGTERMException): the process must not die on the spot."""
    result = run_script("""
        import torch
        from torch import nn
        import lightning.pytorch as pl
        from lightning.pytorch.utilities.exceptions import SIGTERMException
        from stepscope.hooks.lightning import StepscopeCallback

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = nn.Linear(4, 1)
            def training_step(self, batch, batch_idx):
                if batch_idx == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                return self.net(batch[0]).pow(2).mean()
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        data = torch.utils.data.TensorDataset(torch.randn(64, 4))
        callback = StepscopeCallback(run="pl", push_url=receiver_url(), push_interval=60)
        trainer = pl.Trainer(max_steps=50, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
        try:
            trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))
        except SIGTERMException:
            print("lightning stopped at step", trainer.global_step, flush=True)
    """)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "pushed idle" in lines
    assert "lightning stopped at step 4" in lines, lines

"""A real torch CPU training loop with the hooks, pushing to a real Pushgateway (and the exporter)."""

import dataclasses
import importlib.metadata
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import stepscope.hooks as th
from stepscope.contract import EXPORTER_INSTANCE_HEADER
from stepscope.contract.thresholds import THRESHOLDS
from stepscope.exporter.ingest.errors import Rejected
from stepscope.exporter.ingest.families import FAMILIES, INFO_FAMILY
from stepscope.exporter.ingest.parser import PushLimits, parse_push, unknown_family
from stepscope.hooks import pusher as pusher_module
from stepscope.hooks.pusher import Pusher
from stepscope_testkit.loopback import LoopbackServer, serving
from stepscope_testkit.processes import free_port, running_exporter, sample_values, scrape
from stepscope_testkit.pushgateway import running_pushgateway

ITEM_SLEEP = 0.005
BATCH = 4


class SleepyDataset(Dataset):
    """Regression data that takes a known time per item, like slow storage."""

    def __init__(self, items: int, sleep: float) -> None:
        self.items, self.sleep = items, sleep

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep:
            time.sleep(self.sleep)
        x = torch.full((8,), float(index))
        return x, x.sum(dim=0, keepdim=True)


def train(tracker: th.Tracker, steps: int, item_sleep: float = 0.0) -> None:
    """A plain PyTorch loop timed with every standard phase."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
    loader = DataLoader(SleepyDataset(steps * BATCH, item_sleep), batch_size=BATCH)
    for x, y in tracker.loader(loader):
        with tracker.phase("to_device"):
            x, y = x.to("cpu"), y.to("cpu")
        with tracker.phase("train_batch", cuda=True):
            with tracker.phase("forward", cuda=True):
                loss = nn.functional.mse_loss(model(x), y)
            with tracker.phase("backward", cuda=True):
                optimizer.zero_grad()
                loss.backward()
            with tracker.phase("optimizer_step", cuda=True):
                optimizer.step()
        with tracker.phase("step_lr_schedulers"):
            scheduler.step()
        with tracker.phase("from_device"):
            value = loss.detach().to("cpu")
        with tracker.phase("reduce_metrics"):
            float(value)
        tracker.step(samples=len(x))


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_torch_loop_pushes_every_phase_to_a_pushgateway(tmp_path: Path) -> None:
    steps = 12
    with running_pushgateway(tmp_path) as gateway:
        tracker = th.init(run="team/mlp a", push_url=gateway.url, push_interval=0.2, rank=1, world_size=2)
        train(tracker, steps, ITEM_SLEEP)
        tracker.close()
        text = scrape(gateway.url)
    group = {"job": "stepscope", "run": "team/mlp a", "rank": "1"}  # base64 grouping key decoded
    for phase in th.STANDARD_PHASES:
        counts = sample_values(text, "stepscope_step_phase_seconds_count", phase=phase, **group)
        assert counts == [steps], phase
    assert sample_values(text, "stepscope_steps_total", **group) == [steps]
    assert sample_values(text, "stepscope_samples_total", **group) == [steps * BATCH]
    assert sample_values(text, "stepscope_step_seconds_count", **group) == [steps]
    [loading] = sample_values(text, "stepscope_step_phase_seconds_sum", phase="dataloader_next", **group)
    assert loading >= steps * BATCH * ITEM_SLEEP
    [step_sum] = sample_values(text, "stepscope_step_seconds_sum", **group)
    assert step_sum >= loading
    assert sample_values(text, "stepscope_training_state", state="idle", **group) == [1]
    assert sample_values(text, "stepscope_training_info", framework="pytorch", world_size="2", **group) == [1]
    assert sample_values(text, "push_failure_time_seconds", **group) == [0]


def test_pusher_survives_a_missing_gateway_and_a_restart(tmp_path: Path, caplog) -> None:
    steps = 20
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    group = {"job": "stepscope", "run": "robust", "rank": "0"}
    caplog.set_level(logging.WARNING, logger="stepscope.hooks")
    tracker = th.init(run="robust", push_url=url, push_interval=0.05, max_backoff=0.2)
    pusher = tracker.pusher
    train(tracker, steps)
    assert tracker.steps == steps  # nothing listening, and the loop still completed
    wait_for(lambda: pusher.stats.failures >= 3, "failed pushes")
    assert threading.get_ident() not in pusher.stats.threads  # pushes never ran on the training thread
    assert len([r for r in caplog.records if "cannot push" in r.message]) == 1  # one line per outage

    with running_pushgateway(tmp_path, port=port) as gateway:
        wait_for(lambda: pusher.stats.successes >= 1, "the first successful push")
        assert sample_values(scrape(gateway.url), "stepscope_steps_total", **group) == [steps]
    assert len([r for r in caplog.records if "works again" in r.message]) == 1

    with running_pushgateway(tmp_path, port=port) as gateway:  # a restarted gateway has forgotten the run
        pushed = pusher.stats.successes
        wait_for(lambda: pusher.stats.successes > pushed, "a push to the restarted gateway")
        assert sample_values(scrape(gateway.url), "stepscope_steps_total", **group) == [steps]
        train(tracker, 5)
        tracker.close()
        assert sample_values(scrape(gateway.url), "stepscope_steps_total", **group) == [steps + 5]


def test_rejected_push_logs_the_server_message_once(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="stepscope.hooks")
    with running_pushgateway(tmp_path) as gateway:
        tracker = th.init(run="misconfigured", push_url=f"{gateway.url}/wrong-prefix", push_interval=0.05,
                          max_backoff=0.1)
        train(tracker, 3)
        wait_for(lambda: tracker.pusher.stats.failures >= 3, "rejected pushes")
        tracker.close()
    assert tracker.steps == 3
    rejected = [r.message for r in caplog.records if "rejected" in r.message]
    assert len(rejected) == 1
    assert "404" in rejected[0] and "page not found" in rejected[0]


def test_token_and_content_type_reach_the_server() -> None:
    """A stock Pushgateway ignores the token, so a plain HTTP server records what the client sends."""
    received: list[tuple[str, dict[str, str], bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, dict(self.headers), body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tracker = th.init(run="auth", push_url=f"http://127.0.0.1:{server.server_port}", push_token="s3cret")
        tracker.close()
    finally:
        server.shutdown()
        server.server_close()
    path, headers, body = received[-1]
    assert path == "/metrics/job/stepscope/run/auth/rank/0"
    assert headers["Authorization"] == "Bearer s3cret"
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert headers["User-Agent"] == f"stepscope-training-hooks/{importlib.metadata.version('stepscope')}"
    assert b'stepscope_training_state{state="idle"} 1' in body


def test_torch_loop_pushes_to_the_exporter(tmp_path: Path) -> None:
    with running_exporter(tmp_path) as exporter:
        tracker = th.init(run="to-exporter", push_url=exporter.url, push_interval=0.2)
        train(tracker, 6)
        tracker.close()
        assert tracker.pusher.stats.failures == 0, tracker.pusher.stats.last_error
        text = scrape(exporter.url)
    labels = {"run": "to-exporter", "rank": "0"}
    assert sample_values(text, "stepscope_steps_total", **labels) == [6]
    assert sample_values(text, "stepscope_step_phase_seconds_count", phase="forward", **labels) == [6]


def test_two_srun_tasks_of_one_node_push_their_own_ranks_of_their_jobs_run(tmp_path: Path, monkeypatch) -> None:
    """`srun -n 2 python train.py` (no torchrun, no STEPSCOPE_RUN): both tasks pushed run 'train' rank 0 of 1, and the
    exporter refused one at each of its 17 pushes (409), its steps never stored. Each is its rank now, of job 1001's
    run; the variables are srun's (srun(1), OUTPUT ENVIRONMENT VARIABLES)."""
    monkeypatch.setattr("sys.argv", ["/jobs/train.py"])
    for name in ("STEPSCOPE_RUN", "RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"SLURM_JOB_ID": "1001", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}.items():
        monkeypatch.setenv(name, value)
    with running_exporter(tmp_path, "--collectors", "") as exporter:
        trackers = []
        for task in ("0", "1"):
            monkeypatch.setenv("SLURM_PROCID", task)
            monkeypatch.setenv("SLURM_LOCALID", task)
            trackers.append(th.init(push_url=exporter.url, push_interval=60, handle_sigterm=False))
        for tracker in trackers:
            for _ in range(3):
                with tracker.phase("forward"):
                    pass
                tracker.step(samples=1)
            tracker.close()
            assert tracker.pusher.stats.failures == 0, tracker.pusher.stats.last_error
        text = scrape(exporter.url)
    for rank in ("0", "1"):
        assert sample_values(text, "stepscope_steps_total", run="train-1001", rank=rank) == [3]
        assert sample_values(text, "stepscope_training_info", run="train-1001", rank=rank, local_rank=rank,
                             world_size="2") == [1]


def retry_delays(pusher: Pusher, count: int = 4) -> list[float]:
    """The wait after each of the pusher's first `count` tries (its loop, run on this thread)."""
    delays: list[float] = []

    def wait(delay: float) -> bool:
        delays.append(delay)
        return len(delays) >= count  # True: stop

    pusher._stop.wait = wait  # type: ignore[method-assign]
    pusher._loop()
    return delays


def test_a_refused_push_is_retried_at_the_interval_and_a_timeout_backs_off() -> None:
    """Nothing listening (an exporter restarting) costs nothing to try again: the next try comes at the
    interval, so a restarted exporter has every rank again within one interval. A server that accepts and
    never answers backs off, doubling up to max_backoff."""
    refused = Pusher(f"http://127.0.0.1:{free_port()}", lambda: "", interval=5.0, timeout=0.05, max_backoff=60.0)
    assert retry_delays(refused) == [5.0, 5.0, 5.0, 5.0]
    assert refused.stats.failures == 4
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts into its backlog, never answers
        hanging = Pusher(f"http://127.0.0.1:{silent.getsockname()[1]}", lambda: "", interval=5.0, timeout=0.05,
                         max_backoff=60.0)
        assert retry_delays(hanging) == [10.0, 20.0, 40.0, 60.0]
    assert "ReadTimeout" in hanging.stats.last_error


def test_a_failed_final_push_says_that_the_rank_may_be_paged_lost_not_that_it_retries(caplog) -> None:
    """close() at a moment its exporter cannot be reached, the pushes before having landed: the last state, idle, may
    never land. Said once as what it is; before, "retrying, training continues" (neither happens)."""
    caplog.set_level(logging.WARNING, logger="stepscope.hooks")
    pusher = Pusher(f"http://127.0.0.1:{free_port()}", lambda: "", interval=5.0, timeout=0.5, max_backoff=60.0)
    pusher.stop()
    (warning,) = [record.getMessage() for record in caplog.records]
    assert warning.startswith("stepscope: the final push (state idle) failed: cannot push to http://127.0.0.1:")
    assert warning.endswith("the exporter may show this rank in its last state until its --ingest-ttl, and "
                            "StepscopeRankLost page it as lost")
    assert "retrying" not in warning


class BusyFirst(BaseHTTPRequestHandler):
    """An exporter with too many bodies in flight: 503 server_busy with Retry-After (`retry_after`) to the
    first `busy` PUTs, then 200; records each PUT's body."""

    busy = 1
    retry_after = "1"
    bodies: list[bytes] = []

    def do_PUT(self) -> None:
        self.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        refused = len(self.bodies) <= self.busy
        self.send_response(503 if refused else 200)
        if refused:
            self.send_header("Retry-After", self.retry_after)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(("busy", "retry_after", "landed"), [(1, "1", True), (1, "30", False), (9, "1", False)])
def test_the_final_push_waits_as_a_busy_server_asks_within_its_grace(busy: int, retry_after: str,
                                                                     landed: bool, caplog, monkeypatch) -> None:
    """close() beside an exporter busy for now (503, Retry-After): the final push, whose idle ends the rank, is
    sent again after the delay asked, so a cleanly finished rank is not left `train` there to be paged lost; a
    delay beyond the grace (2.5 s here), or a server busy all through it, is not waited for."""
    caplog.set_level(logging.WARNING, logger="stepscope.hooks")
    monkeypatch.setattr(pusher_module, "FINAL_PUSH_GRACE_SECONDS", 2.5, raising=False)
    handler = type("Busy", (BusyFirst,), {"busy": busy, "retry_after": retry_after, "bodies": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pusher = Pusher(f"http://127.0.0.1:{server.server_port}/metrics/job/stepscope/run/r/rank/0",
                        lambda: "idle\n", interval=60.0, max_backoff=60.0)
        pusher.stop()
    finally:
        server.shutdown()
        server.server_close()
    tries = len(handler.bodies)
    if landed:
        assert (pusher.stats.successes, tries) == (1, 2)
    else:  # busy all through: tried after 1 s and 2 s, not after 3 s (a try that stalled a second: one fewer)
        assert pusher.stats.successes == 0 and tries in ((1,) if retry_after == "30" else (2, 3))
    assert bool(caplog.records) is not landed  # the final push's failure is said
    assert all(body == b"idle\n" for body in handler.bodies)


def test_a_conflict_is_retried_at_the_interval_and_logged_once(caplog) -> None:
    """409: the exporter gives the run and rank to another process of the node until it closes or stops
    pushing. Backing off (up to 60 s) would keep this process's series out for a minute after that; at the
    interval they land within one. The server's message, which says what to do, is logged once."""
    caplog.set_level(logging.WARNING, logger="stepscope.hooks")
    message = "run 'train' rank 0 is pushed by another process on this node (pid 1234, last push 0.4s ago): " + \
        "two processes cannot share a run and rank; give each its own run " + "x" * 200

    class Conflict(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(409)
            self.send_header("Content-Length", str(len(message)))
            self.end_headers()
            self.wfile.write(message.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Conflict)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pusher = Pusher(f"http://127.0.0.1:{server.server_port}/metrics/job/stepscope/run/train/rank/0",
                        lambda: "", interval=5.0, max_backoff=60.0)
        assert retry_delays(pusher) == [5.0, 5.0, 5.0, 5.0]
    finally:
        server.shutdown()
        server.server_close()
    assert pusher.stats.failures == 4
    logged = [record.getMessage() for record in caplog.records]
    assert logged == [f"stepscope: push to {pusher.url} rejected (409): {message}; training continues"]


def _read_request(connection: socket.socket) -> bytes:
    """One request's head and Content-Length body from `connection`; b"" once the client closed it."""
    data = b""
    while b"\r\n\r\n" not in data:
        if not (chunk := connection.recv(65536)):
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += connection.recv(65536)
    return head


def test_a_push_on_a_kept_connection_the_server_closed_as_it_went_out_is_sent_again() -> None:
    """A server closes an idle kept-alive connection when it chooses, and a push sent as it does fails though
    nothing is wrong (a clean-clone CI run lost one so, the exporter closing at its 10 s idle limit). Here
    the server answers the first push, then closes that connection when the second push arrives on it; the
    push is sent again on a new connection and stored, and no failure is counted or logged."""
    answered: list[int] = []  # for each push answered, the number of the connection it came on

    def serve(listener: socket.socket) -> None:
        for number in range(2):
            connection, _ = listener.accept()
            with connection:
                while _read_request(connection):
                    if number == 0 and answered:  # the second push on the first connection: closed, no answer
                        break
                    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    answered.append(number)

    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = threading.Thread(target=serve, args=(listener,), daemon=True)
        server.start()
        pusher = Pusher(f"http://127.0.0.1:{listener.getsockname()[1]}/metrics/job/stepscope/run/kept/rank/0",
                        lambda: "stepscope_steps_total 1\n", interval=5.0, timeout=5.0)
        assert pusher.push_once() and pusher.push_once(), pusher.stats.last_error
        pusher._session.close()
        server.join(timeout=5)
    assert answered == [0, 1]
    assert (pusher.stats.successes, pusher.stats.failures) == (2, 0)


class RecordingServer(LoopbackServer):
    """A plain HTTP server that answers every PUT 200 and keeps (request target, Authorization) of each."""

    def __init__(self) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.path, self.headers.get("Authorization")))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(Handler)


def test_a_push_to_this_machine_skips_the_environments_proxy_and_others_keep_it(monkeypatch) -> None:
    """Clusters set HTTP_PROXY for downloads, and requests sent even a push to 127.0.0.1 through it: every push
    failed (ProxyError, or the proxy's 502) and the proxy got the bearer token. Go's clients never proxy
    loopback; the hooks now neither proxy this machine, and a push elsewhere (a Pushgateway across the network)
    goes through the proxy as before."""
    with serving(RecordingServer()) as proxy, serving(RecordingServer()) as exporter:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        local = Pusher(f"{exporter.url}/metrics/job/stepscope/run/r/rank/0", lambda: "x 1\n", interval=5.0,
                       token="s3cret")
        remote = Pusher("http://pushgateway.invalid:9091/metrics/job/stepscope/run/r/rank/0", lambda: "x 1\n",
                        interval=5.0)
        assert local.push_once() and remote.push_once()
    assert exporter.received == [("/metrics/job/stepscope/run/r/rank/0", "Bearer s3cret")]
    assert proxy.received == [("http://pushgateway.invalid:9091/metrics/job/stepscope/run/r/rank/0", None)]


def test_a_rank_pushes_again_within_a_third_of_the_rank_lost_silence_after_its_exporter_recovers() -> None:
    """StepscopeRankLost pages a rank unpushed for rank_lost_seconds (45 s). Backing off to 60 s after timeouts and
    5xx, a rank whose exporter answered 503 for 40 s (waits of 10, 20, then 40 s) stayed unpushed 75 s and was paged
    lost from 71 to 86 s, though the exporter answered again at 52 s. The default backoff stops at a third of the
    threshold: the rank pushed again at 55 s, no page."""
    config = th.Config.resolve(env={}, run="r")
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts into its backlog, never answers
        hanging = Pusher(f"http://127.0.0.1:{silent.getsockname()[1]}", lambda: "", interval=config.push_interval,
                         timeout=0.05, max_backoff=config.max_backoff)
        delays = retry_delays(hanging, 5)
    assert delays == [10.0, 15.0, 15.0, 15.0, 15.0]
    assert max(delays) <= THRESHOLDS["rank_lost_seconds"].value / 3


class OlderExporter(LoopbackServer):
    """A push API of an exporter release that predates a family: it refuses any push holding that family with its
    400 (the exporter's own message), and parses every other with the exporter's parser, keeping what it stored."""

    def __init__(self, unknown: str, port: int = 0, answer_headers: dict[str, str] | None = None) -> None:
        stored = self.stored = []

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    if unknown.encode() in body:
                        raise unknown_family(unknown)
                    stored.append(parse_push(body, "old", "0", PushLimits(128, 2000, 32)))
                    status, answer = 200, b""
                except Rejected as exc:
                    status, answer = exc.status, exc.message.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(answer)))
                for name, value in (answer_headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(Handler, port)
        self.push_url = f"{self.url}/metrics/job/stepscope/run/old/rank/0"


def test_hooks_newer_than_their_exporter_push_without_the_family_it_does_not_know(caplog) -> None:
    """Training images pin the hooks; the DaemonSet's exporter may be older. An exporter from before the global
    step's start refused every push of a rank that stated its global step (400 unknown family), so none of its
    steps landed. The pusher now leaves the unknown family out, says so once, and the rest lands at once."""
    caplog.set_level(logging.WARNING, logger="stepscope.hooks")
    tracker = th.init(run="old", push_url="", handle_sigterm=False)
    for global_step in (1, 2, 3):
        tracker.step(samples=4, global_step=global_step)
    newer = "stepscope_training_global_step_start"
    assert newer in tracker.render()
    with serving(OlderExporter(newer)) as exporter:
        pusher = Pusher(exporter.push_url, tracker.render, interval=5.0)
        assert pusher.push_once() and pusher.push_once()
    tracker.close()
    assert len(exporter.stored) == 2
    assert newer not in exporter.stored[-1]
    assert exporter.stored[-1]["stepscope_steps_total"].lines.split()[-1] == b"3.0"
    assert exporter.stored[-1]["stepscope_training_global_step"].lines.split()[-1] == b"3.0"
    warnings = [record.getMessage() for record in caplog.records if newer in record.getMessage()]
    assert len(warnings) == 1 and "older than these hooks" in warnings[0]


def test_hooks_newer_than_their_exporter_push_without_the_label_it_does_not_know(monkeypatch, caplog) -> None:
    """An exporter from before `pid_namespace` refuses stepscope_training_info with it (400 unexpected label):
    every push of the newer hooks was refused, none of the rank's steps landed. The pusher leaves the label out."""
    caplog.set_level(logging.WARNING, logger="stepscope.hooks")
    older_info = dataclasses.replace(FAMILIES[INFO_FAMILY], optional=("start_time",))
    monkeypatch.setitem(FAMILIES, INFO_FAMILY, older_info)  # the parser of that release
    tracker = th.init(run="old", push_url="", handle_sigterm=False)
    tracker.step(samples=4)
    assert 'pid_namespace="' in tracker.render()
    with serving(OlderExporter("a family no release lacks")) as exporter:
        pusher = Pusher(exporter.push_url, tracker.render, interval=5.0)
        assert pusher.push_once() and pusher.push_once()
    tracker.close()
    assert len(exporter.stored) == 2
    assert b"start_time=" in exporter.stored[-1][INFO_FAMILY].lines
    assert exporter.stored[-1]["stepscope_steps_total"].lines.split()[-1] == b"1.0"
    warnings = [record.getMessage() for record in caplog.records if "pid_namespace" in record.getMessage()]
    assert len(warnings) == 1 and "older than these hooks" in warnings[0]


def test_a_family_left_out_for_an_older_exporter_is_pushed_again_once_the_exporter_restarts() -> None:
    """The DaemonSet upgrades the exporter under running jobs: a process that left a family out for the older
    release pushes it again after a push finds nothing listening (the restart), so the newer exporter gets it."""
    tracker = th.init(run="old", push_url="", handle_sigterm=False)
    tracker.step(samples=4, global_step=7)
    newer = "stepscope_training_global_step_start"
    with serving(OlderExporter(newer)) as older:
        pusher = Pusher(older.push_url, tracker.render, interval=5.0)
        assert pusher.push_once()
    assert not pusher.push_once()  # the rollout: nothing listens for a moment
    with serving(OlderExporter("a family no release lacks", port=older.server_address[1])) as upgraded:
        assert pusher.push_once()
    tracker.close()
    assert newer in upgraded.stored[-1]


def test_a_family_left_out_for_an_older_exporter_is_pushed_again_once_another_exporter_answers() -> None:
    """A rollout that replaced the node's exporter between two pushes fails none of them: the hooks left
    stepscope_training_global_step_start and pid_namespace out of every later push to the upgraded exporter
    (measured: 97d12fc's exporter swapped for this one under a 5 s push interval, 4 pushes over 16 s, none with
    them). An exporter names its process in each accepted push's answer; another name offers everything again."""
    tracker = th.init(run="old", push_url="", handle_sigterm=False)
    tracker.step(samples=4, global_step=7)
    newer = "stepscope_training_global_step_start"
    with serving(OlderExporter(newer)) as older:
        pusher = Pusher(older.push_url, tracker.render, interval=5.0)
        assert pusher.push_once() and pusher.push_once()  # an older release names no process: nothing offered again
    assert older.stored and newer not in older.stored[-1]
    answer = {EXPORTER_INSTANCE_HEADER: "upgraded"}
    with serving(OlderExporter("a family no release lacks", port=older.server_address[1],
                               answer_headers=answer)) as upgraded:
        assert pusher.push_once() and pusher.push_once()
    tracker.close()
    assert newer in upgraded.stored[-1]


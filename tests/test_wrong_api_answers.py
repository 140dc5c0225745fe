"""The two commands that read an HTTP API, pointed at a server that answers success in another shape: another
service on that port, a proxy's page wrapped as JSON, another version. stepscope-report (Prometheus' query API)
and stepscope-profile (the exporter's profile API) each end with one line and exit status 2, where they ended
with a KeyError, TypeError or ValueError traceback, and the report writes nothing. So do they when the server
answers a byte at a time, past their timeout.

The server is the bad input itself: a few lines of http.server answering one fixed JSON body to every request.
"""

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from stepscope.exporter import profile_cli
from stepscope.report import cli as report_cli

# A profile request with every field the exporter writes (ProfileRequest.as_json), pending on rank 0.
PENDING = {"id": "a1", "run": "r", "rank": "0", "state": "pending", "reason": "", "steps": 20, "done_steps": 0,
           "path": "", "bytes": 0, "trace_steps": 0, "last_push_age_seconds": None, "push_interval_seconds": None,
           "training_state": None}


@contextmanager
def answering(body: object) -> Iterator[str]:
    """A server on a free loopback port answering HTTP 200 and `body` as JSON (bytes: as they are) to every GET,
    POST and DELETE."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def trickling() -> Iterator[str]:
    """A server on a free loopback port answering every request with HTTP 200 and a JSON body sent a byte every
    0.2 s: each byte comes well within any timeout a client sets for its next bytes, the answer never ends."""
    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))

    def answer(connection: socket.socket) -> None:
        with connection:
            connection.recv(65536)
            body = b'{"status": "success", "data": []}' + b" " * 100_000
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n" % len(body))
            for index in range(len(body)):
                if stop.wait(0.2):
                    return
                connection.sendall(body[index:index + 1])

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()


def _one_line(err: str, prefix: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


NESTED = b"[" * 100_000 + b"]" * 100_000  # JSON nested deeper than Python's stack: json raises RecursionError
NOT_IN_FORMAT = "answered success with data not in the Prometheus API's"


@pytest.mark.parametrize("body", [
    {"status": "success"},
    {"status": "success", "data": None},
    {"status": "success", "data": {}},
    {"status": "success", "data": [{"run": "r"}]},
    {"status": "success", "data": {"resultType": "matrix", "result": [{"metric": {}}]}},
    {"status": "success", "data": {"resultType": "matrix", "result": [{"metric": {}, "values": [[1, "x"]]}]}},
    {"status": "success", "data": {"resultType": "matrix", "result": [{"metric": {"run": 1}, "values": []}]}},
    {"status": "success", "data": {"resultType": "string", "result": [1, "a"]}},
    NESTED,  # before, a RecursionError traceback from inside requests' json()
], ids=lambda body: "nested-past-the-stack" if body is NESTED else json.dumps(body)[:70])
def test_the_report_names_an_answer_not_in_prometheus_format_in_one_line(
        body: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    with answering(body) as url:
        code = report_cli.main(["--prometheus", url, "--run", "r", "--out", str(out)])
    line = _one_line(capsys.readouterr().err, "stepscope-report: error: ")
    says = "answered HTTP 200 without a Prometheus API response" if body is NESTED else NOT_IN_FORMAT
    assert code == 2 and says in line, line
    assert not out.exists()


def test_the_report_lists_runs_only_from_label_sets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --run the report lists the runs it sees through the series API: a list of label sets."""
    with answering({"status": "success", "data": {"run": "r"}}) as url:
        code = report_cli.main(["--prometheus", url, "--out", str(tmp_path / "report")])
    line = _one_line(capsys.readouterr().err, "stepscope-report: error: ")
    assert code == 2 and "not in the Prometheus API's series format" in line, line


@pytest.mark.parametrize(("body", "says"), [
    ({}, "answered without the requests it made"),
    ({"requests": "r"}, "answered without the requests it made"),
    ({"requests": []}, "answered without the requests it made"),
    ({"requests": [7]}, "answered int where a profile request belongs"),
    ({"requests": [{"id": "a1"}]}, "a profile request without run, rank, state, reason, steps"),
    ({"requests": [{**PENDING, "bytes": "1 KiB"}]}, "a profile request without bytes as"),
    ({"requests": [{**PENDING, "rank": "zero"}]}, "a profile request without rank as"),
    ({"requests": [{**PENDING, "push_interval_seconds": "1 s"}]}, "a profile request without push_interval_seconds as"),
    # the request is made, then its GET answers the same body again: a list where one request belongs
    ({"requests": [PENDING]}, "/api/v1/profiles/a1 answered a profile request without id, run"),
], ids=lambda value: json.dumps(value)[:60])
def test_stepscope_profile_names_an_answer_not_in_the_profile_api_format_in_one_line(
        body: object, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with answering(body) as url:
        code = profile_cli.main(["--exporter", url, "--run", "r", "--wait", "2"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert lines[-1].startswith("stepscope-profile: ") and says in lines[-1], err
    assert lines[-1].endswith("point --exporter at a stepscope exporter of this version"), err


def test_stepscope_profile_takes_a_request_without_the_fields_later_exporters_added(
        capsys: pytest.CaptureFixture[str]) -> None:
    """An earlier exporter wrote no last_push_age_seconds, push_interval_seconds or training_state: its
    finished trace is reported as ever."""
    done = {key: value for key, value in PENDING.items() if value is not None}
    done.update(state="done", path="/traces/r-0.pt.trace.json.gz", bytes=2048, trace_steps=20, done_steps=20)
    assert not {"last_push_age_seconds", "push_interval_seconds", "training_state"} & set(done)
    with answering({"requests": [done]}) as url:
        code = profile_cli.main(["--exporter", url, "--run", "r", "--wait", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == "/traces/r-0.pt.trace.json.gz\n"
    assert captured.err.splitlines()[-1] == "stepscope-profile: rank 0: 20 steps, 2.0 KiB"


def test_the_report_lists_many_runs_and_odd_run_names_on_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --run the report lists the runs it sees: all of them before (1.7 MB of one error for 50,000), and a
    name with a line end or an escape (Prometheus stores any label value, a stock Pushgateway pushes it) as it is,
    which split the line and coloured the terminal."""
    runs = ["a\n\x1b[31m", *(f"run-{index:02}" for index in range(49))]
    series = [{"__name__": "stepscope_training_info", "run": run, "rank": "0", "instance": "n1"} for run in runs]
    with answering({"status": "success", "data": series}) as url:
        code = report_cli.main(["--prometheus", url, "--out", str(tmp_path / "report")])
    line = _one_line(capsys.readouterr().err, "stepscope-report: error: --run is required; runs seen between ")
    assert code == 2 and "\x1b" not in line
    assert "$'a\\n\\x1b[31m' (1 rank on n1); run-00 (1 rank on n1); " in line, line
    assert line.endswith("; run-18 (1 rank on n1); and 30 more (narrow them with --from/--to)"), line


def test_stepscope_profile_names_json_nested_too_deep_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Before, a RecursionError traceback from inside requests' json()."""
    with answering(NESTED) as url:
        code = profile_cli.main(["--exporter", url, "--run", "r", "--wait", "2"])
    line = _one_line(capsys.readouterr().err, "stepscope-profile: ")
    assert code == 2 and "answered HTTP 200 without the profile API's JSON" in line, line


@pytest.mark.timeout(60)
def test_the_report_gives_up_on_a_prometheus_answering_a_byte_at_a_time_after_its_timeout(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--timeout is per query, the whole answer: requests' own timeout bounds each wait for a byte, and the
    report waited on such a server for ever (over 40 s with --timeout 3)."""
    out = tmp_path / "report"
    with trickling() as url:
        code = report_cli.main(["--prometheus", url, "--run", "r", "--out", str(out), "--timeout", "1"])
    line = _one_line(capsys.readouterr().err, "stepscope-report: error: ")
    assert code == 2 and f"Prometheus at {url} did not answer within 1s; " in line, line
    assert line.endswith("raise --timeout (and the server's --query.timeout, --query.max-samples), or report a part "
                         "of the run with --from/--to"), line
    assert not out.exists()


@pytest.mark.timeout(60)
def test_stepscope_profile_gives_up_on_an_exporter_answering_a_byte_at_a_time(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Each call to the exporter is bounded as a whole: before, `--wait 3` waited on such a server for ever (over
    40 s), requests' timeout (10 s) being one for each wait for a byte."""
    monkeypatch.setattr(profile_cli, "HTTP_TIMEOUT_SECONDS", 1.0)
    with trickling() as url:
        code = profile_cli.main(["--exporter", url, "--run", "r", "--wait", "1"])
    line = _one_line(capsys.readouterr().err, "stepscope-profile: ")
    assert code == 2 and line.startswith(f"stepscope-profile: cannot reach the exporter at {url} (Timeout)"), line


def _refusing_url() -> str:
    """A loopback URL nothing listens on, with a user and password in it."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
    return f"http://reader:s3cret@127.0.0.1:{port}"


def test_the_commands_leave_the_password_of_a_url_out_of_their_messages(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The page never showed the password of --prometheus, but the messages that end in CI logs did:
    'cannot reach Prometheus at http://reader:s3cret@127.0.0.1:1: Connection refused'."""
    url = _refusing_url()
    assert report_cli.main(["--prometheus", url, "--run", "r", "--out", str(tmp_path / "report")]) == 2
    line = _one_line(capsys.readouterr().err, "stepscope-report: error: ")
    assert line.startswith(f"stepscope-report: error: cannot reach Prometheus at {url.replace('reader:s3cret@', '')}:")
    assert profile_cli.main(["--exporter", url, "--run", "r", "--wait", "1"]) == 2
    line = _one_line(capsys.readouterr().err, "stepscope-profile: ")
    assert line.startswith(f"stepscope-profile: cannot reach the exporter at {url.replace('reader:s3cret@', '')} (")
    with answering(["not", "an", "object"]) as plain:
        with_password = plain.replace("http://", "http://reader:s3cret@")
        assert profile_cli.main(["--exporter", with_password, "--run", "r", "--wait", "1"]) == 2
    line = _one_line(capsys.readouterr().err, "stepscope-profile: ")
    assert line.startswith(f"stepscope-profile: {plain}/api/v1/profiles answered HTTP 200 without"), line

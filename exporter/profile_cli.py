"""`stepscope-profile` (or `python -m stepscope.exporter.profile_cli`): a PyTorch profiler trace of a live rank.

    stepscope-profile [--exporter URL] --run RUN [--rank K ... | --all-ranks] [--steps 20] [--wait 120]

Asks the node's exporter (the one the ranks push to) for a trace of the next `--steps` steps of each
rank; the rank takes it on its next push, writes a gzipped Chrome trace into its STEPSCOPE_TRACE_DIR
and reports it on the push after. Prints the path of each trace on stdout, one per line (open them in
https://ui.perfetto.dev, chrome://tracing or TensorBoard's profiler plugin), and a line per rank on
stderr. Exit 0 when every rank wrote its trace; exit 2 with the reason per rank when one did not
(not pushing here, profiler not available, already tracing, idle, timeout) and for bad flags, an
exporter that cannot be reached or an answer not in the profile API's shape; 130 on Ctrl-C, which cancels
the requests: a rank tracing stops at its next step and writes no file (hooks older than the exporter trace
on: the line says so). It stops waiting early when every rank still to take its request stopped pushing
(nothing for 3 of its push intervals and a second, 10 s at least). Requests no rank took are cancelled on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import requests

from stepscope.contract import json_text
from stepscope.exporter.flags import positive_float
from stepscope.exporter.ingest.tokens import check_token, first_token
from stepscope.hooks.config import bracket_ipv6_host, sent_token
from stepscope.hooks.pusher import proxies_for
from stepscope.report.prometheus import answered_within, without_credentials

PROG = "stepscope-profile"
DEFAULT_EXPORTER = "http://127.0.0.1:9847"
API = "/api/v1/profiles"
MAX_STEPS = 1000
POLL_SECONDS = 0.5
# A rank is called gone after 3 of its push intervals and a second without a push, and never before this.
STOPPED_PUSHING_FLOOR_SECONDS = 10.0
HTTP_TIMEOUT_SECONDS = 10.0
FINISHED = ("done", "failed", "cancelled")
# A profile request as the exporter writes it (ProfileRequest.as_json): every field this command reads, by type.
# The last three came in later exporters and may be absent (None): the command then says less about a rank.
REQUEST_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str,), "run": (str,), "rank": (str,), "state": (str,), "reason": (str,), "steps": (int,),
    "done_steps": (int,), "path": (str,), "bytes": (int,), "trace_steps": (int,),
}
OPTIONAL_FIELDS: dict[str, tuple[type, ...]] = {
    "last_push_age_seconds": (int, float, type(None)), "push_interval_seconds": (int, float, type(None)),
    "training_state": (str, type(None)),
}


class Failure(Exception):
    """The one-line reason the command ends with exit 2."""


def _int_in(low: int, high: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {text!r}")
        return value
    return parse


def _exporter_source(argv: Sequence[str]) -> str:
    """What set the exporter's URL, for a message about it: the flag, or the variable it defaults to."""
    if os.environ.get("STEPSCOPE_PUSH_URL", "").strip() and not any(arg.startswith("--exporter") for arg in argv):
        return "STEPSCOPE_PUSH_URL (the default of --exporter)"
    return "--exporter"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    # Each help says its default itself (some come from the environment), so no defaults formatter: it
    # printed every default a second time, and "(default: None)" for flags whose default is a variable.
    parser = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--exporter", default=os.environ.get("STEPSCOPE_PUSH_URL", "").strip() or DEFAULT_EXPORTER,
                        metavar="URL", help="the exporter the ranks push to (default: STEPSCOPE_PUSH_URL, else "
                                            f"{DEFAULT_EXPORTER})")
    parser.add_argument("--run", required=True, help="the run (label `run`)")
    ranks = parser.add_mutually_exclusive_group()
    ranks.add_argument("--rank", type=_int_in(0, 10**9), action="append", metavar="K",
                       help="a rank to trace, repeatable (default: 0)")
    ranks.add_argument("--all-ranks", action="store_true", help="every rank of the run pushing to this exporter")
    parser.add_argument("--steps", type=_int_in(1, MAX_STEPS), default=20,
                        help="training steps to record (default: 20)")
    parser.add_argument("--wait", type=positive_float, default=120.0, metavar="SECONDS",
                        help="how long to wait for the traces (default: 120)")
    parser.add_argument("--token-file", metavar="FILE",
                        help="file holding the exporter's push token (default: STEPSCOPE_PUSH_TOKEN)")
    args = parser.parse_args(argv)
    given = _exporter_source(sys.argv[1:] if argv is None else argv)
    if not args.exporter.startswith(("http://", "https://")):
        parser.error(f"{given} must be an http:// or https:// URL, got {args.exporter!r}")
    try:  # STEPSCOPE_PUSH_URL as the chart sets it: http://$(HOST_IP):9847, an IPv6 node's without brackets
        args.exporter = bracket_ipv6_host(args.exporter.rstrip("/"))
    except ValueError as exc:
        parser.error(f"{given} {args.exporter!r} {exc}")
    args.token = _token(parser, args.token_file)
    return args


def _token(parser: argparse.ArgumentParser, path: str | None) -> str:
    """The push token from --token-file or STEPSCOPE_PUSH_TOKEN (empty: none); one that cannot be read or
    sent in a header ends the program with one line, before any request (http.client raised a traceback)."""
    try:
        if path is not None:
            return first_token(path)
        token = sent_token(os.environ.get("STEPSCOPE_PUSH_TOKEN", ""))
        check_token(token)
        return token
    except ValueError as exc:
        source = f"--token-file {path!r}" if path is not None else "STEPSCOPE_PUSH_TOKEN"
        parser.exit(2, f"{PROG}: error: {source}: {exc}\n")


class ExporterApi:
    """The exporter's profile-request API; every problem becomes a Failure with what to do."""

    def __init__(self, base_url: str, token: str) -> None:
        self.base_url = base_url
        self.shown_url = without_credentials(base_url)  # in messages: a proxy's user and password stay out of logs
        self._session = requests.Session()
        if token:
            self._session.headers["Authorization"] = f"Bearer {token}"

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        url = self.base_url + path
        try:
            response = answered_within(HTTP_TIMEOUT_SECONDS, lambda: self._session.request(
                method, url, timeout=HTTP_TIMEOUT_SECONDS, proxies=proxies_for(url), **kwargs))
        except requests.RequestException as exc:
            raise Failure(f"cannot reach the exporter at {self.shown_url} ({type(exc).__name__}): is stepscope-exporter"
                          " running there? (--exporter, STEPSCOPE_PUSH_URL)") from None
        try:
            payload = json_text.loads(response.content)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            raise Failure(f"{self.shown_url + path} answered HTTP {response.status_code} without the profile API's "
                          "JSON: point --exporter at a stepscope exporter (a Pushgateway cannot take profile requests)")
        if response.status_code >= 400:
            raise Failure(str(payload.get("error") or f"HTTP {response.status_code}"))
        return payload

    def one(self, method: str, path: str) -> dict[str, Any]:
        """The profile request a GET or DELETE of one answers with."""
        return checked_request(self.shown_url + path, self.call(method, path))

    def close(self) -> None:
        self._session.close()


def request_traces(api: ExporterApi, args: argparse.Namespace) -> list[dict[str, Any]]:
    ranks: list[int] | str = "all" if args.all_ranks else (args.rank or [0])
    made = api.call("POST", API, json={"run": args.run, "ranks": ranks, "steps": args.steps}).get("requests")
    if not isinstance(made, list) or not made:
        raise Failure(f"{api.shown_url + API} answered without the requests it made: {NOT_OUR_API}")
    return [checked_request(api.shown_url + API, request) for request in made]


NOT_OUR_API = "point --exporter at a stepscope exporter of this version"


def checked_request(url: str, request: Any) -> dict[str, Any]:
    """`request` when it has every field this command reads, of its type, and a whole-number rank: an answer
    in another shape (another service on that port, another version) ends in one line, not a traceback."""
    if not isinstance(request, dict):
        raise Failure(f"{url} answered {type(request).__name__} where a profile request belongs: {NOT_OUR_API}")
    wrong = [name for name, kinds in REQUEST_FIELDS.items() if not isinstance(request.get(name, ...), kinds)]
    wrong += [name for name, kinds in OPTIONAL_FIELDS.items() if not isinstance(request.get(name), kinds)]
    if not wrong and not request["rank"].isdigit():
        wrong.append("rank")
    if wrong:
        raise Failure(f"{url} answered a profile request without {', '.join(wrong)} as the profile API writes "
                      f"them: {NOT_OUR_API}")
    return request


def stopped_pushing(request: dict[str, Any]) -> bool:
    """Whether a request not finished waits for a rank that stopped pushing: its last push is older than 3 of
    its push intervals and a second, and than STOPPED_PUSHING_FLOOR_SECONDS (a rank that never pushed twice
    cannot tell). A rank pushes while it traces (the pusher is a thread of its own, the trace is written by
    another), so a running request's rank that stopped pushing was killed or hung mid-trace: waiting out --wait
    for it tells nothing more. The floor: starting the profiler holds the interpreter in the training thread,
    and the pusher with it, for seconds (CUPTI's first start on a GPU; on a busy CPU a clean-clone CI run's rank
    at 1.1 s pushes went 4.3 s without one and was called gone before it recorded a step)."""
    age, interval = request.get("last_push_age_seconds"), request.get("push_interval_seconds")
    return request["state"] in ("pending", "running") and age is not None and interval is not None \
        and age > max(3 * interval + 1, STOPPED_PUSHING_FLOOR_SECONDS)


def wait_for(api: ExporterApi, requests_made: list[dict[str, Any]], wait: float) -> list[dict[str, Any]]:
    """The requests as they stand when all finished, when those left wait for ranks that stopped pushing,
    or when `wait` seconds passed."""
    deadline = time.monotonic() + wait
    current = requests_made
    while True:
        current = [r if r["state"] in FINISHED else api.one("GET", f"{API}/{r['id']}") for r in current]
        if all(r["state"] in FINISHED or stopped_pushing(r) for r in current) or time.monotonic() >= deadline:
            return current
        time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))


def cancel_unanswered(api: ExporterApi, current: list[dict[str, Any]]) -> None:
    """Cancels the requests nobody will wait for: those no rank took, and those whose rank stopped pushing
    mid-trace (were it only paused, it would trace on and write a file when it comes back)."""
    for request in current:
        if request["state"] == "pending" or stopped_pushing(request):
            with contextlib.suppress(Failure):  # it expires on the exporter by itself
                api.call("DELETE", f"{API}/{request['id']}")


def interrupted(api: ExporterApi, current: list[dict[str, Any]]) -> str:
    """Cancels every request not finished, running ones included (their rank stops at its next step and
    writes no file); the one line to end with, saying what became of each."""
    notes = []
    for request in sorted(current, key=lambda r: int(r["rank"])):
        if request["state"] in FINISHED:
            continue
        who = f"rank {request['rank']}"
        try:
            state = api.one("DELETE", f"{API}/{request['id']}")
        except Failure as failure:
            notes.append(f"{who} traces on ({failure})")
            continue
        if state["state"] == "running":
            notes.append(f"{who} stops its trace at its next step, writing no file")
        elif state["state"] == "done":
            notes.append(f"{who} had written its trace: {state['path']}")
    return "interrupted" + (f": {'; '.join(notes)}" if notes else "")


def explain(request: dict[str, Any], wait: float) -> str:
    """Why a request has no trace, in one line."""
    who = f"rank {request['rank']} of run {request['run']!r}"
    state = request["state"]
    if state in ("failed", "cancelled"):
        return f"{who}: {request['reason'] or state}"
    recorded = f"recorded {request['done_steps']} of {request['steps']} steps"
    if state == "running" and not stopped_pushing(request):
        return (f"{who} took the request but {recorded} in {wait:g} s: training is slow, stalled or not stepping "
                "(eval, checkpoint); raise --wait")
    age, interval = request.get("last_push_age_seconds"), request.get("push_interval_seconds")
    if age is None:
        return f"{who} did not take the request within {wait:g} s and stopped pushing"
    pushed = f"its last push was {age:.1f} s ago"
    if interval is not None:
        pushed += f", pushes came every {interval:.1f} s"
    if request.get("training_state") == "idle":
        pushed += ", and it said the rank is idle (its training ended)"
    if state == "running":
        return f"{who} took the request, {recorded}, then stopped pushing ({pushed}): the process is not " \
               "pushing (killed, hung or gone) and wrote no trace"
    if stopped_pushing(request):
        return f"{who} stopped pushing before it took the request ({pushed}): the process is not pushing (hung, " \
               "stopped or gone)"
    waited = f"{who} did not take the request within {wait:g} s; {pushed}"
    return f"{waited}: raise --wait" if interval is not None else f"{waited}: it may have stopped pushing"


def report(finished: list[dict[str, Any]], wait: float) -> int:
    failed = 0
    for request in sorted(finished, key=lambda r: int(r["rank"])):
        if request["state"] == "done":
            note = f" ({request['reason']})" if request["reason"] else ""
            print(request["path"], flush=True)
            print(f"{PROG}: rank {request['rank']}: {request['trace_steps']} steps, {_size(request['bytes'])}{note}",
                  file=sys.stderr)
        else:
            failed += 1
            print(f"{PROG}: {explain(request, wait)}", file=sys.stderr)
    return 2 if failed else 0


def _size(size: int) -> str:
    if size < 1024:
        return f"{size} bytes"
    return f"{size / 1024:.1f} KiB" if size < 1024**2 else f"{size / 1024**2:.1f} MiB"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    api = ExporterApi(args.exporter, args.token)
    current: list[dict[str, Any]] = []
    try:
        current = request_traces(api, args)
        ranks = ", ".join(r["rank"] for r in current)
        print(f"{PROG}: asked rank{'s' if len(current) > 1 else ''} {ranks} of run {args.run!r} for {args.steps} "
              f"steps; waiting up to {args.wait:g} s", file=sys.stderr)
        current = wait_for(api, current, args.wait)
        cancel_unanswered(api, current)
        return report(current, args.wait)
    except Failure as failure:
        print(f"{PROG}: {failure}", file=sys.stderr)
        cancel_unanswered(api, current)
        return 2
    except KeyboardInterrupt:
        # a second Ctrl-C while cancelling would leave a trace running and print a traceback
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            print(f"{PROG}: {interrupted(api, current)}", file=sys.stderr)
        finally:
            signal.signal(signal.SIGINT, previous)
        return 130
    finally:
        api.close()


if __name__ == "__main__":
    sys.exit(main())

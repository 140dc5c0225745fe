"""Background pusher: PUTs the cumulative exposition to a Pushgateway-compatible endpoint.

Pushes are cumulative and replace the whole group (PUT), so they are idempotent: a failed push, an
exporter restart or a Pushgateway that forgot everything loses resolution, never data. The pusher never
raises into training: a failure is logged once and retried, with exponential backoff up to `max_backoff`
after a timeout or a 5xx; a 4xx is a configuration problem, so the server's message is logged once. A
connection that fails at once (refused: nothing listens, an exporter restarting) is retried at the
interval, the normal cadence: trying costs neither side more than pushing does, and the exporter then
has every rank's series within one interval of its start, as the rules' scrape-gap hold expects
(stepscope_contract/scrape_gaps.py). So is a 409: the exporter gives a run and rank to one process at a
time, and this one's pushes are taken at once when the other process closes or stops pushing, so its
series land within one interval of that.

The final push (close, exit, SIGTERM), whose state `idle` tells the rules the rank ended, is tried again when
the server answers that it is busy for now (503 or 429 with Retry-After, as the exporter answers with too many
bodies in flight), after the delay it asks for, within FINAL_PUSH_GRACE_SECONDS: a rank that finished cleanly
beside a busy exporter stayed `train` there until its TTL, and StepscopeRankLost paged it. Nothing else is
tried again at the end: a process without an exporter must exit at once.

A push that finds its kept-alive connection closed is sent again at once on a new one. A server closes
an idle connection when it chooses (the exporter after 10 s), and a push sent as it does fails though
nothing is wrong: HTTP lets a client retry an idempotent request then (RFC 9110 9.2.2), as Go's client
does. A push interval near the server's idle limit met that race (a clean-clone CI run lost one).

Besides the body, a push may carry headers of the caller's (`headers`, asked for on every push once its
body is rendered) and hand the answer's headers to `on_answer` after a 2xx: the exporter's
side channel for profile requests (stepscope.hooks.profiling) and for the bounds of ranks without a store
(stepscope.hooks.run_bounds); a stock Pushgateway ignores the one and never sends the other.

Training images pin the hooks and the exporter DaemonSet is upgraded on its own, so hooks newer than their
node's exporter push families it does not know yet, and its strict parser refuses the whole push (400
"unknown family 'NAME'"): the rank's steps never landed. The pusher then leaves that family out of this and
every later push, with one warning, and sends the rest at once, until a push finds nothing listening (an
exporter restarting, as a rollout upgrades it, which may know the family by then) or is accepted by another exporter
process than the last (its answer's Stepscope-Exporter-Instance: one restarted between two pushes). An optional
label the contract added later (`pid_namespace` of stepscope_training_info) is left out the same way on the
exporter's 400 "unexpected label 'NAME'".
"""

from __future__ import annotations

import base64
import logging
import posixpath
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import requests

from stepscope.contract import EXPORTER_INSTANCE_HEADER, FAMILIES, VERSION
from stepscope.hooks.config import DEFAULT_MAX_BACKOFF
from stepscope.hooks.render import CONTENT_TYPE

log = logging.getLogger("stepscope.hooks")

_PLAIN_LABEL_VALUE = re.compile(r"[A-Za-z0-9_.:-]+")
# Plain, but a URL's dot segments: requests normalises `run/./rank/0` to `run/rank/0` (404 at every push).
_DOT_SEGMENTS = (".", "..")
# How an exporter refuses a family it does not know (stepscope.exporter.ingest.parser.unknown_family).
_UNKNOWN_FAMILY = re.compile(r"unknown family '([a-zA-Z_:][a-zA-Z0-9_:]*)'")
# How an exporter refuses a label it does not know (the parser's bad_label), and the labels an older one may lack.
_UNEXPECTED_LABEL = re.compile(r"unexpected label '([a-zA-Z_][a-zA-Z0-9_]*)'")
_OPTIONAL_LABELS = frozenset(label for spec in FAMILIES.values() for label in spec.optional)
# The longest the final push waits, in all, on a server that asks to be tried again (Retry-After): well inside
# Kubernetes' default 30 s termination grace, where SIGTERM's close() runs.
FINAL_PUSH_GRACE_SECONDS = 5.0
# A family's sample names: the family's own, or one of these suffixes on it (histograms, counters).
_SAMPLE_SUFFIXES = ("", "_bucket", "_sum", "_count", "_total", "_created")


def encode_label_value(value: str) -> str:
    """The Pushgateway's base64url form of a grouping-label value, for a `name@base64/<value>` segment."""
    return base64.urlsafe_b64encode(value.encode()).decode() or "="  # "=" is its spelling of empty


def group_url(base_url: str, run: str, rank: int) -> str:
    """The group's URL: `run/<run>`, or `run@base64/<b64url>` for a run name a path segment cannot carry."""
    plain = _PLAIN_LABEL_VALUE.fullmatch(run) and run not in _DOT_SEGMENTS
    run_part = f"run/{run}" if plain else f"run@base64/{encode_label_value(run)}"
    return f"{base_url.rstrip('/')}/metrics/job/stepscope/{run_part}/rank/{rank}"


def push_target(base_url: str) -> str:
    """Where pushes to `base_url` land, one spelling for each: the scheme and host in lower case, every name and
    address of this machine as one (localhost, 127.0.0.1, ::1, 0.0.0.0, its host name), the default port filled
    in, dot segments and trailing slashes gone (as requests sends them). Without DNS: names other than this
    machine's stay as written. Two trackers of one process keyed on the URL as written both pushed one exporter's
    group (http://localhost:P and http://127.0.0.1:P/.), each replacing the other's steps."""
    parts = urlsplit(base_url)
    scheme = parts.scheme.lower()
    host = _this_machine_or(parts.hostname or "")
    port = parts.port or (443 if scheme == "https" else 80)  # a number: Config checks it
    path = posixpath.normpath(parts.path or "/").rstrip("/")
    return f"{scheme}://{host}:{port}{path if path not in ('.', '') else ''}"


def _this_machine_or(host: str) -> str:
    """'this machine' for a name or address that reaches it (loopback, unspecified, its host name); else the host
    in lower case, an address in its canonical form."""
    import ipaddress  # at init only: the hooks keep their imports few

    host = host.lower()
    if host == "localhost" or host.endswith(".localhost") or host == socket.gethostname().lower():
        return "this machine"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    return "this machine" if address.is_loopback or address.is_unspecified else address.compressed


USER_AGENT = f"stepscope-training-hooks/{VERSION}"
# requests' spelling of "no proxy for this request": NO_PROXY matching every host.
_BYPASS_PROXY = {"no_proxy": "*"}


def proxies_for(url: str) -> dict[str, str] | None:
    """The `proxies` of a request to `url`: none for this machine, the environment's (HTTP_PROXY, NO_PROXY) else.
    A new dict at each call, as requests adds the environment's proxies to the one it is given.

    requests sends even a loopback push through HTTP_PROXY/HTTPS_PROXY/ALL_PROXY unless NO_PROXY names the host,
    and clusters set those variables for downloads: every push to the default http://127.0.0.1:9847 went to the
    proxy (ProxyError or its 502, the bearer token with it). Go's clients, Prometheus's among them, never proxy
    loopback; a push to this machine's exporter needs no proxy either.
    """
    return dict(_BYPASS_PROXY) if _this_machine_or(urlsplit(url).hostname or "") == "this machine" else None


def without_families(body: str, families: set[str]) -> str:
    """The text exposition `body` less every line (HELP, TYPE, samples) of `families`."""
    if not families:
        return body
    names = {family + suffix for family in families for suffix in _SAMPLE_SUFFIXES}
    return "".join(line for line in body.splitlines(keepends=True) if _line_metric(line) not in names)


def without_labels(body: str, labels: set[str]) -> str:
    """The text exposition `body` with every `label="value"` pair of `labels` taken out of its samples."""
    if not labels:
        return body
    pair = re.compile(r'([{,])(?:' + "|".join(map(re.escape, sorted(labels))) + r')="(?:[^"\\\n]|\\.)*"(,?)')
    return pair.sub(lambda found: found[1] if found[1] == "{" or found[2] else "", body)


def _line_metric(line: str) -> str:
    """The metric a line of text exposition is about: a sample's name, or the name a HELP or TYPE line gives."""
    if line.startswith(("# HELP ", "# TYPE ")):
        return line.split(maxsplit=3)[2]
    return re.split(r"[{\s]", line, maxsplit=1)[0]


@dataclass
class PushStats:
    """What the pusher did; read by tests and by users who want to know whether pushes land."""

    attempts: int = 0
    successes: int = 0
    failures: int = 0
    last_error: str = ""
    threads: set[int] = field(default_factory=set)  # idents of the threads that pushed


class Pusher:
    def __init__(
        self, url: str, body: Callable[[], str], interval: float, token: str | None = None,
        timeout: float = 2.0, max_backoff: float = DEFAULT_MAX_BACKOFF,
        headers: Callable[[], Mapping[str, str]] | None = None,
        on_answer: Callable[[Mapping[str, str]], None] | None = None,
    ) -> None:
        self.url = url
        self._body = body
        self._extra_headers = headers
        self._on_answer = on_answer
        self.interval = interval
        self.timeout = timeout
        self.max_backoff = max(max_backoff, interval)
        self.stats = PushStats()
        self._session = requests.Session()
        # The User-Agent names the hooks' version in the exporter's and a Pushgateway's access logs.
        self._headers = {"Content-Type": CONTENT_TYPE, "User-Agent": USER_AGENT}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = ""  # the problem already logged, until the next success
        self._at_interval = False  # the last push failed in a way that backing off would not help: no backoff
        self._unknown_families: set[str] = set()  # families the server refused as unknown: left out from then on
        self._unknown_labels: set[str] = set()  # optional labels the server refused: left out from then on
        self._exporter_instance: str | None = None  # the last accepting answer's EXPORTER_INSTANCE_HEADER
        self._retry_after: float | None = None  # the last answer's asked delay, where it was busy for now

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="stepscope-pusher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread, then pushes once more from the caller so the final state lands."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 1.0)
            if self._thread.is_alive():  # wedged beyond its timeout: do not share the session with it
                log.warning("stepscope: pusher thread did not stop; skipping the final push")
                return
        already_said = self._failing  # the pushes before failed alike: logged, and the rank's state there is older
        if not self._push_final() and not already_said:
            log.warning("stepscope: the final push (state idle) failed: %s; the exporter may show this rank in its "
                        "last state until its --ingest-ttl, and StepscopeRankLost page it as lost",
                        self.stats.last_error)
        self._session.close()

    def _push_final(self) -> bool:
        """The final push, tried again after each delay a busy server asks for, while the grace lasts."""
        deadline = time.monotonic() + FINAL_PUSH_GRACE_SECONDS
        while not self.push_once():
            if self._retry_after is None or time.monotonic() + self._retry_after > deadline:
                return False
            time.sleep(self._retry_after)
        return True

    def _loop(self) -> None:
        delay = self.interval  # never below the interval: max_backoff >= interval
        ok = self.push_once()  # at once: the exporter learns the pid before the first interval passes
        while True:
            delay = self.interval if ok or self._at_interval else min(delay * 2, self.max_backoff)
            if self._stop.wait(delay):
                return
            ok = self.push_once()

    def push_once(self) -> bool:
        """One PUT of the current cumulative state; True when the server accepted it. Never raises."""
        self.stats.attempts += 1
        self.stats.threads.add(threading.get_ident())
        self._at_interval = False
        self._retry_after = None
        try:
            body = self._body()  # first: the headers say what rendering it decided (the bounds wanted)
            headers = self._headers if self._extra_headers is None else {**self._headers, **self._extra_headers()}
            response = self._put_known_families(body, headers)
        except requests.RequestException as exc:
            # refused at once (not a timeout): nothing listens, an exporter restarting
            self._at_interval = isinstance(exc, requests.ConnectionError) and not isinstance(exc, requests.Timeout)
            if self._at_interval:  # maybe upgraded (a DaemonSet rollout): it may know the families left out now
                self._unknown_families.clear()
                self._unknown_labels.clear()
            return self._failed("unreachable", f"cannot push to {self.url} ({type(exc).__name__})",
                                "retrying, training continues")
        except Exception as exc:  # a bug in rendering must not kill the thread or the training
            return self._failed("error", f"push to {self.url} failed: {exc!r}")
        if response.status_code < 300:
            self.stats.successes += 1
            if self._failing:
                log.warning("stepscope: pushing to %s works again", self.url)
                self._failing = ""
            self._note_exporter_instance(response.headers.get(EXPORTER_INSTANCE_HEADER))
            self._answered(response.headers)
            return True
        self._at_interval = response.status_code == 409  # another process holds the run and rank, until it closes
        self._retry_after = _asked_delay(response)
        message = response.text.strip()[:600] or response.reason
        kind = "rejected" if response.status_code < 500 else "server error"
        return self._failed(
            f"{kind} {response.status_code}",  # not keyed on the message: it may differ on every try
            f"push to {self.url} {kind} ({response.status_code}): {message}",
        )

    def _put_known_families(self, body: str, headers: Mapping[str, str]) -> requests.Response:
        """PUTs `body` less the families the server does not know, learning them from its 400s: each try that
        names a family of the body not yet left out leaves it out too, so the tries end."""
        while True:
            sent = without_labels(without_families(body, self._unknown_families), self._unknown_labels)
            response = self._put(sent.encode(), headers)
            family, label = self._refused_unknown(response, body), self._refused_label(response, sent)
            if family is not None:
                self._unknown_families.add(family)
            elif label is not None:
                self._unknown_labels.add(label)
            else:
                return response
            log.warning("stepscope: the server at %s does not know %s (an exporter older than these hooks): "
                        "pushing without it; upgrade the exporter to have it", self.url,
                        family or f"the label {label}")

    def _note_exporter_instance(self, instance: str | None) -> None:
        """Offers again what was left out once another exporter process answers: one restarted between two pushes
        (a rollout's upgrade) fails none of them, and the newer release would never get those families and labels.
        An older release never names itself, so against it nothing is offered again (no refusals at every push)."""
        if instance is not None and instance != self._exporter_instance:
            self._unknown_families.clear()
            self._unknown_labels.clear()
        self._exporter_instance = instance

    def _refused_label(self, response: requests.Response, sent: str) -> str | None:
        """The optional label of `sent` that `response` refused as unexpected, if it did."""
        match = _UNEXPECTED_LABEL.search(response.text) if response.status_code == 400 else None
        if match is None or match[1] not in _OPTIONAL_LABELS:
            return None
        return match[1] if without_labels(sent, {match[1]}) != sent else None

    def _refused_unknown(self, response: requests.Response, body: str) -> str | None:
        """The family of `body` not yet left out that `response` refused as unknown, if it did."""
        if response.status_code != 400:
            return None
        match = _UNKNOWN_FAMILY.search(response.text)
        if match is None or match[1] in self._unknown_families:
            return None
        family = match[1]
        return family if without_families(body, {family}) != body else None

    def _put(self, body: bytes, headers: Mapping[str, str]) -> requests.Response:
        """One PUT, sent once more on a new connection if the first failed without a timeout: its kept-alive
        connection may have been closed by the server as it went out (the module's docstring)."""
        try:
            return self._send(body, headers)
        except requests.ConnectionError as exc:
            if isinstance(exc, requests.Timeout):
                raise
        return self._send(body, headers)

    def _send(self, body: bytes, headers: Mapping[str, str]) -> requests.Response:
        return self._session.put(self.url, data=body, headers=headers, timeout=self.timeout,
                                 proxies=proxies_for(self.url))

    def _answered(self, headers: Mapping[str, str]) -> None:
        if self._on_answer is None:
            return
        try:
            self._on_answer(headers)
        except Exception as exc:  # a bug in answer handling must not count as a failed push
            log.warning("stepscope: could not handle the answer of %s: %r", self.url, exc)

    def _failed(self, key: str, problem: str, going_on: str = "training continues") -> bool:
        """Logs a failed push once per kind of failure, until one succeeds. Not once stopping: the final push's
        failure is stop()'s to say, since no retry follows and training has ended (a close() that met a busy
        exporter said "retrying, training continues")."""
        self.stats.failures += 1
        self.stats.last_error = problem
        if self._stop.is_set():
            return False
        if self._failing != key:
            log.warning("stepscope: %s; %s", problem, going_on)
            self._failing = key
        return False


def _asked_delay(response: requests.Response) -> float | None:
    """The seconds a 503 or 429 asks the client to wait before trying again (Retry-After in seconds), if it asks."""
    if response.status_code not in (429, 503):
        return None
    try:
        delay = float(response.headers.get("Retry-After", ""))
    except ValueError:  # absent, or an HTTP date: no server of ours sends one
        return None
    return delay if 0 <= delay <= FINAL_PUSH_GRACE_SECONDS else None

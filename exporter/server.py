"""HTTP layer: /metrics, health, the index page and the push API; knows nothing about hardware.

One asyncio loop and no thread per connection, so hundreds of idle, slow or broken clients cost
memory, not threads, and never delay a scrape. Each connection's HTTP/1.1 is exporter.http_exchange
(h11: Content-Length enforced, so a body cut short never reaches the push API; a body not read closes
the connection, so it is never parsed as the next request; deadlines for heads and bodies). What
this module adds is bounded: a cap on connections (a newcomer takes an idle connection's slot) and
on push-body bytes in flight (charged only while they arrive at pace), fitted to the open-files limit
(exporter.server_limits: so scrapes, probes and pushes sent at line rate get through), the push
API's access check before a body byte is read, 405 in plain text for other methods, TLS
(exporter.web_tls), basic auth (exporter.web_auth), the web config file's response headers, a
graceful stop. The profile-request API (PROFILE_PREFIX) goes through the same bounded path as a push.
"""

import asyncio
import errno
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Protocol

from stepscope.exporter import __version__
from stepscope.exporter.exposition import ExpositionStore, node_time
from stepscope.exporter.http_exchange import (
    BODY_TIMEOUT_SECONDS,
    BodyCutShort,
    BodyEvicted,
    DeadlinePassed,
    Exchange,
    Request,
    Response,
)
from stepscope.exporter.ingest import PROFILE_PREFIX
from stepscope.exporter.server_limits import MIN_BODY_RATE, AcceptErrorLog, BodyBudget, ConnectionSlots, fit_connections
from stepscope.exporter.web_auth import AuthBusy, Authenticator, Client

if TYPE_CHECKING:  # web_tls imports ssl, which a plain-HTTP exporter keeps unloaded (exporter.plain_http)
    from stepscope.exporter.web_tls import TlsContextSource

log = logging.getLogger(__name__)

CONTENT_TYPE_LATEST = "text/plain; version=0.0.4; charset=utf-8"
TLS_HANDSHAKE_TIMEOUT_SECONDS = 10.0
SHUTDOWN_TIMEOUT_SECONDS = 5.0  # per stage: in-flight responses finish, then the rest is cancelled
LISTEN_BACKLOG = 1024  # the kernel caps it at net.core.somaxconn
LARGE_BODY_BYTES = 64 * 1024  # parsed off the event loop, one at a time
RECEIVE_BUFFER_BYTES = 64 * 1024
READ_BUFFER_BYTES = 16 * 1024  # a connection's socket is not read while twice this waits: 16 MiB for 512

INDEX_PAGE = """<!doctype html>
<html><head><title>stepscope exporter</title></head>
<body><h1>stepscope exporter {version}</h1>
<p>Why is my training slow, and where?</p>
<ul>
<li><a href="{metrics_link}">{metrics_path}</a> &mdash; node, GPU, process and training metrics</li>
<li><a href="-/healthy">/-/healthy</a> &mdash; liveness</li>
<li><a href="-/ready">/-/ready</a> &mdash; readiness (first collection done)</li>
<li>/api/v1/profiles &mdash; PyTorch profiler traces of live ranks (stepscope-profile)</li>
</ul></body></html>
"""


@dataclass(frozen=True)
class PushResponse:
    status: int
    message: str
    headers: Mapping[str, str] = field(default_factory=dict)  # e.g. a profile request for the pushing rank
    content_type: str = "text/plain"


@dataclass(frozen=True)
class PushRequest:
    method: str
    path: str  # as sent, percent-encoding and query included
    headers: Mapping[str, str]  # lower-case names
    client_ip: str
    length: int | None  # Content-Length; None when absent


class PushHandler(Protocol):
    """Receives the Pushgateway-style API (`/metrics/job/...`) or the profile API (`/api/v1/profiles`);
    implemented by the ingest side."""

    def check(self, request: PushRequest) -> PushResponse | None:
        """The answer decided from the request head alone (a refusal, a DELETE), or None to read the body."""
        ...

    def handle(self, request: PushRequest, body: bytes) -> PushResponse:
        ...

    def refuse(self, request: PushRequest, status: int, reason: str, message: str) -> PushResponse:
        """Counts a refusal the HTTP layer decided: `server_busy` or `incomplete_body`."""
        ...


@dataclass(frozen=True)
class WebLimits:
    max_connections: int = 512
    max_body_bytes_in_flight: int = 8 * 1024 * 1024


@dataclass(frozen=True)
class WebOptions:
    """What the flags and the web config file say about serving, beyond the address."""

    telemetry_path: str = "/metrics"
    tls: "TlsContextSource | None" = None
    auth: Authenticator | None = None
    headers: Callable[[], Mapping[str, str]] = dict  # the headers to add to every response now
    limits: WebLimits = WebLimits()


class _TooManyConnections(asyncio.Protocol):
    """Answers a connection over the cap (every slot serving a request) with a 503 and closes it."""

    REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
             b"Content-Length: 21\r\nConnection: close\r\n\r\ntoo many connections\n")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self.REPLY)
        transport.close()


class _Connection(asyncio.StreamReaderProtocol):
    """A connection holding a slot (server_limits.ConnectionSlots) from its start to its end."""

    def __init__(self, slots: ConnectionSlots, serve: Callable[["_Connection", Exchange], Awaitable[None]]) -> None:
        super().__init__(asyncio.StreamReader(limit=READ_BUFFER_BYTES),
                         lambda reader, writer: serve(self, Exchange(reader, writer)))
        self._slots = slots
        self._client_transport: asyncio.BaseTransport | None = None
        self._started = False
        self.serving = False  # a request is being answered: the graceful stop lets it finish

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._client_transport = transport
        self._slots.opened(self)
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._slots.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._started:
            self._started = True
            self._slots.started(self)
        super().data_received(data)

    def evict(self) -> None:
        """Gives up its slot to a newer connection (or to the graceful stop): closed at once."""
        if isinstance(self._client_transport, asyncio.Transport):
            self._client_transport.abort()


# What socket() or bind() of an IPv6 socket says where the kernel has no IPv6 (booted with ipv6.disable=1,
# built without it): every-interface listening then falls back to IPv4's.
_NO_IPV6 = frozenset({errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT, errno.EADDRNOTAVAIL})


def listen(address: tuple[str, int]) -> socket.socket:
    """The listening socket, bound now so that a busy port fails at start-up with a clear message.

    Host "" (`:PORT`, the default) is every interface of both families, as node_exporter's `:9100`: one IPv6
    socket with IPV6_V6ONLY off, which IPv4 clients reach as ::ffff:a.b.c.d. An IPv4-only 0.0.0.0 never
    answered the pod IPs of an IPv6-only Kubernetes cluster, where Prometheus and the kubelet's probes go.
    Where the kernel has no IPv6, it is 0.0.0.0 without a word: that is every address there."""
    host, port = address
    if host:
        return _bound(socket.AF_INET6 if ":" in host else socket.AF_INET, host, port)
    try:
        return _bound(socket.AF_INET6, "::", port)
    except OSError as exc:
        if exc.errno not in _NO_IPV6:
            raise
        log.debug("no IPv6 here (%s): listening on 0.0.0.0", exc.strerror or exc)
    return _bound(socket.AF_INET, "0.0.0.0", port)


def _bound(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted sockets inherit it: one read brings at most this much of a body nobody asked for yet
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header admits gzip (RFC 9110 12.5.3): `gzip` or `x-gzip`, or `*` when gzip is
    not named, with a weight above 0; `gzip;q=0` refuses it. Codings are case-insensitive."""
    weights: dict[str, float] = {}
    for item in accept_encoding.lower().split(","):
        coding, _, params = item.partition(";")
        weight = 1.0
        for param in params.split(";"):
            name, _, value = param.strip().partition("=")
            if name == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0  # a weight that does not read is no consent to compress
        weights.setdefault(coding.strip(), weight)
    named = weights.get("gzip", weights.get("x-gzip"))
    return (named if named is not None else weights.get("*", 0.0)) > 0


class ExporterServer:
    """Serves until SIGTERM or SIGINT, then finishes in-flight responses (bounded) and returns."""

    def __init__(
        self,
        address: tuple[str, int],
        store: ExpositionStore,
        ready: Callable[[], bool],
        push_handler: PushHandler,
        options: WebOptions = WebOptions(),
        profile_handler: PushHandler | None = None,
    ) -> None:
        self._socket = listen(address)
        self.server_address = self._socket.getsockname()
        self.store = store
        self.ready = ready
        self.options = options
        self.tls = options.tls
        self.auth = options.auth
        self.push_handler = push_handler
        self.profile_handler = profile_handler
        self.limits = options.limits
        self._bodies = BodyBudget(self.limits.max_body_bytes_in_flight)
        self._parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="push-parse")
        self._warned_connections = False
        self._slots = ConnectionSlots(self.limits.max_connections)  # fitted to the open-files limit in _serve
        self._connections: dict[_Connection, asyncio.Task[None]] = {}
        self._stop: asyncio.Event | None = None

    def serve(self) -> None:
        """Runs the event loop in the main thread until SIGTERM or SIGINT."""
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        slots = self._slots = ConnectionSlots(fit_connections(self.limits.max_connections))
        loop.set_exception_handler(AcceptErrorLog(on_failure=slots.shed))

        def protocol() -> asyncio.BaseProtocol:
            if slots.admit():
                return _Connection(slots, self._serve_connection)
            if not self._warned_connections:
                log.warning("%d connections open, each serving a request, the limit (--web-max-connections): "
                            "refusing new ones with 503", slots.limit)
                self._warned_connections = True
            return _TooManyConnections()

        server = await loop.create_server(
            protocol, sock=self._socket, backlog=LISTEN_BACKLOG,
            ssl=self.tls.listening_context() if self.tls else None,
            ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_SECONDS if self.tls else None,
        )
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        loop.add_signal_handler(signal.SIGHUP, self._on_hangup)
        try:
            await self._stop.wait()
        finally:
            server.close()  # no new connections
            await self._finish_connections()
            self._parser.shutdown(wait=False, cancel_futures=True)

    async def _finish_connections(self) -> None:
        """Idle connections close now, busy ones after their response (SHUTDOWN_TIMEOUT_SECONDS at most),
        then what is left is cancelled."""
        for connection in list(self._connections):
            if not connection.serving:
                connection.evict()
        tasks = set(self._connections.values())
        if tasks:
            _done, late = await asyncio.wait(tasks, timeout=SHUTDOWN_TIMEOUT_SECONDS)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=SHUTDOWN_TIMEOUT_SECONDS)

    def _on_signal(self, signum: int) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        assert self._stop is not None
        self._stop.set()

    @staticmethod
    def _on_hangup() -> None:
        """SIGHUP ends a process by default, and the pushed groups live in memory only: an operator who sends it
        to reload, as Prometheus takes it, or a closed terminal would lose every rank's series."""
        log.info("received SIGHUP: not stopping (SIGTERM stops the exporter); --web.config.file and the TLS "
                 "certificate files are re-read when they change, so there is nothing to reload")

    async def _serve_connection(self, connection: _Connection, exchange: Exchange) -> None:
        """Answers requests on one connection until it closes, fails its deadlines or the server stops."""
        task = asyncio.current_task()
        assert task is not None and self._stop is not None
        self._connections[connection] = task
        try:
            while not self._stop.is_set():
                request = await exchange.next_request()
                if request is None:
                    break
                if not await self._answer(connection, exchange, request):
                    break
        except OSError:
            pass  # the client went away (a reset, a TLS record that failed) while we read or wrote
        finally:
            del self._connections[connection]
            exchange.close()

    async def _answer(self, connection: _Connection, exchange: Exchange, request: Request) -> bool:
        """Routes a request and writes its answer; whether the connection may serve another."""
        assert self._stop is not None
        connection.serving = True
        self._slots.busy(connection)  # a connection serving a request keeps its slot
        failed = False
        try:
            try:
                response = await self._route(exchange, request)
            except Exception:  # a bug of ours: the client gets a 500, the connection closes, serving goes on
                log.exception("answering %s %s failed", request.method, request.path)
                response = _text(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error: see the exporter's log")
                failed = True
            headers = {"Server": f"stepscope-exporter/{__version__}", **self.options.headers(), **response.headers}
            return await exchange.respond(Response(response.status, response.body, headers),
                                          close=failed or self._stop.is_set(),
                                          waiting=lambda slow: self._client_pace(connection, slow))
        finally:
            connection.serving = False
            self._slots.idle(connection)

    def _client_pace(self, connection: _Connection, slow: bool) -> None:
        """While the client is slow to read a response its slot may go to a newcomer like an idle one's
        (a client that never reads would hold it for ever)."""
        if slow:
            self._slots.waiting_on_client(connection)
        else:
            self._slots.busy(connection)

    async def _route(self, exchange: Exchange, request: Request) -> Response:
        path, method = request.path, request.method
        if self.profile_handler is not None and (path == PROFILE_PREFIX or path.startswith(PROFILE_PREFIX + "/")):
            # the push API's access rules, not basic auth: who may push may ask for traces
            return await self._api(exchange, request, self.profile_handler)
        if method not in ("GET", "HEAD"):
            if path.startswith("/metrics/"):
                return await self._api(exchange, request, self.push_handler)
            return _text(HTTPStatus.METHOD_NOT_ALLOWED, f"method {method} is not allowed on {path}: use GET",
                         headers={"Allow": "GET, HEAD"})
        if path in ("/-/healthy", "/-/ready"):  # probes stay open: kubelet sends no credentials
            if path == "/-/healthy" or self.ready():
                return _text(HTTPStatus.OK, "OK")
            return _text(HTTPStatus.SERVICE_UNAVAILABLE, "first collection not done")
        if self.auth is not None:
            try:
                allowed = await self.auth.allows(request.headers.get("authorization"),
                                                 Client(request.client_ip, exchange.connected))
            except AuthBusy as busy:
                return _text(HTTPStatus.TOO_MANY_REQUESTS, str(busy), headers={"Retry-After": str(busy.retry_after)})
            if not allowed:
                return _text(HTTPStatus.UNAUTHORIZED, "unauthorized",
                             headers={"WWW-Authenticate": 'Basic realm="stepscope"'})
        if path == self.options.telemetry_path:
            return self._metrics(request)
        if path == "/":
            telemetry = self.options.telemetry_path
            page = INDEX_PAGE.format(version=__version__, metrics_path=telemetry, metrics_link=telemetry.lstrip("/"))
            return Response(200, page.encode(), {"Content-Type": "text/html; charset=utf-8"})
        return _text(HTTPStatus.NOT_FOUND, "not found")

    def _metrics(self, request: Request) -> Response:
        compressed = accepts_gzip(request.headers.get("accept-encoding", ""))
        headers = {"Content-Type": CONTENT_TYPE_LATEST}
        if compressed:
            headers["Content-Encoding"] = "gzip"
        return Response(200, self.store.body(compressed=compressed, tail=node_time()), headers)

    async def _api(self, exchange: Exchange, request: Request, handler: PushHandler) -> Response:
        """check() on the request head; then the body, bounded in size, time and bytes in flight; handle()."""
        push = PushRequest(method=request.method, path=request.target, client_ip=request.client_ip,
                           headers=request.headers, length=request.length)
        answer = handler.check(push)
        if answer is not None:
            return _answer(answer)
        length = push.length or 0
        lease = None
        if not exchange.body_buffered(length):  # a body that came whole with its head needs no room
            lease = self._bodies.admit(length, lambda: exchange.body_received, exchange.evict_body)
            if lease is None:
                answer = handler.refuse(
                    push, 503, "server_busy",
                    f"{self._bodies.used} bytes of other pushes are being received at pace, the limit "
                    f"(--ingest-max-bytes-in-flight {self.limits.max_body_bytes_in_flight}): retry later",
                )
                return _answer(answer, headers={"Retry-After": "1"})
        try:
            body = await exchange.read_body()
        except DeadlinePassed:
            return _answer(handler.refuse(push, 408, "incomplete_body",
                                          f"the body did not arrive within {BODY_TIMEOUT_SECONDS:g}s; nothing stored"))
        except BodyEvicted:
            return _answer(handler.refuse(push, 408, "incomplete_body",
                                          f"the body came slower than {MIN_BODY_RATE // 1024} KiB/s while other "
                                          "pushes needed its room; nothing stored"))
        except BodyCutShort as cut:
            return _answer(handler.refuse(push, 400, "incomplete_body",
                                          f"the body ended after {cut.received} of {length} bytes; nothing stored"))
        finally:
            if lease is not None:
                self._bodies.release(lease)
        if length > LARGE_BODY_BYTES:  # keeps the loop (and scrapes) responsive; one at a time bounds memory
            answer = await asyncio.get_running_loop().run_in_executor(self._parser, handler.handle, push, body)
        else:
            answer = handler.handle(push, body)
        return _answer(answer)


def _text(status: int, message: str, headers: Mapping[str, str] | None = None,
          content_type: str = "text/plain") -> Response:
    return Response(status, (message.rstrip("\n") + "\n").encode(),
                    {"Content-Type": f"{content_type}; charset=utf-8", **(headers or {})})


def _answer(answer: PushResponse, headers: Mapping[str, str] | None = None) -> Response:
    return _text(answer.status, answer.message, headers={**answer.headers, **(headers or {})},
                 content_type=answer.content_type)

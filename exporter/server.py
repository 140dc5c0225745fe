"""HTTP layer: /metrics, health, the index page and the push API; knows nothing about hardware.

Built on aiohttp's low-level server: one asyncio loop, llhttp's C parser, no thread per connection,
so hundreds of idle, slow or broken clients cost memory, not threads, and never delay a scrape.
aiohttp enforces Content-Length, so a body cut short never reaches the push API, and every
response to a request whose body was not read closes the connection: no body is ever parsed as
the next request. What this module adds on top is bounded: a deadline for a request head
(HEADER_TIMEOUT_SECONDS, from the connection's start or the previous response; also the idle limit
of a kept-alive connection) and for a push body, a cap on connections (a newcomer takes an idle
connection's slot) and on push-body bytes in flight (charged only while they arrive at pace), fitted
to the open-files limit (exporter.server_limits: so scrapes, probes and pushes sent at line rate get
through), an answer to a client that half-closes, the push API's access check before a body byte is read,
405 in plain text for other methods, TLS (exporter.web_tls), basic auth (exporter.web_auth), the
web config file's response headers, a graceful stop. The profile-request API (PROFILE_PREFIX) goes
through the same bounded path as a push.
"""

import asyncio
import logging
import signal
import socket
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Protocol

from aiohttp import StreamReader, web
from aiohttp.http_exceptions import HttpProcessingError

from stepscope.exporter import __version__
from stepscope.exporter.exposition import ExpositionStore
from stepscope.exporter.server_limits import MIN_BODY_RATE, AcceptErrorLog, BodyBudget, ConnectionSlots, fit_connections
from stepscope.exporter.web_auth import AuthBusy, Authenticator, Client
from stepscope.exporter.web_tls import TlsContextSource

log = logging.getLogger(__name__)

CONTENT_TYPE_LATEST = "text/plain; version=0.0.4; charset=utf-8"
HEADER_TIMEOUT_SECONDS = 10.0
BODY_TIMEOUT_SECONDS = 10.0
TLS_HANDSHAKE_TIMEOUT_SECONDS = 10.0
SHUTDOWN_TIMEOUT_SECONDS = 5.0  # per stage: in-flight responses finish, then the rest is cancelled
LISTEN_BACKLOG = 1024  # the kernel caps it at net.core.somaxconn
WRITE_SLICE_BYTES = 256 * 1024  # a slow scraper holds at most this much (plus the transport's buffer)
LARGE_BODY_BYTES = 64 * 1024  # parsed off the event loop, one at a time
RECEIVE_BUFFER_BYTES = 64 * 1024
READ_BUFFER_BYTES = 16 * 1024  # aiohttp stops reading a body at twice this until the handler reads it
PROFILE_PREFIX = "/api/v1/profiles"  # the profile-request API (exporter.ingest.profile_api)

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
    tls: TlsContextSource | None = None
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


class _RequestLineGuard(web.RequestHandler):
    """aiohttp's connection handler, closing at once a connection whose first line is no HTTP/1.x
    request line: llhttp reads `GET /metrics` (HTTP/0.9) as a request head still to be finished,
    which would hold the connection until the header deadline. It also holds a connection slot
    (server_limits.ConnectionSlots) and answers a client that half-closes after its request."""

    __slots__ = ("_body", "_first_line", "_peer_closed", "_slots")
    REPLY = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 30\r\n"
             b"Connection: close\r\n\r\nnot an HTTP/1.x request line\n")

    def __init__(self, *args: object, slots: ConnectionSlots, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._first_line: bytes | None = b""  # None once the first line was seen
        self._slots = slots
        self._peer_closed = False  # the client half-closed: no byte comes after what arrived
        self._body: StreamReader | None = None  # the push body being read

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._slots.opened(self)
        super().connection_made(transport)

    def evict(self) -> None:
        """Gives up its slot (server_limits.ConnectionSlots) to a newer connection."""
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._slots.closed(self)
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        """The client half-closed (`nc -N`, HTTP/1.0-style clients). aiohttp closes the connection then,
        dropping a complete request unanswered; here a request is still served and answered (a body it
        cut short fails at once, see reading_body), and the connection closes after the response. An
        idle connection (aiohttp's `_waiter` pending: no request head complete) closes as before, and so
        does a TLS one (asyncio's TLS transport closes on EOF whatever this returns, and warns if True)."""
        waiter = getattr(self, "_waiter", None)
        if (waiter is not None and not waiter.done()) or (
                self.transport is not None and self.transport.get_extra_info("ssl_object") is not None):
            return None
        self._peer_closed = True
        if self._body is not None:
            self.reading_body(self._body)
        self.close()  # no further request; the transport closes after the response
        return True

    def reading_body(self, body: StreamReader) -> None:
        """The push body about to be read: one the client will not finish (it half-closed before the
        end) fails its read at once instead of at the body deadline."""
        self._body = body
        if self._peer_closed and not body.is_eof():
            body.set_exception(ConnectionResetError("the client closed its side before the body ended"))

    def data_received(self, data: bytes) -> None:
        if self._first_line == b"":
            self._slots.started(self)
        if self._first_line is not None:
            head = self._first_line + data[:8192]
            end = head.find(b"\n")
            if end >= 0:
                self._first_line = None
                if not head[:end].rstrip(b"\r").endswith((b" HTTP/1.1", b" HTTP/1.0")):
                    if self.transport is not None:
                        self.transport.write(self.REPLY)
                    self.force_close()
                    return
            else:  # over 8 KiB without a newline: aiohttp's line limit answers it
                self._first_line = head if len(head) <= 8192 else None
        super().data_received(data)


class _QuietBadRequests(logging.Filter):
    """aiohttp logs every unparsable request (a port scanner, TLS on the plain port) as an error with a
    traceback; they are the client's problem and answered with a 400, so they go to debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], HttpProcessingError):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = record.exc_text = None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def _listen(address: tuple[str, int]) -> socket.socket:
    """The listening socket, bound now so that a busy port fails at start-up with a clear message."""
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
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


class _BodyEvicted(Exception):
    """A body's read ended because it fell behind the pace while other pushes needed its room."""


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
        self._socket = _listen(address)
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
        self._stop: asyncio.Event | None = None

    def serve(self) -> None:
        """Runs the event loop in the main thread until SIGTERM or SIGINT."""
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        logger = logging.getLogger(f"{__name__}.aiohttp")
        logger.addFilter(_QuietBadRequests())
        handlers = web.Server(self._dispatch)  # tracks connections for the graceful stop
        slots = self._slots = ConnectionSlots(fit_connections(self.limits.max_connections))
        loop.set_exception_handler(AcceptErrorLog(on_failure=slots.shed))

        def protocol() -> asyncio.BaseProtocol:
            if slots.admit():
                # keepalive_timeout doubles as the header deadline: aiohttp's timer runs from the
                # connection's start and from each response until a complete request head arrives
                return _RequestLineGuard(handlers, loop=loop, keepalive_timeout=HEADER_TIMEOUT_SECONDS,
                                         access_log=None, logger=logger, lingering_time=0,
                                         read_bufsize=READ_BUFFER_BYTES, slots=slots)
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
        try:
            await self._stop.wait()
        finally:
            server.close()  # no new connections
            handlers.pre_shutdown()  # idle keep-alive connections close now, busy ones after their response
            await handlers.shutdown(SHUTDOWN_TIMEOUT_SECONDS)
            self._parser.shutdown(wait=False, cancel_futures=True)

    def _on_signal(self, signum: int) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        assert self._stop is not None
        self._stop.set()

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        connection = request.protocol
        self._slots.busy(connection)  # a connection serving a request keeps its slot
        try:
            response = await self._route(request)
        finally:
            self._slots.idle(connection)
        if not response.prepared:  # /metrics streams, and adds them itself
            response.headers.update(self.options.headers())
        return response

    async def _route(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.raw_path.split("?", 1)[0]
        method = request.method
        if self.profile_handler is not None and (path == PROFILE_PREFIX or path.startswith(PROFILE_PREFIX + "/")):
            # the push API's access rules, not basic auth: who may push may ask for traces
            return await self._api(request, self.profile_handler)
        if method not in ("GET", "HEAD"):
            if path.startswith("/metrics/"):
                return await self._api(request, self.push_handler)
            return _text(HTTPStatus.METHOD_NOT_ALLOWED, f"method {method} is not allowed on {path}: use GET",
                         close=request.body_exists, headers={"Allow": "GET, HEAD"})
        close = request.body_exists  # a body nobody reads must not become the next request
        if path in ("/-/healthy", "/-/ready"):  # probes stay open: kubelet sends no credentials
            if path == "/-/healthy" or self.ready():
                return _text(HTTPStatus.OK, "OK", close=close)
            return _text(HTTPStatus.SERVICE_UNAVAILABLE, "first collection not done", close=close)
        if self.auth is not None:
            client = Client(request.remote or "", lambda: request.transport is not None)  # None once it left
            try:
                allowed = await self.auth.allows(request.headers.get("Authorization"), client)
            except AuthBusy as busy:
                return _text(HTTPStatus.TOO_MANY_REQUESTS, str(busy), close=close,
                             headers={"Retry-After": str(busy.retry_after)})
            if not allowed:
                return _text(HTTPStatus.UNAUTHORIZED, "unauthorized", close=close,
                             headers={"WWW-Authenticate": 'Basic realm="stepscope"'})
        if path == self.options.telemetry_path:
            return await self._metrics(request, close)
        if path == "/":
            telemetry = self.options.telemetry_path
            page = INDEX_PAGE.format(version=__version__, metrics_path=telemetry, metrics_link=telemetry.lstrip("/"))
            return _response(web.Response(status=200, text=page, content_type="text/html", charset="utf-8"), close)
        return _text(HTTPStatus.NOT_FOUND, "not found", close=close)

    async def _metrics(self, request: web.BaseRequest, close: bool) -> web.StreamResponse:
        compressed = "gzip" in request.headers.get("Accept-Encoding", "")
        body = self.store.body(compressed=compressed)
        headers = {**self.options.headers(), "Content-Type": CONTENT_TYPE_LATEST}
        response = _response(web.StreamResponse(status=200, headers=headers), close)
        if compressed:
            response.headers["Content-Encoding"] = "gzip"
        response.content_length = len(body)
        await response.prepare(request)
        if request.method != "HEAD":
            view = memoryview(body)
            for start in range(0, len(body), WRITE_SLICE_BYTES):
                await self._write(request, response, view[start:start + WRITE_SLICE_BYTES])
        await response.write_eof()
        return response

    async def _write(self, request: web.BaseRequest, response: web.StreamResponse, data: memoryview) -> None:
        """Writes a slice, waiting while the client is slow; meanwhile its connection's slot may go to a
        newcomer like an idle one's (a client that never reads would hold it for ever)."""
        self._slots.waiting_on_client(request.protocol)
        try:
            await response.write(data)
        finally:
            self._slots.busy(request.protocol)

    async def _api(self, request: web.BaseRequest, handler: PushHandler) -> web.StreamResponse:
        """check() on the request head; then the body, bounded in size, time and bytes in flight; handle()."""
        push = PushRequest(
            method=request.method, path=request.raw_path, client_ip=request.remote or "",
            headers={name.lower(): value for name, value in request.headers.items()},
            length=request.content_length,
        )
        answer = handler.check(push)
        if answer is not None:
            return _answer(answer, close=request.body_exists)
        length = push.length or 0
        content = request.content
        lease = None
        if not content.is_eof():  # a body that came whole with its head is read already: it needs no room
            lease = self._bodies.admit(length, lambda: content.total_bytes,
                                       lambda: content.set_exception(_BodyEvicted()))
            if lease is None:
                answer = handler.refuse(
                    push, 503, "server_busy",
                    f"{self._bodies.used} bytes of other pushes are being received at pace, the limit "
                    f"(--ingest-max-bytes-in-flight {self.limits.max_body_bytes_in_flight}): retry later",
                )
                return _answer(answer, close=True, headers={"Retry-After": "1"})
        if isinstance(request.protocol, _RequestLineGuard):
            request.protocol.reading_body(content)
        try:
            body = await asyncio.wait_for(content.readexactly(length), BODY_TIMEOUT_SECONDS)
        except asyncio.TimeoutError:
            answer = handler.refuse(push, 408, "incomplete_body",
                                    f"the body did not arrive within {BODY_TIMEOUT_SECONDS:g}s; nothing stored")
            return _answer(answer, close=True)
        except _BodyEvicted:
            answer = handler.refuse(push, 408, "incomplete_body",
                                    f"the body came slower than {MIN_BODY_RATE // 1024} KiB/s while other pushes "
                                    "needed its room; nothing stored")
            return _answer(answer, close=True)
        except (asyncio.IncompleteReadError, ConnectionError, HttpProcessingError) as exc:
            received = len(exc.partial) if isinstance(exc, asyncio.IncompleteReadError) else "fewer"
            answer = handler.refuse(push, 400, "incomplete_body",
                                    f"the body ended after {received} of {length} bytes; nothing stored")
            return _answer(answer, close=True)
        finally:
            if lease is not None:
                self._bodies.release(lease)
        if length > LARGE_BODY_BYTES:  # keeps the loop (and scrapes) responsive; one at a time bounds memory
            answer = await asyncio.get_running_loop().run_in_executor(self._parser, handler.handle, push, body)
        else:
            answer = handler.handle(push, body)
        return _answer(answer)


def _response(response: web.StreamResponse, close: bool) -> web.StreamResponse:
    response.headers["Server"] = f"stepscope-exporter/{__version__}"
    if close:
        response.force_close()
    return response


def _text(status: int, message: str, close: bool = False, headers: Mapping[str, str] | None = None,
          content_type: str = "text/plain") -> web.Response:
    response = web.Response(status=status, text=message.rstrip("\n") + "\n", content_type=content_type,
                            charset="utf-8", headers=headers)
    _response(response, close)
    return response


def _answer(answer: PushResponse, close: bool = False, headers: Mapping[str, str] | None = None) -> web.Response:
    return _text(answer.status, answer.message, close=close, headers={**answer.headers, **(headers or {})} or None,
                 content_type=answer.content_type)

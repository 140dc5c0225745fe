"""One HTTP/1.1 connection of the exporter: request heads and bodies read under deadlines, responses
written at the client's pace. The protocol itself is h11's.

h11 (python-hyper) is HTTP/1.1's state machine without I/O. It enforces Content-Length and refuses
conflicting framing, a head over MAX_HEAD_BYTES and raw bytes outside visible ASCII in a target. It
decides keep-alive from the version and Connection headers, and it will not begin the next request
while a body is unread, so a body nobody read is never parsed as the next request. The exporter
needs nothing more of a web framework: aiohttp, which served it before, cost 11 MiB of RSS on import.

What this module adds:
- a deadline for a request head (HEADER_TIMEOUT_SECONDS from the connection's start or the previous
  response; also the idle limit of a kept-alive connection) and for a body (BODY_TIMEOUT_SECONDS);
- a first line that cannot be an HTTP/1.x request line (HTTP/0.9, TLS on the plain port, a port
  scanner's bytes) is answered 400 and closed as soon as it is seen, not at the head's deadline;
- a client that sends `Expect: 100-continue` is told to go on only once its body is wanted: a push
  refused from its head (a wrong token, too large, the budget full) never sends its body;
- a client that half-closes after its request (`nc -N`, HTTP/1.0-style clients) is answered; a body it
  cut short fails at once;
- responses go out in WRITE_SLICE_BYTES slices, each written when the client has read the last.
"""

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus

import h11

log = logging.getLogger("stepscope.exporter.server")

HEADER_TIMEOUT_SECONDS = 10.0
BODY_TIMEOUT_SECONDS = 10.0
MAX_HEAD_BYTES = 16 * 1024  # a request head larger than this is answered 431
READ_BYTES = 64 * 1024  # one read from the socket's buffer at most
WRITE_SLICE_BYTES = 256 * 1024  # a slow reader holds at most this much (plus the transport's buffer)
_NOT_A_REQUEST_LINE = re.compile(rb"[^\x20-\x7e\r]")  # in the first line: TLS, binary, raw UTF-8
_HTTP_1X = (b" HTTP/1.1", b" HTTP/1.0")
_IPV4_MAPPED = "::ffff:"  # how the kernel names an IPv4 client of an IPv6 socket


def client_address(peer_host: str) -> str:
    """The client's address as it connected: the IPv4 address of an IPv4 client of the dual-stack socket
    (`::ffff:192.0.2.7` -> `192.0.2.7`), so logs and refusals name the address the client knows."""
    mapped = peer_host.removeprefix(_IPV4_MAPPED)
    return mapped if mapped != peer_host and "." in mapped else peer_host


def origin_form(target: str) -> str:
    """The target's path and query: a server must take the absolute form too (RFC 9112 3.2.2,
    `PUT http://node:9847/metrics/job/...`, as a client sends through a proxy), whose scheme and authority
    name this server."""
    scheme, separator, rest = target.partition("://")
    if not separator or scheme.lower() not in ("http", "https"):
        return target
    path_at = min((at for at in (rest.find("/"), rest.find("?")) if at >= 0), default=len(rest))
    path = rest[path_at:]
    return path if path.startswith("/") else "/" + path


@dataclass(frozen=True)
class Request:
    method: str
    target: str  # as sent, percent-encoding and query included
    headers: Mapping[str, str]  # lower-case names; the first of repeated ones
    client_ip: str
    length: int | None  # Content-Length; None when absent
    has_body: bool  # a Content-Length above 0 or a Transfer-Encoding

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # a code http.HTTPStatus does not name: the phrase is optional (RFC 9112 4)
        return ""


class DeadlinePassed(Exception):
    """The head or body did not arrive in time."""


class BodyEvicted(Exception):
    """The body's read was ended: it fell behind the pace while other pushes needed its room."""


class BodyCutShort(Exception):
    """The client ended the connection, or broke the framing, before the body's end."""

    def __init__(self, received: int) -> None:
        super().__init__(f"the body ended after {received} bytes")
        self.received = received


class Exchange:
    """Requests and responses on one connection, one at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._line_tail: bytes | None = b""  # the first line's last bytes so far; None once it passed
        self._head_bytes = 0  # read since this request's head began
        self._method: bytes | None = None  # the current request's (a HEAD gets no body)
        self.body_received = 0  # bytes of the current request's body read so far
        peer = writer.get_extra_info("peername")
        self.client_ip: str = client_address(peer[0]) if isinstance(peer, tuple) and peer else ""

    def connected(self) -> bool:
        """False once the connection is gone (reset, or closed by us); a half-close does not count."""
        return not self._writer.transport.is_closing()

    def close(self) -> None:
        self._writer.close()

    async def next_request(self) -> Request | None:
        """The next request's head; None when the connection should close: the client closed it, sent
        no complete head in time, or sent a malformed one (answered 400 first), or the last exchange
        leaves the connection unusable (a body unread, `Connection: close`)."""
        http = self._http
        if http.our_state is h11.DONE:
            if http.their_state is not h11.DONE:
                return None
            http.start_next_cycle()
        self._line_tail = b""
        self._head_bytes = 0
        self.body_received = 0
        try:
            with self._deadline(HEADER_TIMEOUT_SECONDS):
                pipelined, _closed = http.trailing_data  # sent after the last request's end, before this read
                self._check_request_line(pipelined)
                event = await self._next_event(head=True)
        except (DeadlinePassed, BodyEvicted):  # this head's deadline, or the last body's eviction come late
            return None
        except h11.RemoteProtocolError as error:
            await self._refuse(error)
            return None
        if not isinstance(event, h11.Request):
            return None  # ConnectionClosed
        request = self._request(event)
        if not request.has_body:
            http.next_event()  # its EndOfMessage, already known: the request is complete
        return request

    def body_buffered(self, length: int) -> bool:
        """Whether the whole body of `length` bytes arrived with the head (nothing left to wait for)."""
        data, _closed = self._http.trailing_data
        return len(data) >= length

    def evict_body(self) -> None:
        """Ends the body's read now (BodyEvicted); the connection closes after the answer."""
        self._reader.set_exception(BodyEvicted())

    async def read_body(self) -> bytes:
        """The request's body: DeadlinePassed after BODY_TIMEOUT_SECONDS, BodyCutShort when the client
        ends it early, BodyEvicted when evict_body() was called. b"" at once for a request without one:
        its end came with its head, and waiting for more would only run into the deadline."""
        if self._http.their_state is h11.DONE:
            return b""
        with self._deadline(BODY_TIMEOUT_SECONDS):
            return await self._body()

    @contextlib.contextmanager
    def _deadline(self, seconds: float) -> Iterator[None]:
        """DeadlinePassed from the reads inside once `seconds` have passed: a timer that cancels the reading
        task, as asyncio.timeout (Python 3.11+) does, where asyncio.wait_for would add a task per request (a
        thousand idle connections churning pay for each). It ends only the read under way. An exception set
        on the reader instead outlived its deadline: a head that came as its idle limit passed was read, and
        its body then failed at once, a push answered 408 "did not arrive within 10s" after 0 s."""
        task = asyncio.current_task()
        assert task is not None  # an Exchange reads in its connection's task
        fired = False

        def expire() -> None:
            nonlocal fired
            fired = True
            task.cancel()

        timer = asyncio.get_running_loop().call_later(seconds, expire)
        try:
            yield
        except asyncio.CancelledError:
            if not fired:  # the server stopping: not ours to turn into an answer
                raise
            if hasattr(task, "uncancel"):  # 3.11+: the cancel was consumed here, for asyncio.timeout's count
                task.uncancel()
            raise DeadlinePassed() from None
        finally:
            timer.cancel()

    async def _body(self) -> bytes:
        if self._http.they_are_waiting_for_100_continue:  # curl's `Expect: 100-continue`: the body is wanted
            go_on = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
            self._writer.write(self._http.send(go_on) or b"")
        chunks = []
        while True:
            try:
                event = await self._next_event(head=False)
            except (h11.RemoteProtocolError, OSError) as error:  # a reset, a broken TLS record
                raise BodyCutShort(self.body_received) from error
            if isinstance(event, h11.Data):
                chunks.append(event.data)
                self.body_received += len(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)

    async def respond(self, response: Response, close: bool, waiting: Callable[[bool], None]) -> bool:
        """Writes the response (no body after a HEAD); whether the connection may serve another request.
        `waiting(True)` is called while the client is slow to read, `waiting(False)` when it caught up."""
        http = self._http
        headers = [*response.headers.items(), ("Content-Length", str(len(response.body)))]
        if close or http.their_state is not h11.DONE:  # an unread body must not become the next request
            headers.append(("Connection", "close"))
        phrase = _phrase(response.status)
        parts: list[bytes | memoryview] = [http.send(h11.Response(status_code=response.status, headers=headers,
                                                                  reason=phrase)) or b""]
        if response.body and self._method != b"HEAD":
            view = memoryview(response.body)
            for start in range(0, len(view), WRITE_SLICE_BYTES):
                parts += http.send_with_data_passthrough(h11.Data(data=view[start:start + WRITE_SLICE_BYTES]))
                self._writer.writelines(parts)  # the head goes with the first slice: one send for most
                parts = []
                await self._drain(waiting)
        parts += http.send_with_data_passthrough(h11.EndOfMessage())
        self._writer.writelines(parts)
        await self._drain(waiting)
        return http.our_state is h11.DONE and http.their_state is h11.DONE

    async def _drain(self, waiting: Callable[[bool], None]) -> None:
        if self._writer.transport.get_write_buffer_size() == 0:
            return
        waiting(True)
        try:
            await self._writer.drain()
        finally:
            waiting(False)

    async def _next_event(self, head: bool) -> h11.Event | type[h11.NEED_DATA]:
        http = self._http
        while True:
            event = http.next_event()
            if event is not h11.NEED_DATA:
                return event
            if head and self._head_bytes >= MAX_HEAD_BYTES:  # h11 checks only what one read leaves incomplete
                raise h11.RemoteProtocolError(f"request head over {MAX_HEAD_BYTES} bytes", error_status_hint=431)
            data = await self._reader.read(MAX_HEAD_BYTES if head else READ_BYTES)  # a longer head: 431
            if head and data:
                self._head_bytes += len(data)
                data = self._check_request_line(data)
                if not data:
                    continue  # blank lines only, so far
            http.receive_data(data)  # b"": the client closed its side

    def _check_request_line(self, data: bytes) -> bytes:
        """Refuses at once what cannot become an HTTP/1.x request line; h11 would wait for the head's end.
        `data` continues the bytes seen so far; each byte is looked at once, so a first line sent a byte
        at a time costs no more than one sent whole. Returns `data` less blank lines before the request
        line, which RFC 9112 (2.2) says to ignore and h11 refuses."""
        if self._line_tail is None:
            return data
        if not self._line_tail:
            data = data.lstrip(b"\r\n")
        end = data.find(b"\n")
        piece = data if end < 0 else data[:end]
        if _NOT_A_REQUEST_LINE.search(piece):
            raise h11.RemoteProtocolError("not an HTTP/1.x request line", error_status_hint=400)
        tail = (self._line_tail + piece)[-len(b" HTTP/1.1\r"):]
        if end < 0:
            self._line_tail = tail
        elif tail.rstrip(b"\r").endswith(_HTTP_1X):
            self._line_tail = None
        else:
            raise h11.RemoteProtocolError("not an HTTP/1.x request line", error_status_hint=400)
        return data

    def _request(self, event: h11.Request) -> Request:
        self._method = event.method
        headers: dict[str, str] = {}
        for name, value in event.headers:
            headers.setdefault(name.decode("ascii"), value.decode("latin-1"))
        length = headers.get("content-length")
        return Request(
            method=event.method.decode("ascii"), target=origin_form(event.target.decode("ascii")), headers=headers,
            client_ip=self.client_ip, length=int(length) if length is not None else None,
            has_body="transfer-encoding" in headers or (length is not None and int(length) > 0),
        )

    async def _refuse(self, error: h11.RemoteProtocolError) -> None:
        """Answers a malformed request (400, 431) and lets the connection close: the client's problem,
        logged at debug only (port scanners, TLS on the plain port)."""
        log.debug("malformed request from %s: %s", self.client_ip, error)
        if self._http.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        status = error.error_status_hint
        message = f"{_phrase(status).lower() or status}: {error}\n".encode()
        self._method = None
        with contextlib.suppress(h11.LocalProtocolError, OSError):
            await self.respond(Response(status, message, {"Content-Type": "text/plain; charset=utf-8"}),
                               close=True, waiting=lambda _slow: None)

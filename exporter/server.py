"""HTTP layer: /metrics, health, the index page and the push API; knows nothing about hardware.

A thread per connection, so an idle or slow client (or a slow TLS handshake) never blocks another
scrape; connections idle longer than the timeout are closed.
"""

import base64
import hmac
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from exporter import __version__
from exporter.exposition import ExpositionStore

log = logging.getLogger(__name__)

CONTENT_TYPE_LATEST = "text/plain; version=0.0.4; charset=utf-8"
IDLE_TIMEOUT_SECONDS = 30.0

INDEX_PAGE = """<!doctype html>
<html><head><title>stepscope exporter</title></head>
<body><h1>stepscope exporter {version}</h1>
<p>Why is my training slow, and where?</p>
<ul>
<li><a href="metrics">/metrics</a> &mdash; node, GPU, process and training metrics</li>
<li><a href="-/healthy">/-/healthy</a> &mdash; liveness</li>
<li><a href="-/ready">/-/ready</a> &mdash; readiness (first collection done)</li>
</ul></body></html>
"""


@dataclass(frozen=True)
class PushResponse:
    status: int
    message: str


class PushHandler(Protocol):
    """Receives the Pushgateway-style API (`/metrics/job/...`); implemented by the ingest side."""

    max_body_bytes: int

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes, client_ip: str) -> PushResponse:
        ...

    def reject_oversized(self, method: str, path: str, length: int, client_ip: str) -> PushResponse:
        """The answer to a Content-Length over `max_body_bytes`; the body is never read."""
        ...


class TlsContextSource:
    """Serves an SSLContext for cert/key files and rebuilds it when either file changes.

    Checked at most once a second on new connections; a broken replacement keeps the old context
    and logs why, so a half-written renewal never takes the endpoint down.
    """

    def __init__(self, cert_file: str, key_file: str) -> None:
        self._cert_file = cert_file
        self._key_file = key_file
        self._lock = threading.Lock()
        self._checked_at = 0.0
        self._stamp = self._file_stamp()
        self._context = self._build()

    def context(self) -> ssl.SSLContext:
        now = time.monotonic()
        if now - self._checked_at >= 1.0:
            with self._lock:
                self._checked_at = now
                try:
                    stamp = self._file_stamp()
                except OSError as exc:
                    log.error("TLS files unreadable, keeping the loaded certificate: %s", exc)
                    return self._context
                if stamp != self._stamp:
                    try:
                        self._context = self._build()
                        self._stamp = stamp
                        log.info("reloaded TLS certificate %s", self._cert_file)
                    except (OSError, ssl.SSLError) as exc:
                        log.error("TLS reload failed, keeping the loaded certificate: %s", exc)
        return self._context

    def _file_stamp(self) -> tuple[float, float]:
        return os.stat(self._cert_file).st_mtime, os.stat(self._key_file).st_mtime

    def _build(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self._cert_file, self._key_file)
        return context


class BasicAuth:
    """Checks `Authorization: Basic` against one user and a password read from a file."""

    def __init__(self, user: str, password: str) -> None:
        self._expected = base64.b64encode(f"{user}:{password}".encode()).decode()

    def allows(self, header: str | None) -> bool:
        if not header or not header.startswith("Basic "):
            return False
        return hmac.compare_digest(header[6:].strip(), self._expected)


class ExporterServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        store: ExpositionStore,
        ready: Callable[[], bool],
        push_handler: PushHandler,
        tls: TlsContextSource | None = None,
        auth: BasicAuth | None = None,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.store = store
        self.ready = ready
        self.tls = tls
        self.auth = auth
        self.push_handler = push_handler
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def finish_request(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        # Runs in the connection's own thread, so the TLS handshake cannot stall the accept loop.
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(IDLE_TIMEOUT_SECONDS)
        try:
            tls_socket = self.tls.context().wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            log.debug("TLS handshake with %s failed: %s", client_address[0], exc)
            return
        try:
            super().finish_request(tls_socket, client_address)
        finally:
            tls_socket.close()

    def handle_error(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        log.debug("connection from %s ended with an error", client_address[0], exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: ExporterServer
    protocol_version = "HTTP/1.1"
    server_version = f"stepscope-exporter/{__version__}"
    timeout = IDLE_TIMEOUT_SECONDS
    disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/-/healthy", "/-/ready"):  # probes stay open: kubelet sends no credentials
            if path == "/-/healthy" or self.server.ready():
                self._send(HTTPStatus.OK, b"OK\n", "text/plain; charset=utf-8")
            else:
                self._send(HTTPStatus.SERVICE_UNAVAILABLE, b"first collection not done\n", "text/plain")
            return
        if not self._authorized():
            return
        if path == "/metrics":
            compressed = "gzip" in self.headers.get("Accept-Encoding", "")
            body = self.server.store.body(compressed=compressed)
            extra = {"Content-Encoding": "gzip"} if compressed else {}
            self._send(HTTPStatus.OK, body, CONTENT_TYPE_LATEST, extra)
        elif path == "/":
            page = INDEX_PAGE.format(version=__version__).encode()
            self._send(HTTPStatus.OK, page, "text/html; charset=utf-8")
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_PUT(self) -> None:
        self._push("PUT")

    def do_POST(self) -> None:
        self._push("POST")

    def do_DELETE(self) -> None:
        self._push("DELETE")

    def _push(self, method: str) -> None:
        handler = self.server.push_handler
        if not self.path.startswith("/metrics/"):
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"method not allowed\n", "text/plain; charset=utf-8")
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self._reply_text(HTTPStatus.BAD_REQUEST, "invalid Content-Length")
            return
        if length < 0:
            self._reply_text(HTTPStatus.BAD_REQUEST, "invalid Content-Length")
            return
        headers = {k.lower(): v for k, v in self.headers.items()}
        if length > handler.max_body_bytes or "chunked" in headers.get("transfer-encoding", ""):
            self.close_connection = True  # the unread body must not be parsed as the next request
        if length > handler.max_body_bytes:
            response = handler.reject_oversized(method, self.path, length, self.client_address[0])
            self._reply_text(response.status, response.message)
            return
        body = self.rfile.read(length) if length else b""
        response = handler.handle(method, self.path, headers, body, self.client_address[0])
        self._reply_text(response.status, response.message)

    def _reply_text(self, status: int, message: str) -> None:
        self._send(status, (message.rstrip("\n") + "\n").encode(), "text/plain; charset=utf-8")

    def _authorized(self) -> bool:
        auth = self.server.auth
        if auth is None or auth.allows(self.headers.get("Authorization")):
            return True
        self._send(
            HTTPStatus.UNAUTHORIZED,
            b"unauthorized\n",
            "text/plain; charset=utf-8",
            {"WWW-Authenticate": 'Basic realm="stepscope"'},
        )
        return False

    def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.client_address[0], format % args)

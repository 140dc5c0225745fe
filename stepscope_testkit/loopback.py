"""The tests' own HTTP servers on loopback (a replayed exporter, a webhook receiver, a notifier): a listen
backlog that holds a scrape burst.

http.server's servers listen with a backlog of 5. Where a burst of connections finds it full (a Prometheus
scraping ten replayed targets each second, on a loaded 2-core machine where the serving thread waits for the CPU
and the GIL), Linux drops their SYNs, the client sends them again after its 1 s retransmission timeout, and a
scrape with a 1 s timeout fails: the target's series go stale and the `for: 0s` copy of StepscopeExporterDown
fires, as it did for three corpus workloads in a full run here (the replay cannot say which scrapes it lost).
Measured with 20 concurrent 1 s requests under load: 161-170 of 300 failed with a backlog of 5, 10-16 with 128.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LISTEN_BACKLOG = 128


class LoopbackServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0) -> None:
        """On `port` (a free one unless given: a server restarted where its clients push)."""
        super().__init__(("127.0.0.1", port), handler)

    def handle_error(self, request: object, client_address: object) -> None:
        """Quiet about a client gone before its answer was written (a scrape past its timeout): socketserver
        printed a traceback for each; any other error as socketserver does."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@contextmanager
def serving(server: LoopbackServer) -> Iterator[LoopbackServer]:
    """`server` answering from a thread of its own until the block ends."""
    thread = threading.Thread(target=server.serve_forever, name=type(server).__name__, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()

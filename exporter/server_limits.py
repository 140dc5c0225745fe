"""What bounds exporter.server's connections, push bodies and file descriptors, so that scrapes, health
checks and pushes sent at line rate get through whatever idle, slow or lying clients do.

- Connections: `--web.max-connections` slots. A connection over the cap takes the slot of the one
  that has waited longest for its first request head, or, when none is waiting so, of the one that
  has waited longest for its client otherwise (kept alive since its last response, or writing a
  response the client does not read); only when every slot is serving a request is the newcomer
  refused with 503. Idle connections cost each other their slots, never a scrape's: a scrape's
  connection is busy from its request head on, and a scraper's or pusher's kept-alive connection goes
  after every connection that never sent a request.
- Push bodies (`--ingest-max-bytes-in-flight`): a body that arrived whole with its head needs no
  room (its bytes are read already; this is the share of clients that send at line rate). Any other
  reserves its Content-Length, so an admitted body always has room to finish, and keeps the
  reservation only while its bytes come at MIN_BODY_RATE: when a push needs room, the bodies furthest
  behind that pace lose theirs. Announcing 1 MiB and sending 1 byte holds the budget for 1/16 s, and
  only until someone else needs it.
- File descriptors: the connection cap is fitted under RLIMIT_NOFILE at start (one log line); a
  failing accept() is logged once per ACCEPT_LOG_SECONDS with a count instead of a traceback per try,
  and sheds idle connections so that descriptors come back.
"""

import asyncio
import logging
import os
import resource
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("stepscope.exporter.server")

MIN_BODY_RATE = 1024 * 1024  # bytes/s: a 1 MiB body within about a second; node networks do 100x that
BODY_LAG_ALLOWANCE = 64 * 1024  # bytes a body may be behind that pace (a TCP window, a slow start)
FD_HEADROOM = 64  # descriptors kept for collectors, /proc reads and a burst of accepts over the cap
ACCEPT_LOG_SECONDS = 10.0
_ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message for EMFILE, ENFILE, ENOBUFS
_ACCEPT_RETRY = "._start_serving("  # in the message of a failed retry (asyncio schedules one per failed try)


class Evictable(Protocol):
    def evict(self) -> None:
        """Closes the connection, giving up its slot."""
        ...


class ConnectionSlots:
    """Who holds the connection slots, and which of them wait for a request, oldest first: those that
    never sent a byte (`_fresh`) apart from those that did or were kept alive after a response (`_kept`).

    A connection counts once the event loop reports it made, so a burst of accepts may pass the cap for
    a moment; its newcomers are never each other's victims, only connections made before it (counted
    from creation, a burst larger than the cap evicts its own members, a scraper's among them, before
    their first byte is read). When that leaves no descriptor to accept with, `shed` closes idle ones.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: set[Evictable] = set()
        self._fresh: OrderedDict[Evictable, None] = OrderedDict()
        self._kept: OrderedDict[Evictable, None] = OrderedDict()
        self.evicted = 0

    def admit(self) -> bool:
        """Whether a new connection gets a slot; when all are taken, an idle one is closed for it."""
        return len(self._open) < self.limit or self._evict_one()

    def shed(self) -> None:
        """Out of descriptors (accept() failed): closes idle connections until the open ones are a
        sixteenth under the cap, so the next accept finds descriptors."""
        target = self.limit - max(1, self.limit // 16)
        while len(self._open) > target and self._evict_one():
            pass

    def _evict_one(self) -> bool:
        idle = self._fresh or self._kept
        if not idle:
            return False
        victim, _ = idle.popitem(last=False)
        self._open.discard(victim)
        victim.evict()
        self.evicted += 1
        return True

    def opened(self, connection: Evictable) -> None:
        self._open.add(connection)
        self._fresh[connection] = None

    def started(self, connection: Evictable) -> None:
        """Its first bytes arrived: it goes after every connection that sent none."""
        if connection in self._fresh:
            del self._fresh[connection]
            self._kept[connection] = None

    def busy(self, connection: Evictable) -> None:
        """A request is being served on it: it keeps its slot until it is idle again."""
        self._fresh.pop(connection, None)
        self._kept.pop(connection, None)

    def idle(self, connection: Evictable) -> None:
        """It answered a request and waits for the next (kept alive)."""
        self.waiting_on_client(connection)

    def waiting_on_client(self, connection: Evictable) -> None:
        """It waits for its client: for the next request, or to read the response being written."""
        if connection in self._open:
            self._kept.pop(connection, None)
            self._kept[connection] = None  # the newest: evicted last

    def closed(self, connection: Evictable) -> None:
        self._open.discard(connection)
        self._fresh.pop(connection, None)
        self._kept.pop(connection, None)


@dataclass(eq=False)
class BodyLease:
    """Room reserved for one body being received."""

    length: int
    started: float
    received: Callable[[], int]  # body bytes arrived so far
    evict: Callable[[], None]  # ends the body's read (the push is answered 408 and closed)

    def lag(self, now: float) -> float:
        """Bytes behind the pace of MIN_BODY_RATE, beyond the allowance; > 0 while falling behind."""
        due = min(self.length, MIN_BODY_RATE * (now - self.started) - BODY_LAG_ALLOWANCE)
        return due - self.received()


class BodyBudget:
    """Push-body bytes in flight: reserved by Content-Length, kept only at pace (see the module doc)."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.used = 0
        self._clock = clock
        self._leases: set[BodyLease] = set()

    def admit(self, length: int, received: Callable[[], int], evict: Callable[[], None]) -> BodyLease | None:
        """Room for a body of `length` bytes, taken from laggards if need be; None when there is none."""
        needed = self.used + length - self.limit
        if needed > 0 and not self._evict_laggards(needed):
            return None
        lease = BodyLease(length, self._clock(), received, evict)
        self._leases.add(lease)
        self.used += length
        return lease

    def release(self, lease: BodyLease) -> None:
        if lease in self._leases:
            self._leases.remove(lease)
            self.used -= lease.length

    def _evict_laggards(self, needed: int) -> bool:
        """Evicts the bodies furthest behind the pace until `needed` bytes are free; none unless that
        suffices (evicting some and refusing anyway would only add a victim)."""
        now = self._clock()
        lagging = sorted(((lease.lag(now), lease) for lease in self._leases), key=lambda item: -item[0])
        victims: list[BodyLease] = []
        for lag, lease in lagging:
            if lag <= 0 or needed <= 0:
                break
            victims.append(lease)
            needed -= lease.length
        if needed > 0:
            return False
        for lease in victims:
            self.release(lease)
            lease.evict()
        return True


def fit_connections(wanted: int) -> int:
    """The connection cap the open-files limit allows: raises the soft limit toward what `wanted` needs
    (up to the hard limit) and, when that is not enough, returns a smaller cap and says so once."""
    needed = wanted + FD_HEADROOM + _open_descriptors()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return wanted
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target >= needed:
        return wanted
    fitted = max(1, target - FD_HEADROOM - _open_descriptors())
    log.warning("the open-files limit (RLIMIT_NOFILE %d, hard %s) leaves room for %d connections, not %d: serving "
                "at most %d at once (raise the limit, e.g. `ulimit -n %d`, or lower --web.max-connections)",
                target, "unlimited" if hard == resource.RLIM_INFINITY else hard, fitted, wanted, fitted, needed)
    return fitted


def _open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no procfs: assume a fresh interpreter's few
        return 16


class AcceptErrorLog:
    """The event loop's exception handler: a failing accept() (out of descriptors or memory) is one line
    per ACCEPT_LOG_SECONDS with a count; asyncio would log each try, up to a thousand a second, with a
    traceback. Each failure sheds idle connections (`on_failure`). Python 3.11 schedules a retry per
    failed try; those still pending when the server stops fail on the closed socket and are dropped.
    Everything else goes to asyncio's default handler."""

    def __init__(self, on_failure: Callable[[], None], interval: float = ACCEPT_LOG_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._on_failure = on_failure  # frees descriptors: ConnectionSlots.shed
        self._interval = interval
        self._clock = clock
        self._failed = 0
        self._next_report = 0.0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = context.get("message", "")
        if _ACCEPT_RETRY in message and isinstance(context.get("exception"), ValueError | OSError):
            return
        if message != _ACCEPT_FAILED:
            loop.default_exception_handler(context)
            return
        self._on_failure()
        self._failed += 1
        now = self._clock()
        if now < self._next_report:
            return
        exc = context.get("exception")
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        log.error("accept() failed %d time(s) since the last report (%s): new clients wait in the listen backlog; "
                  "raise the open-files limit or lower --web.max-connections (logged at most every %gs)",
                  self._failed, reason, self._interval)
        self._failed = 0
        self._next_report = now + self._interval

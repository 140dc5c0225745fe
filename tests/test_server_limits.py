"""The policies of exporter.server_limits on their own: which body loses its room, which connection its
slot, and how a failing accept() is logged. The attacks themselves run against real exporters in
tests/test_server_attacks.py."""

import asyncio
import logging

import pytest

from stepscope.exporter.server_limits import (
    BODY_LAG_ALLOWANCE,
    MIN_BODY_RATE,
    AcceptErrorLog,
    BodyBudget,
    ConnectionSlots,
)
from tests.support.clock import ManualClock


class Body:
    """A body being received: how much arrived, and whether the budget evicted it."""

    def __init__(self, received: int = 0) -> None:
        self.received = received
        self.evicted = False

    def admit(self, budget: BodyBudget, length: int) -> bool:
        return budget.admit(length, lambda: self.received, self.evict) is not None

    def evict(self) -> None:
        self.evicted = True


def test_a_body_that_keeps_pace_keeps_its_room_and_a_laggard_gives_it_up() -> None:
    clock = ManualClock(100.0)
    budget = BodyBudget(3 * 2**20, clock)
    liar, paced, stalled = Body(1), Body(), Body()
    assert liar.admit(budget, 2**20) and paced.admit(budget, 2**20) and stalled.admit(budget, 2**20)
    clock.now += 0.5
    paced.received = MIN_BODY_RATE // 2  # exactly at pace
    stalled.received = MIN_BODY_RATE // 4 + BODY_LAG_ALLOWANCE  # behind by a quarter of a second's worth
    newcomer = Body()
    assert newcomer.admit(budget, 2**20)
    assert (liar.evicted, stalled.evicted, paced.evicted) == (True, False, False)  # the furthest behind first
    assert budget.used == 3 * 2**20
    assert Body().admit(budget, 2**20)  # the stalled one goes next
    assert stalled.evicted and not paced.evicted


def test_no_body_is_evicted_unless_that_makes_enough_room() -> None:
    clock = ManualClock(100.0)
    budget = BodyBudget(2 * 2**20, clock)
    laggard, paced = Body(), Body()
    assert laggard.admit(budget, 2**20) and paced.admit(budget, 2**20)
    clock.now += 1
    paced.received = 2**20
    assert not Body().admit(budget, 2 * 2**20)  # evicting the laggard would free half of it
    assert not laggard.evicted and budget.used == 2 * 2**20


def test_a_newcomer_takes_the_slot_of_one_that_sent_nothing_before_one_that_did() -> None:
    class Connection:
        evicted = False

        def evict(self) -> None:
            self.evicted = True

    slots = ConnectionSlots(3)
    scraper, silent, slow_head = Connection(), Connection(), Connection()
    for connection in (scraper, silent, slow_head):
        assert slots.admit()
        slots.opened(connection)
    slots.busy(scraper)
    slots.idle(scraper)  # answered and kept alive, the oldest connection
    slots.started(slow_head)  # sent part of a head
    first = Connection()
    assert slots.admit() and silent.evicted and not scraper.evicted  # one that never sent a byte goes first
    slots.opened(first)
    slots.busy(first)
    second = Connection()
    assert slots.admit() and scraper.evicted and not slow_head.evicted  # then the longest idle of the others
    slots.opened(second)
    slots.busy(second)
    slots.busy(slow_head)
    assert not slots.admit()  # every slot serves a request: the newcomer is refused


def test_shedding_closes_idle_connections_to_a_sixteenth_under_the_cap() -> None:
    class Connection:
        evicted = False

        def evict(self) -> None:
            self.evicted = True

    slots = ConnectionSlots(32)
    connections = [Connection() for _ in range(40)]  # a burst of accepts passed the cap
    for connection in connections:
        slots.opened(connection)
    slots.shed()
    assert sum(c.evicted for c in connections) == 10 and all(c.evicted for c in connections[:10])


def test_failed_accepts_are_one_line_per_interval_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    clock, shed = ManualClock(100.0), []
    handler = AcceptErrorLog(lambda: shed.append(1), interval=10, clock=clock)
    loop = asyncio.new_event_loop()
    failure = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    try:
        with caplog.at_level(logging.ERROR, logger="stepscope.exporter.server"):
            for _ in range(1000):
                handler(loop, failure)
            clock.now += 10
            handler(loop, failure)
            handler(loop, {"message": "Exception in callback BaseSelectorEventLoop._start_serving(...)",
                           "exception": ValueError("Invalid file descriptor: -1")})
    finally:
        loop.close()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "accept() failed 1 time(s) since the last report", "accept() failed 1000 time(s) since the last report"]
    assert "Too many open files" in caplog.records[0].getMessage() and len(shed) == 1001

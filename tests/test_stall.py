"""A router whose own loop stood still (a stopped process, a long GC pause, a starved VM) reads
what was sent to it meanwhile as having waited since the stall began (`plane.router.stall`):
refused unread, 429 `overloaded` or `deadline`, with no ticket, not decided as fresh
(/tmp/probeF finding 2: 429 `busy` tickets "come back in 40 ms" and 503 `no-capacity`, 2-5 s
after the callers sent them). The router runs in-process on a real server; its loop is
blocked with a plain sleep while a caller on its own thread, loop and connection sends."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import nats

from plane.contract.subjects import Header
from plane.router.stall import MIN_STALL_S, LoopStalls
from tests.ledger import Ledger
from tests.plane_fixtures import NAMES, calibrated, client, plane, status

STALL_S = 1.0


class Caller(threading.Thread):
    """Requests sent from another thread (its own loop and connection) once told to go: the
    plane's loop may be blocked meanwhile. Its ledger holds every answer to each."""

    def __init__(self, url: str, deadlines_ms: list[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.deadlines_ms = url, deadlines_ms
        self.ready, self.go, self.sent = threading.Event(), threading.Event(), threading.Event()
        self.ledger: Ledger | None = None

    def run(self) -> None:
        asyncio.run(self._call())

    async def _call(self) -> None:
        nc = await nats.connect(self.url)
        try:
            ledger = await Ledger(nc).start()
            await nc.flush()
            self.ready.set()
            await asyncio.to_thread(self.go.wait, 10)
            for deadline_ms in self.deadlines_ms:
                await ledger.send(NAMES.infer("calibrated"), calibrated(1000), deadline_ms)
            await nc.flush()
            self.sent.set()
            await ledger.settle(10 + STALL_S, quiet_s=0.5)
            self.ledger = ledger
        finally:
            await nc.close()


def stand_still(seconds: float) -> None:
    """Block the running loop (and so the router, and its socket's reads) for `seconds`."""
    time.sleep(seconds)


async def test_what_a_stalled_router_reads_after_its_stall_is_refused_unread() -> None:
    async with plane(models=("calibrated",), slots=2, backend="torch") as stack, \
            client(stack.url) as nc:
        router = stack.routers[0]
        warm = await nc.request(NAMES.infer("calibrated"), calibrated(1000), timeout=5,
                                headers={Header.DEADLINE_MS: "2000"})
        assert status(warm) == 200
        # Deadlines past the stall, and within it: `overloaded`, and `deadline`.
        caller = Caller(stack.url, [5000] * 12 + [400] * 6)
        caller.start()
        assert await asyncio.to_thread(caller.ready.wait, 10)
        caller.go.set()
        stand_still(STALL_S)  # they are sent meanwhile, and wait in the router's socket
        assert caller.sent.is_set()
        await asyncio.to_thread(caller.join, 20)
        ledger = caller.ledger
        assert ledger is not None
        assert ledger.unanswered() == [] and ledger.answered_twice() == []
        answers = [ledger.first(i) for i in sorted(ledger.answers)]
        assert [(a.status, a.reason) for a in answers] == (
            [(429, "overloaded")] * 12 + [(429, "deadline")] * 6)
        for a in answers:
            assert Header.TICKET not in a.headers
            assert "behind" in json.loads(a.msg.data)["error"]
            # Told to come back no sooner than the router stood still (it was behind as long).
            assert int(a.headers[Header.RETRY_AFTER_MS]) >= STALL_S * 1000 * 0.9
        assert router.stalls.count >= 1
        assert router.metrics.behind.labels("calibrated")._value.get() == 18
        # The burst is over once read: the next request is decided, and served.
        fresh = await nc.request(NAMES.infer("calibrated"), calibrated(1000), timeout=5,
                                 headers={Header.DEADLINE_MS: "2000"})
        assert status(fresh) == 200, fresh.headers



def test_a_pause_shorter_than_a_stall_is_not_taken_for_one() -> None:
    # A 60-100 ms pause (a collection, a blocking call; frequent where routers, nodes, a
    # gateway and its callers share one loop) was taken for a stall of the 50 ms inbox
    # bound: everything read after it refused `overloaded`, the request sent in its last
    # millisecond too (a clean clone's test_gateway_edges). A stall is MIN_STALL_S or more.
    stalls = LoopStalls(bound_s=0.05)
    stalls.sleeping(0.0, for_s=0.1)
    assert not stalls.look(0.1 + 0.12)  # the watchdog 120 ms late: a pause
    stalls.woke(0.22)
    assert not stalls.look(0.22 + MIN_STALL_S - 0.01)
    assert stalls.look(0.22 + MIN_STALL_S + 0.01)  # a stop
    assert stalls.waited_s(0.22 + MIN_STALL_S + 0.01) >= MIN_STALL_S

"""Where ticket holders wait for a slot to free: one line per model, in due order.

A freed slot wakes one holder, the one whose promise is due first, rather than every holder
of the model (a thundering herd that re-decides N times for one free slot, and lets whoever
the event loop happens to run first take it). The woken holder decides again; admission
still has the last word (a holder it cannot place parks again).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(order=True, slots=True)
class InLine:
    """A holder's place in its model's line: set when a freed slot wakes it."""

    due_s: float
    seq: int
    woken: asyncio.Future[None] = field(compare=False)


class ParkingLot:
    def __init__(self) -> None:
        self._lines: dict[str, list[InLine]] = {}
        self._seq = itertools.count()

    def hold(self, model: str, due_s: float) -> InLine:
        """A place in `model`'s line from now, for a holder whose wait (`wait`) begins a
        moment later, on a task of its own: a slot that frees in between (a done-event is
        taken as it is read, before that task first runs) wakes it all the same, where it
        found nobody parked, left the slot to the next promise, and the holder, parked after
        it, waited for the next one (at 2x of 4 slots of 2 ms: the accepted p99/p50 2.6
        against 1.9). `release` it if the wait never begins."""
        waiter = InLine(due_s, next(self._seq), asyncio.get_running_loop().create_future())
        heapq.heappush(self._lines.setdefault(model, []), waiter)
        return waiter

    @staticmethod
    def release(place: InLine) -> None:
        """A place held and not waited on (or waited on and over): passed over from now."""
        if not place.woken.done():
            place.woken.cancel()

    async def wait(self, model: str, due_s: float, until_s: float,
                   place: InLine | None = None) -> bool:
        """Wait until a slot of `model` frees for us or `until_s` (loop time) passes; True
        when woken. `place`: one taken in the line before (`hold`), woken perhaps already."""
        waiter = place if place is not None else self.hold(model, due_s)
        try:
            async with asyncio.timeout_at(until_s):
                await waiter.woken
            return True
        except TimeoutError:
            return False
        finally:
            self.release(waiter)  # left in the heap; skipped when it comes up

    def wake_one(self, model: str) -> bool:
        """A slot of `model` freed: wake the holder due first. False when nobody waits."""
        line = self._lines.get(model)
        while line:
            waiter = heapq.heappop(line)
            if not waiter.woken.done():
                waiter.woken.set_result(None)
                return True
        return False

    def waiting(self, model: str) -> int:
        return sum(1 for w in self._lines.get(model, ()) if not w.woken.done())

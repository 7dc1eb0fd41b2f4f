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
class _Waiter:
    due_s: float
    seq: int
    woken: asyncio.Future[None] = field(compare=False)


class ParkingLot:
    def __init__(self) -> None:
        self._lines: dict[str, list[_Waiter]] = {}
        self._seq = itertools.count()

    async def wait(self, model: str, due_s: float, until_s: float) -> bool:
        """Wait until a slot of `model` frees for us or `until_s` (loop time) passes; True
        when woken."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(due_s, next(self._seq), loop.create_future())
        heapq.heappush(self._lines.setdefault(model, []), waiter)
        try:
            async with asyncio.timeout_at(until_s):
                await waiter.woken
            return True
        except TimeoutError:
            return False
        finally:
            if not waiter.woken.done():
                waiter.woken.cancel()  # left in the heap; skipped when it comes up

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

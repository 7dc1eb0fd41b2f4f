"""Calling ticket holders back (`Plane-Wake`, docs/design.md "Retry-After that is worth
trusting"): when a slot frees, the holder it goes to is told on its inbox, and comes one
trip later, never before the work ahead ends. A holder on call (a stream, or work long
beside a call's trip: `Admission.decide`) was told a late fallback, well past the predicted
end of the work ahead, so it never waits out an overrun of that work, parked, in its own
latency; one told the predicted time (short work) comes earlier when its slot freed early.

A holder on call for work long beside the trip (not a stream) is called ahead: one median
trip before a busy slot's work is predicted to end (a timer per model), so that it comes as
the slot frees rather than a trip after. Called only when the slot freed, every holder left
its slot idle for a trip: at 0.9x of 4 x 20 ms on this project's host (trips of 1-3 ms) that
cost the slots ~10% of their time, the promises' line never drained, and every newcomer was
refused for as long as the load lasted (BENCHMARKS.md, forty-fifth session). A holder called
ahead that comes before its slot frees waits for it, parked; one whose slot frees first finds
it kept for it (`Admission._held`: called holders are), as a holder called at the free does.

The calls are made in the router that made the promises; when it is gone, in the router that
makes them in its place (the notes carry the inboxes: `Admission.called_elsewhere`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.client import Client

from plane.contract.publish import publish
from plane.contract.subjects import Header
from plane.router.admission import Admission
from plane.router.occupancy import ModelSlots
from plane.router.parking import ParkingLot
from plane.router.promises import Promise

# Slots whose predicted end is within this much of the timer's firing are called ahead of in
# the same firing (the loop's timers are not finer than a millisecond).
AHEAD_BATCH_S = 0.0005


class Calls:
    def __init__(self, nc: Client, admission: Admission, parking: ParkingLot,
                 tell: Callable[[], Coroutine[Any, Any, None]],
                 spawn: Callable[[Coroutine[Any, Any, None]], object]) -> None:
        self._nc = nc
        self._admission = admission
        self._parking = parking
        self._tell = tell  # the other routers: a called promise is due now
        self._spawn = spawn
        self._timers: dict[str, asyncio.TimerHandle] = {}  # by model: the next call ahead
        # The models whose book may hold a holder to call ahead (one was promised since the
        # book was last seen without one): the only ones a placement looks at.
        self._models: set[str] = set()
        self._closed = False

    def freed(self, ms: ModelSlots, now: float) -> Promise | None:
        """A slot of `ms` freed: a holder parked here takes it (woken now); else the holder
        it goes to is called: its promise is returned, for `call` (None also when that
        holder was called ahead already)."""
        if self._parking.wake_one(ms.model):
            return None
        p = self._admission.slot_for(ms, now)
        return p if p is not None and p.called_s == now and p.wake is not None else None

    async def call(self, p: Promise) -> None:
        """Tell the holder of `p` (on its inbox) to come now."""
        assert p.wake is not None
        await publish(self._nc, p.wake, b"", {Header.TICKET: p.ticket})
        await self._tell()

    def ahead(self, ms: ModelSlots, made: bool) -> None:
        """A promise whose holder is called ahead was made (`made`), or a request of `ms` was
        placed (a slot's new end): make sure the timer runs for the next call ahead, if one
        may be due. (Every placement comes here: one set lookup for a model with nobody to
        call ahead, short work's.)"""
        if made:
            self._models.add(ms.model)
        elif ms.model not in self._models:
            return
        if ms.model not in self._timers and not self._closed:
            self._arm(ms, time.monotonic())

    def close(self) -> None:
        """No more calls ahead (the router stops)."""
        self._closed = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def _arm(self, ms: ModelSlots, now: float) -> None:
        if not any(p.ahead and not p.called_s for p in ms.promises):
            self._models.discard(ms.model)  # until the next such promise
            return
        first = ms.next_end_not_called_ahead()
        if first is None:
            return
        at_s = first.expected_free_s - self._admission.call_trip_s(ms.model)
        self._timers[ms.model] = asyncio.get_running_loop().call_later(
            max(0.0, at_s - now), self._fire, ms)

    def _fire(self, ms: ModelSlots) -> None:
        del self._timers[ms.model]
        self._fire_now(ms)

    def _fire_now(self, ms: ModelSlots) -> None:
        """Call ahead of each busy slot whose work ends within a trip, unless the holders
        that will take the slots freeing first are here already or called (`claimed`): the
        k-th slot to free goes to the k-th of them, parked holders first. (Calling one for
        every end, a holder parked a moment earlier took the slot a holder was called
        ahead for, and that one waited for the next: the line of waiting holders never
        shrank while the overload lasted, and 0.5-1% of them were refused again after their
        park; BENCHMARKS.md, forty-fifth session.)"""
        now = time.monotonic()
        until_s = now + self._admission.call_trip_s(ms.model) + AHEAD_BATCH_S
        claimed = sum(1 for p in ms.promises if p.parked or (p.called_s and not p.slotted))
        for freeing, view in enumerate(ms.by_end(), start=1):
            if view.expected_free_s > until_s:
                break
            if view.called_ahead:
                continue  # called ahead of already (counted in `claimed`, or placed since)
            view.called_ahead_s = view.expected_free_s  # one look ahead of this work
            if claimed >= freeing:
                continue  # its free goes to a holder here or called already
            if (p := self._admission.call_ahead(ms, now, until_s - now)) is None:
                break
            claimed += 1
            self._spawn(self.call(p))
        self._arm(ms, now)

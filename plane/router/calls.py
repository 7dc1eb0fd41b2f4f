"""Calling ticket holders back (`Plane-Wake`, docs/design.md "Retry-After that is worth
trusting"): when a slot frees, the holder it goes to is told on its inbox, and comes one
trip later, never before the work ahead ends. A holder on call (a stream, or work long
beside a call's trip: `Admission.decide`) was told a late fallback, well past the predicted
end of the work ahead, so it never waits out an overrun of that work, parked, in its own
latency; one told the predicted time (short work) comes earlier when its slot freed early.

The calls are made in the router that made the promises; when it is gone, in the router that
makes them in its place (the notes carry the inboxes: `Admission.called_elsewhere`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.client import Client

from plane.contract.publish import publish
from plane.contract.subjects import Header
from plane.router.admission import Admission
from plane.router.occupancy import ModelSlots
from plane.router.parking import ParkingLot
from plane.router.promises import Promise


class Calls:
    def __init__(self, nc: Client, admission: Admission, parking: ParkingLot,
                 tell: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._nc = nc
        self._admission = admission
        self._parking = parking
        self._tell = tell  # the other routers: a called promise is due now

    def freed(self, ms: ModelSlots, now: float) -> Promise | None:
        """A slot of `ms` freed: a holder parked here takes it (woken now); else the holder
        it goes to is called: its promise is returned, for `call`."""
        if self._parking.wake_one(ms.model):
            return None
        p = self._admission.slot_for(ms, now)
        return p if p is not None and p.called_s and p.wake is not None else None

    async def call(self, p: Promise) -> None:
        """Tell the holder of `p` (on its inbox) to come now."""
        assert p.wake is not None
        await publish(self._nc, p.wake, b"", {Header.TICKET: p.ticket})
        await self._tell()

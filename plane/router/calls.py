"""Calling ticket holders back (`Plane-Wake`, docs/design.md "Retry-After that is worth
trusting"): when a slot frees, or is about to, the holder it goes to is told on its inbox.

Two moments, by how a call's trip compares with the holder's work (`Admission._call_mode`):
- **when the slot frees** (its done-event): the holder comes one trip later, never before
  the work ahead ends; for work long beside the trip (streams), where an overrun of the work
  ahead would otherwise be waited out, parked, in the holder's own latency.
- **ahead**: one trip before the slot's current work is predicted to end (a timer per
  placement, armed only while such holders are promised), so that the holder arrives as
  the slot frees; for short work, where a slot idle for a trip is a large share of its time.
  Each slot calls ahead once per placement; its done-event then calls nobody while that
  holder is on its way (not placed on another slot that freed first), and if the slot freed
  before its timer, the done-event calls instead.

The calls are made in the router that made the promises (it alone holds the inboxes).
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
from plane.router.occupancy import ModelSlots, SlotView
from plane.router.parking import ParkingLot
from plane.router.promises import Promise


class Calls:
    def __init__(self, nc: Client, admission: Admission, parking: ParkingLot,
                 spawn: Callable[[Coroutine[Any, Any, None]], object],
                 tell: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._nc = nc
        self._admission = admission
        self._parking = parking
        self._spawn = spawn
        self._tell = tell  # the other routers: a called promise is due now

    async def freed(self, ms: ModelSlots, view: SlotView | None, now: float) -> None:
        """A slot of `ms` freed (`view`, when known): a holder parked here takes it; else the
        holder it goes to is called, unless one was called ahead for it."""
        if self._parking.wake_one(ms.model):
            return
        if view is not None and view.called_for is not None:
            called, view.called_for = view.called_for, None
            if called in self._admission.tickets:
                return  # its holder is on its way (not placed on another slot meanwhile)
        await self._call(self._admission.slot_for(ms, now))

    def placed(self, ms: ModelSlots, view: SlotView, now: float) -> None:
        """Work was just placed on `view` (by this router or, told by `peers`, another):
        while holders to call ahead are promised, a timer one call's trip before it is
        predicted to end."""
        view.called_for = None
        if not self._admission.calls_ahead(ms):
            return
        at_s = view.expected_free_s - self._admission.call_trip_s(ms.model)
        asyncio.get_running_loop().call_later(
            max(0.0, at_s - now), self._ahead, ms, view, view.occupied_s)

    def _ahead(self, ms: ModelSlots, view: SlotView, occupied_s: float) -> None:
        if not view.busy or view.occupied_s != occupied_s or view.called_for is not None:
            return  # freed already (its done-event called), or taken by other work since
        p = self._admission.slot_for(ms, time.monotonic(), ahead=True)
        if p is not None:
            view.called_for = p.ticket  # this slot's holder: its done-event calls nobody
            if p.called_s:
                self._spawn(self._call(p))

    async def _call(self, p: Promise | None) -> None:
        if p is not None and p.called_s and p.wake is not None:
            await publish(self._nc, p.wake, b"", {Header.TICKET: p.ticket})
            await self._tell()

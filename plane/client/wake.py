"""Calls back: one inbox per client where the router calls a ticket's holder (`Plane-Wake`,
docs/design.md "Retry-After that is worth trusting").

A holder that sends the inbox is called there when its slot frees before its Retry-After
(`plane.router.calls`), timed to the slot's real state rather than to a prediction made at
refusal time; for a stream, and work long beside a call's trip, it is on call: its
Retry-After is a late fallback, well past the predicted end of the work ahead. A call that
never comes (the router restarted, the connection dropped) costs the wait until the
Retry-After.

The call carries only the ticket. It can arrive before its holder starts waiting (the 429 and
the call come on different subscriptions, each read in its own task): such calls are kept,
the last EARLY_KEPT of them, and a holder that starts waiting finds its own there.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from plane.contract.subjects import Header

EARLY_KEPT = 256


class EarlyCalls:
    """The client's inbox for calls back, subscribed on first use (it lives as long as the
    connection), and the holders waiting for theirs."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._sub: Subscription | None = None
        self._subject = ""
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._early: OrderedDict[str, None] = OrderedDict()  # calls no holder waited for yet

    async def inbox(self) -> str:
        """The subject to send as `Plane-Wake` (subscribed once; the SUB goes out before
        the request that names it, so the server knows it before any router could call)."""
        if self._sub is None:
            self._subject = self._nc.new_inbox()
            self._sub = await self._nc.subscribe(self._subject, cb=self._called)
        return self._subject

    @property
    def subject(self) -> str:
        """The inbox (empty until the first call that sends it)."""
        return self._subject

    async def _called(self, msg: Msg) -> None:
        ticket = (msg.headers or {}).get(Header.TICKET)
        if not ticket:
            return
        waiter = self._waiting.pop(ticket, None)
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(None)
            return
        self._early[ticket] = None
        while len(self._early) > EARLY_KEPT:
            self._early.popitem(last=False)

    def wake_all(self) -> None:
        """End every holder's wait now (the connection closed: no call can come)."""
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_result(None)

    async def sleep(self, ticket: str | None, delay_s: float) -> bool:
        """Wait `delay_s`, or less when the router calls `ticket`'s holder first; True when
        it did."""
        if ticket is None or self._sub is None:
            await asyncio.sleep(delay_s)
            return False
        if ticket in self._early:  # called before we got here
            del self._early[ticket]
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = waiter
        try:
            async with asyncio.timeout(delay_s):
                await waiter
            return True
        except TimeoutError:
            return False
        finally:
            if self._waiting.get(ticket) is waiter:
                del self._waiting[ticket]

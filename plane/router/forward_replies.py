"""Forwards to another router, sent in the turn that decided them, answered to one callback.

A router that does not make promises hands a request that needs one to the router that
does, and a ticket holder's retry to the router that made its promise (`RequestPath._forward`).
Sent with `nc.request` from the task that waits for the answer, the forward left only when
that task first ran: behind the backlog the router was working through, whose turns come every
`TURN_EVERY_S` and last several rounds of the loop. Two routers at 2x of 4 x 5 ms (40 ms
deadlines): the ticket holders forwarded were held p90 1.4-4.2 ms, p99 2.4-22 ms before they
were sent on (the router's inbox's own wait: p90 0.7-1.3 ms), and came back to the promiser
late by that; 0.7-1 ms at the p90 sent at once (BENCHMARKS.md, forty-second session).

Here the forward is published at once (`send`, awaited in the read's own turn: a publish
does not wait), with a reply subject under one router-wide inbox, and a single subscription
hands each answer, as nats-py reads it, to the future `send` returned; only the wait for that
answer is in a task. The one answer is the owner's "taken", an owner of an earlier version's
own answer, or the server's no-responders status (the owner is gone).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from plane.contract.publish import publish
from plane.contract.taken_as_read import subscribe_as_read


class ForwardReplies:
    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = ""
        self._sub: Subscription | None = None
        self._tokens = itertools.count(1)
        self._pending: dict[str, asyncio.Future[Msg]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    async def start(self) -> None:
        if self._sub is None:
            self._prefix = self._nc.new_inbox()
            self._sub = await subscribe_as_read(self._nc, f"{self._prefix}.*", self._take)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.unsubscribe()

    async def send(self, subject: str, data: bytes,
                   headers: Mapping[str, str]) -> asyncio.Future[Msg]:
        """Publish now; the future gets the one answer. Cancel it (`asyncio.wait_for` on a
        timeout does) to stop waiting: its token is dropped with it."""
        token = str(next(self._tokens))
        answer: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._pending[token] = answer
        answer.add_done_callback(lambda _: self._pending.pop(token, None))
        try:
            await publish(self._nc, subject, data, headers, reply=f"{self._prefix}.{token}")
        except BaseException:
            answer.cancel()
            raise
        return answer

    def _take(self, msg: Msg) -> None:
        answer = self._pending.pop(msg.subject[len(self._prefix) + 1:], None)
        if answer is not None and not answer.done():
            answer.set_result(msg)

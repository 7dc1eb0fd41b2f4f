"""Requests and their replies, through one inbox subscription of the connection's own: a
client's calls (`plane.client`), and a router's forwards to another router
(`plane.router.requests`, `_forward`).

nats-py's `request` costs a caller more than it needs (`Client.call`'s every try: the
gateway's per HTTP request, `plane pulse`'s per attempt): per request it reads two random
bytes from the OS for the reply's token, builds the header block in `publish`, waits with
`asyncio.wait_for` (on Python 3.11 a callback and a second future besides the timer, and it
drops a cancel that comes as the answer does), and the reply reaches the waiting call one
task's turn after it is read (the response subscription's queue and task). Here:

- one wildcard subscription `<inbox>.*` per client, its messages taken as nats-py reads them
  (`plane.contract.taken_as_read`): a reply resolves its call at once;
- a reply's token is a counter, unique under the subscription's own inbox (a NUID);
- the request goes out as `plane.contract.publish` writes it;
- the wait is the future's alone, ended by a timer (`NatsTimeout`) or the connection's close
  (`fail_all`: `plane.client.connection.OnClose`);
- `send` publishes at once and hands back the reply's future, to be waited on later
  (`reply`): a router sends a forward in the turn that decided it, and waits for the answer
  in a task (from that task, the forward left only when the task first ran, behind the
  backlog the router was working through: two routers at 2x of 4 x 5 ms, 40 ms deadlines,
  held the ticket holders they forwarded p90 1.4-4.2 ms, p99 2.4-22 ms; BENCHMARKS.md,
  forty-second session).

The answers are nats-py's `Msg`s, and the errors nats-py's (`NatsTimeout`,
`NoRespondersError`, `ConnectionClosedError`, `ConnectionDrainingError`), so that callers
read them as they read `nc.request`'s. `benchmarks/sdk_call.py` measures both.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from plane.contract.publish import publish
from plane.contract.taken_as_read import subscribe_as_read

NO_RESPONDERS = "503"  # the server's status on a request nobody is subscribed to


def _time_out(future: asyncio.Future[Msg]) -> None:
    if not future.done():
        future.set_exception(NatsTimeout())


class ReplyInbox:
    """The connection's reply subscription (made at the first request; it lives as long as
    the connection) and the requests waiting on it."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._prefix = ""  # `<inbox>.`: a reply's subject is this and its token
        self._sub: Subscription | None = None
        self._subscribing = asyncio.Lock()
        self._tokens = itertools.count()
        self._waiting: dict[str, asyncio.Future[Msg]] = {}

    async def request(self, subject: str, payload: bytes, headers: Mapping[str, str],
                      timeout_s: float) -> Msg:
        """`nc.request(subject, payload, timeout=timeout_s, headers=headers)`, cheaper."""
        return await self.reply(await self.send(subject, payload, headers), timeout_s)

    async def send(self, subject: str, payload: bytes,
                   headers: Mapping[str, str]) -> asyncio.Future[Msg]:
        """Publish the request now; the future of its reply (`reply` waits for it; cancelled,
        nothing is kept for it)."""
        if self._sub is None:
            await self._subscribe()
        token = str(next(self._tokens))
        future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._waiting[token] = future
        future.add_done_callback(lambda _: self._waiting.pop(token, None))
        try:
            await publish(self._nc, subject, payload, headers, reply=self._prefix + token)
        except BaseException:
            future.cancel()
            raise
        return future

    async def reply(self, future: asyncio.Future[Msg], timeout_s: float) -> Msg:
        """The reply `send` gave the future of, within `timeout_s`; the errors nats-py's
        `request` raises."""
        timer = asyncio.get_running_loop().call_later(timeout_s, _time_out, future)
        try:
            msg = await future
        finally:
            timer.cancel()
        return self.checked(msg)

    @staticmethod
    def checked(msg: Msg) -> Msg:
        """A reply as `reply` hands it back: the server's no-responders status raises
        `NoRespondersError` (for a future waited on otherwise: `plane.router.owner_watch`)."""
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:  # as nats-py reads it
            raise NoRespondersError
        return msg

    def fail_all(self, error: type[Exception] = ConnectionClosedError) -> None:
        """End every request waiting with `error`: the connection closed (or, for a client
        that asks it, dropped), no reply can come."""
        for future in list(self._waiting.values()):
            if not future.done():
                future.set_exception(error())

    async def _subscribe(self) -> None:
        async with self._subscribing:  # two first requests at once subscribe once
            if self._sub is not None:
                return
            prefix = f"{self._nc.new_inbox()}."
            sub = await subscribe_as_read(self._nc, f"{prefix}*", self._take)
            self._prefix, self._sub = prefix, sub

    def _take(self, msg: Msg) -> None:
        future = self._waiting.get(msg.subject[len(self._prefix):])
        if future is not None and not future.done():
            future.set_result(msg)

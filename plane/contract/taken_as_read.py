"""Messages handed on as nats-py reads them off the socket, not through a subscription's queue.

nats-py gives each subscription with a callback an `asyncio.Queue` and a task that awaits it:
every message waits for that task's turn of the event loop before its callback runs, and the
callback must be a coroutine. For the messages of the plane's hot path whose handling is
plain bookkeeping (a slot's delivery, which only wakes the slot's task; a done-event, which
frees a slot in the router's books), that turn is a task wake per message for nothing, and
it lets whatever was read after the message be handled before it: a request read after a
done-event was decided before the slot it freed was seen free.

`take_as_read` (or `subscribe_as_read`, which subscribes too) replaces the queue's
`put_nowait` (as `plane.router.receipt` wraps it; a private attribute of the nats-py version
pinned in pyproject.toml) so that nats-py's read loop hands each message to `take` at once.
Nothing is queued: the subscription's own task waits on an empty queue until the unsubscribe
ends it, and what nats-py counted as pending is taken off again at once (left to grow, it
would call the subscription a slow consumer and drop messages). `take` runs inside nats-py's
read loop: it must not block, and whatever it raises is logged here, never left to end that
loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = structlog.get_logger("plane.read")


def take_as_read(sub: Subscription, take: Callable[[Msg], None]) -> Subscription:
    """From now on, hand each message of `sub` to `take` as it is read."""

    def put_nowait(msg: Msg) -> None:
        sub._pending_size -= len(msg.data)
        try:
            take(msg)
        except Exception:
            log.exception("a message could not be handled", subject=msg.subject)

    sub._pending_queue.put_nowait = put_nowait  # type: ignore[method-assign,assignment]
    return sub


async def subscribe_as_read(nc: Client, subject: str, take: Callable[[Msg], None],
                            **options: Any) -> Subscription:
    """`nc.subscribe(subject, **options)`, each message handed to `take` as it is read."""

    async def handed(msg: Msg) -> None:  # nats-py's callback, gone round by `take_as_read`
        take(msg)

    return take_as_read(await nc.subscribe(subject, cb=handed, **options), take)

"""A flush waiting when its connection drops fails at once, not at its timeout.

nats-py's `flush()` (and so each subscription's `drain()`, and the connection's) sends a
PING and waits for its PONG, 10 s by default. A connection that drops can never bring that
PONG: nats-py forgets the PINGs it sent when it reconnects (`_pongs = []`), so every waiter
waits out its whole timeout, and then fails all the same. A stop that drained while its
server went away waited for nothing: a SIGKILLed `plane up`'s router process and its
nats-server get SIGTERM together, and the router's request subscriptions waited 10 s each
in `drain()`, or its connection's drain 5 s, cut then with asyncio's "_GatheringFuture
exception was never retrieved" traceback (found from outside).

`fail_lost_pings(nc)`, called by the connection's disconnected callback (`natsconn.connect`),
fails each such waiter with the error its timeout would have raised (`FlushTimeoutError`),
now. Uses nats-py's `_pongs`, as `plane.contract.soon_flush` does (nats-py is pinned).
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.errors import FlushTimeoutError


def fail_lost_pings(nc: Client) -> int:
    """Fail the PINGs `nc` sent and has no PONG for (its connection dropped: none can come);
    how many."""
    pongs: list[asyncio.Future[object]] = nc._pongs
    nc._pongs = []
    failed = 0
    for fut in pongs:
        if not fut.done():
            fut.set_exception(FlushTimeoutError())
            # Retrieved here: a keep-alive PING's future has no waiter, and asyncio would log
            # it as an exception never retrieved. A flush's waiter gets the error all the same.
            fut.exception()
            failed += 1
    return failed

"""When the router received a request: the moment nats-py read it off the socket, not the
moment the router got round to it.

A router reads requests one after another. In a burst (2,000 at once: `benchmarks/burst.py`)
the last waited 200-300 ms behind the others before its own decision, and that wait counted
nowhere: its `Plane-Deadline-Ms` ran from the decision (design.md says from receipt), so a
caller with a 100 ms budget could be placed at 300 ms and answered after it had given up, and
`plane_router_decision_seconds` ("from receipt") showed a fraction of a millisecond. Stamped
here, the budget and the metric both start at receipt: the wait is the caller's, and it shows.

The stamp is put on as nats-py hands the message to the subscription's queue: that queue's
`put_nowait` is wrapped (the queue itself stays: the subscription's task already waits on
it). `_pending_queue` is a private attribute of nats-py's `Subscription`; the nats-py version
is pinned in pyproject.toml and `tests/test_receipt.py` checks the stamp on a real server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

_RECEIVED = "_plane_received_s"  # on the Msg (a plain dataclass): monotonic seconds


def stamp_receipt(sub: Subscription, *, clock: Callable[[], float] = time.monotonic,
                  then: Callable[[Msg, float], None] | None = None,
                  past_limit: Callable[[Msg], bool] | None = None) -> Subscription:
    """Make `sub` stamp each message with its receipt time (`clock`) from now on, and hand
    each one queued to `then`, with its stamp (`plane.router.inbox` notes its ticket holders,
    and restamps what it reads in the wake of the loop's stall). A message
    `past_limit` accepts is queued even when the queue holds its pending limit already (a
    ticket holder's: its promise is for a time; the inbox bounds how many)."""
    queue: asyncio.Queue[Msg] = sub._pending_queue
    put = queue.put_nowait

    def stamped(item: Msg) -> None:
        try:
            put(item)
        except asyncio.QueueFull:
            if past_limit is None or not past_limit(item):
                raise  # nats-py answers it (`RequestPath.overflowed`), unstamped
            # What `asyncio.Queue.put_nowait` does, less its test of the limit.
            queue._put(item)
            queue._unfinished_tasks += 1  # type: ignore[attr-defined]
            queue._finished.clear()  # type: ignore[attr-defined]
            queue._wakeup_next(queue._getters)  # type: ignore[attr-defined]
        at = clock()
        mark_received(item, at)
        if then is not None:
            then(item, at)

    queue.put_nowait = stamped  # type: ignore[method-assign]
    return sub


def mark_received(msg: Msg, at_s: float) -> None:
    setattr(msg, _RECEIVED, at_s)


def received_s(msg: Msg, default: float) -> float:
    """When `msg` was received (monotonic s); `default` for one not stamped."""
    at = getattr(msg, _RECEIVED, None)
    return at if isinstance(at, float) else default

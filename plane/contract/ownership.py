"""Who answers a placed request: whoever removes its slot message first.

A node answers what it finishes before the deadline: it acks (removing the message) and
replies. After the deadline, a node or a router that wants to answer must first *delete* the
message through the JetStream API, which says definitively whether it was still there. Only
the one whose delete succeeded answers; the broker serialises the two. So a lost done-event, a
router that lost its server, or a node that dies mid-request can never make two answers.
"""

from __future__ import annotations

import asyncio
import enum

from nats.js import JetStreamContext
from nats.js.errors import APIError

# A done-event's status when the node did not answer (it finished after the deadline, and
# the deadline owner answers): the slot is free, the request is not answered by the node.
NOT_ANSWERED = 0


def placement_id(stream: str, seq: int) -> str:
    """One placement of one request: unique, unlike caller request ids (reused by retries)."""
    return f"{stream}:{seq}"


# JetStream's "sequence N not found": the message is gone (acked, or deleted by the other side).
SEQUENCE_NOT_FOUND = 10043


class Take(enum.Enum):
    OWNED = "owned"  # we deleted it: we answer
    GONE = "gone"  # someone else removed it first: they answer
    UNKNOWN = "unknown"  # the broker could not tell us in time


async def take(js: JetStreamContext, stream: str, seq: int, *, within_s: float = 5.0,
               retry_s: float = 0.1) -> Take:
    """Try to delete message `seq` of `stream`; retry broker errors for up to `within_s`."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + within_s
    while True:
        try:
            return Take.OWNED if await js.delete_msg(stream, seq) else Take.GONE
        except APIError as exc:
            if exc.err_code == SEQUENCE_NOT_FOUND:
                return Take.GONE
        except Exception:  # timeouts, no leader, reconnecting: ask again
            pass
        if loop.time() + retry_s > give_up:
            return Take.UNKNOWN
        await asyncio.sleep(retry_s)

"""Who answers a placed request: whoever removes its slot message first.

A node answers what it finishes before the deadline: it acks (removing the message) and
replies. After the deadline, a node or a router that wants to answer must first *delete* the
message through the JetStream API, which says definitively whether it was still there. Only
the one whose delete succeeded answers; the broker serialises the two. So a lost done-event, a
router that lost its server, or a node that dies mid-request can never make two answers.
A message that neither removed (a restarted server's memory stream comes back empty) reads
as "the other's" to both: the router asks the node, which has its claim on record before it
answers, and answers only on its "no", recording the attempt as below.

When the broker cannot say (a cluster failing over: the router's publish got no PubAck and
the message is nowhere to be found, or a delete that keeps timing out), the router answers at
the deadline all the same (else nobody might), after asking the node, and remembers that
attempt (`attempt_id`). The message may still land later and reach a node: a node that takes
a message after its deadline first records the attempt, then asks the router that placed it
whether it already answered it (`Names.router_answered`), and answers only if not (or if
that router does not reply: it is gone). The router asks before it records, the node records
before it asks, so each sees the other's answer except within one turn of the router's loop.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import _V1_TOKEN_COUNT, Msg
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.errors import APIError

# A done-event's status when the node did not answer (it finished after the deadline, and
# the deadline owner answers): the slot is free, the request is not answered by the node.
NOT_ANSWERED = 0


def placement_id(stream: str, seq: int) -> str:
    """One placement of one request: unique, unlike caller request ids (reused by retries)."""
    return f"{stream}:{seq}"


def stream_sequence(msg: Msg) -> int:
    """The stream sequence of a JetStream message, read off its ack subject as nats-py's
    `msg.metadata.sequence.stream` reads it (both forms, with and without a domain), without
    the rest of its `Metadata`: a `datetime` and three dataclasses per message, ~4% of a
    node's CPU per request in py-spy's profile (docs/perf, thirty-first session)."""
    # nats-py's own split, and its own positions: `$JS.ACK.<stream>.<consumer>.<delivered>.
    # <sseq>...` (v1), or with the domain and account hash ahead of the stream (v2).
    tokens = Msg.Metadata._get_metadata_fields(msg.reply)  # raises NotJSMessageError
    return int(tokens[5] if len(tokens) == _V1_TOKEN_COUNT else tokens[Msg.Ack.StreamSeq])


def attempt_id(request_id: str, attempt: str) -> str:
    """One attempt of one request (`Plane-Attempt`), as its router knows it even when its
    publish's outcome is unknown and it has no stream sequence to name."""
    return f"{request_id}#{attempt}"


async def ask_answered(nc: Client, subject: str, asked: str, *, timeout_s: float,
                       within_s: float, gone: Callable[[], bool] | None = None,
                       instance: str = "",
                       nobody_is_gone: Callable[[], bool] | None = None) -> bool | None:
    """Ask the other side (a node's or a router's `answered` subject) whether it answered
    `asked` (a placement or an attempt id). Asked again while the question cannot get
    through (a server failing over). True: it says it did; False: it says it did not; None:
    it stayed silent, or unreachable, for `within_s`, or `gone()` says it is gone (its
    heartbeats lapsed), or the process that replied is not `instance` (the one it was
    placed with: a node restarted with the same id remembers nothing of its predecessor's
    answers, and its "no" would make a second answer), or the server says nobody listens on
    `subject` and `nobody_is_gone()` finds no reason to wait for the other side's return (a
    failover under way). Where the message is still ours to answer, silence means nobody
    else will (test it for truth: None is falsy); where it is gone, only a "no" does."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + within_s
    while True:
        try:
            reply = await nc.request(subject, asked.encode(), timeout=timeout_s)
            said, _, theirs = reply.data.partition(b" ")
            if instance and theirs and theirs.decode(errors="replace") != instance:
                return None
            return said == b"1"
        except NoRespondersError:
            if nobody_is_gone is not None and nobody_is_gone():
                return None
            if loop.time() >= give_up or (gone is not None and gone()):
                return None
            await asyncio.sleep(0.05)
        except Exception:
            if loop.time() >= give_up or (gone is not None and gone()):
                return None
            await asyncio.sleep(0.05)


async def reply_answered(nc: Client, msg: Msg, seen: Callable[[str], bool],
                         instance: str = "") -> None:
    """The other side of `ask_answered`: "1" when `seen(asked)`, else "0"; then, from a
    node, a space and its process's instance token (who says so)."""
    if msg.reply:
        asked = msg.data.decode(errors="replace")
        said = b"1" if seen(asked) else b"0"
        await nc.publish(msg.reply, f"{said.decode()} {instance}".encode() if instance else said)


# JetStream's "sequence N not found": the message is gone (acked, or deleted by the other side).
SEQUENCE_NOT_FOUND = 10043


class Take(enum.Enum):
    OWNED = "owned"  # we deleted it: we answer
    GONE = "gone"  # someone else removed it first: they answer
    UNKNOWN = "unknown"  # the broker could not tell us in time


# How long a take retries broker errors (a cluster electing a leader) before it says UNKNOWN.
TAKE_WITHIN_S = 5.0
# What a slot message outlives its end (deadline) by, in whole seconds (Nats-TTL's unit). The
# deadline owner's takeover starts at the deadline plus its grace, later when its loop stalls,
# and retries broker errors for TAKE_WITHIN_S: a message expired meanwhile reads as "taken by
# the other side" to both router and node, and nobody answers (one way a CI run could lose
# the request it lost seconds after a cluster lost a server, while JetStream's API was slow).
# A long margin costs only an orphan (its router and its node both gone, nobody to take it)
# holding its slot a little longer.
SLOT_TTL_MARGIN_S = 2 * int(TAKE_WITHIN_S)


def slot_ttl(end_ms: int) -> str:
    """The `Nats-TTL` of a slot message whose request (or stream) ends in `end_ms`."""
    return f"{math.ceil(end_ms / 1000) + SLOT_TTL_MARGIN_S}s"


async def take(js: JetStreamContext, stream: str, seq: int, *, within_s: float = TAKE_WITHIN_S,
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

"""The least a depth-one plane can cost: a relay through JetStream slots, with no decisions.

    .venv/bin/python benchmarks/depth_one_relay.py NATS_URL SUBJECT [--slots 1]
                                                   [--role both|relay|worker]

The plane's message flow and nothing else. The relay (a router with no admission, budgets,
promises, metrics or logs) takes a core request on SUBJECT, publishes it onto a free slot's
subject of a stream made as the plane makes its slot streams (WorkQueue, memory, one message
per subject, the second refused) with the caller's inbox in a header and a reply subject for
the PubAck, and counts the slot busy until its done-event; with no slot free it answers 429
at once. The worker (a node with no validation, accounting or health) holds one standing
pull per slot on a consumer with `max_ack_pending=1` (as `gpu_node/pull.py` does) and, for
each delivery, after `duration_us` of the JSON body (slept, not spun), acks, sends the
done-event and answers the caller, in the node's order (the done-events of the slots that
finished in one turn of its loop as one message, as a node sends them). So a request costs
what a plane request costs in messages: the request, a JetStream publish and its PubAck, a
delivery, an ack, a done-event (or its share of one) and the answer.

`both` runs the two on two connections of one process, as `plane up` does
(`plane_vs_floor.py`); `relay` and `worker` apart, as `plane router` and `plane node`
(`cpu_per_request.py --relay`, which starts the worker first: it makes the stream). Beside
the bare echo and the plane in one run, the plane's distance to the floor splits into what
its message flow costs and what its own code adds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
from collections import deque
from pathlib import Path

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the plane's constants

from plane.contract.subjects import Header
from plane.router.requests import BROKER_SETTLE_S  # the router's own waits

STREAM = "RELAY_SLOTS"
SLOTS = "relay.slot.*"
DONE = "relay.done"
CALLER = "Relay-Caller"  # the header that carries the caller's inbox
REFUSED = {Header.STATUS: "429", Header.REASON: "busy"}  # as the plane says it
UNAVAILABLE = {Header.STATUS: "503", Header.REASON: "unhealthy"}
GIVE_UP_TRIES = 300  # ~1 s of 3 ms waits


class _Work(msgspec.Struct):
    duration_us: int = 0


_work = msgspec.json.Decoder(_Work).decode


def slot_subject(k: int) -> str:
    return f"relay.slot.{k}"


async def relay(nc: Client, subject: str, slots: int) -> None:
    """Place each request on a free slot, or refuse it; a slot is free again on its done-event.

    The broker applies a worker's ack a moment after the done-event that follows it has
    reached the relay, so a publish onto a slot just freed can still be refused: sent again
    after the plane's own waits (`plane.router.requests.BROKER_SETTLE_S`)."""
    free = deque(range(slots))  # the longest free first: its ack has surely landed
    busy: set[int] = set()
    acks = nc.new_inbox()
    tokens = itertools.count()
    sent: dict[str, tuple[int, bytes, str, int]] = {}  # token -> slot, body, caller, tries

    async def place(k: int, data: bytes, caller: str, tries: int) -> None:
        token = str(next(tokens))
        sent[token] = (k, data, caller, tries)
        await nc.publish(slot_subject(k), data, reply=f"{acks}.{token}",
                         headers={CALLER: caller})

    async def on_request(msg: Msg) -> None:
        if not free:
            await nc.publish(msg.reply, b"no slot free", headers=REFUSED)
            return
        k = free.popleft()
        busy.add(k)
        await place(k, msg.data, msg.reply, 0)

    async def on_ack(msg: Msg) -> None:
        k, data, caller, tries = sent.pop(msg.subject[len(acks) + 1:])
        if b'"error"' not in msg.data:
            return
        if tries >= GIVE_UP_TRIES:  # (never seen: the broker applies an ack in ms)
            await nc.publish(caller, b"slot still held", headers=UNAVAILABLE)
            return
        asyncio.get_running_loop().call_later(
            BROKER_SETTLE_S[min(tries, len(BROKER_SETTLE_S) - 1)],
            lambda: asyncio.ensure_future(place(k, data, caller, tries + 1)))

    async def on_done(msg: Msg) -> None:
        for k in map(int, msg.data.split(b",")):  # one turn of the worker's loop
            if k in busy:
                busy.discard(k)
                free.append(k)

    await nc.subscribe(subject, cb=on_request)
    await nc.subscribe(f"{acks}.*", cb=on_ack)
    await nc.subscribe(DONE, cb=on_done)
    await nc.flush()


async def worker(nc: Client, slots: int) -> None:
    """Make the stream and one consumer per slot, and answer what each delivers."""
    js = nc.jetstream()
    with contextlib.suppress(Exception):
        await js.delete_stream(STREAM)  # an earlier run's, on a reused server
    await js.add_stream(StreamConfig(
        name=STREAM, subjects=[SLOTS], retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.MEMORY, max_msgs_per_subject=1, discard=DiscardPolicy.NEW,
        discard_new_per_subject=True))
    turn: list[tuple[Msg, int]] = []  # what finished in this turn of the loop
    sending: set[asyncio.Future[None]] = set()

    async def send_turn() -> None:
        """The turn's acks, its done-events as one message, then its answers: the node's
        order and batching (`gpu_node/done_batch.py`)."""
        done = turn[:]
        turn.clear()
        for msg, _ in done:
            await nc.publish(msg.reply, b"+ACK")
        await nc.publish(DONE, ",".join(str(k) for _, k in done).encode())
        for msg, _ in done:
            await nc.publish((msg.headers or {})[CALLER], msg.data)

    for k in range(slots):
        await js.add_consumer(STREAM, ConsumerConfig(
            durable_name=f"w{k}", filter_subject=slot_subject(k),
            ack_policy=AckPolicy.EXPLICIT, max_ack_pending=1, ack_wait=60, mem_storage=True))

        async def finish(msg: Msg, k: int = k) -> None:
            if not turn:  # the first of the turn: they go out once its other slots' are in
                sending.add(task := asyncio.ensure_future(send_turn()))
                task.add_done_callback(sending.discard)
            turn.append((msg, k))

        async def on_delivery(msg: Msg, finish=finish) -> None:  # type: ignore[no-untyped-def]
            if not msg.reply:  # a status (heartbeat): the standing pull outlives the run
                return
            us = _work(msg.data).duration_us
            if us:
                await asyncio.sleep(us / 1e6)
            await finish(msg)

        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=on_delivery)
        await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.w{k}",
                         json.dumps({"batch": 10**9, "expires": 3_600 * 10**9}).encode(),
                         reply=inbox)
    await nc.flush()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("url")
    ap.add_argument("subject")
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--role", choices=["both", "relay", "worker"], default="both")
    args = ap.parse_args()
    conns = []
    if args.role in ("both", "worker"):
        conns.append(nc := await nats.connect(args.url))
        await worker(nc, args.slots)
    if args.role in ("both", "relay"):
        conns.append(nc := await nats.connect(args.url, no_echo=True))
        await relay(nc, args.subject, args.slots)
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for nc in conns:
            await nc.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())

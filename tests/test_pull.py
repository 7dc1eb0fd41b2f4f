"""A slot's standing pull (gpu_node/pull.py) against a real nats-server: one pull request
delivers every message while it stands, is renewed before it expires, comes back after its
consumer was deleted and made again, and says on stop what it delivered that nobody took."""

from __future__ import annotations

import asyncio
import contextlib
import json

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

import gpu_node.pull as pull_module
from gpu_node.pull import StandingPull, _Delivered
from plane.contract.embedded import EmbeddedNats
from tests.plane_fixtures import listen, wait_until

STREAM, SUBJECT, CONSUMER = "PULLTEST", "pulltest.slot", "pulltest_slot"


async def _setup(nc: Client) -> None:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT]))
    await _consumer(nc)


async def _consumer(nc: Client) -> None:
    await nc.jetstream().add_consumer(STREAM, ConsumerConfig(
        durable_name=CONSUMER, filter_subject=SUBJECT, ack_policy=AckPolicy.EXPLICIT,
        max_ack_pending=1, ack_wait=30, max_waiting=4))


async def _started(nc: Client, *, expires_s: float = 30, setup: bool = True) -> StandingPull:
    """A standing pull on the test consumer (made first unless `setup` is False)."""
    if setup:
        await _setup(nc)
    pull = StandingPull(nc, STREAM, CONSUMER, expires_s=expires_s)
    await pull.start()
    return pull


async def _count_pull_requests(nc: Client) -> list[Msg]:
    return await listen(nc, f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{CONSUMER}")


async def _standing(nc: Client) -> None:
    """Until a pull stands at the consumer (the broker holds it, waiting)."""
    async def waiting() -> bool:
        return (await nc.jetstream().consumer_info(STREAM, CONSUMER)).num_waiting >= 1

    await wait_until(waiting, 5, "a pull to stand at the consumer")


async def _take(pull: StandingPull, n: int) -> list[bytes]:
    got = []
    for _ in range(n):
        msg = await asyncio.wait_for(pull.next(), 5)
        got.append(msg.data)
        await msg.ack()
    return got


async def test_one_pull_request_delivers_many_messages_one_at_a_time(nc: Client) -> None:
    await _setup(nc)
    requests = await _count_pull_requests(nc)
    pull = await _started(nc, setup=False)
    js = nc.jetstream()
    for i in range(50):
        await js.publish(SUBJECT, str(i).encode())
    assert await _take(pull, 50) == [str(i).encode() for i in range(50)]
    await nc.flush()
    assert len(requests) == 1  # fetch(1) would have made 50

    async def all_acked() -> bool:  # the broker takes acks in on its own time
        info = await js.consumer_info(STREAM, CONSUMER)
        return info.num_ack_pending == 0 and info.num_pending == 0

    await wait_until(all_acked, 5, "every message acked")
    assert await pull.stop() == 0


async def test_deliveries_are_taken_as_read_and_nothing_is_left_pending(nc: Client) -> None:
    """Messages reach the slot as nats-py reads them, not through the subscription's queue:
    the queue stays empty and nats-py's pending count at zero (left to grow, it would call
    the pull a slow consumer and drop deliveries), with deliveries and heartbeats alike."""
    pull = await _started(nc, expires_s=2)
    sub = pull._sub
    assert sub is not None
    js = nc.jetstream()
    for i in range(30):
        await js.publish(SUBJECT, b"x" * 1000 + str(i).encode())
        assert (await _take(pull, 1))[0].endswith(str(i).encode())
        assert sub._pending_queue.qsize() == 0 and sub._pending_size == 0
    heard = pull._heard_s
    await wait_until(lambda: pull._heard_s > heard, 5, "an idle heartbeat")  # status 100
    assert sub._pending_queue.qsize() == 0 and sub._pending_size == 0
    # Handed on within nats-py's own call, before any other task runs:
    sub._pending_size += 3  # as nats-py counts a message in before it queues it
    sub._pending_queue.put_nowait(Msg(_client=nc, subject=SUBJECT, data=b"abc"))
    assert pull.held == 1 and sub._pending_size == 0
    assert (await pull.next()).data == b"abc"
    await pull.stop()


async def test_the_pull_is_renewed_before_it_expires(nc: Client) -> None:
    await _setup(nc)
    requests = await _count_pull_requests(nc)
    pull = await _started(nc, expires_s=0.3, setup=False)
    await asyncio.sleep(1.0)  # three pulls' lifetimes
    await nc.flush()
    assert len(requests) >= 3
    await _standing(nc)  # still one standing, for what comes next
    await nc.jetstream().publish(SUBJECT, b"late")
    assert await _take(pull, 1) == [b"late"]
    assert pull.errors == 0
    await pull.stop()


async def test_a_consumer_deleted_and_made_again_is_pulled_again(nc: Client) -> None:
    await _setup(nc)
    reached: list[bool] = []
    pull = StandingPull(nc, STREAM, CONSUMER, expires_s=30, on_reach=reached.append)
    await pull.start()
    js = nc.jetstream()
    await _standing(nc)  # else the delete may come before the pull
    await js.delete_consumer(STREAM, CONSUMER)  # the broker ends the pull: 409
    await wait_until(lambda: pull.errors, 5, "the broker to end the pull")
    assert not pull.reaches and reached == [False]  # and the renewals find no consumer (503)
    await _consumer(nc)
    await js.publish(SUBJECT, b"after")
    assert await _take(pull, 1) == [b"after"]
    assert pull.errors == 0
    assert pull.reaches and reached == [False, True]
    await pull.stop()


async def test_stop_says_how_many_delivered_messages_nobody_took(nc: Client) -> None:
    pull = await _started(nc)
    await nc.jetstream().publish(SUBJECT, b"untaken")
    await wait_until(lambda: pull.held, 5, "the delivery")
    assert await pull.stop() == 1
    # Still on the subject, unacked: the slot answers it (Slot.sweep).
    assert (await nc.jetstream().get_last_msg(STREAM, SUBJECT)).data == b"untaken"


async def test_an_idle_pull_hears_the_brokers_heartbeats_and_stands(nc: Client) -> None:
    await _setup(nc)
    requests = await _count_pull_requests(nc)
    pull = StandingPull(nc, STREAM, CONSUMER, expires_s=30, heartbeat_s=0.1)
    await pull.start()
    await asyncio.sleep(1.0)  # ten heartbeats: none missed, nothing renewed
    await nc.flush()
    assert len(requests) == 1 and pull.silences == 0
    # A message taken and held unacked (a slot running a long request or stream): the
    # broker keeps beating for the pull, which stands for the next message.
    await nc.jetstream().publish(SUBJECT, b"long")
    held = await asyncio.wait_for(pull.next(), 5)
    await asyncio.sleep(1.0)
    assert len(requests) == 1 and pull.silences == 0
    await held.ack()
    await nc.jetstream().publish(SUBJECT, b"next")
    assert await _take(pull, 1) == [b"next"]
    await pull.stop()


async def test_a_pull_that_falls_silent_is_asked_again(nc: Client) -> None:
    """A pull the broker forgot without a word (its consumer's leader died with its server,
    in a cluster): played here by a relay in front of the JetStream API that sends the first
    pull on with a short expiry and a reply subject nobody reads, the later ones as they are."""
    await _setup(nc)
    relayed: list[Msg] = []

    async def relay(msg: Msg) -> None:
        relayed.append(msg)
        body, reply = msg.data, msg.reply
        if len(relayed) == 1:  # lost: its heartbeats go nowhere, and it ends at once
            body = json.dumps({**json.loads(body), "expires": 100_000_000}).encode()
            reply = nc.new_inbox()
        await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{CONSUMER}", body, reply=reply)

    await nc.subscribe(f"$JS.relay.API.CONSUMER.MSG.NEXT.{STREAM}.{CONSUMER}", cb=relay)
    told: list[int] = []
    pull = StandingPull(nc, STREAM, CONSUMER, expires_s=30, heartbeat_s=0.1,
                        api_prefix="$JS.relay.API", on_silent=lambda: told.append(1))
    await pull.start()
    # Renewed after 2.5 heartbeats of silence, not at 80% of its 30 s expiry.
    await wait_until(lambda: len(relayed) >= 2, 2, "the silent pull to be asked again")
    assert pull.silences >= 1 and len(told) == pull.silences  # the slot counts them
    await _standing(nc)
    await nc.jetstream().publish(SUBJECT, b"after")
    assert await _take(pull, 1) == [b"after"]
    await pull.stop()


async def test_a_pull_whose_connection_is_down_is_not_silent(
        nats_server: EmbeddedNats) -> None:
    """The server gone for a while (restarted, or dead): nothing can be asked and nothing
    stands, so the consumer takes no pulls (`reaches` False, the slot's health gauge 0); but
    the pull is not silent. Counted and logged on every pass while disconnected, it was 158
    `pull silent` lines in 10 s for two slots. Back, it is asked again and delivers."""
    async def quiet(exc: Exception) -> None:  # the refused reconnects: expected here
        pass

    nc = await nats.connect(nats_server.url, reconnect_time_wait=0.1,
                            max_reconnect_attempts=-1, error_cb=quiet)
    try:
        await _setup(nc)
        reached: list[bool] = []
        told: list[int] = []
        pull = StandingPull(nc, STREAM, CONSUMER, expires_s=30, heartbeat_s=0.1,
                            on_reach=reached.append, on_silent=lambda: told.append(1))
        await pull.start()
        await _standing(nc)
        await nats_server.stop(kill=True)
        await asyncio.sleep(1.0)  # four times the silence (2.5 beats of 0.1 s) and more
        assert pull.silences == 0 and told == []
        assert not pull.reaches and reached == [False]
        await nats_server.start()  # its port and store: the stream and consumer are back
        await wait_until(lambda: nc.is_connected, 10, "the reconnect")
        await wait_until(lambda: pull.reaches, 5, "the pull back in reach")
        await nc.jetstream().publish(SUBJECT, b"after")
        assert await _take(pull, 1) == [b"after"]
        assert pull.silences == 0 and reached == [False, True]
        await pull.stop()
    finally:
        await nc.close()


async def test_a_busy_pull_is_not_taken_for_silent(nc: Client) -> None:
    """A delivered message carries the slot's subject, not the pull's inbox, and the broker
    sends no heartbeats while it delivers: a busy slot whose pull counted only words on its
    inbox renewed it as silent every 2.5 heartbeats, for as long as it stayed busy."""
    await _setup(nc)
    requests = await _count_pull_requests(nc)
    pull = StandingPull(nc, STREAM, CONSUMER, expires_s=30, heartbeat_s=0.1)
    await pull.start()
    await _standing(nc)
    js = nc.jetstream()
    end = asyncio.get_running_loop().time() + 1.0  # ten heartbeats' time, busy throughout
    n = 0
    while asyncio.get_running_loop().time() < end:
        await js.publish(SUBJECT, str(n).encode())
        assert await _take(pull, 1) == [str(n).encode()]
        n += 1
    await nc.flush()
    assert pull.silences == 0 and len(requests) == 1, (pull.silences, len(requests), n)
    await pull.stop()


async def test_a_pull_whose_batch_is_spent_is_renewed(nc: Client,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull delivers at most its batch; the next is asked when it is spent, not at 80% of
    its expiry (here 24 s: the messages after the fifth would wait that long)."""
    monkeypatch.setattr(pull_module, "BATCH", 5)
    await _setup(nc)
    requests = await _count_pull_requests(nc)
    pull = await _started(nc, setup=False)
    js = nc.jetstream()
    for i in range(12):
        await js.publish(SUBJECT, str(i).encode())
    assert await _take(pull, 12) == [str(i).encode() for i in range(12)]
    await nc.flush()
    # Asked again on each fifth delivery, not after the spent pull fell silent.
    assert len(requests) == 3 and pull.silences == 0, (len(requests), pull.silences)
    await pull.stop()


async def test_a_503_just_after_a_leader_move_is_the_move_not_an_outage(nc: Client) -> None:
    """A step-down ends the consumer's pulls with 409 "Leadership Change"; asked again at
    once, the pull can reach the consumer before its new leader is up and hear 503. That is
    the move (the router's `keep_apart` makes them), not an error: asked again after a
    back-off, nothing counted. The slot is out of reach until the new leader answers all the
    same (routers must not place where nothing fetches), as after a 503 with no move."""
    answers: list[tuple[str, str] | None] = [("409", "Leadership Change"), ("503", ""), None]
    asked: list[Msg] = []
    reach: list[bool] = []
    api = "$JS.fake.API"

    async def fake_api(msg: Msg) -> None:  # statuses as the broker sends them, on the inbox
        asked.append(msg)
        if answers and (status := answers.pop(0)) is not None:
            await nc.publish(msg.reply, b"", headers={"Status": status[0],
                                                      "Description": status[1]})

    await nc.subscribe(f"{api}.CONSUMER.MSG.NEXT.{STREAM}.{CONSUMER}", cb=fake_api)
    pull = StandingPull(nc, STREAM, CONSUMER, expires_s=30, api_prefix=api,
                        on_reach=reach.append)
    await pull.start()
    await wait_until(lambda: len(asked) >= 3, 2, "the pull asked again after the 503")
    assert pull.errors == 0 and reach == [False]
    await pull.stop()
    reach.clear()

    answers[:] = [("503", ""), None]  # no move before it: the consumer is out of reach
    outage = StandingPull(nc, STREAM, CONSUMER, expires_s=30, api_prefix=api,
                          on_reach=reach.append)
    await outage.start()
    await wait_until(lambda: not outage.reaches, 2, "the slot out of reach")
    assert outage.errors == 1 and reach == [False]
    await outage.stop()


async def test_delivered_messages_reach_the_reader_in_order_and_a_cancelled_wait_loses_none(
) -> None:
    """The standing pull's hand-off to the slot (a deque and one future, in place of an
    asyncio.Queue): in order whether the reader waits or not, and a reader cancelled just as
    a message woke it leaves that message for the next read."""
    box = _Delivered()
    a, b, c = (Msg(_client=None, subject=f"m{i}") for i in range(3))  # type: ignore[arg-type]
    box.put(a)
    assert await box.get() is a and len(box) == 0
    reader = asyncio.create_task(box.get())
    await asyncio.sleep(0)  # the reader waits
    box.put(b)
    box.put(c)
    assert await reader is b and len(box) == 1
    assert await box.get() is c
    late = asyncio.create_task(box.get())
    await asyncio.sleep(0)
    box.put(a)  # wakes it ...
    late.cancel()  # ... and it is cancelled before it runs
    with contextlib.suppress(asyncio.CancelledError):
        await late
    assert late.cancelled() and len(box) == 1
    assert await box.get() is a

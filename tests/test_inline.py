"""`plane.contract.inline`: messages handed to their handler from nats-py's read loop, against
a real nats-server."""

from __future__ import annotations

import asyncio

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from plane.contract.embedded import EmbeddedNats
from plane.contract.inline import YIELD_EVERY, Inline
from tests.plane_fixtures import listen, wait_until


async def test_in_order_with_headers_beside_nats_pys_own_subscriptions(nc: Client) -> None:
    got: list[tuple[str, bytes, dict[str, str] | None]] = []
    inline = Inline.of(nc)
    assert Inline.of(nc) is inline  # one per connection
    await inline.subscribe("in.*", lambda m: got.append((m.subject, m.data, m.headers)))
    theirs = await listen(nc, "other")  # a plain nats-py subscription on the same connection

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe("echo", cb=echo)
    for i in range(100):
        await nc.publish(f"in.{i}", str(i).encode(), headers={"K": f"v{i}"} if i % 2 else None)
    await nc.publish("other", b"x")
    assert (await nc.request("echo", b"ping", timeout=5)).data == b"ping"
    await wait_until(lambda: len(got) == 100 and theirs, 5, "every message")
    assert [s for s, _, _ in got] == [f"in.{i}" for i in range(100)]
    assert [d for _, d, _ in got] == [str(i).encode() for i in range(100)]
    assert all(h == ({"K": f"v{i}"} if i % 2 else None) for i, (_, _, h) in enumerate(got))
    assert nc.stats["in_msgs"] >= 102


async def test_a_status_reaches_the_handler(nc: Client) -> None:
    """A request to a subject nobody listens on: the server's 503 (no responders), an inline
    status line, arrives as nats-py reads it."""
    got: list[Msg] = []
    inbox = nc.new_inbox()
    await Inline.of(nc).subscribe(f"{inbox}.*", got.append)
    await nc.publish("nobody.listens", b"", reply=f"{inbox}.1", headers={"A": "b"})
    await wait_until(lambda: got, 5, "the no-responders status")
    assert (got[0].headers or {}).get("Status") == "503"


async def test_a_coroutine_runs_at_once_and_one_that_waits_goes_on_in_a_task(nc: Client) -> None:
    order: list[str] = []
    release = asyncio.Event()
    inline = Inline.of(nc)

    async def handler(msg: Msg) -> None:
        order.append(f"start {msg.data.decode()}")
        if msg.data == b"waits":
            await release.wait()
        order.append(f"end {msg.data.decode()}")

    await inline.subscribe("co", handler)
    for body in (b"quick", b"waits", b"after"):
        await nc.publish("co", body)
    await wait_until(lambda: "end after" in order, 5, "the message after the waiting one")
    # The quick one ran to its end at once; the waiting one did not hold the next one up.
    assert order == ["start quick", "end quick", "start waits", "start after", "end after"]
    assert inline.carried_on == 1
    release.set()
    await wait_until(lambda: "end waits" in order, 5, "the waiting one's end")
    await wait_until(lambda: inline.carried_on == 0, 5, "its task to end")


async def test_no_task_is_current_before_the_first_suspension(nc: Client) -> None:
    """`asyncio.timeout` there would arm itself on nats-py's read loop (and cancel it): it
    fails instead, that handler alone, and the connection reads on."""
    seen: list[object] = []

    async def handler(msg: Msg) -> None:
        seen.append(asyncio.current_task())
        if msg.data == b"timeout":
            async with asyncio.timeout(1):
                await asyncio.sleep(0)
                seen.append("inside")

    await Inline.of(nc).subscribe("t", handler)
    await nc.publish("t", b"timeout")
    await nc.publish("t", b"next")
    await wait_until(lambda: len(seen) == 2, 5, "both messages")
    assert seen == [None, None]  # the timeout's body never ran
    assert (await nc.request("$JS.API.INFO", b"", timeout=5)).data  # the reader is alive


async def test_a_cancelled_handler_task_and_a_failing_handler(nc: Client) -> None:
    inline = Inline.of(nc)
    cancelled = asyncio.Event()
    got: list[bytes] = []

    async def waits_forever(msg: Msg) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def fails(msg: Msg) -> None:
        got.append(msg.data)
        raise ValueError("a bug in a handler")

    await inline.subscribe("forever", waits_forever)
    await inline.subscribe("fails", fails)
    await nc.publish("forever", b"")
    await nc.publish("fails", b"1")
    await nc.publish("fails", b"2")
    await wait_until(lambda: inline.carried_on == 1 and len(got) == 2, 5, "both handlers")
    await inline.aclose()
    assert cancelled.is_set() and inline.carried_on == 0


async def test_unsubscribed_then_nothing_and_a_burst_lets_the_loop_turn(nc: Client) -> None:
    got: list[bytes] = []
    turns = 0
    sub = await Inline.of(nc).subscribe("burst", lambda m: got.append(m.data))

    async def ticker() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    tick = asyncio.create_task(ticker())
    n = YIELD_EVERY * 40
    for i in range(n):
        await nc.publish("burst", b"%d" % i)
    await wait_until(lambda: len(got) == n, 10, "the burst")
    tick.cancel()
    assert turns > 1  # the loop turned while the burst was being handled
    await sub.unsubscribe()
    await nc.publish("burst", b"late")
    await nc.flush()
    await asyncio.sleep(0.1)
    assert len(got) == n


async def test_it_delivers_on_after_the_server_restarts() -> None:
    async with EmbeddedNats() as srv:
        nc = await nats.connect(srv.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
        try:
            got: list[bytes] = []
            await Inline.of(nc).subscribe("r", lambda m: got.append(m.data))
            await nc.publish("r", b"before")
            await wait_until(lambda: got == [b"before"], 5, "the first message")
            await srv.restart()
            await wait_until(lambda: nc.is_connected, 10, "the reconnect")
            # Re-subscribed by nats-py; published until one comes (the SUB races our PUB).
            for _ in range(100):
                await nc.publish("r", b"after")
                await nc.flush()
                if b"after" in got:
                    break
                await asyncio.sleep(0.05)
            assert got[0] == b"before" and b"after" in got
        finally:
            await nc.close()

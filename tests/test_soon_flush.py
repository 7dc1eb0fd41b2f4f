"""Writing a connection's buffer at the end of the loop's turn (plane/contract/soon_flush.py),
against a real nats-server: a turn's publishes, nats-py's own and the plane's, arrive in the
order they were made, in one write; a server that stops reading gets its back-pressure from
nats-py's flusher again, and loses nothing; a reconnect's buffer is sent as nats-py sends it;
and every connection the plane makes has it."""

from __future__ import annotations

import asyncio
import os
import signal

import nats
from nats.aio.msg import Msg

from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats
from plane.contract.natsconn import close, connect
from plane.contract.publish import append, command, publish
from plane.contract.soon_flush import SoonFlush, use_soon_flush
from tests.plane_fixtures import listen, wait_until


async def test_a_turns_publishes_arrive_in_order_in_one_write(nats_server: EmbeddedNats) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        soon = use_soon_flush(nc)
        assert use_soon_flush(nc) is soon  # installed once
        got = await listen(nc, "soon.order")
        await asyncio.sleep(0.05)  # the subscription's own write is behind us
        writes = soon.writes
        for i in range(30):  # one turn of the loop: no await that yields in between
            if i % 2:
                await nc.publish("soon.order", str(i).encode())
            else:
                await publish(nc, "soon.order", str(i).encode(), {"Plane-Request-Id": f"r-{i}"})
        await wait_until(lambda: len(got) >= 30, 5, "30 messages")
        assert [int(m.data) for m in got] == list(range(30))
        assert [m.headers for m in got[::2]] == [{"Plane-Request-Id": f"r-{i}"}
                                                  for i in range(0, 30, 2)]
        assert soon.writes == writes + 1
        assert soon.handed_back == 0
    finally:
        await nc.close()


async def test_a_server_that_stops_reading_gets_nats_py_back_pressure_and_loses_nothing(
        ) -> None:
    async with EmbeddedNats() as srv:
        reader = await nats.connect(srv.url)
        writer = await nats.connect(srv.url)
        try:
            soon = use_soon_flush(writer)
            got = await listen(reader, "soon.full")
            body = b"x" * 60_000
            assert srv.pid is not None
            os.kill(srv.pid, signal.SIGSTOP)  # the socket's buffers fill; then ours

            async def flood() -> None:  # ~18 MB: more than loopback's buffers hold
                for i in range(300):
                    # (past nats-py's pending limit a publish waits for its flusher, as ever)
                    await writer.publish("soon.full", body + str(i).encode())
                    await asyncio.sleep(0)

            flooding = asyncio.create_task(flood())
            try:
                await wait_until(lambda: soon.handed_back > 0, 20, "a turn handed back")
            finally:
                os.kill(srv.pid, signal.SIGCONT)
            await asyncio.wait_for(flooding, 30)
            await wait_until(lambda: len(got) >= 300, 30, "all 300 messages")
            assert [int(m.data[60_000:]) for m in got] == list(range(300))
        finally:
            await writer.close()
            await reader.close()


async def test_published_while_reconnecting_arrives_after_the_reconnect() -> None:
    async with EmbeddedNats() as srv:
        nc = await nats.connect(srv.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
        use_soon_flush(nc)
        try:
            got = await listen(nc, "soon.later")
            await srv.stop()
            await wait_until(lambda: not nc.is_connected, 5, "the client to see the loss")
            await publish(nc, "soon.later", b"kept", {"Plane-Request-Id": "r-1"})
            await srv.start()
            await wait_until(lambda: len(got) >= 1, 10, "the buffered message")
            await publish(nc, "soon.later", b"after", {"Plane-Request-Id": "r-2"})
            await wait_until(lambda: len(got) >= 2, 5, "the message after the reconnect")
            assert [m.data for m in got] == [b"kept", b"after"]
        finally:
            await nc.close()


async def test_before_write_hooks_add_to_the_turns_one_write_and_one_that_raises_stops_none(
        nats_server: EmbeddedNats) -> None:
    nc = await nats.connect(nats_server.url)
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    try:
        soon = use_soon_flush(nc)
        got = await listen(nc, "soon.hook")
        await asyncio.sleep(0.05)
        writes = soon.writes

        def broken() -> None:
            raise RuntimeError("a hook's bug")

        await nc.publish("soon.hook", b"first")
        soon.before_write(broken)
        soon.before_write(lambda: append(nc, command(nc, "soon.hook", b"hooked", None)))
        await nc.publish("soon.hook", b"second")  # made after the hooks, written before them
        await wait_until(lambda: len(got) >= 3, 5, "3 messages")
        assert [m.data for m in got] == [b"first", b"second", b"hooked"]
        assert soon.writes == writes + 1
        assert [str(r["exception"]) for r in reported] == ["a hook's bug"]
    finally:
        loop.set_exception_handler(None)
        await nc.close()


async def test_every_connection_the_plane_makes_has_it(nats_server: EmbeddedNats) -> None:
    nc = await connect(ConnectOptions(url=nats_server.url, name="soon-test"))
    try:
        assert isinstance(getattr(nc._flush_pending, "__self__", None), SoonFlush)
        assert await nc.request("$JS.API.INFO", b"", timeout=5)  # a round trip through it
    finally:
        await close(nc)



async def test_a_router_or_node_on_a_connection_of_the_callers_own_gets_it(
        nats_server: EmbeddedNats) -> None:
    """Their `start` ends with a flush that must be a barrier for the subscriptions made
    before it: a router started on a plain `nats.connect()` connection now and then answered
    the first request sent after its start with no responders (CI, test_abuse_router)."""
    from gpu_node.node import Node
    from plane.contract.config import NodeConfig, RouterConfig
    from plane.router import Router

    nc = await nats.connect(nats_server.url)
    try:
        assert not isinstance(getattr(nc._flush_pending, "__self__", None), SoonFlush)
        Router(nc, RouterConfig(router_id="router-own-nc"))
        assert isinstance(getattr(nc._flush_pending, "__self__", None), SoonFlush)
    finally:
        await nc.close()
    nc = await nats.connect(nats_server.url)
    try:
        Node(nc, NodeConfig(node_id="node-own-nc", model="calibrated", slots=1, backend="torch"))
        assert isinstance(getattr(nc._flush_pending, "__self__", None), SoonFlush)
    finally:
        await nc.close()

async def test_published_just_before_a_drain_arrives(nats_server: EmbeddedNats) -> None:
    nc = await nats.connect(nats_server.url)
    use_soon_flush(nc)
    other = await nats.connect(nats_server.url)
    try:
        got = await listen(other, "soon.drained")
        await publish(nc, "soon.drained", b"last words", {"Plane-Request-Id": "r-9"})
        await nc.drain()  # in the same turn: the end-of-turn write finds the drain begun
        await wait_until(lambda: len(got) >= 1, 5, "the message published before the drain")
        assert got[0].data == b"last words"
    finally:
        await other.close()


async def test_a_flush_returns_once_the_server_has_what_was_made_before_it(
        nats_server: EmbeddedNats) -> None:
    """`flush()` on a plane connection is a barrier: a SUB made just before it is on the
    server when it returns, so a message another connection publishes right after arrives.
    nats-py writes flush()'s PING ahead of its buffer: with its own PING, this loop (the
    drain test's steps, the receiver flushed once) missed 1 to 4 messages in 300."""
    for i in range(300):
        sender = await nats.connect(nats_server.url)
        use_soon_flush(sender)
        receiver = await nats.connect(nats_server.url)
        use_soon_flush(receiver)
        try:
            got: list[bytes] = []

            async def keep(msg: Msg, got: list[bytes] = got) -> None:
                got.append(msg.data)

            await receiver.subscribe(f"soon.barrier.{i}", cb=keep)
            await receiver.flush()  # once: the barrier under test
            await publish(sender, f"soon.barrier.{i}", b"right after", {"Plane-Request-Id": "r"})
            await sender.drain()
            await wait_until(lambda got=got: bool(got), 2, f"message {i} after the flush")
        finally:
            await receiver.close()
            if not sender.is_closed:
                await sender.close()

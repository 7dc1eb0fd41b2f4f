"""A drain (a subscription's, a connection's) whose server goes away under it ends at once,
and quietly: its PONGs can never come (`plane.contract.lost_pings`)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats
from plane.contract.natsconn import close, connect

# Far below nats-py's waits that it cut short: a flush's 10 s, a drain's 5 s (ours).
PROMPT_S = 2.0


async def _ignore(msg: Msg) -> None:
    pass


@pytest.fixture
async def dying() -> AsyncIterator[tuple[Client, Callable[[], Awaitable[None]]]]:
    """A connection (`natsconn.connect`) with subscriptions, and how to kill its server
    while a drain waits on it: frozen first (SIGSTOP), so that no PONG can come before it
    dies, then killed."""
    server = EmbeddedNats()
    await server.start()
    nc = await connect(ConnectOptions(url=server.url, name="dying"))
    for i in range(3):
        await nc.subscribe(f"t.{i}", cb=_ignore)
    await nc.flush()
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)

    async def kill() -> None:
        await asyncio.sleep(0.3)  # the drain has sent its PINGs and waits
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)

    try:
        yield nc, kill
    finally:
        await close(nc)
        await server.close()


def _unretrieved() -> list[dict[str, Any]]:
    """What asyncio reports as never retrieved from now on (call `gc.collect()` first)."""
    seen: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    return seen


async def test_a_connection_whose_server_dies_while_it_drains_closes_at_once(
        dying: tuple[Client, Callable[[], Awaitable[None]]]) -> None:
    # A SIGKILLed `plane up`: its router's process drained while its nats-server went away
    # with it; the drain waited out its 5 s and left asyncio's "_GatheringFuture exception
    # was never retrieved" traceback (found from outside).
    nc, kill = dying
    reported = _unretrieved()
    killing = asyncio.create_task(kill())
    t0 = time.monotonic()
    await close(nc)
    took_s = time.monotonic() - t0
    await killing
    gc.collect()
    await asyncio.sleep(0)
    assert nc.is_closed
    assert took_s < 0.3 + PROMPT_S, f"close took {took_s:.2f} s"
    assert reported == [], reported


async def test_a_subscription_whose_server_dies_while_it_drains_fails_at_once(
        dying: tuple[Client, Callable[[], Awaitable[None]]]) -> None:
    # A router's request subscriptions, drained at its stop: each waited 10 s (nats-py's
    # flush timeout) for a PONG that could not come.
    nc, kill = dying
    sub = await nc.subscribe("t.request", cb=_ignore)
    killing = asyncio.create_task(kill())
    t0 = time.monotonic()
    with pytest.raises(nats.errors.FlushTimeoutError):
        await sub.drain()
    took_s = time.monotonic() - t0
    await killing
    assert took_s < 0.3 + PROMPT_S, f"the drain took {took_s:.2f} s"


async def test_a_drain_cut_short_by_its_timeout_leaves_no_traceback(
        dying: tuple[Client, Callable[[], Awaitable[None]]]) -> None:
    # A server that stays silent (frozen, a stalled host): the drain ends at its timeout.
    # Cancelled from outside, nats-py's drain swallowed the cancellation and left its
    # gather's CancelledError for asyncio to log as a traceback.
    nc, _ = dying
    reported = _unretrieved()
    t0 = time.monotonic()
    await close(nc, timeout_s=0.5)
    took_s = time.monotonic() - t0
    gc.collect()
    await asyncio.sleep(0)
    assert nc.is_closed
    assert took_s < 0.5 + PROMPT_S + 1.0, f"close took {took_s:.2f} s"
    assert reported == [], reported


def test_a_connection_closed_as_its_reconnect_begins_leaves_no_reconnect_running() -> None:
    # A stop that closes its connection right after it lost its server (its drains fail at
    # once now): nats-py's close cancelled the reconnect once, Python 3.11's `wait_for`
    # lost that cancellation as the first connect attempt was refused, and the reconnect went
    # on for ever: the event loop's end (`asyncio.run`) waited for it, and the process never
    # exited. Here the loop stops between the drain and the close, as a test's fixture's
    # tear-down and a command's last step do: the refusal is in by then.
    runner = asyncio.Runner()
    loop = runner.get_loop()
    server = EmbeddedNats()
    try:
        nc = loop.run_until_complete(_connected(server))
        loop.run_until_complete(_drained_as_the_server_dies(nc, server))
        loop.run_until_complete(close(nc))
        loop.run_until_complete(asyncio.sleep(0.3))  # what close cancelled ends meanwhile
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        assert left == [], left
    finally:
        loop.run_until_complete(server.close())
        if not [t for t in asyncio.all_tasks(loop) if not t.done()]:
            runner.close()  # (else it would wait for ever: the failure above says why)


async def _connected(server: EmbeddedNats) -> Client:
    await server.start()
    nc = await connect(ConnectOptions(url=server.url, name="closing"))
    await nc.subscribe("t.request", cb=_ignore)
    await nc.flush()
    return nc


async def _drained_as_the_server_dies(nc: Client, server: EmbeddedNats) -> None:
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    [sub] = nc._subs.values()
    killing = asyncio.create_task(_kill_soon(server.pid))
    with pytest.raises(nats.errors.FlushTimeoutError):
        await sub.drain()
    await killing


async def _kill_soon(pid: int) -> None:
    await asyncio.sleep(0.3)
    os.kill(pid, signal.SIGKILL)

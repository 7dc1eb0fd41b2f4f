"""Factories for whole planes on a real nats-server, shared by the end-to-end tests."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from plane.contract.config import ConnectOptions
from plane.contract.messages import FaultCommand, json_encoder
from plane.contract.subjects import Header, Names
from plane.stack import PlaneStack, StackConfig

NAMES = Names()
RISK_BODY = json.dumps({"features": [0.01 * i for i in range(32)]}).encode()


def calibrated(us: int) -> bytes:
    return json.dumps({"duration_us": us}).encode()


@asynccontextmanager
async def plane(url: str | None = None, **kw: Any) -> AsyncIterator[PlaneStack]:
    cfg = StackConfig(connect=ConnectOptions(url=url), **kw)
    async with PlaneStack(cfg) as stack:
        yield stack


@asynccontextmanager
async def client(url: str) -> AsyncIterator[Client]:
    nc = await nats.connect(url)
    try:
        yield nc
    finally:
        await nc.close()


def status(msg: Msg) -> int:
    return int((msg.headers or {})[Header.STATUS])


def header(msg: Msg, name: str) -> str | None:
    return (msg.headers or {}).get(name)


def where(msgs: list[Msg], pred: Callable[[Msg], bool]) -> list[Msg]:
    return [m for m in msgs if pred(m)]


def slots_running(stack: PlaneStack) -> int:
    """How many slots, over all the stack's nodes, are running a request right now."""
    return sum(1 for node in stack.nodes for s in node.slots if s.current is not None)


async def wait_until(pred: Callable[[], object], timeout_s: float, what: str) -> float:
    """Poll `pred` until it holds, or fail naming `what` (no fixed sleeps on a loaded box).

    `pred` may be a coroutine function (it is awaited each time: a broker query). Returns the
    seconds it took, for a test that also bounds how long the state took to come."""
    t0 = time.monotonic()
    while True:
        held = pred()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


async def slow_steps(nc: Client, extra_us: int, node: str = "node0-tinylm", k: int = 0) -> None:
    """Every request (every token step, for a generation) of slot k of `node` takes
    `extra_us` more; 0: back to normal. The node must run with `allow_faults`."""
    cmd = FaultCommand(k=k, mode="slow" if extra_us else "none", extra_us=extra_us)
    assert (await nc.request(NAMES.fault(node), json_encoder.encode(cmd), timeout=5)).data == b"ok"


async def listen(nc: Client, subject: str) -> list[Msg]:
    """Every message on `subject` from now on (a real subscription on the plane's server)."""
    seen: list[Msg] = []

    async def keep(msg: Msg) -> None:
        seen.append(msg)

    await nc.subscribe(subject, cb=keep)
    # Twice: a plain nats-py connection writes flush()'s PING ahead of the SUB still in its
    # buffer, so the first PONG can come before the server has the SUB; the second PING goes
    # out after it. (The plane's own connections keep the order: plane.contract.soon_flush.)
    await nc.flush()
    await nc.flush()
    return seen

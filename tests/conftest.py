"""Shared fixtures: every test gets its own real nats-server on a free loopback port, stopped
by PID afterwards. Fixtures are factories that clean up after themselves."""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET when it is imported (its own library is decorated then), so it
# must be set before anything imports triton: the `interpret` backend's tests run in-process.
# On a CPU machine the `auto` backend is torch either way.
os.environ.setdefault("TRITON_INTERPRET", "1")


import random
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from plane.contract.embedded import EmbeddedNats
from plane.contract.replies import ok_headers
from plane.contract.subjects import Header, Names


def pytest_report_header() -> str:
    return f"seed: {_seed()} (set PLANE_TEST_SEED to repeat)"


def _seed() -> int:
    return int(os.environ.get("PLANE_TEST_SEED", "20261129"))


@pytest.fixture(autouse=True)
def _structlog_config() -> Iterator[None]:
    """A command run in-process (click's CliRunner) configures structlog for the whole
    process: put back what was there, so that no test logs through another's set-up."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture
def rng() -> random.Random:
    """A seeded random source; the seed is printed in the report header."""
    return random.Random(_seed())


@pytest.fixture
async def nats_server() -> AsyncIterator[EmbeddedNats]:
    async with EmbeddedNats() as srv:
        yield srv


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()


@pytest.fixture
async def seen(nc: Client) -> AsyncIterator[list[dict[str, str]]]:
    """A stand-in router on `plane.infer.>` that answers 200 and records each request's
    headers (what a caller of the plane actually sent)."""
    headers: list[dict[str, str]] = []

    async def answer(msg: Msg) -> None:
        h = dict(msg.headers or {})
        headers.append(h)
        await nc.publish(msg.reply, b'{"duration_us": 1}',
                         headers=ok_headers(h.get(Header.REQUEST_ID, "x"), "n1", 0, 1))

    sub = await nc.subscribe(Names().infer_all(), cb=answer)
    await nc.flush()  # the server has the subscription before anyone calls
    yield headers
    await sub.unsubscribe()

"""Shared fixtures: every test gets its own real nats-server on a free loopback port, stopped
by PID afterwards. Fixtures are factories that clean up after themselves."""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client

from plane.embedded import EmbeddedNats


def pytest_report_header() -> str:
    return f"seed: {_seed()} (set PLANE_TEST_SEED to repeat)"


def _seed() -> int:
    return int(os.environ.get("PLANE_TEST_SEED", "20261129"))


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

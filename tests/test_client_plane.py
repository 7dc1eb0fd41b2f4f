"""The SDK against a real plane (router + node + nats-server in process)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from plane.client import Client, SyncClient
from plane.contract.backoff import NO_RETRY, RetryPolicy
from plane.contract.errors import BadRequest, Rejected
from plane.stack import PlaneStack, StackConfig


@pytest.fixture
async def stack() -> AsyncIterator[PlaneStack]:
    async with PlaneStack(StackConfig(models=("calibrated",), slots=2)) as s:
        yield s


async def test_invoke_reports_where_and_how_long(stack: PlaneStack) -> None:
    async with Client.connect(stack.url) as plane:
        r = await plane.invoke("calibrated", {"duration_us": 3000}, deadline_ms=500)
    assert r.json() == {"duration_us": 3000}
    assert r.attempts == 1 and r.node and r.slot in (0, 1)
    assert r.service_us is not None and r.service_us >= 3000
    with pytest.raises(BadRequest):
        async with Client.connect(stack.url) as plane:
            await plane.invoke("calibrated", {"duration_us": -1}, deadline_ms=500)


async def test_refusals_are_typed_then_retried(stack: PlaneStack) -> None:
    """Six 30 ms calls on two slots: without retries the excess is Rejected at once with a
    Retry-After; with retries (tickets sent back) they get in within the deadline."""
    body = {"duration_us": 30_000}
    async with Client.connect(stack.url) as plane:
        answers = await asyncio.gather(
            *(plane.invoke("calibrated", body, deadline_ms=1000, policy=NO_RETRY)
              for _ in range(6)), return_exceptions=True)
        refused = [a for a in answers if isinstance(a, Rejected)]
        assert refused and all(a.retry_after_ms >= 1 and a.attempts == 1 for a in refused)
        await asyncio.sleep(0.3)  # let the promises made above lapse
        retried = await asyncio.gather(
            *(plane.call("calibrated", body, deadline_ms=2000,
                         policy=RetryPolicy(max_attempts=8)) for _ in range(4)))
    assert any(r.attempts > 1 for r in retried)
    assert sum(r.ok for r in retried) >= 3, [r.statuses for r in retried]


async def test_sync_client_against_the_plane(stack: PlaneStack) -> None:
    def blocking() -> int | None:
        with SyncClient(stack.url) as plane:
            return plane.invoke("calibrated", {"duration_us": 1000}, deadline_ms=500).service_us

    service_us = await asyncio.to_thread(blocking)
    assert service_us is not None and service_us >= 1000

"""`Plane-Wait-Ms`: a caller that will not retry a 429 says how long it waits for its start.
A burst larger than the slots, sent at once (a Kafka consumer's batch, `hey -q`'s workers),
is refused but for one request a slot without it, and started within the wait with it; a
start past the wait is still refused at once. Real nats-server, router and node; plain NATS
requests, as any language sends them."""

from __future__ import annotations

import asyncio

import nats
import pytest

from plane.client import Client
from plane.contract.backoff import NO_RETRY
from plane.contract.errors import ConfigError
from plane.contract.subjects import Header
from tests.ledger import Ledger
from tests.plane_fixtures import NAMES, calibrated, plane

pytestmark = pytest.mark.slow

WORK_US = 30_000  # long beside this host's noise: each start is 30 ms after the one before


async def burst(nc: nats.NATS, n: int, headers: dict[str, str]) -> Ledger:
    ledger = await Ledger(nc).start()
    for _ in range(n):
        await ledger.send(NAMES.infer("calibrated"), calibrated(WORK_US), 5000, headers)
    await nc.flush()
    await ledger.settle(10)
    assert ledger.unanswered() == [] and ledger.answered_twice() == []
    return ledger


async def test_a_burst_that_says_how_long_it_waits_is_started_within_the_wait() -> None:
    async with plane(models=("calibrated",), slots=2, backend="torch") as stack:
        nc = await nats.connect(stack.url)
        try:
            # Warm the slots' cycle estimate, one request at a time.
            for _ in range(4):
                await burst(nc, 1, {})
            # Eight at once on two slots of 30 ms, no wait said: two run, the rest get 429s
            # (with a ticket and Retry-After: a caller that retries is told when).
            refused = await burst(nc, 8, {})
            assert refused.statuses()[200] <= 4 and refused.statuses()[429] >= 4, (
                refused.statuses())
            # The same with a wait of 1 s: each waits for its start (four deep a slot).
            waited = await burst(nc, 8, {Header.WAIT_MS: "1000"})
            assert waited.statuses() == {200: 8}, waited.statuses()
            took_ms = sorted(waited.latency_ms(i) for i in waited.answers)
            # They ran one after another on each slot: the last one's answer came about four
            # works after the burst, not with the first.
            assert took_ms[-1] >= 3 * WORK_US / 1000, took_ms
            # A wait shorter than the starts ahead: those past it are refused at once (well
            # before their start would have come), not kept.
            short = await burst(nc, 8, {Header.WAIT_MS: "40"})
            statuses = short.statuses()
            assert statuses[200] >= 2 and statuses[429] >= 2, statuses
            refused_ms = [short.latency_ms(i) for i in short.answers if short.status(i) == 429]
            assert max(refused_ms) < 3 * WORK_US / 1000, refused_ms
        finally:
            await nc.close()


async def test_the_sdk_says_how_long_it_waits_for_its_start() -> None:
    """`Client.call(..., start_wait_ms=)` sends `Plane-Wait-Ms`: six calls at once on two
    slots of 30 ms from a caller that never retries are all started within a wait of 1 s,
    where without it some are refused; a wait out of range is the caller's error, raised
    before anything is sent."""
    async with plane(models=("calibrated",), slots=2, backend="torch") as stack, \
            Client.connect(stack.url) as c:
        body = calibrated(WORK_US)
        for _ in range(4):  # the slots' cycle estimate, one request at a time
            await c.call("calibrated", body, deadline_ms=5000)

        async def six(**kw: int) -> list[int]:
            results = await asyncio.gather(*(c.call("calibrated", body, deadline_ms=5000,
                                                    policy=NO_RETRY, **kw) for _ in range(6)))
            return [r.status for r in results]

        assert await six(start_wait_ms=1000) == [200] * 6
        # (Then without: the refused are promised slot time that the next burst, sent at
        # once, would wait behind.)
        assert (await six()).count(429) >= 2
        with pytest.raises(ConfigError, match="start_wait_ms"):
            await c.call("calibrated", body, start_wait_ms=0)

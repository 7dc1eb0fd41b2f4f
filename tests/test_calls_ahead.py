"""A ticket holder on call is called a trip ahead of its slot's predicted end
(`plane.router.calls`), on a real plane: it starts as the work ahead ends, without a second
call when the slot frees, and long before the late fallback it was told."""

from __future__ import annotations

import asyncio
import time

from plane.client import Client
from tests.plane_fixtures import plane, slots_running, wait_until

WORK_US = 300_000  # long beside a call's trip (on call: at most a tenth of the work)


async def test_a_holder_on_call_starts_as_the_work_ahead_ends() -> None:
    async with plane(models=("calibrated",), slots=1) as stack, \
            Client.connect(stack.url) as sdk:
        router = stack.routers[0]
        first_end_s = 0.0

        async def first_call() -> int:
            nonlocal first_end_s
            r = await sdk.invoke("calibrated", {"duration_us": WORK_US}, deadline_ms=5000)
            first_end_s = time.monotonic()
            return r.statuses[-1]

        first = asyncio.create_task(first_call())
        await wait_until(lambda: slots_running(stack) == 1, 5.0, "the first request to run")
        second = await sdk.invoke("calibrated", {"duration_us": WORK_US}, deadline_ms=5000)
        ended_s = time.monotonic()
        assert await first == 200
        stats = router.admission.stats
        assert second.statuses == (429, 200), second
        # Told a late fallback (the work ahead's end plus as long again: ~600 ms), it came
        # when called, a trip before the slot freed, and its work ran right after.
        assert stats["holder-called-ahead"] == 1 and stats["holder-called"] == 0, stats
        assert second.waited_ms < 450, second
        # Its work ran right after the first's (one work's time, plus trips on a loaded host).
        assert ended_s - first_end_s < WORK_US / 1e6 + 0.15, (ended_s - first_end_s)

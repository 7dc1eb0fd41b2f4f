"""A ticket holder on call is called a trip ahead of its slot's predicted end
(`plane.router.calls`): on a real plane it starts as the work ahead ends, without a second
call when the slot frees, and long before the late fallback it was told; and a slot whose
free a holder already here will take calls nobody ahead."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from plane.client import Client
from plane.contract.budget import Prediction
from plane.contract.messages import NodeAdvert, SlotAdvert
from plane.contract.subjects import Names
from plane.router.admission import Admission, Ask, Refuse
from plane.router.calls import Calls
from plane.router.occupancy import ModelSlots
from plane.router.parking import ParkingLot
from tests.plane_fixtures import plane, slots_running, wait_until

NAMES = Names()
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


async def test_a_slot_whose_free_a_parked_holder_takes_calls_nobody_ahead() -> None:
    """Two slots about to free, three holders on call, the first already here (parked): the
    first free is its, so only one holder is called ahead, for the second; calling one for
    each end left a holder more waiting than slots freeing for as long as the load lasted."""
    ms = ModelSlots(model="calibrated")
    ms.apply_advert(NodeAdvert(node="n", model="calibrated", backend="torch", at_ms=0, slots=[
        SlotAdvert(k=k, subject=NAMES.slot("calibrated", "n", k), healthy=True)
        for k in range(2)]), NAMES, 0.0)
    adm = Admission("r")
    now = time.monotonic()
    long = Prediction(p50_us=100_000, p99_us=150_000)
    for i, view in enumerate(ms.slots.values()):
        view.occupy(now, f"ours{i}", 0.010, 0.015)
    for i in range(3):
        refused = adm.decide(ms, Ask(now_s=now, deadline_s=now + 5, prediction=long,
                                     wake=f"_INBOX.h{i}"))
        assert isinstance(refused, Refuse) and refused.ahead
    here, first, second = ms.promises
    here.parked = True  # its holder came early and waits for a slot
    for i, view in enumerate(ms.slots.values()):  # both end within a call's trip
        view.occupy(now, f"ours{i}", 0.0005 + i * 0.0005, 0.005)
    spawned: list[Coroutine[Any, Any, None]] = []

    def spawn(coro: Coroutine[Any, Any, None]) -> None:
        spawned.append(coro)
        coro.close()  # not sent: no server here, the call itself is the SDK test's

    async def tell() -> None:
        return None

    calls = Calls(nc=None, admission=adm, parking=ParkingLot(), tell=tell,  # type: ignore[arg-type]
                  spawn=spawn)
    calls._fire_now(ms)
    assert len(spawned) == 1 and first.called_s and not second.called_s
    assert adm.stats["holder-called-ahead"] == 1
    calls.close()

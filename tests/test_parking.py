"""The parking lot: a freed slot wakes the holder due first, one holder per freed slot."""

import asyncio

from plane.router.parking import ParkingLot


async def test_wakes_the_holder_due_first_one_at_a_time() -> None:
    lot = ParkingLot()
    loop = asyncio.get_running_loop()
    order: list[str] = []

    async def holder(name: str, due_s: float) -> None:
        if await lot.wait("m", due_s, loop.time() + 5.0):
            order.append(name)

    tasks = [asyncio.create_task(holder(n, d)) for n, d in (("late", 3.0), ("first", 1.0),
                                                             ("second", 2.0))]
    await asyncio.sleep(0)
    assert lot.waiting("m") == 3
    assert lot.wake_one("m")
    await asyncio.sleep(0)
    assert order == ["first"] and lot.waiting("m") == 2
    assert lot.wake_one("m") and lot.wake_one("m")
    await asyncio.gather(*tasks)
    assert order == ["first", "second", "late"]
    assert not lot.wake_one("m") and not lot.wake_one("other")


async def test_a_holder_whose_window_closes_is_skipped() -> None:
    lot = ParkingLot()
    loop = asyncio.get_running_loop()
    assert not await lot.wait("m", 1.0, loop.time() + 0.01)  # nobody freed a slot
    woken = asyncio.create_task(lot.wait("m", 2.0, loop.time() + 5.0))
    await asyncio.sleep(0)
    assert lot.wake_one("m")  # the timed-out holder is passed over, the waiting one woken
    assert await woken

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


async def test_a_place_held_before_its_wait_is_woken_by_a_slot_that_frees_in_between() -> None:
    """The router parks a holder in one step and its task waits in a later one: a done-event
    read in between wakes the place it holds, and the wait that begins after returns at
    once; a place whose wait never begins is passed over once released."""
    lot = ParkingLot()
    loop = asyncio.get_running_loop()
    place = lot.hold("m", 1.0)
    assert lot.waiting("m") == 1
    assert lot.wake_one("m")  # the slot frees before the holder's task runs
    assert await asyncio.wait_for(lot.wait("m", 1.0, loop.time() + 5.0, place), 1.0)
    gone = lot.hold("m", 0.5)
    ParkingLot.release(gone)  # its task failed before it waited
    later = asyncio.create_task(lot.wait("m", 2.0, loop.time() + 5.0))
    await asyncio.sleep(0)
    assert lot.wake_one("m") and await later  # the released place passed over

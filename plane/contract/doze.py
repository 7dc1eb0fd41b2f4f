"""A sleep that another part of the process can cut short: the router's idle watchdog (woken
by the first slot publish after an idle spell) and the node's health supervisor (woken by a
probe's end) both sleep so, instead of waking on a short timer (on these VMs a wake from idle
costs 30-220 us of CPU, `benchmarks/wake_cost.py`).

    doze = Doze()
    woken = await doze.sleep(0.1)   # True: `doze.wake()` was called (since the last sleep)
    doze.wake()                     # from any callback on the same loop

A wake while nobody sleeps is kept for the next sleep, which then returns at once.
"""

from __future__ import annotations

import asyncio


class Doze:
    def __init__(self) -> None:
        self._woken = asyncio.Event()

    def wake(self) -> None:
        self._woken.set()

    async def sleep(self, timeout_s: float) -> bool:
        """Until `wake()` or `timeout_s`; True when woken."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._woken.wait()
            woken = True
        except TimeoutError:
            woken = False
        self._woken.clear()
        return woken

"""An idle plane sleeps (on this project's VMs every wake from idle costs ~100-220 µs of CPU,
`benchmarks/wake_cost.py`), and wakes at once when work comes: the router's watchdog ticks at
its idle period with nothing to watch and at its short one from the first slot publish on; a
CPU node's probes run on its event loop, so an idle slot never starts its thread."""

from __future__ import annotations

import asyncio

from plane.router.service import IDLE_WATCHDOG_PERIOD_S, WATCHDOG_PERIOD_S
from tests.plane_fixtures import NAMES, calibrated, client, plane, status, wait_until


async def test_an_idle_router_dozes_and_its_first_placement_wakes_the_watchdog() -> None:
    async with plane(models=("calibrated",), slots=1) as stack, client(stack.url) as nc:
        router = stack.routers[0]
        assert status(await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5)) \
            == 200
        await asyncio.sleep(0.3)  # the request's traces gone: nothing to watch
        t0 = router.watchdog_ticks
        await asyncio.sleep(1.0)
        idle_ticks = router.watchdog_ticks - t0
        # ~10 at the idle period (50 at the short one); a loaded host only makes it fewer.
        assert idle_ticks <= 1.0 / IDLE_WATCHDOG_PERIOD_S + 3, idle_ticks
        # Just after an idle tick (its next is ~100 ms away), a request of 400 ms is placed:
        # the watchdog ticks again at once, then at the short period.
        ticks = router.watchdog_ticks
        await wait_until(lambda: router.watchdog_ticks > ticks, 1, "an idle tick")
        t1 = router.watchdog_ticks
        placed_s = asyncio.get_running_loop().time()
        pending = asyncio.ensure_future(
            nc.request(NAMES.infer("calibrated"), calibrated(400_000), timeout=5))
        woke_after_s = await wait_until(lambda: router.watchdog_ticks > t1, 1, "a tick")
        assert woke_after_s < IDLE_WATCHDOG_PERIOD_S / 2, woke_after_s
        assert router.inflight.entries or router.publisher, "the tick came before the placement"
        t2 = router.watchdog_ticks
        await asyncio.sleep(0.2)
        # 10 at the short period; at the idle one 2 at most.
        assert router.watchdog_ticks - t2 >= 0.2 / WATCHDOG_PERIOD_S / 2, \
            router.watchdog_ticks - t2
        assert asyncio.get_running_loop().time() - placed_s < 0.4  # still in flight above
        assert status(await pending) == 200


async def test_an_idle_cpu_nodes_probes_run_on_its_loop() -> None:
    async with plane(models=("calibrated",), slots=2) as stack:
        slots = stack.nodes[0].slots
        # Probes go out every 100 ms to each idle slot: several have run, none on a thread.
        await wait_until(lambda: all(s.probe_window.count >= 3 for s in slots), 5,
                         "three probes on each slot")
        assert not any(s.thread.started for s in slots)
        assert all(s.healthy for s in slots)
        # One wake of the supervisor per probe period: it reads the probes' results as they
        # end, not a check later (it woke twice a period).
        supervisor = stack.nodes[0]._supervisor
        assert supervisor is not None
        checks, probes = supervisor.timed_checks, slots[0].probe_window.count
        await asyncio.sleep(1.0)
        period_s = stack.nodes[0].cfg.probe_period_ms / 1000
        assert slots[0].probe_window.count - probes >= 0.5 / period_s  # still probing
        woke = supervisor.timed_checks - checks
        assert woke <= 1.0 / period_s + 3, woke

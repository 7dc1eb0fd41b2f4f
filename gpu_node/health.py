"""The health supervisor: probes each slot every period, withdraws a slot after `misses`
missed periods (hung, raising, or far slower than expected) or when its measured p99 no longer
fits its model's budget, and reclaims it when probes pass and the budget fits again.

A *miss* is a probe that failed or raised, or a call in progress (probe or request) that has
run past what it was expected to take: one miss when it overruns, one more for each period it
stays stuck. So a hang is withdrawn about two periods and a few ms after it starts. A request
running within its expectation is life, so long requests are never mistaken for hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from gpu_node.slot import Slot
from plane.contract.doze import Doze
from plane.contract.metrics import PlaneMetrics

log = structlog.get_logger("plane.health")

# Before this many request samples the p99 is only the max of a few: the probes' median alone
# speaks for the slot's budget (one slow probe on a busy host must not withdraw a slot).
MIN_BUDGET_SAMPLES = 100
CHECKS_PER_PERIOD = 4
# A slot withdrawn for its budget comes back after this many fresh probes that fit.
RECLAIM_PROBES = 5
# A check that comes more than this many periods after it was due: the whole process stood
# still meanwhile (SIGSTOP, a paused VM, a blocked loop), the calls in progress with it.
STALL_PERIODS = 1.0


@dataclass(slots=True)
class SlotHealth:
    misses: int = 0
    passes: int = 0
    probe: asyncio.Task[bool] | None = None
    last_probe_s: float = 0.0
    failures_seen: int = 0


class Supervisor:
    def __init__(
        self, *, slots: Callable[[], list[Slot]], metrics: PlaneMetrics,
        period_s: Callable[[], float], misses: int, budget_us: Callable[[], int],
        changed: Callable[[], None],
    ) -> None:
        self._slots = slots
        self._metrics = metrics
        self._period_s = period_s
        self._misses = misses
        self._budget_us = budget_us
        self._changed = changed
        self.state: dict[int, SlotHealth] = {}
        self._stopping = False
        # Set when a probe ends: its result is read in the same wake, not a check later (an
        # idle node woke twice per probe period, once to start its probes and once to read
        # them).
        self._doze = Doze()
        self.timed_checks = 0  # checks its timer woke it for (a probe's end wakes it too)
        # The process's stalls (`_stalled`): (monotonic end, seconds stalled in all until
        # then), the latest few. A call's overrun leaves out the stalls since it started.
        self.stalls: deque[tuple[float, float]] = deque([(-math.inf, 0.0)], maxlen=64)

    async def run(self) -> None:
        try:
            while not self._stopping:
                asked_s = self._next_check_s()
                due_s = time.monotonic() + asked_s
                if not await self._doze.sleep(asked_s):
                    self.timed_checks += 1
                self._stalled(time.monotonic() - due_s)
                for slot in self._slots():
                    await self._tick(slot)
        finally:
            for st in self.state.values():
                if st.probe is not None and not st.probe.done():
                    st.probe.cancel()

    def stop(self) -> None:
        self._stopping = True

    def _stalled(self, late_s: float) -> None:
        """A check `late_s` past when it was due. Past `STALL_PERIODS`, the process stood
        still: a call in progress stood still with it, and its overrun counts from now. A
        member of a node group resumed from a 7 s SIGSTOP counted 70 missed probes for the
        call it was in, withdrew the slot, and answered 503 the request a router had just
        placed there on the strength of its first heartbeat after the stop (probe F,
        finding 5)."""
        if late_s > STALL_PERIODS * self._period_s():
            self.stalls.append((time.monotonic(), self.stalls[-1][1] + late_s))
            log.warning("health checks resumed after a stall: calls in progress are not "
                        "blamed for it", late_s=round(late_s, 3))

    def stalled_since(self, started_s: float) -> float:
        """Seconds the process stood still since `started_s` (monotonic), as checks saw."""
        before = next((total for at_s, total in reversed(self.stalls) if at_s <= started_s),
                      self.stalls[0][1])
        return self.stalls[-1][1] - before

    def _next_check_s(self) -> float:
        """Look often (a quarter period) while any slot has a call or a probe in progress, so
        that a stuck call is seen soon after it overruns; with none, sleep until the next
        probe is due (an idle node wakes for its probes only: on this project's VMs each wake
        from idle costs ~100-220 us of CPU, `benchmarks/wake_cost.py`). A call that starts
        meanwhile is seen at that wake, within a period: its misses count the time past its
        expectation, not the checks, so a hang is withdrawn as soon as before."""
        period = self._period_s()
        quarter = period / CHECKS_PER_PERIOD
        now = time.monotonic()
        until_due = period
        for slot in self._slots():
            st = self.state.get(slot.k)
            if st is None or (st.probe is not None and not st.probe.done()) or not slot.idle:
                return quarter
            until_due = min(until_due, st.last_probe_s + period - now)
        return max(quarter, until_due)

    async def _tick(self, slot: Slot) -> None:
        st = self.state.setdefault(slot.k, SlotHealth())
        now = time.monotonic()
        period = self._period_s()
        before = st.misses
        started = slot.runner.call_started_s
        if started is not None:
            started += self.stalled_since(started)  # a stall of the process is no overrun
        if started is not None and now - started > slot.runner.call_expected_s:
            # Stuck in a call past its expectation: the first miss when it overruns, one more
            # each period after.
            overrun = now - started - slot.runner.call_expected_s
            st.misses = max(st.misses, 1 + int(overrun / period))
            st.passes = 0
        elif st.probe is not None and st.probe.done():
            ok = not st.probe.cancelled() and st.probe.exception() is None and st.probe.result()
            st.probe = None
            if ok:
                st.misses, st.passes = 0, st.passes + 1
            else:
                st.misses, st.passes = st.misses + 1, 0
        if slot.failures != st.failures_seen:  # requests that raised count as misses
            st.misses += slot.failures - st.failures_seen
            st.failures_seen = slot.failures
            st.passes = 0
        if st.misses > before:
            misses = self._metrics.probe_misses.labels(slot.model, slot.node, str(slot.k))
            misses.inc(st.misses - before)
        if st.probe is None and slot.idle and now - st.last_probe_s >= period:
            st.last_probe_s = now
            st.probe = asyncio.create_task(slot.probe())
            st.probe.add_done_callback(lambda _: self._doze.wake())
        await self._decide(slot, st)

    async def _decide(self, slot: Slot, st: SlotHealth) -> None:
        if slot.claimed and st.misses >= self._misses:
            slot.healthy = False
            log.warning("slot withdrawn: missed probes", slot=slot.k, misses=st.misses)
            await self._withdraw(slot, "unhealthy", wait_s=0.0)
            return
        budget = self._budget_us()
        req_p99 = slot.window.p99_us if slot.window.count >= MIN_BUDGET_SAMPLES else 0
        fits = max(req_p99, slot.probe_window.p50_us) <= budget
        if slot.claimed and not fits:
            log.warning("slot withdrawn: p99 over budget", slot=slot.k, budget_us=budget,
                        request_p99_us=req_p99, probe_p50_us=slot.probe_window.p50_us)
            await self._withdraw(slot, "budget", wait_s=budget / 1e6)
            # Judge the comeback on fresh probes only.
            slot.window.clear()
            slot.probe_window.clear()
            return
        if not slot.claimed and slot.withdrawn_for in ("unhealthy", "budget"):
            recovered = st.misses == 0 and st.passes >= 1
            fresh = slot.withdrawn_for != "budget" or slot.probe_window.count >= RECLAIM_PROBES
            if recovered and fits and fresh:
                slot.healthy = True
                log.info("slot reclaimed", slot=slot.k, was=slot.withdrawn_for)
                with contextlib.suppress(Exception):
                    await slot.claim()
                self._changed()

    async def _withdraw(self, slot: Slot, cause: str, wait_s: float) -> None:
        # Tell routers first (advert + heartbeat), then stop fetching and answer the stuck.
        slot.withdrawn_for = cause
        self._changed()
        await slot.withdraw(cause, wait_s=wait_s)
        self._changed()

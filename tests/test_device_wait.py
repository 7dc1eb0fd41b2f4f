"""Device work awaited on the event loop (`gpu_node.device_wait`): a timer that never wakes
early, with a timerfd or without; a wait that polls until the work says it is done; and, on
a real plane, calibrated requests launched and awaited without the slot's thread, back on
the thread where a fault is injected or the node is told `--device-waits thread`, and a
slot withdrawn mid-wait left idle."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from gpu_node import device_wait
from gpu_node.device_wait import CALIBRATED, RISK, LoopTimer, TimedWork, finished
from plane.contract.messages import FaultCommand, json_encoder
from plane.contract.subjects import Header
from tests.plane_fixtures import NAMES, calibrated, client, plane, status, wait_until


async def sleeps_never_early(timer: LoopTimer, n: int) -> None:
    rng = random.Random(7)
    for _ in range(n):
        target = time.monotonic() + rng.uniform(0.0001, 0.002)
        await timer.sleep_until(target)
        assert time.monotonic() >= target


async def test_a_loop_timer_never_wakes_before_its_time() -> None:
    timer = LoopTimer()
    try:
        await sleeps_never_early(timer, 200)
        assert timer.precise  # a timerfd on Linux
    finally:
        timer.close()


async def test_without_a_timerfd_the_loops_own_timer_is_never_early_either(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_wait, "_timerfd", lambda: -1)
    timer = LoopTimer()
    try:
        await sleeps_never_early(timer, 50)
        assert not timer.precise
    finally:
        timer.close()


async def test_a_cancelled_sleep_does_not_wake_the_next_one_early() -> None:
    """A slot's wait cancelled (a withdrawal) and the next request's begun at once: the
    cancelled one's end must not clear, nor its expiry end, the next one's wait."""
    timer = LoopTimer()
    try:
        for _ in range(20):
            first = asyncio.ensure_future(timer.sleep_until(time.monotonic() + 0.0005))
            await asyncio.sleep(0)
            first.cancel()
            target = time.monotonic() + 0.002
            await asyncio.wait_for(timer.sleep_until(target), 1.0)  # (hung before the fix)
            assert time.monotonic() >= target
            assert first.cancelled()
    finally:
        timer.close()


class SlowToSay:
    """Work predicted to end at `end_s` that says it is done only `late_s` after that."""

    def __init__(self, duration_s: float, late_s: float) -> None:
        self.end_s = time.monotonic() + duration_s
        self.really_s = self.end_s + late_s
        self.looks = 0

    def done(self) -> bool:
        self.looks += 1
        return time.monotonic() >= self.really_s


async def test_a_wait_polls_past_the_predicted_end_until_the_work_is_done() -> None:
    timer = LoopTimer()
    try:
        work = SlowToSay(0.001, 0.003)
        await finished(work, timer)
        assert time.monotonic() >= work.really_s
        assert 2 <= work.looks <= 12  # polls a little further apart each time
        on_time = TimedWork(0.001)
        await finished(on_time, timer)
        assert on_time.done()
    finally:
        timer.close()


async def test_a_wait_aims_early_by_the_loops_lateness_and_still_ends_with_the_work() -> None:
    """A loop kept busy (a callback holding it 300 us every 100 us, as other slots' messages
    do) resumes a timer's waiter late: the timer learns a lead (bounded), a wait aims that
    much before the work's end, and still returns only once the work is done and never
    before its predicted end."""
    loop = asyncio.get_running_loop()
    busy = True

    def hold() -> None:
        t = time.monotonic() + 0.0003
        while time.monotonic() < t:
            pass
        if busy:
            loop.call_later(0.0001, hold)

    timer = LoopTimer()
    try:
        await finished(TimedWork(0.0005), timer)
        assert timer.lead_s <= device_wait.LEAD_STEP_S  # one step at a time
        loop.call_soon(hold)
        for _ in range(150):
            await finished(TimedWork(0.0005), timer)
        assert 0.0 < timer.lead_s <= device_wait.LEAD_MAX_S
        for _ in range(30):
            work = TimedWork(0.001)
            await finished(work, timer)
            assert time.monotonic() >= work.end_s
            late = SlowToSay(0.001, 0.0005)
            await finished(late, timer)
            assert time.monotonic() >= late.really_s
    finally:
        busy = False
        timer.close()


async def test_calibrated_work_is_awaited_on_the_loop_without_the_slot_thread() -> None:
    """The torch backend's calibrated request is device time's stand-in: launched (a time to
    end at) and awaited on the loop, its slot's thread never started; each answer's
    `Plane-Service-Us` covers the work asked for."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack, \
            client(stack.url) as nc:
        slot = stack.nodes[0].slots[0]
        assert slot._waits_on_loop(CALIBRATED)
        assert not slot._waits_on_loop(RISK)  # compute on this CPU: the inline or thread way
        for us in (1_000, 3_000, 0, 2_000) * 3:
            m = await nc.request(NAMES.infer("calibrated"), calibrated(us), timeout=5)
            assert status(m) == 200, m.headers
            assert int((m.headers or {})[Header.SERVICE_US]) >= us
        assert not slot.thread.started
        assert slot.idle


async def test_told_thread_or_with_a_fault_the_slot_waits_on_its_thread() -> None:
    async with plane(models=("calibrated",), slots=1, backend="torch",
                     node_overrides={"device_waits": "thread"}) as stack, \
            client(stack.url) as nc:
        m = await nc.request(NAMES.infer("calibrated"), calibrated(1_000), timeout=5)
        assert status(m) == 200
        assert stack.nodes[0].slots[0].thread.started
    async with plane(models=("calibrated",), slots=1, backend="torch",
                     allow_faults=True) as stack, client(stack.url) as nc:
        slot = stack.nodes[0].slots[0]
        cmd = FaultCommand(k=0, mode="slow", extra_us=1)
        assert (await nc.request(NAMES.fault(stack.nodes[0].cfg.node_id),
                                 json_encoder.encode(cmd), timeout=5)).data == b"ok"
        assert not slot._waits_on_loop(CALIBRATED)
        m = await nc.request(NAMES.infer("calibrated"), calibrated(1_000), timeout=5)
        assert status(m) == 200
        assert slot.thread.started


async def test_a_slot_withdrawn_while_it_waits_answers_once_and_is_idle_after() -> None:
    """The wait is the slot task's: a withdrawal cancels it, the caller gets the 503 of an
    abandoned request (and nothing after it), and the runner's call is over, so that the
    supervisor sees the slot idle and probes it again."""
    async with plane(models=("calibrated",), slots=1, backend="torch") as stack, \
            client(stack.url) as nc:
        slot = stack.nodes[0].slots[0]
        inbox = nc.new_inbox()
        answers = await nc.subscribe(inbox)
        await nc.publish(NAMES.infer("calibrated"), calibrated(2_000_000), reply=inbox,
                         headers={Header.DEADLINE_MS: "5000"})
        await wait_until(lambda: slot.runner.call_started_s is not None, 5, "the wait begun")
        await slot.withdraw("test")
        m = await answers.next_msg(timeout=5)
        assert status(m) == 503, (m.headers, json.loads(m.data))
        assert slot.runner.call_started_s is None and slot.idle
        assert not slot.thread.started
        with pytest.raises(TimeoutError):
            await answers.next_msg(timeout=0.5)


def test_a_cpu_runner_asked_to_launch_risk_computes_it_now() -> None:
    """Risk is compute on a CPU, not in the runner's `launches` (the slot calls `run_risk`);
    asked to launch it all the same, the runner computes it at once: done, the same score."""
    from gpu_node.compute import TorchSlot
    from kernels.risk import FEATURES, RiskWeights

    slot = TorchSlot(RiskWeights.from_seed(4))
    assert RISK not in slot.launches
    row = [(i % 7 - 3) / 4 for i in range(FEATURES)]
    want = slot.run_risk(row)
    slot.run_risk([0.0] * FEATURES)  # another score in the output first
    work = slot.start_risk(row)
    assert work.done()
    assert slot.risk_score() == want

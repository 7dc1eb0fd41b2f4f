"""A slot's own thread (gpu_node/slot_thread.py): calls run off the loop, one at a time and in
order; results and exceptions come back; a call cancelled before it starts never runs; a
shut-down thread cancels what has not started and takes no more; the start hook runs once, on
the thread, before the first call, and one that fails leaves the calls running."""

from __future__ import annotations

import asyncio
import threading

import pytest
from structlog.testing import capture_logs

from gpu_node.slot_thread import SlotThread


async def test_calls_run_in_order_on_one_thread_that_is_not_the_loops() -> None:
    t = SlotThread("slot-test-0")
    seen: list[tuple[int, str]] = []

    def note(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * 2

    results = await asyncio.gather(*(t.run(note, i) for i in range(20)))
    assert results == [i * 2 for i in range(20)]
    assert [i for i, _ in seen] == list(range(20))
    assert {name for _, name in seen} == {"slot-test-0"}
    assert threading.current_thread().name != "slot-test-0"
    t.shutdown()


async def test_an_exception_reaches_the_caller_and_the_thread_goes_on() -> None:
    t = SlotThread("slot-test-1")

    def fail() -> None:
        raise ValueError("device said no")

    with pytest.raises(ValueError, match="device said no"):
        await t.run(fail)
    assert await t.run(lambda: 7) == 7
    t.shutdown()


async def test_a_call_cancelled_before_it_starts_never_runs() -> None:
    t = SlotThread("slot-test-2")
    gate = threading.Event()
    ran: list[str] = []
    first = t.run(gate.wait, 5)
    second = t.run(ran.append, "second")
    second.cancel()
    third = t.run(ran.append, "third")
    gate.set()
    assert await first is True
    await third
    assert ran == ["third"]
    t.shutdown()


async def test_shutdown_cancels_what_has_not_started_and_refuses_more() -> None:
    t = SlotThread("slot-test-3")
    gate = threading.Event()
    running = t.run(gate.wait, 5)
    queued = t.run(lambda: "never")
    await asyncio.sleep(0.05)  # the first call is running
    t.shutdown()
    assert queued.cancelled()
    gate.set()
    assert await running is True  # the one running ran to its end
    with pytest.raises(RuntimeError, match="shut down"):
        t.run(lambda: None)
    for _ in range(100):
        if not any(th.name == "slot-test-3" for th in threading.enumerate()):
            break
        await asyncio.sleep(0.01)
    assert not any(th.name == "slot-test-3" for th in threading.enumerate())


async def test_the_start_hook_runs_once_on_the_thread_before_the_first_call() -> None:
    order: list[tuple[str, str]] = []
    t = SlotThread("slot-test-4", on_start=lambda: order.append(
        ("start", threading.current_thread().name)))

    def call(i: int) -> int:
        order.append((f"call {i}", threading.current_thread().name))
        return i

    assert order == []  # the thread starts with the first call, not before
    assert await asyncio.gather(*(t.run(call, i) for i in range(3))) == [0, 1, 2]
    assert order == [("start", "slot-test-4"), ("call 0", "slot-test-4"),
                     ("call 1", "slot-test-4"), ("call 2", "slot-test-4")]
    t.shutdown()


async def test_a_failing_start_hook_is_logged_and_the_calls_still_run() -> None:
    def broken() -> None:
        raise RuntimeError("no such stream")

    t = SlotThread("slot-test-5", on_start=broken)
    with capture_logs() as logs:
        assert await t.run(lambda: 11) == 11
        assert await t.run(lambda: 12) == 12
    failed = [e for e in logs if e["event"] == "slot thread start hook failed"]
    assert len(failed) == 1
    assert failed[0]["thread"] == "slot-test-5"
    assert failed[0]["error"] == "RuntimeError: no such stream"
    t.shutdown()

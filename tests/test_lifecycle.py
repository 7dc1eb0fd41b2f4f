"""TaskOwner: a task that fails is logged with its traceback and counted, never lost; a
cancelled one is not a failure; ended tasks are let go."""

from __future__ import annotations

import asyncio

import structlog

from plane.contract.lifecycle import TaskOwner


async def test_a_failed_task_is_logged_and_counted() -> None:
    owner = TaskOwner()

    async def boom() -> None:
        raise RuntimeError("the slot said no")

    async def forever() -> None:
        await asyncio.sleep(3600)

    with structlog.testing.capture_logs() as logs:
        owner._spawn(boom())
        owner._spawn(forever())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        [t] = list(owner._tasks)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
    assert owner.task_failures == 1 and not owner._tasks
    [entry] = [e for e in logs if e["event"] == "task failed"]
    assert entry["log_level"] == "error" and "boom" in entry["task"]
    assert isinstance(entry["exc_info"], RuntimeError)

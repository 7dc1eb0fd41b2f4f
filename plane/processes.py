"""Child processes the project starts itself (nats-server, tansu, redis-server in benchmarks):
stopped by PID, politely first, and their log readers cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from plane.lifecycle import cancel_and_wait

__all__ = ["cancel_and_wait", "stop_by_pid"]


async def stop_by_pid(
    proc: asyncio.subprocess.Process | None, *, kill: bool = False, timeout_s: float = 10.0
) -> None:
    """SIGTERM (SIGKILL when `kill`) and wait; SIGKILL after `timeout_s`. Idempotent."""
    if proc is None or proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
    try:
        async with asyncio.timeout(timeout_s):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()

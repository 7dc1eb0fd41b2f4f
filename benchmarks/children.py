"""Processes a benchmark starts itself (a plane router or node, a responder, Redis, Celery
workers): each logs to a file, dies with us, and is stopped by its PID; `until` polls one
until it answers and, when it does not, says why with the tail of its log."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

from plane.contract.processes import die_with_parent, stop_by_pid

REPO = Path(__file__).resolve().parent.parent


@contextlib.asynccontextmanager
async def child(args: Sequence[str], log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """A child process logging to `log`; SIGTERM (then SIGKILL) by PID on exit."""
    with log.open("wb") as f:
        proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.DEVNULL, stdout=f, stderr=f, cwd=REPO,
            preexec_fn=die_with_parent)
    try:
        yield proc
    finally:
        await stop_by_pid(proc, timeout_s=15)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


async def until(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float,
                log: Path) -> None:
    """Poll `check` until it says yes; on timeout raise with the tail of `log`."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                if await check():
                    return
                await asyncio.sleep(0.2)
    except TimeoutError:
        tail = await asyncio.to_thread(_tail, log)
        raise RuntimeError(f"{what} not ready after {timeout_s} s; log tail:\n{tail}") from None

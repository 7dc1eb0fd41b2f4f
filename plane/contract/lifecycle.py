"""Signals are handled here, at the application edge only: SIGINT/SIGTERM set an Event that
the command's main coroutine awaits before it unwinds its AsyncExitStack."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import os
import signal
import sys
from abc import ABC, abstractmethod
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, NoReturn, Self, TypeVar

import structlog
import uvloop

_log = structlog.get_logger("plane.contract.lifecycle")

T = TypeVar("T")


def freeze_startup_heap() -> None:
    """Move everything alive now (imports: torch alone brings ~155k objects) out of the
    cyclic collector's reach. Without it every full collection walks that heap and stops the
    event loop for 50-130 ms (150-240 ms on a busy host), a stall that slot cycles, promises
    and callers' timers all feel. What the process allocates later is collected as usual.
    `run` calls it before the loop starts; a command that imports its heavy modules later
    (the node's torch and triton, kept out of the commands that do not compute) calls it again
    once they are in, before it serves: frozen at `run` alone, a node's heap was 25k objects
    of 180k."""
    gc.collect()
    gc.freeze()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's main coroutine on uvloop: a faster event loop for the whole process
    (nats-py's hot path is mostly loop overhead). Every command goes through here; the code
    itself runs on the stdlib loop too (the tests use it)."""
    freeze_startup_heap()
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    finally:
        gc.unfreeze()  # a normal interpreter exit (native extensions check for leaks then)


def exit_now(code: int) -> NoReturn:
    """End a command whose work has stopped (drained, answered, flushed) with `code`, without
    the interpreter's teardown. That teardown frees every module and object one by one, and
    with torch and triton imported it took 0.8-1.7 s on this project's host (a stopped
    `plane node` was 7 ms stopping, then a second exiting; `plane up` paid it once more in
    its router's process): time in which the process serves nothing and a supervisor or a
    terminal waits. What an exit owes the world still happens: the exit handlers run (the
    log's writer flushes its queue, OpenTelemetry exports its spans), then stdout and stderr
    are flushed. The threads left are daemons (the log's writer, /metrics): nothing joins
    them at a normal exit either."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel a task we own and wait until it has really ended (idempotent on None)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def finish_or_cancel(task: asyncio.Task[Any], timeout_s: float) -> bool:
    """Staged stop: give `task` `timeout_s` to finish by itself, then cancel it. True when
    it finished in time."""
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(task)
        return True
    except TimeoutError:
        await cancel_and_wait(task)
        return False


def stop_event() -> asyncio.Event:
    """An Event set by SIGINT or SIGTERM (call inside the running loop)."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event


async def until_any(*events: asyncio.Event) -> None:
    """Wait until one of `events` is set (a stop signal, or a component that failed)."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


class Lifecycle(ABC):
    """Base of the long-lived things (router, node, stack, bridge, guard ...): an async context
    manager over the subclass's idempotent `start()` and `stop()`."""

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


class TaskOwner:
    """Owns the background tasks it spawns (no fire-and-forget): the set keeps a reference
    until each task ends; `stop()` of the owner cancels and awaits what is left."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.task_failures = 0

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` as a task this object owns. The number of tasks is bounded by the
        owner's own admission (a router sheds past `max_routing` requests in hand, see
        `plane.router.requests`), not here: a task refused here would be an answer lost."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        """Every failure is logged (with its traceback) and counted, never lost unseen."""
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.task_failures += 1
            _log.error("task failed", owner=type(self).__name__,
                       task=getattr(task.get_coro(), "__qualname__", task.get_name()),
                       exc_info=exc)

"""Signals are handled here, at the application edge only: SIGINT/SIGTERM set an Event that
the command's main coroutine awaits before it unwinds its AsyncExitStack."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's main coroutine on uvloop: a faster event loop for the whole process
    (nats-py's hot path is mostly loop overhead). Every command goes through here; the code
    itself runs on the stdlib loop too (the tests use it)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def stop_event() -> asyncio.Event:
    """An Event set by SIGINT or SIGTERM (call inside the running loop)."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event

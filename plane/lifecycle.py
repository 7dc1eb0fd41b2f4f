"""Signals are handled here, at the application edge only: SIGINT/SIGTERM set an Event that
the command's main coroutine awaits before it unwinds its AsyncExitStack."""

from __future__ import annotations

import asyncio
import signal


def stop_event() -> asyncio.Event:
    """An Event set by SIGINT or SIGTERM (call inside the running loop)."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event

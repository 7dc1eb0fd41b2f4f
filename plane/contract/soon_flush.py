"""Send what a connection has buffered at the end of the loop's turn, without nats-py's flusher.

nats-py buffers every command (`Client._pending`) and has it written by a flusher task: each
publish whose turn finds that task idle makes a future, puts it on an `asyncio.Queue`, wakes
the task, which writes, awaits `drain()` and resolves the future. That is two futures and one
task step per burst of publishes, which the plane pays once or more per request in the router
and in the node (a slot message; an answer, a done-event, an ack): the same order of cost as
the socket write itself on this VM.

`use_soon_flush(nc)` replaces that, for one connection, by a plain callback the loop runs at
the end of its current turn (`loop.call_soon`, scheduled once per turn however many publishes
the turn makes): it writes the whole buffer in order, in one call, as the flusher would. What
is unchanged, by handing back to nats-py's own flusher:
- while the connection is not up (connecting, reconnecting, closed): nats-py's reconnect
  buffer and its rules;
- a forced flush (nats-py's pending-size limit), and a flusher task that is gone;
- while the socket does not take what it is given (the transport holds unsent bytes): the
  flusher writes and then awaits `drain()`, which is the only back-pressure nats-py has;
- a transport without a stream writer of its own (WebSocket), and a write that fails
  (nats-py's error path, `_process_op_err`, handles the connection).
It also puts nats-py's PINGs (`flush()`, the keep-alive) in the buffer, behind what was made
before them, instead of on the socket ahead of it (`SoonFlush.send_ping`).

Everything goes through nats-py's one buffer, so the order of commands on the wire is the
order they were made in, whichever path writes them. Uses nats-py internals (`_pending`, `_pongs`,
`_pending_data_size`, `_transport`, `_flush_queue`, `_flusher_task`, `_flush_pending`, the
transport's `_io_writer`): nats-py is pinned in pyproject.toml and tests/test_soon_flush.py
checks what arrives, its order, and the hand-backs, against a real nats-server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import PING_PROTO, Client


class SoonFlush:
    """The replacement for one connection's `_flush_pending` (see the module's docstring)."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._nats_flush: Callable[..., Awaitable[Any]] = nc._flush_pending
        self._scheduled = False
        self.writes = 0  # buffers written by this path (for tests and benchmarks)
        self.handed_back = 0  # turns whose buffer went to nats-py's flusher instead
        self._failing: asyncio.Task[None] | None = None  # nats-py's handling of a failed write
        self._hooks: list[Callable[[], None]] = []  # `before_write`'s, this turn's

    async def flush_pending(self, force_flush: bool = False) -> Any:
        nc = self._nc
        task = nc._flusher_task
        if force_flush or nc._status != Client.CONNECTED or task is None or task.done():
            return await self._nats_flush(force_flush)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._write)
        return None

    def before_write(self, hook: Callable[[], None]) -> None:
        """Have `hook` called once at the end of this turn of the loop, just before the
        buffer is written, so that what it adds to the buffer (`plane.contract.publish.append`)
        goes in the turn's one write, behind everything made before, in the order hooks
        were given. It runs whatever the connection's state (not connected, its additions
        wait in nats-py's reconnect buffer). One that raises is reported to the loop's
        exception handler; the others, and the write, go on."""
        self._hooks.append(hook)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._write)

    def _write(self) -> None:
        self._scheduled = False
        if self._hooks:
            hooks, self._hooks = self._hooks, []
            for hook in hooks:
                try:
                    hook()
                except Exception as exc:  # a bug in one: the others and the write go on
                    asyncio.get_running_loop().call_exception_handler(
                        {"message": "a before-write hook raised", "exception": exc})
        nc = self._nc
        if not nc._pending:
            return  # written already
        if nc._status != Client.CONNECTED:
            if nc.is_draining:  # began since the publish: nats-py's flusher still runs
                self._hand_back()
            return  # (not connected: nats-py's reconnect sends its buffer)
        writer = getattr(nc._transport, "_io_writer", None)
        transport = writer.transport if writer is not None else None
        if (transport is None or transport.is_closing()
                or transport.get_write_buffer_size() > 0):
            self._hand_back()
            return
        pending, nc._pending, nc._pending_data_size = nc._pending, [], 0
        try:
            transport.writelines(pending)
        except (OSError, RuntimeError) as exc:
            # The socket failed under us: put the bytes back (nats-py resends its buffer on
            # reconnect) and let nats-py's error path handle the connection.
            nc._pending[:0] = pending
            nc._pending_data_size += sum(len(p) for p in pending)
            if self._failing is None or self._failing.done():
                self._failing = asyncio.ensure_future(nc._process_op_err(exc))
            return
        self.writes += 1

    async def send_ping(self, future: asyncio.Future[Any] | None = None) -> None:
        """A PING in its place in the buffer. nats-py writes it straight to the socket, ahead
        of what the buffer still holds (a SUB made a moment before), so `flush()` could
        return before the server had that SUB, and a message another connection published
        right after was missed (1 to 4 in 300 of tests/test_soon_flush.py's drain test).
        Behind everything made before it, its PONG means the server has all of that."""
        nc = self._nc
        if future is None:
            future = asyncio.get_running_loop().create_future()
        nc._pongs.append(future)
        nc._pending.append(PING_PROTO)
        nc._pending_data_size += len(PING_PROTO)
        await nc._flush_pending()

    def _hand_back(self) -> None:
        """Kick nats-py's flusher (it writes, then awaits drain), as nats-py itself would."""
        self.handed_back += 1
        queue = self._nc._flush_queue
        if queue is not None and queue.empty():
            queue.put_nowait(asyncio.get_running_loop().create_future())


def use_soon_flush(nc: Client) -> SoonFlush:
    """Have `nc` write its buffer at the end of the loop's turn (idempotent)."""
    current = getattr(nc._flush_pending, "__self__", None)
    if isinstance(current, SoonFlush):
        return current
    soon = SoonFlush(nc)
    nc._flush_pending = soon.flush_pending  # type: ignore[method-assign]
    nc._send_ping = soon.send_ping  # type: ignore[method-assign]
    return soon

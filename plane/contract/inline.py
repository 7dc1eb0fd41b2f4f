"""Messages handed to their handler from nats-py's read loop: no queue, no task per message.

nats-py gives every subscription with a callback an `asyncio.Queue` and a task: each message
is built, put on the queue, the task wakes, takes it and awaits the callback. On this host
that is ~15 µs of CPU per message and one more turn of the event loop before the message is
handled (an echo responder: 70 -> 55 µs of CPU per request, `benchmarks/inline_dispatch.py`).
The router handles three such messages per request (the request, its PubAck, the slot's
done-event) and a node one (its pull's delivery).

`Inline.of(nc).subscribe(subject, handler)` subscribes as nats-py does (its SUB, its
re-subscription after a reconnect, `unsubscribe` and `drain` all stay nats-py's) and puts
itself in front of nats-py's `Client._process_msg`, which the protocol parser awaits for each
message read: a message for one of its subscriptions goes to its handler right there, in the
order the server sent them; every other message goes on to nats-py as before. `_process_msg`
is a private method of nats-py's `Client`: the version is pinned in pyproject.toml, and
tests/test_inline.py checks the delivery, statuses and headers against a real server.

A handler is a plain function or a coroutine function. A coroutine is run at once, up to its
first suspension; most of the plane's never suspend (their publishes go to nats-py's write
buffer). One that does is carried on in a task of its own (`_Rest`), which this object owns
(`aclose` cancels what is left). While it runs before that first suspension no task is
current, so what needs one (`asyncio.timeout`, `asyncio.current_task`) fails loudly instead
of arming itself on nats-py's read loop: a handler that needs it starts a task.

Handlers run on the read loop, so nothing else is read meanwhile: they must be short. After
`YIELD_EVERY` messages handled back to back the loop is let turn (the writer, timers and
other tasks run), so that a burst read in one go does not starve them.

A burst waits for its turn in the socket (the kernel's buffer, then the stream reader's),
not in a queue of ours, and that wait must count against the callers' budgets
(`Plane-Deadline-Ms` runs from receipt, design.md): each message carries, for
`received_s`, the time by which its bytes had reached this host. The parser is handed the
connection's bytes in chunks (at most 32 KiB); as each chunk (and each pause of a burst)
begins, the bytes already waiting behind it (the reader's buffer and, by `FIONREAD`, the
socket's) are noted with the time, and a message is stamped with the earliest time its
chunk's bytes were all known to be here: at most one chunk's (or `YIELD_EVERY` messages')
handling later than they came.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import struct
import termios
import time
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = structlog.get_logger("plane.inline")

Handler = Callable[[Msg], None] | Callable[[Msg], Coroutine[Any, Any, None]]
# Messages handled back to back on the read loop before it lets the loop turn: the answers
# a burst's handlers send pile up in nats-py's write buffer until its writer runs (a router
# that let the loop turn only when its burst of 20,000 was done kept RSS 11% up for good).
YIELD_EVERY = 32

_RECEIVED = "_plane_received_s"  # on the Msg (a plain dataclass): monotonic seconds
_FIONREAD_BUF = b"\0\0\0\0"

_leave_task = asyncio.tasks._leave_task
_enter_task = asyncio.tasks._enter_task


class Inline:
    """The inline subscriptions of one connection (`Inline.of(nc)`, made on first use)."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._theirs = nc._process_msg
        self._handlers: dict[int, tuple[Subscription, Handler]] = {}
        self._rests: set[asyncio.Task[None]] = set()
        self._run = 0  # messages handled since the loop last turned
        # Receipt: (byte offset W, monotonic t): every byte before W was here by t.
        self._marks: deque[tuple[int, float]] = deque()
        self._parsed = 0  # bytes handed to the parser so far
        self._chunk_s = 0.0  # when the chunk being parsed was here, at the latest
        self._reader: object = None  # the stream reader the marks are about
        self._fd = -1
        nc._process_msg = self._process_msg  # type: ignore[method-assign]
        self._theirs_parse = nc._ps.parse
        nc._ps.parse = self._parse  # type: ignore[method-assign]

    @classmethod
    def of(cls, nc: Client) -> Inline:
        installed = getattr(nc._process_msg, "__self__", None)
        return installed if isinstance(installed, Inline) else cls(nc)

    async def subscribe(self, subject: str, handler: Handler, *, queue: str = "") -> Subscription:
        """Subscribe `handler` to `subject` (in queue group `queue`)."""
        # No callback for nats-py: no task of its own, and its queue stays empty.
        sub = await self._nc.subscribe(subject, queue=queue)
        # Forget the ones unsubscribed since (nats-py has no hook for it; subscribing is rare).
        subs = self._nc._subs
        for sid in [sid for sid, (s, _) in self._handlers.items() if subs.get(sid) is not s]:
            del self._handlers[sid]
        self._handlers[sub._id] = (sub, handler)
        return sub

    @property
    def carried_on(self) -> int:
        """Handlers that suspended and are running in a task of their own now."""
        return len(self._rests)

    async def aclose(self) -> None:
        """Cancel the handlers still running in a task of their own, and wait for them."""
        rests = list(self._rests)
        for task in rests:
            task.cancel()
        for task in rests:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _parse(self, data: bytes = b"") -> None:
        self._parsed += len(data)
        self._mark(time.monotonic())
        await self._theirs_parse(data)

    def _mark(self, now: float) -> None:
        """Note what is waiting behind the bytes parsed so far, and stamp the chunk."""
        end = self._parsed
        marks = self._marks
        waiting = self._waiting_bytes(marks)
        if not marks or end + waiting > marks[-1][0]:
            marks.append((end + waiting, now))
        while marks[0][0] < end:  # offsets and times both grow along the deque
            marks.popleft()
        self._chunk_s = marks[0][1]

    def _waiting_bytes(self, marks: deque[tuple[int, float]]) -> int:
        """Bytes read from the socket and not parsed yet, and bytes in the socket."""
        transport = self._nc._transport
        reader = getattr(transport, "_io_reader", None)
        if reader is not self._reader:  # a new connection: the old marks are void
            marks.clear()
            self._reader = reader
            writer = getattr(transport, "_io_writer", None)
            sock = writer.get_extra_info("socket") if writer is not None else None
            self._fd = sock.fileno() if sock is not None else -1
        waiting = len(getattr(reader, "_buffer", b""))
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                waiting += struct.unpack(
                    "i", fcntl.ioctl(self._fd, termios.FIONREAD, _FIONREAD_BUF))[0]
        return waiting

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                           headers: bytes) -> None:  # nats-py passes None for no headers
        entry = self._handlers.get(sid)
        if entry is None:
            await self._theirs(sid, subject, reply, data, headers)
            return
        nc = self._nc
        sub, handler = entry
        if nc._subs.get(sid) is not sub:  # unsubscribed, its last messages in flight
            del self._handlers[sid]
            return
        nc.stats["in_msgs"] += 1
        nc.stats["in_bytes"] += len(data)
        sub._received += 1
        hdr = await nc._process_headers(headers) if headers else None
        msg = nc._build_message(sid, subject, reply, data, hdr)
        setattr(msg, _RECEIVED, self._chunk_s)
        self._handle(handler, msg)
        self._run += 1
        if self._run >= YIELD_EVERY:
            self._run = 0
            await asyncio.sleep(0)
            self._mark(time.monotonic())  # what came in meanwhile

    def _handle(self, handler: Handler, msg: Msg) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.current_task(loop)
        if reader is not None:
            _leave_task(loop, reader)
        try:
            result = handler(msg)
            if result is None:
                return
            coro = result
            try:
                first = coro.send(None)
            except StopIteration:
                return
        except Exception:
            log.exception("message handler failed", subject=msg.subject)
            return
        finally:
            if reader is not None:
                _enter_task(loop, reader)
        task = loop.create_task(_carry_on(_Rest(coro, first)), name=f"inline {msg.subject}")
        self._rests.add(task)
        task.add_done_callback(self._rest_done)

    def _rest_done(self, task: asyncio.Task[None]) -> None:
        self._rests.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("message handler failed", error=repr(exc), exc_info=exc)


class _Rest:
    """The rest of a coroutine that suspended before it finished: awaited in a task, it
    hands that task what the coroutine waits on, and the task's answers (a result, or an
    exception such as a cancellation) back to the coroutine, as `await coro` would."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, None], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, Any, None]:
        coro, waiting_on = self._coro, self._first
        while True:
            try:
                sent = yield waiting_on
            except BaseException as exc:
                try:
                    waiting_on = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    waiting_on = coro.send(sent)
                except StopIteration:
                    return


async def _carry_on(rest: _Rest) -> None:
    await rest


def mark_received(msg: Msg, at_s: float) -> None:
    """Stamp `msg` as received at `at_s` (monotonic s)."""
    setattr(msg, _RECEIVED, at_s)


def received_s(msg: Msg, default: float) -> float:
    """When `msg` was received (monotonic s): its stamp, or `default` for one without."""
    at = getattr(msg, _RECEIVED, None)
    return at if isinstance(at, float) else default

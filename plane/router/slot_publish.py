"""JetStream publishes onto slot subjects whose acknowledgements come back to one callback.

`js.publish` awaits each PubAck: a request future, a timer (`wait_for`) and a task to await
them in, per request; the router's profile showed that machinery, not its decisions, as the
cost of a placement (docs/perf). Here every publish carries a reply subject under one
router-wide inbox (`<inbox>.<token>`), a single subscription receives every PubAck and hands
it, decoded once with msgspec, to what the publisher registered for that token. Nothing waits:
a placement is a small state machine driven by its acknowledgement (see `plane.router`).

What can come back for a token: `Published(seq)`; `Refused(APIError)` (the broker said no:
depth one, a stream limit); `NoStream()` (no JetStream stream listens on the subject: the
broker's no-responders status); and, from `expire`, `TimedOut()` when nothing came within
the timeout (the message may or may not be stored: the caller must treat it as placed).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import APIError

from plane.contract.headers import is_no_responders
from plane.contract.publish import publish


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    error: _ApiError | None = None


_decode_ack = msgspec.json.Decoder(_PubAck).decode


@dataclass(frozen=True, slots=True)
class Published:
    seq: int


@dataclass(frozen=True, slots=True)
class Refused:
    error: APIError


@dataclass(frozen=True, slots=True)
class NoStream:
    pass


@dataclass(frozen=True, slots=True)
class TimedOut:
    pass


Outcome = Published | Refused | NoStream | TimedOut
OnOutcome = Callable[[Outcome], Coroutine[Any, Any, None]]


class SlotPublisher:
    def __init__(self, nc: Client, timeout_s: float,
                 on_busy: Callable[[], None] | None = None) -> None:
        self._nc = nc
        self._timeout_s = timeout_s
        self._on_busy = on_busy  # called when a publish finds none pending
        self._prefix = ""
        self._sub: Subscription | None = None
        self._tokens = itertools.count(1)
        # token -> (when sent, monotonic s; what to call): dicts keep insertion order, so the
        # oldest come first for `expire`.
        self._pending: dict[str, tuple[float, OnOutcome]] = {}
        self._idle = asyncio.Event()  # set while nothing is pending
        self._idle.set()

    def __len__(self) -> int:
        return len(self._pending)

    async def start(self) -> None:
        if self._sub is None:
            self._prefix = self._nc.new_inbox()
            self._sub = await self._nc.subscribe(f"{self._prefix}.*", cb=self._on_ack)

    async def drained(self, timeout_s: float) -> None:
        """Until every publish has its answer (or `timeout_s`)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.unsubscribe()

    async def publish(self, subject: str, data: bytes, headers: dict[str, str], now_s: float,
                      then: OnOutcome) -> None:
        """Publish; `then(outcome)` runs when the broker answers (or `expire` gives up)."""
        token = str(next(self._tokens))
        if not self._pending and self._on_busy is not None:
            self._on_busy()
        self._pending[token] = (now_s, then)
        self._idle.clear()
        try:
            await publish(self._nc, subject, data, headers, reply=f"{self._prefix}.{token}")
        except BaseException:
            self._forget(token)
            raise

    def expire(self, now_s: float) -> list[OnOutcome]:
        """The callbacks of publishes unanswered for longer than the timeout (removed)."""
        late: list[OnOutcome] = []
        cutoff = now_s - self._timeout_s
        while self._pending:
            token, (sent_s, then) = next(iter(self._pending.items()))
            if sent_s > cutoff:
                break
            self._forget(token)
            late.append(then)
        return late

    def _forget(self, token: str) -> tuple[float, OnOutcome] | None:
        entry = self._pending.pop(token, None)
        if not self._pending:
            self._idle.set()
        return entry

    async def _on_ack(self, msg: Msg) -> None:
        entry = self._forget(msg.subject[len(self._prefix) + 1:])
        if entry is None:
            return  # given up on already (expired): the caller treated it as placed
        outcome: Outcome
        if is_no_responders(msg.headers):
            outcome = NoStream()
        else:
            try:
                ack = _decode_ack(msg.data)
            except msgspec.DecodeError:
                ack = _PubAck(error=_ApiError(description=f"unreadable PubAck {msg.data[:80]!r}"))
            if ack.error is not None:
                e = ack.error
                outcome = Refused(APIError(code=e.code, err_code=e.err_code,
                                           description=e.description))
            else:
                outcome = Published(ack.seq)
        await entry[1](outcome)

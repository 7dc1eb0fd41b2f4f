"""A generation read as it is made: `Client.stream(...)` (docs/design.md "Streams").

    async with Client.connect(url) as plane:
        stream = plane.stream("tinylm", {"prompt": "hello", "max_tokens": 32}, deadline_ms=500)
        async for piece in stream:
            print(piece, end="", flush=True)
        print(stream.finish_reason, stream.usage)

The request goes out with `Plane-Stream: 1` and an inbox of its own as its reply subject; every
message on that inbox is fed to `plane.contract.streams.StreamReader` (the one reader rule:
`start` and `token` are the stream, anything else its one final message). Iterating yields
each token message's text.

- Before the stream starts, a refusal is handled as `Client.call` handles it (the same
  retry decision, `Client.retry_delay_for`: a 429's Retry-After-Ms and ticket, a 503's
  Plane-Avoid-Node), within the TTFT budget `deadline_ms`. Once started, nothing is retried:
  the tokens already read would be read twice.
- A final status other than 200 raises the SDK's usual error (`Result.to_error`: `Rejected`,
  `BadRequest`, `DeadlineExceeded`, `Unavailable`) unless `raise_errors=False`; either way
  `stream.result` is the final message as a `Result`.
- Closed early (`break`, `aclose()`, an exception in the loop, leaving `async with`), the
  stream sends its cancel (an empty message with `Plane-Request-Id` to the start's
  `Plane-Cancel-Subject`) and unsubscribes, so the slot frees within a token step. Leaving an
  `async for` by `break` without `async with` relies on the event loop closing the abandoned
  iterator (asyncio does it at once, in a task); `async with` does it before it returns.
- With `ClientConfig.end_on_disconnect`, a connection that drops while it waits ends it at
  once, a local 503 `unhealthy` (what the plane sends meanwhile is lost), and cancels it.
- It never hangs: with no message for the TTFT budget (or `ClientConfig.wait_ms`) before the
  start, or past the stream deadline afterwards (with none given: `wait_ms` between two
  messages), plus `ClientConfig.stream_margin_ms` for the plane's own answer, the stream ends
  with a local 504 (`DeadlineExceeded`) saying it went silent, and is cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from plane.client.attempt import attempt_headers_for, encode_payload, local_reply
from plane.client.connection import (
    DROPPED,
    DROPPED_MID_STREAM,
    NOT_CONNECTED,
    NOT_CONNECTED_TO_DEADLINE,
    closed_error,
)
from plane.client.result import LocalCause, Result, reply_status
from plane.contract.backoff import RetryPolicy
from plane.contract.errors import ConfigError
from plane.contract.headers import is_no_responders
from plane.contract.messages import Reason, Status, Usage
from plane.contract.streams import ASKED, Kind, StreamBroken, StreamReader
from plane.contract.subjects import Header
from plane.contract.taken_as_read import subscribe_as_read

if TYPE_CHECKING:
    from plane.client.aio import Client

log = structlog.get_logger("plane.client")

# nats-server's own status header: a no-responders answer carries `Status: 503` and no
# Plane-Status (no router listens on the subject).


class TokenStream:
    """One stream: an async iterator of text pieces and an async context manager. Made by
    `Client.stream`; nothing is sent until it is entered, started or iterated."""

    def __init__(
        self,
        client: Client,
        model: str,
        payload: Any,
        *,
        deadline_ms: int | None = None,
        stream_deadline_ms: int | None = None,
        policy: RetryPolicy | None = None,
        request_id: str | None = None,
        raise_errors: bool = True,
        ticket: str | None = None,
        avoid_node: str | None = None,
        first_attempt: int = 1,
        content_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._client = client
        cfg = client.config
        self.subject = cfg.names.infer(model)  # raises InvalidToken on a bad name
        if deadline_ms is None:
            deadline_ms = cfg.deadline_ms(model)
        if deadline_ms is not None and deadline_ms <= 0:
            raise ConfigError("deadline_ms must be positive")
        if stream_deadline_ms is not None and (
                stream_deadline_ms <= 0 or (deadline_ms and stream_deadline_ms < deadline_ms)):
            raise ConfigError("stream_deadline_ms must be positive and at least deadline_ms "
                              "(the budget for the first token)")
        self.model = model
        self.request_id = request_id or client.request_ids.next()
        self.raise_errors = raise_errors
        self._deadline_ms = deadline_ms
        self._stream_deadline_ms = stream_deadline_ms
        self._policy = policy or cfg.policy
        self._body = encode_payload(payload)
        self._ticket, self._avoid_node = ticket, avoid_node
        self._first_attempt = first_attempt
        self._content_type = content_type
        self._headers = dict(headers or {})
        self._margin_s = cfg.stream_margin_ms / 1000
        self._wait_s = cfg.wait_ms / 1000
        # Set as it runs.
        self.reader = StreamReader()
        self.result: Result | None = None  # the final message (None while it runs)
        self.pieces: list[str] = []
        self.cancelled = False  # the caller closed it before its end
        self._sub: Subscription | None = None
        self._queue: asyncio.Queue[Msg | None] | None = None  # None: closed, stop waiting
        self._statuses: list[int] = []
        self._hinted = 0
        self._waited_ms = 0.0
        self._sent_at = 0.0
        self._stream_at: float | None = None  # monotonic: the whole stream's deadline
        self._begun = False
        self._closed = False  # aclose ran: nothing more is sent or read
        self._dropped = False  # the connection dropped under it (`end_on_disconnect`)
        self._wake: str | None = None  # the client's inbox for calls back (`Plane-Wake`)
        self._start_lock: asyncio.Lock | None = None

    # -- what it came to ---------------------------------------------------------------------
    @property
    def started(self) -> bool:
        """The plane's `start` arrived: a slot runs it."""
        return self.reader.start is not None

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def status(self) -> int:
        """The final status; 0 while it runs."""
        return self.result.status if self.result is not None else 0

    @property
    def start_headers(self) -> Mapping[str, str]:
        """The `start` message's headers (node, slot, cancel subject); empty before it."""
        return self.reader.start or {}

    @property
    def statuses(self) -> tuple[int, ...]:
        """The status of each attempt's final message so far (a refusal retried, ...)."""
        return tuple(self._statuses)

    @property
    def seq(self) -> int:
        """`Plane-Stream-Seq` of the last message read (0: the start; -1 before it)."""
        return self.reader.next_seq - 1

    @property
    def text(self) -> str:
        """Every piece read so far, joined."""
        return "".join(self.pieces)

    @property
    def finish_reason(self) -> str | None:
        """`stop`, `length`, `deadline`, `error` from the node's `end`; `cancelled` when it
        was cancelled; None for a final message that is not an `end` (a refusal)."""
        end = self.reader.end
        if end is not None:
            return end.finish_reason
        return "cancelled" if self.cancelled else None

    @property
    def usage(self) -> Usage | None:
        """The node's usage (tokens, slot µs, SM·ms); None until its `end` (or without one)."""
        return self.reader.usage

    # -- starting ------------------------------------------------------------------------------
    async def start(self) -> bool:
        """Send the request (retrying refusals as `Client.call` does) and wait for its first
        message. True when the stream started; False when its one message was final (a
        refusal that was not retried, or a local timeout): then `result` says what came,
        and with `raise_errors` its error is raised instead. Idempotent."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if not self._begun:
                self._begun = True
                await self._start()
        if self.result is not None and not self.started:
            self._raise_if_error()
        return self.started

    async def _start(self) -> None:
        client = self._client
        if client.nc.is_closed:  # before the wake inbox's subscribe (then: until_connected)
            raise closed_error(client.nc)
        send_deadline = self._deadline_ms is not None
        t0 = time.monotonic()
        budget_ms = self._deadline_ms if self._deadline_ms is not None else client.config.wait_ms
        budget_s = budget_ms / 1000
        deadline_at = t0 + budget_s
        if self._stream_deadline_ms is not None:
            self._stream_at = t0 + self._stream_deadline_ms / 1000
        attempt = self._first_attempt
        self._wake = (await client.calls.inbox()
                      if client.calls is not None and self._policy.max_attempts > 1 else None)
        while not self._closed:  # closed while it waited to retry: send nothing more
            held_until = client.reconnect_until(deadline_at)
            held = await client.comeback.until_connected(held_until)
            # Still down, held as long as it may be, or back only once the deadline had
            # passed: never sent, for the connection's sake.
            if client.comeback.down() or (held and time.monotonic() >= deadline_at):
                if held_until < deadline_at:
                    self._finish_local(Status.UNAVAILABLE, Reason.NO_CAPACITY, NOT_CONNECTED,
                                       LocalCause.DISCONNECTED)
                else:
                    self._finish_local(Status.DEADLINE, Reason.DEADLINE,
                                       NOT_CONNECTED_TO_DEADLINE, LocalCause.DISCONNECTED)
                return
            remaining_s = deadline_at - time.monotonic()
            if remaining_s <= 0:
                self._finish_local(Status.DEADLINE, Reason.DEADLINE,
                                   "deadline passed before send", LocalCause.NOT_SENT)
                return
            await self._send(attempt, remaining_s, send_deadline)
            wait_s = remaining_s + (self._margin_s if send_deadline else 0)
            first = await self._next(wait_s)
            if self._closed:  # by aclose, from another task, while it waited
                return
            if first is None:
                what = ("no answer within the deadline" if send_deadline else
                        f"no answer within {client.config.wait_ms} ms (ClientConfig.wait_ms:"
                        " the stream set no deadline)")
                await self._end_silent(what)
                return
            kind = self._feed(first)
            if kind is None:  # broke: finished with a local 503
                await self._cancel()
                return
            if kind is not Kind.FINAL:
                return  # started
            assert self.result is not None
            result = self.result
            delay_ms = client.retry_delay_for(result, self._policy,
                                              attempt - self._first_attempt + 1, deadline_at)
            if delay_ms is None:
                # Its one message was final: nothing more comes on the inbox. Left subscribed
                # until `aclose`, a refusal the caller did not close (the gateway's) kept a
                # subscription, its task and the stream alive, one per refusal.
                await self._unsubscribe()
                return
            given = result.headers.get(Header.TICKET) if result.status == Status.BUSY else None
            if given:
                self._ticket = given
            elif result.status == Status.UNAVAILABLE:
                self._avoid_node = result.headers.get(Header.NODE) or self._avoid_node
            await self._unsubscribe()
            self.result, self.reader = None, StreamReader()
            self._waited_ms += await client.pause(given, delay_ms)
            attempt += 1

    async def _send(self, attempt: int, remaining_s: float, send_deadline: bool) -> None:
        """One attempt: a fresh inbox (a late message of an earlier attempt cannot mix in),
        subscribed before the request goes out."""
        nc = self._client.nc
        headers = attempt_headers_for(
            self._headers, request_id=self.request_id, attempt=attempt,
            deadline_ms=max(1, int(remaining_s * 1000)) if send_deadline else None,
            ticket=self._ticket, avoid_node=self._avoid_node, content_type=self._content_type,
            wake=self._wake if attempt - self._first_attempt + 1 < self._policy.max_attempts
            else None)
        headers[Header.STREAM] = ASKED
        if self._stream_at is not None:
            left_ms = max(1, int((self._stream_at - time.monotonic()) * 1000))
            deadline = int(headers.get(Header.DEADLINE_MS, "0"))
            headers[Header.STREAM_DEADLINE_MS] = str(max(left_ms, deadline))
        queue: asyncio.Queue[Msg | None] = asyncio.Queue()
        self._queue = queue

        inbox = self._client.stream_inbox()  # `Client.stream_inbox`: the caller's own prefix
        # Each message queued as nats-py reads it: no task wake between.
        self._sub = await subscribe_as_read(nc, inbox, queue.put_nowait)
        # A close ends the wait for the next message at once (`_end_silent` says why), and
        # so does a drop for a client that asks it (`ClientConfig.end_on_disconnect`).
        self._client.on_close.add(self, lambda: queue.put_nowait(None))
        if self._client.on_drop is not None:
            self._client.on_drop.add(self, lambda: self._dropped_under(queue))
        if self._closed:  # closed while it subscribed
            await self._unsubscribe()
            return
        self._sent_at = time.monotonic()
        await nc.publish(self.subject, self._body, reply=inbox, headers=headers)

    # -- reading ---------------------------------------------------------------------------
    async def _next(self, wait_s: float) -> Msg | None:
        """The next message on the inbox, or None when none comes within `wait_s` (or the
        stream was closed meanwhile)."""
        assert self._queue is not None
        if self._closed:
            return None
        if wait_s <= 0:
            return self._queue.get_nowait() if not self._queue.empty() else None
        try:
            async with asyncio.timeout(wait_s):
                return await self._queue.get()
        except TimeoutError:
            return None

    def _feed(self, msg: Msg) -> Kind | None:
        """Read one message; on the final one, keep it as `result` (and unsubscribe later).
        None when the stream broke (then it is finished with a local 503)."""
        headers = dict(msg.headers or {})
        if is_no_responders(headers):
            self._finish_local(Status.UNAVAILABLE, Reason.NO_CAPACITY,
                               f"no router listens on {self.subject}", LocalCause.NO_RESPONDERS)
            return Kind.FINAL
        try:
            kind = self.reader.feed(headers, msg.data)
        except StreamBroken as exc:
            self._finish_local(Status.UNAVAILABLE, Reason.UNHEALTHY, f"the stream broke: {exc}",
                               LocalCause.BROKEN)
            return None
        if kind is Kind.TOKEN:
            self.pieces.append(msg.data.decode(errors="replace"))
        elif kind in (Kind.END, Kind.FINAL):
            self._finish(reply_status(headers), msg.data, headers, cause=None)
        return kind

    def __aiter__(self) -> AsyncGenerator[str, None]:
        return self._pieces()

    async def _pieces(self) -> AsyncGenerator[str, None]:
        try:
            await self.start()
            while self.result is None:
                msg = await self._next(self._wait_after_start_s())
                if self._closed:  # by aclose, from another task, while it waited
                    break
                if msg is None:
                    await self._end_silent("the stream went silent")
                    break
                kind = self._feed(msg)
                if kind is Kind.TOKEN:
                    yield self.pieces[-1]
                elif kind is None:  # broke: finished with a local 503
                    await self._cancel()
            self._raise_if_error()
        finally:
            await self.aclose()  # a no-op once it ended; else the cancel

    def _wait_after_start_s(self) -> float:
        if self._stream_at is None:
            return self._wait_s
        return self._stream_at + self._margin_s - time.monotonic()

    # -- ending ------------------------------------------------------------------------------
    def _finish(self, status: int, body: bytes, headers: dict[str, str], *,
                cause: LocalCause | None) -> None:
        self._statuses.append(status)
        if status == Status.BUSY and (Header.RETRY_AFTER_MS in headers
                                      or Header.RETRY_AFTER in headers):
            self._hinted += 1
        self.result = Result(
            status=status, body=body, headers=headers, request_id=self.request_id,
            statuses=tuple(self._statuses), hinted=self._hinted, waited_ms=self._waited_ms,
            last_attempt_ms=(time.monotonic() - self._sent_at) * 1000, local=cause is not None,
            local_cause=cause)

    def _finish_local(self, status: Status, reason: Reason, message: str,
                      cause: LocalCause) -> None:
        body, headers = local_reply(status, reason, message, self.request_id, cause)
        self._finish(int(status), body, headers, cause=cause)

    def _dropped_under(self, queue: asyncio.Queue[Msg | None]) -> None:
        """The connection dropped while this stream waited for its next message: what the
        plane sends meanwhile is lost (`OnDrop`), so the wait ends now."""
        self._dropped = True
        queue.put_nowait(None)

    async def _end_silent(self, what: str) -> None:
        if self._client.nc.is_closed:  # closed under it: say why, not "no message"
            self._finish_local(Status.UNAVAILABLE, Reason.UNHEALTHY,
                               str(closed_error(self._client.nc)), LocalCause.CLOSED)
            return
        if self._dropped:  # the cancel goes out at the reconnect: a node still on stops
            self._finish_local(Status.UNAVAILABLE, Reason.UNHEALTHY, DROPPED if not self.started
                               else DROPPED_MID_STREAM.format(
                                   node=self.start_headers.get(Header.NODE)),
                               LocalCause.DROPPED)
            await self._cancel()
            return
        where = f" (node {self.start_headers.get(Header.NODE)})" if self.started else ""
        self._finish_local(Status.DEADLINE, Reason.DEADLINE,
                           f"{what}{where}: no message in time from the plane; cancelled",
                           LocalCause.NO_ANSWER)
        await self._cancel()

    async def aclose(self) -> None:
        """End the stream now: a stream still running is cancelled (the plane frees its slot
        within a token step); the inbox is unsubscribed. Idempotent."""
        self._closed = True
        if self.result is None:
            # A 200 made up here: the caller ended it, there is no error to raise.
            self._begun = True  # never sent yet: now it never will be
            self._finish(int(Status.OK), b"", {Header.STATUS: str(int(Status.OK)),
                                              Header.REQUEST_ID: self.request_id},
                         cause=LocalCause.CANCELLED)
            if self._queue is not None:
                self._queue.put_nowait(None)  # wake a task waiting for the next message
            self.cancelled = True
            await self._cancel()
        await self._unsubscribe()

    async def _cancel(self) -> None:
        """Tell the node to stop (only a started stream has somewhere to send it), then stop
        listening: the node also notices nobody reads its inbox any more."""
        subject = self.reader.cancel_subject
        if subject:
            rid = self.start_headers.get(Header.REQUEST_ID, self.request_id)
            try:
                await self._client.nc.publish(subject, b"", headers={Header.REQUEST_ID: rid})
            except Exception as exc:  # a closed connection: the node sees nobody reads
                log.warning("stream cancel not sent", request_id=rid, error=repr(exc))
        await self._unsubscribe()

    async def _unsubscribe(self) -> None:
        self._client.on_close.discard(self)
        if self._client.on_drop is not None:
            self._client.on_drop.discard(self)
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # closed or draining connection: nothing left to stop
                log.debug("stream unsubscribe failed", error=repr(exc))

    def _raise_if_error(self) -> None:
        if self.raise_errors and self.result is not None and not self.result.ok:
            raise self.result.to_error()

    async def __aenter__(self) -> TokenStream:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

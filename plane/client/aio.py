"""The asyncio client: `invoke(model, payload, deadline_ms=...)` over core NATS request-reply.

    async with Client.connect("nats://127.0.0.1:4222") as plane:
        result = await plane.invoke("calibrated", {"duration_us": 2000}, deadline_ms=200)
        print(result.json(), result.attempts, result.node, result.service_us)

A call that gives no `deadline_ms` sends no `Plane-Deadline-Ms`: the plane's live deadline
for the model (`deadline_ms.<model>` in the PLANE_CONFIG bucket) applies to it, on each
attempt; the client bounds the whole call by `ClientConfig.wait_ms` only in case the plane
stays silent.

On a 429 it waits as `plane.contract.backoff.retry_delay_ms` says (the server's
Retry-After-Ms when its clock agrees with ours, exactly when it came with a ticket, else
capped exponential backoff with full jitter), and sends back the ticket it was given; a
holder the router calls back (its inbox, `Plane-Wake`, sent while another attempt may
follow: `plane.client.wake`) comes back then. After
a 503 that named a node it asks for another (Plane-Avoid-Node). It never sleeps past the
caller's deadline; it waits for an answer until the deadline plus `ClientConfig.
answer_margin_ms`, because the plane counts the deadline from when the router received the
request and answers within its grace of it (docs/design.md): at the deadline exactly, the
client would answer "no answer" for an answer on its way (a 200 of work done, or the
router's own 429 for a request it held). An attempt about to be sent while the connection
is down (reconnecting) waits for it at most `ClientConfig.reconnect_wait_ms`, then the call
ends 503 `no-capacity` locally; one already sent waits for its answer as above, or, with
`ClientConfig.end_on_disconnect`, ends 503 `unhealthy` locally the moment the connection
drops. A status the client made up itself is `Result.local`, and `Result.local_cause` says
why (`LocalCause`: no answer, never sent, the connection, nobody listening, ...).
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from nats.aio.client import Client as NATS
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from plane.client.attempt import (
    attempt_headers_for,
    encode_payload,
    local_reply,
    with_start_wait,
)
from plane.client.connection import (
    CONNECT_ATTEMPTS,
    DROPPED,
    NOT_CONNECTED,
    NOT_CONNECTED_TO_DEADLINE,
    ROUTERS_BACK_POLL_MS,
    Comeback,
    ConnectionDropped,
    OnClose,
    OnDrop,
    closed_error,
    open_connection,
)
from plane.client.result import LocalCause, Result, header_int, reply_status
from plane.client.stream import TokenStream
from plane.client.wake import EarlyCalls
from plane.contract.backoff import RetryPolicy, retry_delay_ms
from plane.contract.config import MAX_DEADLINE_MS, ConnectOptions
from plane.contract.errors import ConfigError
from plane.contract.identity import RequestIds
from plane.contract.messages import FINAL_REFUSALS, Reason, Status
from plane.contract.natsconn import close
from plane.contract.replies import now_ms
from plane.contract.reply_inbox import ReplyInbox
from plane.contract.subjects import Header, Names


class CallOptions(TypedDict, total=False):
    """`Client.call`'s optional arguments, as one typed value (the gateway builds it from an
    HTTP request's headers)."""

    deadline_ms: int
    request_id: str
    ticket: str
    avoid_node: str
    first_attempt: int
    content_type: str
    headers: Mapping[str, str]


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    names: Names = field(default_factory=Names)
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    # Deadlines to send, per model, for calls that give none. Empty (the default): send none,
    # so the plane's live `deadline_ms.<model>` applies.
    default_deadline_ms: dict[str, int] = field(default_factory=dict)
    # How long a call without a deadline waits for its answer, retries included. The plane
    # answers within its deadline; this only bounds a plane that stays silent.
    wait_ms: int = 30_000
    connect_attempts: int = CONNECT_ATTEMPTS  # retries of the first connect, then ConnectFailed
    # How long past a stream's deadline (or its TTFT budget, before the start) a stream waits
    # for the plane's own final message before it ends it as silent (local 504). The router
    # answers within its grace (50 ms) of the deadline; this leaves room for a busy machine.
    stream_margin_ms: int = 1000
    # How long past a call's deadline it waits for the plane's answer before it makes up its
    # own 504 (the router answers within its grace, 50 ms, of the deadline it counts from its
    # receipt; the rest is room for a busy machine). Calls without a deadline: `wait_ms`.
    answer_margin_ms: int = 250
    # How long an attempt waits for a lost connection to come back (nats-py reconnecting)
    # before the call ends 503 `no-capacity` locally; None: until the call's deadline (or
    # `wait_ms`). The gateway sets it short: an HTTP caller is better told at once.
    reconnect_wait_ms: int | None = None
    # A call or stream waiting for the plane when the connection drops ends at once, a local
    # 503 `unhealthy` (`plane.client.connection.OnDrop`: what the plane sent meanwhile is
    # lost). False: it waits on until its deadline (or `wait_ms`), for an answer a
    # connection back in time (another server of a cluster) may still bring. The gateway
    # sets it: an HTTP caller is better told at once than held.
    end_on_disconnect: bool = False
    seed: int | None = None  # the jitter's random source; None: seeded from the OS
    # Give the router an inbox (`Plane-Wake`) where it calls a ticket's holder back: on every
    # attempt that may be followed by another (`plane.client.wake`).
    early_calls: bool = True

    def __post_init__(self) -> None:
        for model, ms in self.default_deadline_ms.items():
            if not 1 <= ms <= MAX_DEADLINE_MS:
                raise ConfigError(f"deadline for {model} must be 1..{MAX_DEADLINE_MS} ms")
        if not 1 <= self.wait_ms <= 2 * MAX_DEADLINE_MS:
            raise ConfigError(f"wait_ms must be 1..{2 * MAX_DEADLINE_MS} ms")
        if not 1 <= self.connect_attempts <= 1000:
            raise ConfigError("connect_attempts must be 1..1000")
        if not 0 <= self.stream_margin_ms <= 60_000:
            raise ConfigError("stream_margin_ms must be 0..60000 ms")
        if not 0 <= self.answer_margin_ms <= 60_000:
            raise ConfigError("answer_margin_ms must be 0..60000 ms")
        if self.reconnect_wait_ms is not None and not 0 <= self.reconnect_wait_ms <= 600_000:
            raise ConfigError("reconnect_wait_ms must be 0..600000 ms (or None)")

    def deadline_ms(self, model: str) -> int | None:
        """The deadline to send for `model` when a call gives none (None: send none)."""
        return self.default_deadline_ms.get(model)


class Client:
    """Wraps a connected nats-py client (borrowed: `close()` is the owner's job), or owns one
    when made by `Client.connect(...)`."""

    def __init__(self, nc: NATS, config: ClientConfig | None = None) -> None:
        self.nc = nc
        self.config = config or ClientConfig()
        self._rng = random.Random(self.config.seed)
        self.calls = EarlyCalls(nc) if self.config.early_calls else None
        self.comeback = Comeback(nc)
        self.on_close = OnClose(nc)
        self.replies = ReplyInbox(nc)
        self.request_ids = RequestIds()
        # Each stream's inbox, under one prefix of this client's: `_INBOX.<nuid>.<n>`, as its
        # requests' replies are, so that the router tells this caller's tickets from others'
        # (`plane.router.caller`; an inbox of its own per stream made every stream caller
        # one, "": a gateway's no-shows unpinned everybody's streams). Its own subscription
        # each: a stream's reader that stops reading is seen by its node.
        self._stream_prefix = nc.new_inbox()
        self._streams = itertools.count(1)
        self.on_close.add(self.replies, self.replies.fail_all)
        self.on_drop = OnDrop(nc) if self.config.end_on_disconnect else None
        if self.on_drop is not None:
            self.on_drop.add(self.replies, lambda: self.replies.fail_all(ConnectionDropped))
        if self.calls is not None:
            self.on_close.add(self.calls, self.calls.wake_all)

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls, opts: ConnectOptions | str, config: ClientConfig | None = None
    ) -> AsyncIterator[Client]:
        if isinstance(opts, str):
            opts = ConnectOptions(url=opts, name="plane-client")
        config = config or ClientConfig()
        nc = await open_connection(opts, config.connect_attempts)
        try:
            yield cls(nc, config)
        finally:
            await close(nc)  # drains; closes when the server is gone (drain would raise)

    async def invoke(
        self,
        model: str,
        payload: Any,
        *,
        deadline_ms: int | None = None,
        policy: RetryPolicy | None = None,
        request_id: str | None = None,
        start_wait_ms: int | None = None,
    ) -> Result:
        """Call `model` and return its 200 `Result`; raise `Rejected`, `BadRequest`,
        `DeadlineExceeded` or `Unavailable` (with `attempts`) for anything else.
        `start_wait_ms` (`Plane-Wait-Ms`): how long to wait at the router for the request's
        start rather than be refused 429 (see `call`)."""
        result = await self.call(
            model, payload, deadline_ms=deadline_ms, policy=policy, request_id=request_id,
            start_wait_ms=start_wait_ms,
        )
        return result.raise_for_status()

    def stream(
        self,
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
        start_wait_ms: int | None = None,
    ) -> TokenStream:
        """A generation read as it is made (`plane.client.stream`): iterate it for its
        text pieces (`async for piece in plane.stream("tinylm", {...}, deadline_ms=500)`),
        or enter it (`async with`) to close it for sure. `deadline_ms` is the budget for the
        first token (refusals are retried within it, as `call` retries); `stream_deadline_ms`
        the whole stream's (default: the plane's); `start_wait_ms` as `call`'s. Nothing is
        sent until it is iterated, entered or started."""
        return TokenStream(
            self, model, payload, deadline_ms=deadline_ms,
            stream_deadline_ms=stream_deadline_ms, policy=policy, request_id=request_id,
            raise_errors=raise_errors, ticket=ticket, avoid_node=avoid_node,
            first_attempt=first_attempt, content_type=content_type,
            headers=with_start_wait(headers, start_wait_ms))

    async def call(
        self,
        model: str,
        payload: Any,
        *,
        deadline_ms: int | None = None,
        policy: RetryPolicy | None = None,
        request_id: str | None = None,
        ticket: str | None = None,
        avoid_node: str | None = None,
        first_attempt: int = 1,
        content_type: str | None = None,
        headers: Mapping[str, str] | None = None,
        start_wait_ms: int | None = None,
    ) -> Result:
        """Like `invoke`, but returns the final answer whatever its status (never raises for
        a status). The gateway and `plane pulse` use this to see every reply as it was.
        `start_wait_ms` (`Plane-Wait-Ms`, 1..600000): how long this caller waits at the router
        for its start rather than be refused 429 when no slot is free (for a burst sent at
        once, a batch: started within it, in turn, or refused at once as without it; a
        caller that retries its 429s needs none). Not `ClientConfig.wait_ms`, the bound on
        the whole call when it sets no deadline."""
        headers = with_start_wait(headers, start_wait_ms)
        subject = self.config.names.infer(model)  # raises InvalidToken on a bad name
        if deadline_ms is None:
            deadline_ms = self.config.deadline_ms(model)
        if deadline_ms is not None and deadline_ms <= 0:
            raise ConfigError("deadline_ms must be positive")
        # With no deadline the plane's own applies to each attempt; we only bound the wait.
        send_deadline = deadline_ms is not None
        budget_ms = deadline_ms if deadline_ms is not None else self.config.wait_ms
        policy = policy or self.config.policy
        body = encode_payload(payload)
        request_id = request_id or self.request_ids.next()
        deadline_at = time.monotonic() + budget_ms / 1000
        statuses: list[int] = []
        waited_ms = 0.0
        hinted = 0
        attempt = first_attempt
        if self.nc.is_closed:  # before the wake inbox's subscribe (then: until_connected)
            raise closed_error(self.nc)
        # Only a caller that will come back is put on call (the gateway's, which answers the
        # 429 itself, is not): its Retry-After counts on the call.
        wake = (await self.calls.inbox() if self.calls is not None and policy.max_attempts > 1
                else None)
        while True:
            held_until = self.reconnect_until(deadline_at)
            held = await self.comeback.until_connected(held_until)
            # Still down, held as long as it may be, or back only once the deadline had
            # passed: never sent, for the connection's sake.
            if self.comeback.down() or (held and time.monotonic() >= deadline_at):
                return self._disconnected(request_id, statuses, hinted, waited_ms,
                                          deadline_passed=held_until >= deadline_at)
            remaining_s = deadline_at - time.monotonic()
            attempt_headers = attempt_headers_for(
                headers, request_id=request_id, attempt=attempt,
                deadline_ms=max(1, int(remaining_s * 1000)) if send_deadline else None,
                ticket=ticket, avoid_node=avoid_node, content_type=content_type,
                wake=wake if attempt - first_attempt + 1 < policy.max_attempts else None)
            sent = time.monotonic()
            reply_body, reply_headers, cause = await self._attempt(
                subject, body, attempt_headers, remaining_s,
                remaining_s + self.config.answer_margin_ms / 1000 if send_deadline else
                remaining_s,
                "no answer within the deadline" if send_deadline else
                f"no answer within {budget_ms} ms (ClientConfig.wait_ms: the call set no "
                "deadline)",
            )
            last_attempt_ms = (time.monotonic() - sent) * 1000
            status = reply_status(reply_headers)
            statuses.append(status)
            if status == Status.BUSY and (Header.RETRY_AFTER_MS in reply_headers
                                          or Header.RETRY_AFTER in reply_headers):
                hinted += 1
            result = Result(
                status=status, body=reply_body, headers=reply_headers, request_id=request_id,
                statuses=tuple(statuses), hinted=hinted, waited_ms=waited_ms,
                last_attempt_ms=last_attempt_ms, local=cause is not None, local_cause=cause,
            )
            delay_ms = self.retry_delay_for(result, policy, attempt - first_attempt + 1,
                                            deadline_at)
            if delay_ms is None:
                return result
            given = reply_headers.get(Header.TICKET) if status == Status.BUSY else None
            if given:
                ticket = given
            elif status == Status.UNAVAILABLE:
                avoid_node = reply_headers.get(Header.NODE) or avoid_node
            waited_ms += await self.pause(given, delay_ms)
            attempt += 1

    def stream_inbox(self) -> str:
        """A new stream's inbox: `<this client's stream prefix>.<n>`."""
        return f"{self._stream_prefix}.{next(self._streams)}"

    def reconnect_until(self, deadline_at: float) -> float:
        """Until when an attempt waits for a lost connection (monotonic; calls and streams)."""
        if self.config.reconnect_wait_ms is None:
            return deadline_at
        return min(deadline_at, time.monotonic() + self.config.reconnect_wait_ms / 1000)

    def _disconnected(self, request_id: str, statuses: list[int], hinted: int,
                      waited_ms: float, *, deadline_passed: bool) -> Result:
        """The call's end when the connection stayed down past `reconnect_wait_ms` (503
        `no-capacity`), or, waited for until the deadline, past that (504, as any call whose
        deadline passed, saying why it was never sent)."""
        status, reason, why = ((Status.DEADLINE, Reason.DEADLINE, NOT_CONNECTED_TO_DEADLINE)
                               if deadline_passed else
                               (Status.UNAVAILABLE, Reason.NO_CAPACITY, NOT_CONNECTED))
        body, headers = local_reply(status, reason, why, request_id, LocalCause.DISCONNECTED)
        statuses.append(status)
        return Result(status=status, body=body, headers=headers,
                      request_id=request_id, statuses=tuple(statuses), hinted=hinted,
                      waited_ms=waited_ms, last_attempt_ms=0.0, local=True,
                      local_cause=LocalCause.DISCONNECTED)

    async def pause(self, ticket: str | None, delay_ms: float) -> float:
        """Wait `delay_ms` before the next attempt, or less when the router calls `ticket`'s
        holder early (`plane.client.wake`); the ms waited (`delay_ms`, or as long as it took
        the call to come)."""
        began = time.monotonic()
        if self.calls is None or ticket is None or not self.calls.subject:
            # No call can come: only a close (the next attempt would fail) ends it early.
            ended = await self.on_close.sleep(delay_ms / 1000)
        else:
            ended = await self.calls.sleep(ticket, delay_ms / 1000)
        return (time.monotonic() - began) * 1000 if ended else delay_ms

    def retry_delay_for(
        self, result: Result, policy: RetryPolicy, tries: int, deadline_at: float
    ) -> float | None:
        """Whether to try again after `result` (the answer to the `tries`-th attempt), and
        after how long (ms; None: give up). Only a 429 that is not final (`FINAL_REFUSALS`), or a
        503 from the server, is worth another attempt; `deadline_at` is monotonic. Shared by
        `call` and the streams (`plane.client.stream`), which retry only before a start.

        Also, whatever the policy, an attempt that found no router just after the connection
        came back is sent again shortly (`Comeback`): it reached nobody, and the routers are
        likely still reconnecting."""
        if (result.local and result.status == Status.UNAVAILABLE
                and result.reason == Reason.NO_CAPACITY
                and self.comeback.routers_may_be_returning()):
            left_ms = (deadline_at - time.monotonic()) * 1000
            return ROUTERS_BACK_POLL_MS if left_ms > ROUTERS_BACK_POLL_MS else None
        retryable = (result.status == Status.BUSY and result.reason not in FINAL_REFUSALS) or (
            result.status == Status.UNAVAILABLE and not result.local
        )
        if not retryable or tries >= policy.max_attempts:
            return None
        busy = result.status == Status.BUSY
        return retry_delay_ms(
            policy,
            attempt=tries,
            remaining_ms=(deadline_at - time.monotonic()) * 1000,
            u=self._rng.random(),
            retry_after_ms=result.retry_after_ms if busy else None,
            server_time_ms=header_int(result.headers, Header.SERVER_TIME),
            local_time_ms=now_ms(),
            ticket=busy and Header.TICKET in result.headers,
        )

    async def _attempt(
        self, subject: str, body: bytes, headers: dict[str, str], remaining_s: float,
        timeout_s: float, no_answer: str,
    ) -> tuple[bytes, dict[str, str], LocalCause | None]:
        """One request, sent with `remaining_s` of the call left, waited for `timeout_s`;
        (body, headers, why the client made it up itself: None for the plane's answer)."""
        rid = headers[Header.REQUEST_ID]
        if remaining_s <= 0:  # a retry's wait (or the loop) ran past the deadline
            b, h = local_reply(Status.DEADLINE, Reason.DEADLINE, "deadline passed before send",
                               rid, LocalCause.NOT_SENT)
            return b, h, LocalCause.NOT_SENT
        try:
            msg = await self.replies.request(subject, body, headers, timeout_s)
        except ConnectionClosedError:
            raise closed_error(self.nc) from None
        except NatsTimeout:
            if self.nc.is_closed:  # closed while it waited: say why, not "no answer"
                raise closed_error(self.nc) from None
            b, h = local_reply(Status.DEADLINE, Reason.DEADLINE, no_answer, rid,
                               LocalCause.NO_ANSWER)
            return b, h, LocalCause.NO_ANSWER
        except NoRespondersError:
            b, h = local_reply(Status.UNAVAILABLE, Reason.NO_CAPACITY,
                               f"no router listens on {subject}", rid, LocalCause.NO_RESPONDERS)
            return b, h, LocalCause.NO_RESPONDERS
        except ConnectionDropped:  # `end_on_disconnect`: its answer, if any, is lost
            b, h = local_reply(Status.UNAVAILABLE, Reason.UNHEALTHY, DROPPED, rid,
                               LocalCause.DROPPED)
            return b, h, LocalCause.DROPPED
        return msg.data, msg.headers or {}, None  # nats-py makes a dict per message

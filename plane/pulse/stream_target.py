"""The plane's streams over raw NATS, read the way any client reads them: a request published
with a reply inbox, every message on that inbox fed to `StreamReader` (the one reader rule of
docs/design.md "Streams"), until its one final message.

One wildcard subscription (`<inbox>.*`) carries every stream of the run, each attempt on an
inbox of its own (`<inbox>.<n>`): the cheapest way to read thousands of streams. Its
messages are taken as nats-py reads them (`plane.contract.taken_as_read`), not one task's
turn later: a message's arrival time is when it came off the socket, and the load generator
spends no wake-up per token message on the cores it shares with the plane. A message on an
inbox whose stream has already ended (a second final message, a token after `end`) is
counted in `after_final`: the contract says there are none.

With a retry policy a 429 is retried as the SDK retries a request: at its Retry-After-Ms
(when the server's clock is trusted), or when the router calls its holder first (the
inbox sent as `Plane-Wake`, `plane.client.wake`), with its `Plane-Ticket`, within the TTFT
budget.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from plane.client.result import header_int
from plane.client.wake import EarlyCalls
from plane.contract.backoff import NO_RETRY, RetryPolicy, retry_delay_ms
from plane.contract.config import ConnectOptions
from plane.contract.errors import ConfigError
from plane.contract.headers import is_no_responders
from plane.contract.identity import RequestIds
from plane.contract.messages import FINAL_REFUSALS
from plane.contract.natsconn import close, connect
from plane.contract.replies import now_ms
from plane.contract.streams import ASKED, Kind, StreamBroken, StreamReader
from plane.contract.subjects import Header, Names
from plane.contract.taken_as_read import subscribe_as_read
from plane.pulse.stream_outcome import BROKEN, ERROR, TIMEOUT, StreamOutcome

# The server's own status line on a request nobody listens to (nats-py puts it in `Status`).
NO_RESPONDERS = "no-responders"  # the reason pulse records for the server's status
WAIT_GRACE_MS = 2000  # past the stream deadline: the router's own 504 comes within its grace
DEFAULT_WAIT_MS = 60_000  # no stream deadline sent: wait this long for a stream to end
_PENDING_MSGS = 1 << 20  # the subscription's buffer: a token burst must never be dropped
_PENDING_BYTES = 256 << 20


@dataclass(frozen=True, kw_only=True)
class StreamSpec:
    """What every stream of a run asks for.

    deadline_ms:        Plane-Deadline-Ms, the TTFT budget (None: the plane's default)
    stream_deadline_ms: Plane-Stream-Deadline-Ms (None: the plane's default)
    wait_ms:            how long an attempt waits for its final message when pulse sent no
                        stream deadline (with one: the deadline left + WAIT_GRACE_MS)
    """

    model: str = "tinylm"
    deadline_ms: int | None = None
    stream_deadline_ms: int | None = None
    policy: RetryPolicy = NO_RETRY
    wait_ms: int = DEFAULT_WAIT_MS
    names: Names = field(default_factory=Names)

    def __post_init__(self) -> None:
        if (self.deadline_ms is not None and self.stream_deadline_ms is not None
                and self.stream_deadline_ms < self.deadline_ms):
            raise ConfigError("--stream-deadline-ms must be at least --deadline-ms (the "
                              "first token comes within the whole stream's budget)")
        if self.wait_ms < 1:
            raise ConfigError("wait_ms must be positive")


class StreamCall:
    """One attempt in flight, fed by the target's subscription. The benchmark uses it
    directly (`StreamTarget.begin`) to watch a stream start and to cancel it."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.reader = StreamReader()
        self.start_t: float | None = None  # monotonic times of arrival
        self.token_t: list[float] = []
        self.token_n: list[int] = []
        self.end_t: float | None = None
        self.broken = False
        self.started = asyncio.Event()
        self.first_token = asyncio.Event()
        self.done = asyncio.Event()

    def feed(self, t: float, headers: Mapping[str, str] | None, body: bytes) -> None:
        try:
            kind = self.reader.feed(headers, body)
        except StreamBroken:
            self.broken, self.end_t = True, t
            self.done.set()
            return
        if kind is Kind.TOKEN:
            self.token_t.append(t)
            self.token_n.append(len(body))  # tinylm emits ASCII: one byte, one token
            if len(self.token_t) == 1:
                self.first_token.set()
        elif kind is Kind.START:
            self.start_t = t
            self.started.set()
        else:
            self.end_t = t
            self.done.set()

    @property
    def headers(self) -> Mapping[str, str]:
        return self.reader.final_headers or {}


class StreamTarget:
    """`async with StreamTarget(opts, spec) as t: outcome = await t.stream(body, ...)`"""

    def __init__(self, opts: ConnectOptions, spec: StreamSpec, *, seed: int | None = None
                 ) -> None:
        self.name = f"nats {opts.url} model={spec.model} streams"
        self.spec = spec
        self._opts = opts
        self._subject = spec.names.infer(spec.model)  # raises InvalidToken on a bad name
        self._rng = random.Random(seed)
        self._nc: NATS | None = None
        self._early: EarlyCalls | None = None  # where the router calls holders (Plane-Wake)
        self._wake = ""
        self._prefix = ""
        self._ids = itertools.count()
        self._rids = RequestIds()
        self._calls: dict[str, StreamCall] = {}
        self._ended: set[str] = set()  # inboxes whose stream ended: a message there is stray
        self.after_final = 0  # messages on an inbox after its final message (contract: none)
        self.after_timeout = 0  # messages on an inbox pulse stopped waiting on

    async def __aenter__(self) -> StreamTarget:
        self._nc = await connect(self._opts)
        self._early = EarlyCalls(self._nc)
        self._wake = await self._early.inbox()
        self._prefix = self._nc.new_inbox()
        await subscribe_as_read(self._nc, f"{self._prefix}.*", self._take,
                                pending_msgs_limit=_PENDING_MSGS,
                                pending_bytes_limit=_PENDING_BYTES)
        await self._nc.flush()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        nc, self._nc = self._nc, None
        if nc is not None:
            await close(nc)

    def _take(self, msg: Msg) -> None:
        t = time.monotonic()
        inbox = msg.subject
        call = self._calls.get(inbox)
        if call is None:
            if inbox in self._ended:
                self.after_final += 1
            else:
                self.after_timeout += 1
            return
        call.feed(t, msg.headers, msg.data)
        if call.done.is_set():
            del self._calls[inbox]
            self._ended.add(inbox)

    # -- one attempt ------------------------------------------------------------------------
    async def begin(self, body: bytes, headers: Mapping[str, str]) -> tuple[str, StreamCall]:
        """Publish one attempt with `headers` (Plane-Stream and the request id are set here);
        return its inbox and the call its messages feed."""
        assert self._nc is not None, "use StreamTarget as an async context manager"
        request_id = headers.get(Header.REQUEST_ID) or self._rids.next()
        inbox = f"{self._prefix}.{next(self._ids)}"
        call = StreamCall(request_id)
        self._calls[inbox] = call
        h = {**headers, Header.STREAM: ASKED, Header.REQUEST_ID: request_id}
        await self._nc.publish(self._subject, body, reply=inbox, headers=h)
        return inbox, call

    async def cancel(self, call: StreamCall) -> bool:
        """Publish the stream's cancel (its start's Plane-Cancel-Subject); False when it has
        not started (nothing to name yet)."""
        assert self._nc is not None
        subject = call.reader.cancel_subject
        if subject is None:
            return False
        await self._nc.publish(subject, b"", headers={Header.REQUEST_ID: call.request_id})
        await self._nc.flush()
        return True

    def forget(self, inbox: str) -> None:
        """Stop waiting on an attempt (it ran out of time): later messages count as such."""
        self._calls.pop(inbox, None)

    # -- one stream, retries included --------------------------------------------------------
    async def stream(self, body: bytes, *, t0: float, scheduled_s: float) -> StreamOutcome:
        """Run one stream to its final message (or out of time); never raises for a status.
        `t0` is the run's start (monotonic), `scheduled_s` this stream's arrival after it."""
        spec = self.spec
        first_sent = time.monotonic()
        ttft_at = None if spec.deadline_ms is None else first_sent + spec.deadline_ms / 1000
        end_at = (None if spec.stream_deadline_ms is None
                  else first_sent + spec.stream_deadline_ms / 1000)
        retry_until = ttft_at if ttft_at is not None else first_sent + spec.wait_ms / 1000
        request_id = self._rids.next()
        statuses: list[int] = []
        reasons: list[str] = []
        hinted, ticket = 0, None
        while True:
            now = time.monotonic()
            headers = {Header.REQUEST_ID: request_id, Header.ATTEMPT: str(len(statuses) + 1)}
            if ttft_at is not None:
                headers[Header.DEADLINE_MS] = str(max(1, int((ttft_at - now) * 1000)))
            if end_at is not None:
                # At least the TTFT budget sent (the contract's rule), both counted from now.
                left = max(1, int((end_at - now) * 1000))
                headers[Header.STREAM_DEADLINE_MS] = str(
                    max(left, int(headers.get(Header.DEADLINE_MS, "1"))))
            if ticket:
                headers[Header.TICKET] = ticket
            if self._wake and len(statuses) + 1 < spec.policy.max_attempts:
                headers[Header.WAKE] = self._wake  # a caller that may come back
            sent = time.monotonic()
            try:
                inbox, call = await self.begin(body, headers)
            except (NatsError, OSError):  # the connection under us failed: count, go on
                return StreamOutcome(scheduled_s=scheduled_s, sent_s=first_sent - t0,
                                     statuses=(*statuses, 0), reasons=(*reasons, ""),
                                     final=ERROR, hinted=hinted,
                                     stream_deadline_ms=spec.stream_deadline_ms)
            wait_s = (end_at - sent + WAIT_GRACE_MS / 1000 if end_at is not None
                      else spec.wait_ms / 1000)
            try:
                async with asyncio.timeout(max(0.001, wait_s)):
                    await call.done.wait()
            except TimeoutError:
                self.forget(inbox)
                await self.cancel(call)  # free the slot if it still runs
            status = 0 if call.end_t is None or call.broken else call.reader.status
            reason = call.headers.get(Header.REASON, "")
            if status == 0 and is_no_responders(call.headers):
                status, reason = 503, NO_RESPONDERS  # the server's: nobody listens there
            statuses.append(status)
            reasons.append(reason)
            if status == 429 and Header.RETRY_AFTER_MS in call.headers:
                hinted += 1
            delay = None
            if status == 429 and reason not in FINAL_REFUSALS:
                delay = retry_delay_ms(
                    spec.policy, attempt=len(statuses),
                    remaining_ms=(retry_until - time.monotonic()) * 1000,
                    u=self._rng.random(),
                    retry_after_ms=header_int(call.headers, Header.RETRY_AFTER_MS),
                    server_time_ms=header_int(call.headers, Header.SERVER_TIME),
                    local_time_ms=now_ms(), ticket=Header.TICKET in call.headers)
            if delay is None:
                return self._outcome(call, t0=t0, scheduled_s=scheduled_s,
                                     first_sent=first_sent, sent=sent, statuses=statuses,
                                     reasons=reasons, hinted=hinted)
            given = call.headers.get(Header.TICKET)
            ticket = given or ticket
            assert self._early is not None
            await self._early.sleep(given, delay / 1000)  # or until called, with a ticket

    def _outcome(self, call: StreamCall, *, t0: float, scheduled_s: float, first_sent: float,
                 sent: float, statuses: list[int], reasons: list[str], hinted: int
                 ) -> StreamOutcome:
        def rel(t: float | None) -> float | None:
            return None if t is None else t - t0

        if call.broken:
            final = BROKEN
        elif call.end_t is None:
            final = TIMEOUT
        else:
            final = str(statuses[-1])
        end = call.reader.end
        admitted = call.start_t is not None or final in ("504", TIMEOUT)
        return StreamOutcome(
            scheduled_s=scheduled_s, sent_s=first_sent - t0,
            accepted_s=rel(sent) if admitted else None,
            start_s=rel(call.start_t), token_s=tuple(t - t0 for t in call.token_t),
            token_n=tuple(call.token_n), end_s=rel(call.end_t),
            statuses=tuple(statuses), reasons=tuple(reasons), final=final,
            finish=end.finish_reason if end is not None else "", hinted=hinted,
            stream_deadline_ms=self.spec.stream_deadline_ms,
        )

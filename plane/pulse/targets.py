"""What pulse can load: the plane over NATS (through the SDK, so `--retry` is the SDK's own
retry policy) and any HTTP endpoint (with the same policy function when `--retry`).

A target is an async context manager with `send(body) -> Attempts`. It never raises for a
status, a timeout or a broken connection: each of those is an answer to count. An answer the
client made up itself (the SDK's, or, through the gateway, its SDK's: `Plane-Local`) is
counted as that, by why (`Attempts.local`), never as a status of the plane's.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Protocol

import aiohttp
import structlog
from nats.errors import ConnectionClosedError

from plane.client import Client, ClientConfig
from plane.client.result import LocalCause, Result, header_int
from plane.contract.backoff import RetryPolicy, retry_delay_ms
from plane.contract.config import ConnectOptions
from plane.contract.errors import ConnectionClosed
from plane.contract.messages import FINAL_REFUSALS
from plane.contract.replies import now_ms
from plane.contract.subjects import Header
from plane.pulse.outcome import ERROR, TIMEOUT, UNSENT, Attempts

log = structlog.get_logger("plane.pulse")

SERVER_TIME_HTTP = "X-Server-Time"  # the gateway's name for Plane-Server-Time


class Target(Protocol):
    name: str

    async def __aenter__(self) -> Target: ...

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    async def send(self, body: bytes) -> Attempts: ...


class NatsTarget:
    """The plane, over core NATS, through `plane.client.Client.call`. `deadline_ms` None:
    no `Plane-Deadline-Ms` is sent (the router's live deadline applies) and an answer is
    waited for up to `wait_ms`."""

    def __init__(self, opts: ConnectOptions, *, model: str, deadline_ms: int | None,
                 policy: RetryPolicy, wait_ms: int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.name = f"nats {opts.url} model={model}"
        self._opts, self._model, self._deadline_ms = opts, model, deadline_ms
        self._headers = headers or None  # sent on every request (`--wait-ms`)
        self._config = ClientConfig(policy=policy) if wait_ms is None else ClientConfig(
            policy=policy, wait_ms=wait_ms)
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Client | None = None
        self._closed_said = False  # its connection's close is logged once

    async def __aenter__(self) -> NatsTarget:
        """Connect (again, after an exit: a target can be used for several runs)."""
        self._closed_said = False
        self._stack = contextlib.AsyncExitStack()
        self._client = await self._stack.enter_async_context(
            Client.connect(self._opts, self._config))
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    async def send(self, body: bytes) -> Attempts:
        """A closed connection (nats-py closes it on most of the server's errors, and never
        opens it again) ends this request, and each one after it at once, as failed in
        transport (`LocalCause.CLOSED`); it raised out of the run, a traceback and no
        report. Said once, with why it closed."""
        assert self._client is not None
        try:
            r = await self._client.call(self._model, body, deadline_ms=self._deadline_ms,
                                        headers=self._headers)
        except (ConnectionClosed, ConnectionClosedError) as exc:
            if not self._closed_said:
                self._closed_said = True
                log.warning("the connection to the plane closed: every request from now on "
                            "ends in error (closed); run pulse again once the plane's server "
                            "takes this connection", target=self.name, why=str(exc))
            return Attempts(statuses=(0,), final=ERROR, local=LocalCause.CLOSED)
        return attempts_of(r)


def attempts_of(r: Result) -> Attempts:
    """A call's account, each end under its own name. The SDK's own statuses (`r.local`)
    are told apart by why it made them (`LocalCause`), not by their number: a 504 it made is
    a timeout only when an attempt went and nothing came back. Counted by status alone, a
    call held for a lost connection until its deadline and never sent ("deadline passed
    before send") was a timeout, with its whole deadline as an accepted latency and as a
    mark of saturation, and a retry whose wait ran past the deadline was a first retry
    sent and failed, at ~0 ms."""
    last_us = int(r.last_attempt_ms * 1000)
    cause = r.local_cause if r.local else None
    if cause is None:
        return Attempts(statuses=r.statuses, final=str(r.status), hinted=r.hinted,
                        last_attempt_us=last_us)
    return client_made(cause, r.statuses[:-1], hinted=r.hinted, last_attempt_us=last_us)


def client_made(cause: str, earlier: tuple[int, ...], *, hinted: int,
                last_attempt_us: int) -> Attempts:
    """A final the client made up itself for `cause` (`LocalCause`'s value: the SDK's own,
    or the gateway's SDK's, `Plane-Local`), after the attempts `earlier`."""
    if cause == LocalCause.NOT_SENT and earlier:
        # Its deadline passed in the wait for a retry: the attempt that never went is none.
        return Attempts(statuses=earlier, final=UNSENT, hinted=hinted,
                        last_attempt_us=last_attempt_us, local=cause)
    # No answer to an attempt sent, or (nothing sent at all) the deadline gone before the
    # first could go: out of time. Anything else (nobody listening, the connection down,
    # dropped or closed, a cause newer than this pulse) failed in transport.
    final = TIMEOUT if cause in (LocalCause.NO_ANSWER, LocalCause.NOT_SENT) else ERROR
    return Attempts(statuses=(*earlier, 0), final=final, hinted=hinted,
                    last_attempt_us=last_attempt_us, local=cause)


class HttpTarget:
    """Any HTTP endpoint: POST `body` to `url`. With a retry policy, a 429 is retried as the
    SDK would (Retry-After-Ms / Retry-After, X-Server-Time, Plane-Ticket echoed).
    `deadline_ms` None: no `Plane-Deadline-Ms` is sent; retries stop at `timeout_ms`."""

    def __init__(self, url: str, *, deadline_ms: int | None, timeout_ms: int,
                 policy: RetryPolicy,
                 concurrency: int, headers: dict[str, str] | None = None,
                 seed: int | None = None) -> None:
        self.name = f"http {url}"
        self._url, self._deadline_ms, self._policy = url, deadline_ms, policy
        self._timeout = aiohttp.ClientTimeout(total=timeout_ms / 1000)
        self._concurrency = concurrency
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        self._rng = random.Random(seed)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> HttpTarget:
        connector = aiohttp.TCPConnector(limit=self._concurrency, force_close=False)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()

    async def send(self, body: bytes) -> Attempts:
        assert self._session is not None
        budget_s = (self._deadline_ms / 1000 if self._deadline_ms is not None
                    else self._timeout.total or 0.0)
        deadline_at = time.monotonic() + budget_s
        statuses: list[int] = []
        hinted, ticket = 0, None
        while True:
            headers = {**self._headers, Header.ATTEMPT: str(len(statuses) + 1)}
            if self._deadline_ms is not None:
                headers[Header.DEADLINE_MS] = str(max(1, int((deadline_at - time.monotonic())
                                                             * 1000)))
            if ticket:
                headers[Header.TICKET] = ticket
            sent = time.monotonic()
            try:
                async with self._session.post(self._url, data=body, headers=headers) as resp:
                    await resp.read()
                    status, rh = resp.status, resp.headers
            except TimeoutError:
                return Attempts(statuses=(*statuses, 0), final=TIMEOUT, hinted=hinted,
                                last_attempt_us=int((time.monotonic() - sent) * 1e6))
            except aiohttp.ClientError:
                return Attempts(statuses=(*statuses, 0), final=ERROR, hinted=hinted,
                                last_attempt_us=int((time.monotonic() - sent) * 1e6))
            last_us = int((time.monotonic() - sent) * 1e6)
            if cause := rh.get(Header.LOCAL):  # the gateway's SDK's answer, not the plane's
                return client_made(cause, tuple(statuses), hinted=hinted,
                                   last_attempt_us=last_us)
            statuses.append(status)
            after_ms = _retry_after_ms(rh)
            if status == 429 and after_ms is not None:
                hinted += 1
            delay = None
            if status == 429 and rh.get(Header.REASON) not in FINAL_REFUSALS:
                delay = retry_delay_ms(
                    self._policy, attempt=len(statuses),
                    remaining_ms=(deadline_at - time.monotonic()) * 1000,
                    u=self._rng.random(), retry_after_ms=after_ms,
                    server_time_ms=header_int(rh, SERVER_TIME_HTTP)
                    or header_int(rh, Header.SERVER_TIME),
                    local_time_ms=now_ms(), ticket=Header.TICKET in rh)
            if delay is None:
                return Attempts(statuses=tuple(statuses), final=str(status), hinted=hinted,
                                last_attempt_us=last_us)
            ticket = rh.get(Header.TICKET) or ticket
            await asyncio.sleep(delay / 1000)


def _retry_after_ms(headers: Mapping[str, str]) -> int | None:
    """Retry-After-Ms, else Retry-After (whole seconds; an HTTP date is not used here)."""
    ms = header_int(headers, Header.RETRY_AFTER_MS)
    if ms is not None:
        return ms
    s = header_int(headers, Header.RETRY_AFTER)
    return None if s is None else s * 1000

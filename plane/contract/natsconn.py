"""Connect to NATS with the options every command shares (URL, user/password, token, creds,
TLS CA). One function, so a secured server works the same for router, node, gateway, bridge;
and one to close, so that a stop with the server gone is as clean as any other."""

from __future__ import annotations

import asyncio
import math
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.errors import SlowConsumerError

from plane.contract.config import ConnectOptions
from plane.contract.errors import ConfigError, PlaneError, Unavailable
from plane.contract.header_lines import use_fast_header_lines
from plane.contract.lost_pings import fail_lost_pings
from plane.contract.refusals import Refusal, refusal_of, unknown_host, what_to_do
from plane.contract.soon_flush import use_soon_flush


def connect_kwargs(opts: ConnectOptions) -> dict[str, Any]:
    if opts.url is None:
        raise ConfigError("no NATS URL: pass --nats URL, or use `plane up` for the embedded one")
    kw: dict[str, Any] = {
        "servers": opts.url.split(","),
        "name": opts.name,
        "connect_timeout": 5,
        # Bounded for the first connection (a wrong password or URL fails in about ten
        # seconds with a clear error), unbounded once connected: see `connect`.
        "max_reconnect_attempts": INITIAL_ATTEMPTS,
        "reconnect_time_wait": 0.25,
        "allow_reconnect": True,
        "no_echo": opts.no_echo,
    }
    if opts.user is not None:
        kw["user"], kw["password"] = opts.user, opts.password
    if opts.token is not None:
        kw["token"] = opts.token
    if opts.creds is not None:
        kw["user_credentials"] = opts.creds
    if opts.tls_ca is not None:
        kw["tls"] = ssl.create_default_context(cafile=opts.tls_ca)
    return kw


log = structlog.get_logger("plane.nats")

INITIAL_ATTEMPTS = 40  # x reconnect_time_wait 0.25 s
# While the server is gone every reconnect attempt (4 a second) reports an error: one line
# for the first, then at most one per ERROR_LOG_EVERY_S saying how many it stands for.
ERROR_LOG_EVERY_S = 30.0
DRAIN_TIMEOUT_S = 5.0
DRAIN_FLUSH_S = 2.0  # past a drain's timeout, for the flush that ends it
RECONNECT_END_S = 2.0  # a reconnect cancelled at close ends within this (`_end_reconnecting`)
RECONNECT_END_POLL_S = 0.05


class Throttle:
    """At most one pass per `every_s` for each kind of event; `allow` answers None to hold
    one back, else how many were held back since the last pass. `reset` after a recovery,
    so the next outage is reported at once."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (last pass, held since)

    def allow(self, kind: str) -> int | None:
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last[0] < self.every_s:
            self._last[kind] = (last[0], last[1] + 1)
            return None
        self._last[kind] = (now, 0)
        return last[1] if last is not None else 0

    def reset(self) -> None:
        self._last.clear()


Overflow = Callable[[str, str], Awaitable[None]]  # (subject, reply) of a dropped message

# Subscriptions whose overflow someone answers. nats-py drops a message that arrives while
# the subscription holds its pending limit, and reports it to the connection's error
# callback (`SlowConsumerError`, with the message's subject and reply): for a request, the
# handler registered here answers it, so that a flood is refused, not lost. Weak: a
# subscription that is gone takes its entry with it.
_OVERFLOW: weakref.WeakKeyDictionary[Subscription, Overflow] = weakref.WeakKeyDictionary()


def on_overflow(sub: Subscription, handler: Overflow) -> None:
    """Answer the messages `sub` drops past its pending limit with `handler` (connections
    made by `connect` only)."""
    _OVERFLOW[sub] = handler


# Where a role's command takes its credentials, for the message of a refusal.
ROLE_CREDENTIALS = "--user/--password, --token, --creds, or PLANE_AUTH=DIR:ROLE"


class Refused(Exception):
    """A first connect ended at an error that another try cannot mend (`connect_refusable`):
    the server's refusal (`refusal`), or a URL that names no host (`bad_url`, why)."""

    def __init__(self, cause: BaseException, *, refusal: Refusal | None,
                 bad_url: str | None) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.refusal = refusal
        self.bad_url = bad_url

    def error(self, url: str | None, *, credentials: str,
              failed: Callable[[str], PlaneError]) -> PlaneError:
        """The error a command raises for it: `ConfigError` for a URL that is none, else
        `failed` of a message that names the server's words and what to do)."""
        if self.bad_url is not None:
            return ConfigError(f"cannot connect to NATS at {url}: {self.bad_url}")
        assert self.refusal is not None
        return failed(f"cannot connect to NATS at {url}: {self.cause}: "
                      f"{what_to_do(self.refusal, credentials=credentials)}")


ErrorCallback = Callable[[Exception], Awaitable[None]]


async def connect_refusable(nc: Client, kw: dict[str, Any], url: str) -> Client:
    """nats-py's first connect (`kw`: its options, whose `error_cb` sees every error),
    ended at once by the first error another try cannot mend: the server's refusal (wrong
    credentials, an account at its connection limit: `plane.contract.refusals`) or a URL
    without a scheme whose host does not resolve. Raises `Refused` for those (the
    half-made connection closed), else what nats-py raises once its tries are spent.

    The stop is the error callback's: nats-py calls it for each failed try, from inside its
    connect loop, and an exception out of it ends the loop (`Refused` is no OSError, and no
    nats error, which the loop would take for another failed try)."""
    theirs: ErrorCallback = kw["error_cb"]
    first = True

    async def error_cb(exc: Exception) -> None:
        await theirs(exc)
        if not first:
            return
        refusal = refusal_of(exc)
        bad_url = unknown_host(exc, url)
        if refusal is not None or bad_url is not None:
            raise Refused(exc, refusal=refusal, bad_url=bad_url)

    try:
        await nc.connect(**kw | {"error_cb": error_cb})
    except Refused:
        first = False  # what the close reports is no refusal of ours
        await close_now(nc)
        raise
    first = False
    return nc


async def connect(opts: ConnectOptions) -> Client:
    """Connect; raise `Unavailable` saying why when the server cannot be reached or refuses
    us (at once for a refusal: `connect_refusable`). Once connected, reconnect forever (a
    broker restart must not end a node)."""
    last: list[BaseException] = []
    throttle = Throttle(ERROR_LOG_EVERY_S)

    async def remember(exc: Exception) -> None:
        if isinstance(exc, SlowConsumerError) and (answer := _OVERFLOW.get(exc.sub)):
            await answer(exc.subject, exc.reply)
            return
        last[:] = [exc]  # only the latest: this callback lives as long as the connection
        held = throttle.allow(type(exc).__name__)
        if held is not None:
            log.warning("nats connection error", name=opts.name, error=repr(exc),
                        repeats_not_logged=held)

    async def reconnected() -> None:
        throttle.reset()  # so the first error of the next outage is logged at once
        log.info("nats reconnected", name=opts.name)

    made: list[Client] = []  # the connection, once made (its callbacks come from inside it)

    async def disconnected() -> None:
        for conn in made:
            fail_lost_pings(conn)  # its flushes and drains wait for nothing: they fail now

    kw = connect_kwargs(opts) | {"error_cb": remember, "reconnected_cb": reconnected,
                                 "disconnected_cb": disconnected}
    try:
        nc = await connect_refusable(Client(), kw, opts.url or "")
        made.append(nc)
    except Refused as refused:
        raise refused.error(opts.url, credentials=ROLE_CREDENTIALS,
                            failed=Unavailable) from None
    except Exception as exc:
        why = last[-1] if last else exc
        raise Unavailable(
            f"cannot connect to NATS at {opts.url}: {why}. Check the URL and the credentials "
            "(--user/--password, --token, --creds, --tls-ca)"
        ) from exc
    return once_up(nc)


def once_up(nc: Client) -> Client:
    """What every connection the plane makes (its roles', the SDK's) gets once it is up:
    reconnect forever from now on (nats-py reads the option at each reconnect), read
    header lines at half nats-py's cost (`plane.contract.header_lines`), and write what it
    buffers at the end of the loop's turn instead of through nats-py's flusher task
    (`plane.contract.soon_flush`)."""
    nc.options["max_reconnect_attempts"] = -1
    use_soon_flush(nc)
    return use_fast_header_lines(nc)


def connected_since_s(nc: Client) -> float:
    """When (monotonic s) the connection now up was opened: a message received before it
    came on an earlier one. nats-py stamps each attempt to connect (`Srv.last_attempt`, set
    as it opens the socket, and only again when an attempt fails): -inf when it has none."""
    srv = nc._current_server
    at = srv.last_attempt if srv is not None else None
    return at if at is not None else -math.inf


async def close(nc: Client, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Drain while connected (what is in flight is delivered), else close. `drain()` on a
    connection that is reconnecting raises ConnectionReconnectingError (a stop with the
    server gone exited 1 with a traceback), and one that loses its server on the way would
    wait out nats-py's 30 s drain timeout. Idempotent."""
    if nc.is_closed:
        return
    if nc.is_connected:
        # nats-py's own drain timeout, not a cancellation from here: `drain()` swallows a
        # cancellation and leaves its gather's CancelledError unretrieved, which asyncio
        # logs as a traceback. The outer bound is for the flush it makes after.
        nc.options["drain_timeout"] = timeout_s
        try:
            async with asyncio.timeout(timeout_s + DRAIN_FLUSH_S):
                await nc.drain()
            await _end_reconnecting(nc)  # a server lost on the way: see there
            return
        except (TimeoutError, nats.errors.Error, OSError, RuntimeError) as exc:
            # Its server gone during the drain: nats-py writes into the dead transport
            # (uvloop: RuntimeError; a `plane up` SIGKILLed left its router child to stop
            # on its own, and it exited with that traceback; found from outside).
            log.warning("nats drain cut short: closing", error=repr(exc))
    await close_now(nc)


async def close_now(nc: Client) -> None:
    """Close without draining (for a connection whose users have stopped), as cleanly with
    the server gone as with it there. Idempotent."""
    try:
        await nc.close()
    except (nats.errors.Error, OSError, RuntimeError) as exc:
        # nats-py 2.16 flushes what it buffered while disconnected into the dead transport
        # (uvloop: RuntimeError "handler is closed"; the stdlib loop: ConnectionResetError).
        # The client is closed all the same (its status is set first); what it buffered had
        # nowhere to go.
        log.info("nats closed without its server", error=repr(exc),
                 unsent_bytes=nc.pending_data_size)
    await _end_reconnecting(nc)


async def _end_reconnecting(nc: Client, within_s: float = RECONNECT_END_S) -> None:
    """Until the reconnect that nats-py's close cancelled has really ended. It cancels it
    once, and Python 3.11's `wait_for` loses a cancellation that lands as the connect
    attempt inside it ends, which with the server gone (refused at once) is as soon as the
    reconnect starts: the task went on trying every 0.25 s on a closed connection, and the
    event loop's own end waited for it forever (a stop right after a lost server; a flush
    fails at once then, `plane.contract.lost_pings`). Uses nats-py's `_reconnection_task`."""
    task: asyncio.Task[None] | None = nc._reconnection_task
    t_end = time.monotonic() + within_s
    while task is not None and not task.done():
        if time.monotonic() > t_end:
            log.warning("nats reconnect did not end at close", name=nc.options.get("name"))
            return
        task.cancel()  # again: each lands at a random point of its 0.25 s cycle
        await asyncio.wait({task}, timeout=RECONNECT_END_POLL_S)

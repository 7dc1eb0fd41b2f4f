"""The SDK's NATS connection: a few quick attempts, then one clear error.

nats-py, left to itself, reports every failed attempt through its default `error_cb`, which
logs the exception with its traceback (a wrong port printed 41 tracebacks in 11 s before a
raw `NoServersError`). Here the callback only keeps the latest error; after
`connect_attempts` tries the caller gets `plane.contract.errors.ConnectFailed` naming the URL it
tried and why. Once connected, nats-py reconnects forever (a broker restart must not break a
long-lived service's client), and an outage is logged once, then at most once per
`ERROR_LOG_EVERY_S`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from functools import partial

import structlog
from nats.aio.client import Client as NATS
from nats.errors import ConnectionClosedError

from plane.contract.config import ConnectOptions
from plane.contract.errors import ConnectFailed, ConnectionClosed
from plane.contract.natsconn import (
    ERROR_LOG_EVERY_S,
    Refused,
    Throttle,
    connect_kwargs,
    connect_refusable,
    once_up,
)
from plane.contract.refusals import Refusal, refusal_of, what_to_do

log = structlog.get_logger("plane.client")

# Tries after the first (nats-py's max_reconnect_attempts), RECONNECT_WAIT_S apart: a refused
# port fails in well under a second.
CONNECT_ATTEMPTS = 3
CONNECT_TIMEOUT_S = 2.0  # per attempt: a blackholed address fails in a few seconds
RECONNECT_WAIT_S = 0.2
# While the connection is down, how often a request about to be sent looks whether it is up.
RECONNECTED_POLL_S = 0.005
# After the connection comes back, how long a no-responders means "the routers are not back
# yet" (they reconnect every 0.25 s), and how often the attempt is sent again meanwhile.
ROUTERS_BACK_S = 2.0
ROUTERS_BACK_POLL_MS = 20.0
# Reconnects the server refuses in a row (credentials revoked or changed while connected)
# before the client closes its connection (nats.go: the same auth error twice).
REFUSALS_TO_CLOSE = 2
# Where the SDK's caller gave its credentials, for the message of a refusal.
SDK_CREDENTIALS = "ConnectOptions user/password, token or creds"


# A call's (or stream's) local 503 when the connection stayed down past
# `ClientConfig.reconnect_wait_ms`.
NOT_CONNECTED = "not sent: the connection to NATS is down (reconnecting); try again shortly"
# ... and when it was waited for until the call's deadline (`reconnect_wait_ms` None).
NOT_CONNECTED_TO_DEADLINE = ("deadline passed before send: the connection to NATS stayed down "
                             "(reconnecting) all that time; try again shortly")
# A call's (or stream's) local 503 `unhealthy` when the connection dropped while it waited
# for the plane (`ClientConfig.end_on_disconnect`): sent, so it may have run.
DROPPED = ("the connection to NATS dropped while this waited for the plane's answer, which "
           "is lost with it (the request may have run); try again shortly")
DROPPED_MID_STREAM = ("the connection to NATS dropped mid-stream (node {node}): the rest of "
                      "the stream is lost with it; send the request again for a whole answer")


class ConnectionDropped(Exception):
    """A request's wait ended by its connection dropping (`OnDrop`), not by an answer."""


class Comeback:
    """What a client knows of its connection's outages: it waits out one before it sends, and
    tells a no-responders just after one from a plane that is down.

    When the connection comes back the routers may not have yet: each reconnects on its own
    schedule (every 0.25 s: `plane.contract.natsconn`; the SDK every `RECONNECT_WAIT_S`), so
    a call held through a server restart and sent at the reconnect found nobody listening,
    and failed with a 503 (CI, tests/test_client_connect.py). For `ROUTERS_BACK_S` after this
    client sees its connection back, "no router listens" is taken for "not back yet" and the
    attempt is sent again (`Client.retry_delay_for`), within the caller's deadline. nats-py
    counts reconnects in `nc.stats`; a client idle through an outage learns of it at its next
    call, which then waits for the routers at most as long."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._reconnects = nc.stats["reconnects"]
        self._back_s = -math.inf

    async def until_connected(self, deadline_at: float) -> bool:
        """Wait while the connection is reconnecting, at most until `deadline_at` (monotonic);
        True when it was down (the caller was held: a deadline that passed meanwhile passed
        for the connection's sake).

        A request published while the connection is down waits in nats-py's buffer and goes
        out at the reconnect with the `Plane-Deadline-Ms` it was given before the wait; the
        router counts a budget from when it receives a request, so it would give such a
        request time its caller no longer has (measured: a call held 2 s by a server restart
        was told to come back after its caller's deadline, and gave up). Held here instead,
        the attempt is sent with what is left. Raises `ConnectionClosed` on a closed
        connection (why it closed: `closed_error`). Three reads when connected: nothing on
        the hot path."""
        nc = self._nc
        if nc.is_closed:
            raise closed_error(nc)
        # Polled: nats-py has no awaitable for "reconnected", and its callbacks on a
        # connection the caller passed in are the caller's. Between two tries it is
        # "reconnecting", during a try's handshake "connecting" (it counts the reconnect
        # once the handshake is done): a call that went at "connecting" found no router.
        held = self.down()
        while self.down() and time.monotonic() < deadline_at:  # noqa: ASYNC110
            await asyncio.sleep(RECONNECTED_POLL_S)
        if nc.is_closed:  # closed while it waited (reconnects refused): say why
            raise closed_error(nc)
        if (n := nc.stats["reconnects"]) != self._reconnects:
            self._reconnects, self._back_s = n, time.monotonic()
        return held

    def down(self) -> bool:
        """The connection is lost and nats-py is trying to get it back."""
        return bool(self._nc.is_reconnecting or self._nc.is_connecting)

    def routers_may_be_returning(self) -> bool:
        """The connection came back lately: a no-responders may be routers not back yet."""
        return time.monotonic() - self._back_s < ROUTERS_BACK_S


class Wakers:
    """What of a client is to be woken when something happens to its connection (`OnClose`:
    it closes; `OnDrop`: it drops): a waker per key, added and discarded as its waiter comes
    and goes, and all of them called when it happens."""

    def __init__(self) -> None:
        self._wakers: dict[object, Callable[[], None]] = {}

    def add(self, key: object, wake: Callable[[], None]) -> None:
        """Call `wake` if it happens before `discard(key)` (a second `add` of `key` replaces
        its waker)."""
        self._wakers[key] = wake

    def discard(self, key: object) -> None:
        self._wakers.pop(key, None)

    def _wake_all(self, *, forget: bool) -> None:
        """Call every waker; `forget`: and hold none after (it cannot happen again)."""
        wakers = self._wakers
        if forget:
            self._wakers = {}
        for wake in list(wakers.values()):  # a waker may add or discard
            wake()


class OnClose(Wakers):
    """Ends at once whatever of a client waits on a connection that closes.

    nats-py closes a connection on its own on most of the server's errors (an account's
    "maximum subscriptions exceeded" among them) and resolves nothing that waits on it: a call
    in flight waited out its whole deadline before it said `ConnectionClosed`, a stream its
    next token's, a refused call its Retry-After. Here the connection's close fails every
    request nats-py holds open (its `_resp_map`, nats-py pinned in pyproject.toml: the
    caller's `_attempt` turns that into `closed_error`) and calls every waker registered
    (a stream's inbox queue, a holder's wait for its call back). nats-py has one close
    callback per connection, maybe the owner's: ours runs first, then theirs."""

    def __init__(self, nc: NATS) -> None:
        super().__init__()
        self._nc = nc
        self._closed = asyncio.Event()  # binds to the loop at its first wait
        theirs = nc._closed_cb

        async def closed() -> None:
            self.end_all()
            if theirs is not None:
                await theirs()

        nc._closed_cb = closed

    async def sleep(self, delay_s: float) -> bool:
        """Wait `delay_s`, or less if the connection closes first (True then): a pause
        before a retry that could only fail."""
        if self._closed.is_set() or self._nc.is_closed:
            return True
        try:
            async with asyncio.timeout(delay_s):
                await self._closed.wait()
            return True
        except TimeoutError:
            return False

    def end_all(self) -> None:
        self._closed.set()
        for future in list(self._nc._resp_map.values()):
            if not future.done():
                future.set_exception(ConnectionClosedError())
        self._wake_all(forget=True)  # a closed connection never opens again


class OnDrop(Wakers):
    """Ends at once what of a client waits for the plane when its connection drops (nats-py
    then reconnects), for a client that asks it (`ClientConfig.end_on_disconnect`: the
    gateway, whose HTTP callers are better told at once).

    Core NATS keeps nothing for a subscriber that is away: a reply, or a stream's message,
    sent while the connection is down is dropped by the server, and once a lone server is
    back it has lost the plane's JetStream state (the slot messages) with which a node would
    have answered later. So what waited went on waiting for nothing: the gateway held an
    HTTP call in flight when its nats-server was killed until the call's deadline and the
    SDK's margin (18 s of a 20 s deadline), a stream until its stream deadline (59 s), or
    `wait_ms` (30 s) without one. Here the drop fails every request the client's reply
    inbox holds open (`ConnectionDropped`: the caller's `_attempt` makes it a local 503
    `unhealthy`) and wakes every stream registered (it ends 503 `unhealthy` and sends its
    cancel, which goes out at the reconnect). A close is `OnClose`'s: nats-py calls the
    disconnect callback on a close too, and this one leaves it alone.

    Not the SDK's default: in a cluster the connection may come back to another server in
    time for an answer sent after it; a caller that would rather wait for that keeps its
    deadline. nats-py has one disconnect callback per connection, maybe the owner's: ours
    runs first, then theirs."""

    def __init__(self, nc: NATS) -> None:
        super().__init__()
        self._nc = nc
        theirs = nc._disconnected_cb

        async def dropped() -> None:
            if not nc.is_closed:
                self.end_all()
            if theirs is not None:
                await theirs()

        nc._disconnected_cb = dropped

    def end_all(self) -> None:
        self._wake_all(forget=False)  # kept: the client's reply inbox waits on every drop


def closed_error(nc: NATS) -> ConnectionClosed:
    """What a call on a closed connection raises: why it closed, when nats-py knows. nats-py
    closes the connection itself on most of the server's errors (`-ERR`), among them an
    account's "maximum subscriptions exceeded", and tells no error callback; ours closes it
    after reconnects the server refused (`Connection.refused`)."""
    err = (nc.refused if isinstance(nc, Connection) else None) or nc.last_error
    why = str(err) if err is not None else ""
    refusal = refusal_of(err)
    if refusal is Refusal.SUBSCRIPTIONS:
        cause = f"; {what_to_do(refusal, credentials=SDK_CREDENTIALS)}"
    elif refusal is not None:
        cause = (f", its reconnects refused ({why}): "
                 f"{what_to_do(refusal, credentials=SDK_CREDENTIALS)}")
    else:
        cause = ""
    said = f": {why}" if why and not cause.startswith(",") else ""
    return ConnectionClosed(f"the connection to the plane is closed{said}{cause}; open a new "
                            "client", why=why)


class Connection(NATS):
    """nats-py's client, and why the server refused it when it last tried to reconnect
    (`refused`; None once it is back). nats-py forgets it when it gives up reconnecting: its
    `last_error` is then "no servers available for connection"."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: BaseException | None = None


async def open_connection(opts: ConnectOptions,
                          connect_attempts: int = CONNECT_ATTEMPTS) -> NATS:
    """Connect to the plane's NATS server, or raise `ConnectFailed` (an `Unavailable`, also
    a `ConnectionError`) saying which URL failed and why: at once when the server refuses
    the credentials or the account's connection limit is reached (another try would be
    refused as well: `plane.contract.natsconn.connect_refusable`).

    Once connected, a reconnect the server refuses `REFUSALS_TO_CLOSE` times in a row (the
    credentials revoked or changed meanwhile) closes the connection, as nats.go does: each
    call then raises `ConnectionClosed` naming the refusal, where it waited for a connection
    that could not come back and was answered "try again shortly"."""
    nc = Connection()
    last: list[BaseException] = []
    failed = 0  # attempts that failed before we gave up
    connected = False
    refusals = 0  # reconnects refused in a row
    throttle = Throttle(ERROR_LOG_EVERY_S)

    async def on_error(exc: Exception) -> None:
        nonlocal failed, refusals
        failed += 1
        last[:] = [exc]  # only the latest: this callback lives as long as the connection
        if not connected:
            return
        if refusal_of(exc) is not None:
            nc.refused = exc
            refusals += 1
            if refusals >= REFUSALS_TO_CLOSE:
                # nats-py drops a server from its pool past this many failed tries in a
                # row (this one among them), and closes once none is left.
                nc.options["max_reconnect_attempts"] = 1
        if (held := throttle.allow(type(exc).__name__)) is not None:
            log.warning("plane connection error", url=opts.url, error=repr(exc),
                        repeats_not_logged=held)

    async def on_reconnect() -> None:
        nonlocal refusals
        refusals, nc.refused = 0, None
        nc.options["max_reconnect_attempts"] = -1
        throttle.reset()
        log.info("plane connection restored", url=opts.url)

    kw = connect_kwargs(opts) | {
        "max_reconnect_attempts": connect_attempts,
        "connect_timeout": CONNECT_TIMEOUT_S,
        "reconnect_time_wait": RECONNECT_WAIT_S,
        "error_cb": on_error,
        "reconnected_cb": on_reconnect,
    }
    try:
        await connect_refusable(nc, kw, opts.url or "")
    except Refused as refused:
        raise refused.error(opts.url, credentials=SDK_CREDENTIALS,
                            failed=partial(ConnectFailed, url=opts.url or "")) from None
    except Exception as exc:  # nats-py raises OSError, its own errors or a TimeoutError
        why = last[-1] if last else exc
        raise ConnectFailed(
            f"cannot reach the plane at {opts.url}: {why!r} (tried {max(failed, 1)} times). "
            "Is a plane running there (`plane up --port 4222`)? Check the URL",
            url=opts.url or "",
        ) from None
    connected = True
    return once_up(nc)

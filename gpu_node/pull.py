"""A slot's standing pull request: one JetStream pull that delivers many messages.

nats-py's `fetch(1)` costs, per message, a pull request (JSON, a publish), a uuid, two tasks
and a timer (`next_msg` under `wait_for`), and one more NATS message than the work needs:
without it the node spends 15-25% less CPU per request, and one request alone is answered in
about two thirds of the time (BENCHMARKS.md, seventh session). A slot
consumer has `max_ack_pending=1`, so the broker delivers one message at a time however large
a pull's batch is: one pull of `BATCH` messages, renewed before it expires, delivers every
request while the slot is claimed, and each message costs only its own delivery.

Each pull has its own reply subject (`<inbox>.<n>`), so a status says which pull it belongs
to (408 the pull expired, 409 a conflict such as the consumer deleted or a leader change, 503
no consumer, 100 a heartbeat): it ends the pull it names, and only the current pull's end asks
for a new one. A delivered message carries the slot's own subject, not the inbox: it is handed
on whichever pull delivered it, and proves that the consumer holds our pulls. A pull renews
at `RENEW_AT` of its expiry (before the broker ends it: no gap without a pull), when its
batch is spent, and at once after a reconnect (`renew`): a restarted or failed-over broker
keeps no waiting pulls. A pull also asks for JetStream's idle heartbeats (status 100 while it
delivers nothing): one that hears nothing for `SILENT_BEATS` of them is renewed, for a pull
can end silently: its consumer's leader died with its server (a cluster), and the consumer's
new leader knows no waiting pulls, so the slot heard nothing until its next renewal (up to
`RENEW_AT` of the expiry) while routers placed on it. A renewal overlaps the last fifth of
its predecessor's life, so two stand at once for a while (three at most, when a reconnect
renews as well), within the consumer's `max_waiting` of 4. While the connection is down
the consumer takes no pulls (`reaches` False), but nothing is silent: nats-py reconnects, and
the pull is asked again once it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections import deque
from collections.abc import Callable

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from plane.contract.taken_as_read import take_as_read

log = structlog.get_logger("plane.slot")

BATCH = 10_000
# A pull renews when this share of its expiry has passed.
RENEW_AT = 0.8
# The idle heartbeat asked for: this share of the expiry (the broker takes at most half),
# at most MAX_HEARTBEAT_S; a pull silent for SILENT_BEATS of them is renewed.
HEARTBEAT_SHARE = 0.25
MAX_HEARTBEAT_S = 1.0
SILENT_BEATS = 2.5
# After a status that ends the current pull with an error (409, 503), wait this long before
# the next: a deleted consumer would otherwise be asked again in a tight loop.
ERROR_BACKOFF_S = 0.1
# A consumer moved to another server (409 "Leadership Change": a step-down, the router's
# `keep_apart` or an operator's) has no leader for a moment: a pull asked at once may hear
# 503. For this long after a move that is the move, not an error: asked again after the
# back-off, nothing logged or counted (the slot is out of reach meanwhile all the same).
MOVE_GRACE_S = 2.0


class _Delivered:
    """Messages delivered and not yet taken, for one reader (the slot's loop). What
    `asyncio.Queue` does per put and get (its loop check, getter list, unfinished-task count
    and event) was ~4% of a node's CPU per request at 4 callers (py-spy, docs/perf): here a
    deque and the reader's one future. A message is in the deque until it is taken, so a
    reader cancelled as it is woken leaves it there for the next `get` (as with the queue)."""

    def __init__(self) -> None:
        self._items: deque[Msg] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, msg: Msg) -> None:
        self._items.append(msg)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Msg:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


class StandingPull:
    def __init__(self, nc: Client, stream: str, consumer: str, *, expires_s: float,
                 api_prefix: str = "$JS.API", heartbeat_s: float | None = None,
                 on_reach: Callable[[bool], None] | None = None,
                 on_silent: Callable[[], None] | None = None) -> None:
        self._nc = nc
        self._next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._expires_s = expires_s
        beat_s = heartbeat_s or min(MAX_HEARTBEAT_S, HEARTBEAT_SHARE * expires_s)
        self._silent_s = SILENT_BEATS * beat_s
        self._request = json.dumps({"batch": BATCH, "expires": int(expires_s * 1e9),
                                    "idle_heartbeat": int(beat_s * 1e9)}).encode()
        self._heard_s = 0.0  # monotonic: a delivery or heartbeat on any pull (or the last issue)
        self.silences = 0  # pulls renewed because they fell silent (`on_silent` hears each)
        self._on_silent = on_silent
        # Whether the consumer takes our pulls: False from a pull ended by no-responders (no
        # consumer leader: a cluster electing one, 4-9 s) or by the consumer's deletion, True
        # again at the next delivery or heartbeat. `on_reach` hears each change (the slot
        # advertises itself unhealthy meanwhile: routers would place where nothing fetches).
        self.reaches = True
        self._on_reach = on_reach
        self._tokens = itertools.count(1)
        self._prefix = ""
        self._sub: Subscription | None = None
        self._current = ""  # the token of the newest pull
        self._delivered = 0  # messages delivered since the current pull was issued
        self._issued_s = 0.0  # monotonic, the current pull
        self._renewed = asyncio.Event()
        self._messages = _Delivered()
        self._keeper: asyncio.Task[None] | None = None
        self.errors = 0  # statuses that ended a pull with an error, in a row
        self._moved_s = -MOVE_GRACE_S  # monotonic: the consumer's last leader change
        self._back_off = False  # the pull ended on an error status: the next waits a moment

    async def start(self) -> None:
        self._prefix = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(f"{self._prefix}.*", cb=self._on_msg)
        take_as_read(self._sub, self._take)  # a delivery wakes the slot's task at once
        try:
            await self._issue()
        except BaseException:
            await self.stop()
            raise
        self._keeper = asyncio.create_task(self._keep(), name=f"pull-{self._next_subject}")

    async def stop(self) -> int:
        """Stop asking; how many delivered messages nobody took with `next` (still on the
        subject, unacked: the slot answers them, `Slot.sweep`). A pull still standing at the
        broker ends at its expiry; a message it delivers meanwhile finds no subscriber and
        stays on the subject for whoever takes it first (the router at its deadline, the
        slot's next claim)."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return self.held

    @property
    def held(self) -> int:
        """Messages delivered that nobody has taken with `next` yet."""
        return len(self._messages)

    async def next(self) -> Msg:
        """The next message the consumer delivers (waits as long as it takes)."""
        return await self._messages.get()

    def renew(self) -> None:
        """Ask again now (after a reconnect: the broker may have lost the standing pull)."""
        self._renewed.set()

    async def _issue(self) -> None:
        self._current = f"{self._prefix}.{next(self._tokens)}"
        self._delivered = 0
        self._issued_s = self._heard_s = time.monotonic()
        await self._nc.publish(self._next_subject, self._request, reply=self._current)

    async def _keep(self) -> None:
        """Renew the current pull before it expires, or when asked (`renew`, a status)."""
        while True:
            due_s = min(self._issued_s + RENEW_AT * self._expires_s,
                        self._heard_s + self._silent_s) - time.monotonic()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, due_s)):
                    await self._renewed.wait()
            if not self._nc.is_connected:
                await self._until_connected()
            elif not self._renewed.is_set():
                now = time.monotonic()
                if now >= self._heard_s + self._silent_s:
                    self.silences += 1
                    if self._on_silent is not None:
                        self._on_silent()
                    log.warning("pull silent: asked again", subject=self._next_subject,
                                silent_s=round(now - self._heard_s, 3))
                elif now < self._issued_s + RENEW_AT * self._expires_s:
                    continue  # heard from lately, and not due: wait on
            if self._renewed.is_set() and self._back_off:
                await asyncio.sleep(ERROR_BACKOFF_S)
            self._renewed.clear()
            self._back_off = False
            try:
                await self._issue()
            except Exception as exc:  # a reconnect under way: try again shortly
                log.warning("pull request not sent", subject=self._next_subject, error=repr(exc))
                await asyncio.sleep(ERROR_BACKOFF_S)

    async def _until_connected(self) -> None:
        """While the connection is down nothing stands at the broker and nothing can be asked:
        the consumer takes no pulls (`reaches` False), but the pull is not silent, and there
        is nothing to count or log (nats-py reconnects, and says so). A silence counted on
        every pass meanwhile logged 158 lines in 10 s for two slots and climbed
        `plane_slot_pull_silences_total`. Back, the pull is asked again at once (a restarted
        or failed-over broker keeps no waiting pulls), and the consumer is taken to be there,
        as at a claim: a 503 or a 409 says otherwise, a heartbeat or a delivery confirms."""
        was = self.reaches
        self._reached(False)
        # Polled: nats-py has no awaitable for "reconnected", and its callback is the
        # connection's owner's (`plane.contract.natsconn.connect`).
        while not self._nc.is_connected:  # noqa: ASYNC110
            await asyncio.sleep(ERROR_BACKOFF_S)
        self._renewed.set()
        if was:
            self._reached(True)

    def _reached(self, ok: bool) -> None:
        if ok != self.reaches:
            self.reaches = ok
            if self._on_reach is not None:
                self._on_reach(ok)

    async def _on_msg(self, msg: Msg) -> None:
        """What nats-py would call (it takes only coroutines); `take_as_read` goes round it."""
        self._take(msg)

    def _take(self, msg: Msg) -> None:
        h = msg.headers
        status = h.get("Status") if h else None
        if not status:
            self.errors = 0
            self._messages.put(msg)
            # A delivery carries the slot's subject, not the pull's inbox: which pull it
            # came on is not known, and need not be. The consumer delivers, so its leader
            # holds our pulls (the current one too: they die together); and while it
            # delivers it sends no heartbeats. Counting only the current pull's words took
            # every busy slot's pull for silent.
            self._heard_s = time.monotonic()
            if not self.reaches:
                self._reached(True)
            self._delivered += 1  # since the current pull's issue: its batch, at most
            if self._delivered >= BATCH:
                self._renewed.set()
            return
        if status == "100":  # idle heartbeat: a pull stands at the consumer
            self._reached(True)
            self._heard_s = time.monotonic()
            if msg.subject == self._current:
                self.errors = 0  # the current pull stands: whatever ended the last is over
            return
        if msg.subject != self._current:
            return  # the end of a pull already renewed
        description = h.get("Description", "") if h else ""
        if status == "409" and description == "Leadership Change":
            self._moved_s = time.monotonic()
            self._renewed.set()  # moved to another server (a step-down): ask it at once
            return
        if status == "503" or (status == "409" and "Deleted" in description):
            self._reached(False)  # nothing fetches: routers pass the slot over meanwhile
        if status != "408":  # 408: expired (a stalled loop renewed late); anything else: why
            self._back_off = True
            # Just after a move, a 503 is the move (the new leader not up yet): no error.
            if not (status == "503" and time.monotonic() - self._moved_s < MOVE_GRACE_S):
                self.errors += 1
                if self.errors in (1, 10) or self.errors % 100 == 0:
                    log.warning("pull ended by the broker", subject=self._next_subject,
                                status=status, description=description, times=self.errors)
        self._renewed.set()
